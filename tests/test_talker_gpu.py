"""GPU: the captured frame step replays exactly what the eager step computes."""

from __future__ import annotations

import pytest
import torch

from music3serve.checkpoint import load_models
from music3serve.kernels.decode_attention import triton_available
from music3serve.prompt import encode_prompt
from music3serve.talker.config import TalkerConfig
from music3serve.talker.engine import Talker
from music3serve.talker.events import SongFinished, WindowReady

pytestmark = pytest.mark.gpu


def run_songs(models, enforce_eager: bool, depth_cache: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    config = TalkerConfig(max_num_seqs=8, enforce_eager=enforce_eager, capture_sizes=(2, 4, 8), depth_cache=depth_cache)
    return _run_with(models, config)


def _run_with(models, config: TalkerConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Codes and concatenated window conditioning of three songs of different lengths."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, config)
    for i, frames in enumerate((230, 40, 75)):
        cond, uncond = encode_prompt(models.tokenizer, f"song {i}", "[verse]\nla " * (i + 1))
        talker.submit(str(i), cond, uncond, seed=i, requested_frames=frames)
    windows, codes = {}, {}
    while talker.busy:
        for event in talker.step():
            if isinstance(event, WindowReady):
                windows.setdefault(event.song, []).append(event.mixed.cpu())
            elif isinstance(event, SongFinished):
                codes[event.song] = event.codes
    return {song: (codes[song], torch.cat(windows[song])) for song in codes}


@pytest.mark.parametrize("depth_cache", [False, True], ids=["recomputed", "cached"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(tiny_dir, dtype, depth_cache):
    models = load_models(tiny_dir, device="cuda", talker_dtype=dtype)
    eager, graphs = run_songs(models, True, depth_cache), run_songs(models, False, depth_cache)
    assert set(eager) == set(graphs) == {"0", "1", "2"}
    for song in eager:
        assert torch.equal(eager[song][0], graphs[song][0])
        assert torch.equal(eager[song][1], graphs[song][1])


def test_fused_hot_paths_match_plain_ones(tiny_dir):
    from music3serve.models.fusion import disable_fusion, enable_fusion

    models = load_models(tiny_dir, device="cuda", talker_dtype=torch.float32)
    disable_fusion()
    try:
        config = TalkerConfig(max_num_seqs=8, enforce_eager=True, fuse=False)
        plain = _run_with(models, config)
        enable_fusion()
        fused = _run_with(models, TalkerConfig(max_num_seqs=8, enforce_eager=True))
    finally:
        disable_fusion()
    for song in plain:
        assert torch.equal(plain[song][0][:20], fused[song][0][:20])
        # float32 sums reassociated by the fused norms, fed back for 20 frames: measured 2.9e-5 at worst (H200).
        torch.testing.assert_close(plain[song][1][:20], fused[song][1][:20], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_depth_decode_attention_gives_the_recomputed_hidden_states(tiny_dir, dtype):
    """On CUDA the cached depth calls keep keys and values in buffers and run the decode attention kernel: their
    hidden states agree with recomputing the whole sequence (SDPA in float32; in bf16 the decode kernel a position at a
    time, over the sequence's own keys and values), within the attention's roundings."""
    from music3serve.models.depth_decoder import DepthKV

    depth = load_models(tiny_dir, device="cuda", talker_dtype=dtype).depth_decoder
    projected = torch.randn(16, 8, depth.cfg.hidden, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)

    def cached(x):
        cache = DepthKV()
        return torch.cat([depth(x[:, :2], cache)] + [depth(x[:, t : t + 1], cache) for t in range(2, 8)], dim=1)

    whole, steps = depth(projected).float(), cached(projected)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3  # the kernel's tl.dot rounds float32 inputs to TF32
    torch.testing.assert_close(steps.float(), whole, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_looked_up_depth_inputs_equal_computed_ones(tiny_dir, dtype):
    """With the hot paths fused as the engine runs them, frames whose depth calls 2..7 look their new position and
    first q, k, v up (DepthInputs) equal frames that compute them: bit for bit in bf16, where the skinny GEMM's rows
    do not depend on each other (the table is built 128 rows at a time, the frames run 2-16); in float32 cuBLAS picks
    its kernel by the row count, so the codes agree exactly and the conditioning to what those roundings become
    through the depth calls: 9.7e-5 at most on values up to 3.8 (H100, 2026-12-06; 7.7e-7 on the CPU)."""
    from music3serve.models.fusion import disable_fusion, enable_fusion
    from music3serve.talker.depth_inputs import DepthInputs
    from music3serve.talker.frame import talker_frame

    models = load_models(tiny_dir, device="cuda", talker_dtype=dtype)
    lm, depth = models.language_model, models.depth_decoder
    enable_fusion()
    try:
        inputs = DepthInputs(depth)  # outside inference mode, as the engine builds it
        for songs in (1, 2, 5, 8):
            hidden = torch.randn(2 * songs, lm.cfg.hidden, generator=torch.Generator().manual_seed(songs))
            hidden, seeds, frames = hidden.to("cuda", dtype), torch.arange(songs).cuda() + 7, torch.arange(songs).cuda()
            with torch.inference_mode():
                computed = talker_frame(lm, depth, hidden, seeds, frames, True)
                looked_up = talker_frame(lm, depth, hidden, seeds, frames, True, inputs)
            for name in ("codes", "ended", "feedback"):
                assert torch.equal(getattr(computed, name), getattr(looked_up, name)), (songs, name)
            if dtype == torch.bfloat16:
                assert torch.equal(computed.conditioning, looked_up.conditioning), songs
            else:
                torch.testing.assert_close(computed.conditioning, looked_up.conditioning, rtol=1e-5, atol=2e-4)
    finally:
        disable_fusion()


@pytest.mark.skipif(not triton_available(), reason="the rotation is the Triton kernel's")
@torch.inference_mode()
def test_decode_rows_norm_and_rotate_in_the_kernel_as_the_layers_did(tiny_dir):
    """On CUDA DecodeRows hands each layer's q and k projections to the attention kernel, which norms and rotates
    them: a bf16 decode step of rows at different positions (the last one padded, at the scratch position) gives the
    hidden states and the stored keys and values of the layers' own norms and RoPE (fused, as the engine runs them)
    bit for bit."""
    from music3serve.models.fusion import disable_fusion, enable_fusion
    from music3serve.talker.slots import SlotCache

    lm = load_models(tiny_dir, device="cuda", talker_dtype=torch.bfloat16).language_model
    g = torch.Generator(device="cuda").manual_seed(5)
    shape = (lm.cfg.layers, 4, lm.cfg.kv_heads, 601, lm.cfg.head_dim)
    past_k, past_v = (torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    embeds = torch.randn(4, 1, lm.cfg.hidden, generator=g, device="cuda").to(torch.bfloat16)
    positions = torch.tensor([7, 311, 599, 600], device="cuda")  # 600: the scratch position of a padded row
    results = []
    enable_fusion()
    try:
        for takes_projections in (True, False):
            slots = SlotCache(lm.cfg, pairs=2, max_model_len=600, dtype=torch.bfloat16, device="cuda")
            slots.k.copy_(past_k)
            slots.v.copy_(past_v)
            rows = slots.decode(4, positions)
            assert rows.takes_projections  # on CUDA with Triton
            rows.takes_projections = takes_projections
            results.append((lm(embeds, positions[:, None], rows), slots.k, slots.v))
    finally:
        disable_fusion()
    (hidden, k, v), (hidden_plain, k_plain, v_plain) = results
    assert torch.equal(k, k_plain) and torch.equal(v, v_plain)
    assert torch.equal(hidden, hidden_plain)
