"""The fusable hot paths (models/fusion.py) trace as one graph each with dynamic shapes, as inductor needs them
on CUDA, and give the plain results: traced here on the CPU with the aot_eager backend (no code generation)."""

from __future__ import annotations

import functools

import pytest
import torch

from music3serve.acoustic.renderer import Renderer
from music3serve.checkpoint import load_models
from music3serve.models.fusion import _fused, _plain, enable_fusion
from music3serve.talker.config import TalkerConfig
from music3serve.talker.depth_inputs import DepthInputs
from music3serve.talker.engine import Talker
from music3serve.talker.frame import talker_frame


@pytest.fixture(scope="module")
def models(tiny_dir):
    return load_models(tiny_dir, talker_dtype=torch.float32)


def frames_and_window(models, depth_cache: bool | str, songs: int = 3):
    """depth_cache "table": cached depth calls taking their new positions from DepthInputs, as the engine runs them
    (the table built with the hot paths of the moment, as the engine builds it)."""
    inputs = DepthInputs(models.depth_decoder) if depth_cache == "table" else None
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(2 * songs, models.language_model.cfg.hidden, generator=gen)
        frame = talker_frame(models.language_model, models.depth_decoder, hidden, torch.arange(1, songs + 1),
                             torch.arange(4, songs + 4), bool(depth_cache), inputs)
        return frame, rendered_window(models, gen)


def rendered_window(models, gen: torch.Generator):
    renderer = Renderer.from_models(models)
    mixed = renderer.mix(torch.randn(150, 8 * models.language_model.cfg.hidden, generator=gen))
    (window,) = renderer.render(renderer.payloads("song", 7, mixed, steps=2)[:1])
    return window


@pytest.mark.parametrize("songs", [3, 1])
@pytest.mark.parametrize("depth_cache", [False, True, "table"], ids=["recomputed", "cached", "looked up"])
def test_hot_paths_trace_whole_and_match_plain(models, depth_cache, songs):
    """One song too: its frame runs the graph of every song count (fusion.share_graphs_across_sizes)."""
    plain_frame, plain_window = frames_and_window(models, depth_cache, songs)
    enable_fusion(backend="aot_eager")
    assert set(_fused) == set(_plain)
    frame, window = frames_and_window(models, depth_cache, songs)
    assert torch.equal(frame.codes, plain_frame.codes)
    torch.testing.assert_close(frame.conditioning, plain_frame.conditioning, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(window.latent, plain_window.latent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(window.pcm, plain_window.pcm, rtol=1e-5, atol=1e-6)  # the vocoder's snakes fused


@torch.inference_mode()
def test_the_depth_decoders_decode_path_traces_whole_and_matches_plain(models):
    """The cached depth calls of CUDA (keys and values in buffers, decode attention between two hot paths)."""
    from music3serve.models.depth_decoder import DepthKV

    depth = models.depth_decoder
    projected = torch.randn(6, 5, depth.cfg.hidden, generator=torch.Generator().manual_seed(1))

    def calls():
        cache = DepthKV()
        return [depth(projected[:, :2], cache)] + [depth(projected[:, t : t + 1], cache) for t in range(2, 5)]

    plain = calls()
    enable_fusion(backend="aot_eager")
    for got, expected in zip(calls(), plain):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_generated_kernels_launch_early_only_outside_the_dit(monkeypatch):
    """Inductor's PDL follows MUSIC3SERVE_PDL for the talker's hot paths; the DiT's (between cuBLAS / cuDNN calls,
    which never launch early) are generated without it."""
    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        pytest.skip("this torch's inductor has no PDL option")
    from music3serve.models import fusion

    talker_path, dit_path = "music3serve.models.layers.residual_mlp", "music3serve.models.dit.dit_qkv"
    assert {talker_path, dit_path} <= set(fusion._plain)
    monkeypatch.setenv("MUSIC3SERVE_PDL", "all")
    assert fusion._inductor_options(talker_path) == {"triton.enable_pdl": True}
    assert fusion._inductor_options(dit_path) == {"triton.enable_pdl": False}
    assert fusion._inductor_options("music3serve.models.vocoder.snake") == {"triton.enable_pdl": False}
    monkeypatch.setenv("MUSIC3SERVE_PDL", "ours")
    assert fusion._inductor_options(talker_path) == {"triton.enable_pdl": False}


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"])
def test_enable_fusion_gives_each_hot_path_its_pdl_option(monkeypatch, mode):
    """What enable_fusion hands torch.compile: inductor's PDL on for the talker's hot paths and off for the DiT's,
    also when a compile mode is asked for (its options merged in, as torch.compile takes a mode or options)."""
    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        pytest.skip("this torch's inductor has no PDL option")
    from music3serve.models import fusion

    calls = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.setdefault(fn.__qualname__, kwargs) and fn)
    monkeypatch.setenv("MUSIC3SERVE_PDL", "all")
    fusion.disable_fusion()
    fusion.enable_fusion(mode=mode)
    assert calls["residual_mlp"]["options"]["triton.enable_pdl"] is True
    assert calls["dit_qkv"]["options"]["triton.enable_pdl"] is False
    assert all("mode" not in kwargs for kwargs in calls.values())
    if mode:
        assert calls["dit_qkv"]["options"]["max_autotune"] is True


def test_the_snake_compiles_once_for_every_vocoder_width():
    """Twelve widths through one compiled snake: parameter shapes are static to dynamo, so passing alpha itself
    compiled one graph per width and the ninth raised FailOnRecompileLimitHit (GPU suite, 2026-11-30)."""
    from music3serve.models import fusion
    from music3serve.models.vocoder import Snake

    fusion.enable_fusion(backend="aot_eager")
    try:
        for width in range(2, 14):
            snake, x = Snake(width), torch.randn(2, width, 30)
            torch.nn.init.uniform_(snake.alpha, 0.5, 2.0)
            torch.testing.assert_close(snake(x), x + snake.alpha.reciprocal() * torch.sin(snake.alpha * x) ** 2)
    finally:
        fusion.disable_fusion()


@torch.inference_mode()
def test_a_process_may_compile_the_hot_paths_for_many_model_widths():
    """Weight shapes are static to dynamo: each width compiles anew. Dynamo's default limit of 8 compilations per
    function failed the GPU suite, whose engines are built for several checkpoints in one process."""
    from music3serve.models.layers import normed, rms_norm

    enable_fusion(backend="aot_eager")
    for width in range(1, 11):
        x = torch.randn(3, width)
        weight = torch.nn.Parameter(torch.rand(width), requires_grad=False)
        torch.testing.assert_close(normed(x, weight, 1e-6), rms_norm(x, weight, 1e-6), rtol=0, atol=0)


def test_every_capture_size_shares_the_talkers_compiled_graphs(models):
    """Compiles are most of the time to ready: once the talker is built and has run a frame of one song, frames of 2,
    4 and 8 songs (its other capture sizes) compile nothing more. Dynamo's defaults compiled each per-song hot function
    again from two songs on (sizes 0 and 1 are specialised), and the table of depth inputs, built outside inference
    mode, compiled its functions twice."""
    from torch._dynamo.utils import counters

    from music3serve.models import fusion

    torch._dynamo.reset()
    counters.clear()
    enable_fusion(backend="aot_eager")
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig(max_num_seqs=16))
    with torch.inference_mode():
        talker.step_fn.run_eager(2)
        compiled = counters["stats"]["unique_graphs"]
        for rows in (4, 8, 16):
            talker.step_fn.run_eager(rows)
    assert compiled > 0
    assert counters["stats"]["unique_graphs"] == compiled
    # One graph per model width (backbone, depth decoder), none for a row stride: the looked-up depth positions come
    # contiguous (talker/depth_inputs.py).
    assert fusion.graphs_per_function()["residual_mlp"] == 2


def test_one_frames_mix_compiles_no_graph_of_its_own():
    """mix_streams compiled by inductor, as on CUDA (the guard shows in inductor's graphs, not aot_eager's): one graph
    for 1, 2 and 8 frames, each frame's bits those of splitting the streams by a reshape, whose strides were guarded on
    the frame count being one (a second graph for a lone song's frame)."""
    from music3serve.models import fusion
    from music3serve.models.condition_encoder import mix_streams

    gen = torch.Generator().manual_seed(3)
    frames, weights = torch.randn(8, 8 * 16, generator=gen), torch.softmax(torch.randn(8, generator=gen), 0)
    scale = torch.nn.Parameter(torch.tensor([1.7]), requires_grad=False)  # as ConditionEncoder's: a static shape
    reshaped = (frames.unflatten(-1, (8, -1)) * weights[:, None]).unbind(-2)
    want = scale * functools.reduce(torch.add, reshaped)  # the streams added one after the other, as mix_streams does
    torch._dynamo.reset()
    enable_fusion()
    for n in (1, 2, 8):
        assert torch.equal(mix_streams(frames[:n], weights, scale), want[:n]), n
    assert fusion.graphs_per_function()["mix_streams"] == 1


def test_one_song_and_one_token_compile_no_graphs_of_their_own_before_torch_2_13(models, monkeypatch):
    """Without size-oblivious shapes (torch before 2.13, models/fusion.py) dynamo compiles a graph of its own for a
    size of one. The talker never gives its hot paths one: a lone song's frame is drawn beside an idle pair, and the
    per-token paths take every token as a row (a decode step's rows and a prefill chunk's tokens alike). Its warm-up
    (frames of 1, 2, 4 and 8 songs, prefill chunks of 16 tokens and of one) compiles each of them once."""
    from music3serve.models import fusion

    monkeypatch.setattr(fusion, "SHARED_SHAPE_SETTINGS", fusion.shared_shape_settings("2.11.0"))
    torch._dynamo.reset()
    enable_fusion(backend="aot_eager")
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder,
                    TalkerConfig(max_num_seqs=16))
    per_song = ["first_depth_positions", "guided_draw", "gather_code_inputs", "frame_outputs", "embed_codes",
                "mix_streams"]
    per_token = ["normed", "attention_inputs", "depth_qkv"]
    counts = fusion.graphs_per_function()
    assert {name: counts.get(name) for name in per_song + per_token} == dict.fromkeys(per_song + per_token, 1)
    assert counts["residual_mlp"] == 2  # the backbone's weights and the depth decoder's: two widths
    step, gen = talker.step_fn, torch.Generator().manual_seed(5)
    with torch.inference_mode():  # the idle pair beside a lone song changes none of its codes
        step.hidden.copy_(torch.randn(step.hidden.shape, generator=gen))
        step.seeds[:2], step.frames[:2] = torch.tensor([7, 123]), torch.tensor([3, 999])
        alone = talker_frame(models.language_model, models.depth_decoder, step.hidden[:2].clone(), step.seeds[:1],
                             step.frames[:1], step.depth_cache, step.depth_inputs)
        step.run_eager(2)
    assert torch.equal(step.codes[:1], alone.codes) and torch.equal(step.ended[:1], alone.ended)


def test_fusion_leaves_torchs_settings_as_it_found_them():
    """enable_fusion sets torch's process-wide settings for its graphs (shapes, bf16 roundings, recompile limit);
    disable_fusion puts back what was there (other code's torch.compile in the process broadcasts size-1 dimensions
    again). Enabling again keeps the compiled functions; other arguments are refused until disabled."""
    from music3serve.models import fusion

    shapes = torch.fx.experimental._config

    def settings() -> dict[str, object]:
        return {**{key: getattr(shapes, key) for key in fusion.SHARED_SHAPE_SETTINGS},
                "emulate_precision_casts": torch._inductor.config.emulate_precision_casts,
                "recompile_limit": torch._dynamo.config.recompile_limit}

    before = settings()
    assert not before["emulate_precision_casts"] and before["recompile_limit"] < fusion.RECOMPILE_LIMIT
    for _ in range(2):  # twice: the second enable must not save the first one's values as torch's
        enable_fusion(backend="aot_eager")
    compiled_functions = dict(fusion._fused)
    assert settings() == {**fusion.SHARED_SHAPE_SETTINGS, "emulate_precision_casts": True,
                          "recompile_limit": fusion.RECOMPILE_LIMIT}
    with pytest.raises(RuntimeError, match="disable_fusion"):
        enable_fusion(backend="inductor")
    assert fusion._fused == compiled_functions
    fusion.disable_fusion()
    assert settings() == before
    compiled = torch.compile(lambda x, y: x + y, backend="aot_eager", dynamic=True, fullgraph=True)
    assert torch.equal(compiled(torch.ones(3, 4), torch.ones(1, 4)), torch.full((3, 4), 2.0))


def test_size_oblivious_shapes_only_from_the_torch_whose_inductor_lowers_them():
    """torch 2.11's inductor failed on the H200 to lower a slice of a size-oblivious size (the engine never got ready):
    there a size of one keeps graphs of its own; from 2.13 on, one graph serves every size."""
    from music3serve.models.fusion import shared_shape_settings

    assert shared_shape_settings("2.11.0+cu130") == {"use_duck_shape": False}
    for version in ("2.13.0+cpu", "2.14.1", "2.15.0"):
        assert shared_shape_settings(version) == {"use_duck_shape": False, "backed_size_oblivious": True}
