"""Our five modules against the reference ones (transformers Qwen3ForCausalLM, diffusers MiniMax-Music3 models).

Both sides load the same tiny checkpoint in float32; every output must be within 1e-5 relative error
(max |ours - reference| / max |reference|)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from music3serve import contract
from music3serve.checkpoint import load_component
from music3serve.checkpoint_layout import COMPONENTS
from music3serve.models.language_model import KVCache, QKTransform
from music3serve.models.layers import apply_rope, rms_norm
from music3serve.talker.frame import embed_both_rows, embed_codes, frame_outputs

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
LEGAL_ROWS = [contract.AUDIO_END] + list(
    range(contract.AUDIO_CODE_OFFSET, contract.AUDIO_CODE_OFFSET + contract.SEMANTIC_CODES)
)
REFERENCE_CLASSES = {
    "depth_decoder": diffusers.MiniMaxMusic3RVQDepthDecoder,
    "condition_encoder": diffusers.MiniMaxMusic3ConditionEncoder,
    "dit": diffusers.MiniMaxMusic3Transformer1DModel,
    "vocoder": diffusers.MiniMaxMusic3Vocoder,
}


def positions(embeds: torch.Tensor, start: int) -> torch.Tensor:
    """Positions start, start + 1, ... of a [rows, t, hidden] input."""
    return torch.arange(start, start + embeds.shape[1])


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = rel_err(ours, ref)
    assert err <= TOLERANCE, f"{what}: relative error {err:.3g}"


@pytest.fixture(scope="module")
def models(tiny_dir: Path):
    """(ours, reference) per component, loaded lazily from the same tiny checkpoint in float32."""
    cache: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def get(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
        if name not in cache:
            ours = load_component(tiny_dir, name, "cpu", torch.float32)
            folder = COMPONENTS[name].folder
            if name == "language_model":
                ref = transformers.Qwen3ForCausalLM.from_pretrained(tiny_dir / folder, dtype=torch.float32)
            else:
                ref = REFERENCE_CLASSES[name].from_pretrained(tiny_dir, subfolder=folder, dtype=torch.float32)
            cache[name] = (ours, ref.eval().requires_grad_(False))
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def prompt_ids(rows: int, length: int, seed: int) -> torch.Tensor:
    """Token ids that mix ordinary text, the special tokens and audio codes, like a real prompt + frames."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151_643, (rows, length), generator=gen)
    ids[:, 0] = contract.IM_START
    ids[:, -1] = contract.AUDIO_START
    if length > 3:
        ids[:, 1] = contract.CAPTION_START
        ids[1:, 2:-1] = contract.AUDIO_CFG
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Language model


def test_lm_prefill_two_rows(models) -> None:
    ours, ref = models("language_model")
    ids = prompt_ids(2, 13, seed=0)
    cache = KVCache.allocate(ours.cfg, 2, 32, torch.float32, torch.device("cpu"))
    hidden = ours(ours.embed(ids), positions(ours.embed(ids), 0), cache.at(0))
    ref_hidden = ref.model(input_ids=ids).last_hidden_state
    assert_close(hidden, ref_hidden, "prefill hidden states")
    assert_close(ours.logits(hidden), ref.lm_head(ref_hidden)[..., LEGAL_ROWS].float(), "prefill legal logits")
    # Through the full reference forward too (its own head, all positions).
    ref_logits = ref(input_ids=ids).logits
    assert_close(ours.logits(hidden[:, -1]), ref_logits[:, -1, LEGAL_ROWS].float(), "last-position logits")
    assert ours.logits(hidden).dtype == torch.float32


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_lm_cached_decode(models) -> None:
    """Prefill N tokens, then decode 3 single positions against transformers with past_key_values."""
    ours, ref = models("language_model")
    prefill = prompt_ids(2, 9, seed=1)
    gen = torch.Generator().manual_seed(2)
    cache = KVCache.allocate(ours.cfg, 2, 16, torch.float32, torch.device("cpu"))
    hidden = ours(ours.embed(prefill), positions(ours.embed(prefill), 0), cache.at(0))
    out = ref.model(input_ids=prefill, use_cache=True)
    assert_close(hidden, out.last_hidden_state, "prefill hidden states")
    past, position = out.past_key_values, prefill.shape[1]
    for step in range(3):
        codes = torch.randint(0, contract.SEMANTIC_CODES, (2,), generator=gen)
        if step == 0:  # a plain code token
            ids = (codes + contract.AUDIO_CODE_OFFSET)[:, None]
            ours_in, ref_kwargs = ours.embed(ids), {"input_ids": ids}
        else:  # a feedback embedding, as the talker feeds back (any vector, rows differ)
            embeds = ref.model.embed_tokens(codes + contract.AUDIO_CODE_OFFSET)[:, None]
            embeds = embeds + 0.5 * torch.randn(embeds.shape, generator=gen)
            ours_in, ref_kwargs = embeds, {"inputs_embeds": embeds}
        hidden = ours(ours_in, positions(ours_in, position), cache.at(position))
        out = ref.model(past_key_values=past, use_cache=True, **ref_kwargs)
        past, position = out.past_key_values, position + 1
        assert_close(hidden, out.last_hidden_state, f"decode step {step} hidden")
        assert_close(
            ours.logits(hidden[:, -1]), ref.lm_head(out.last_hidden_state[:, -1])[:, LEGAL_ROWS], f"decode step {step} logits"
        )


class ProjectionsCache(KVCache):
    """A backend that takes q and k as projections and applies their QKTransform itself (as the CUDA decode attention
    kernel does), with the models' torch ops."""

    takes_projections = True

    def __call__(self, layer, q, k, v, transform=None):
        assert transform is not None
        q = apply_rope(rms_norm(q, transform.q_norm, transform.eps), transform.cos, transform.sin)
        k = apply_rope(rms_norm(k, transform.k_norm, transform.eps), transform.cos, transform.sin)
        return super().__call__(layer, q, k, v)


def test_lm_gives_a_projections_backend_what_it_needs(models) -> None:
    """A backend taking projections (the decode kernel's path on CUDA) gets each layer's q, k, v projections and the
    norms and rotary angles that turn them into the plain path's inputs: the same hidden states, bit for bit."""
    ours, _ = models("language_model")
    ids = prompt_ids(2, 9, seed=3)
    plain = KVCache.allocate(ours.cfg, 2, 16, torch.float32, torch.device("cpu"))
    other = ProjectionsCache(torch.zeros_like(plain.k), torch.zeros_like(plain.v))
    want = ours(ours.embed(ids), positions(ours.embed(ids), 0), plain.at(0))
    got = ours(ours.embed(ids), positions(ours.embed(ids), 0), other.at(0))
    assert torch.equal(got, want) and torch.equal(other.k, plain.k)


def test_a_plain_cache_refuses_projections(models) -> None:
    """KVCache stores attention inputs: handed projections with their transform, it says so instead of storing keys
    that were never normed or rotated."""
    ours, _ = models("language_model")
    cfg = ours.cfg
    cache = KVCache.allocate(cfg, 2, 16, torch.float32, torch.device("cpu"))
    q, k = torch.zeros(2, 1, cfg.heads, cfg.head_dim), torch.zeros(2, 1, cfg.kv_heads, cfg.head_dim)
    ones, angles = torch.ones(cfg.head_dim), torch.zeros(2, 1, cfg.head_dim)
    with pytest.raises(ValueError, match="not projections"):
        cache(0, q, k, k.clone(), QKTransform(ones, ones, cfg.eps, angles, angles))


def test_lm_chunked_prefill_equals_single_prefill(models) -> None:
    ours, ref = models("language_model")
    ids = prompt_ids(2, 11, seed=3)
    single = KVCache.allocate(ours.cfg, 2, 16, torch.float32, torch.device("cpu"))
    whole = ours(ours.embed(ids), positions(ours.embed(ids), 0), single.at(0))
    chunked = KVCache.allocate(ours.cfg, 2, 16, torch.float32, torch.device("cpu"))
    first = ours(ours.embed(ids[:, :4]), positions(ours.embed(ids[:, :4]), 0), chunked.at(0))
    second = ours(ours.embed(ids[:, 4:]), positions(ours.embed(ids[:, 4:]), 4), chunked.at(4))
    assert_close(torch.cat((first, second), dim=1), whole, "chunked vs single prefill")
    assert_close(chunked.k[:, :, :, :11], single.k[:, :, :, :11], "cached keys")
    assert_close(chunked.v[:, :, :, :11], single.v[:, :, :, :11], "cached values")
    assert_close(second, ref.model(input_ids=ids).last_hidden_state[:, 4:], "second chunk vs reference")
    # The next decode step reads the chunked cache like the single one.
    step = ours.embed(torch.tensor([5, 9]) + contract.AUDIO_CODE_OFFSET)[:, None]
    assert_close(ours(step, positions(step, 11), chunked.at(11)), ours(step, positions(step, 11), single.at(11)), "decode after chunked prefill")



# ---------------------------------------------------------------------------------------------------------------
# Depth decoder


@pytest.mark.parametrize("length", range(1, 9))
def test_depth_decoder_hidden_states(models, length: int) -> None:
    ours, ref = models("depth_decoder")
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, ours.cfg.hidden, generator=gen)
    assert_close(ours.projection(x), ref.projection(x), "projection")
    projected = ref.projection(x)
    hidden = ours(projected)
    ref_hidden = ref(projected)
    assert_close(hidden, ref_hidden, f"hidden states, length {length}")
    if length <= ours.cfg.codebooks - 1:
        assert_close(
            ours.head_logits(hidden[:, -1], length), ref.audio_heads[length - 1](ref_hidden[:, -1]).float(), f"head {length}"
        )


def test_depth_decoder_heads_and_embeddings(models) -> None:
    ours, ref = models("depth_decoder")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, ours.cfg.hidden, generator=gen)
    for codebook in range(1, ours.cfg.codebooks):
        logits = ours.head_logits(hidden, codebook)
        assert logits.dtype == torch.float32 and logits.shape == (2, contract.RESIDUAL_CODES)
        assert_close(logits, ref.audio_heads[codebook - 1](hidden).float(), f"head {codebook}")
        codes = torch.randint(0, contract.RESIDUAL_CODES, (2,), generator=gen)
        embedded = embed_both_rows(codes, ours.code_row(codebook), ours.embed.weight)  # as the talker frame does
        assert torch.equal(embedded[0::2], ref.audio_embeddings(codes + (codebook - 1) * contract.RESIDUAL_CODES))


def test_frame_feedback_embedding(models) -> None:
    """The talker frame's embeddings of its codes and its feedback input (talker/frame.py, the functions the frame
    step runs) equal the reference pipeline's _embed_audio_frame, for both rows of each song."""
    from diffusers.modular_pipelines.minimax_music3 import encoders

    lm, lm_ref = models("language_model")
    depth, depth_ref = models("depth_decoder")
    gen = torch.Generator().manual_seed(1)
    semantic = torch.randint(0, contract.SEMANTIC_CODES, (2, 1), generator=gen)
    residual = torch.randint(0, contract.RESIDUAL_CODES, (2, contract.NUM_CODEBOOKS - 1), generator=gen)
    semantic_embed = embed_both_rows(semantic[:, 0], contract.AUDIO_CODE_OFFSET, lm.embed.weight)
    last = contract.NUM_CODEBOOKS - 1  # embedded by frame_outputs itself
    residual_embeds = [embed_codes(residual[:, i - 1], depth.code_row(i), depth.embed.weight, depth.projection.weight,
                                   depth.positions.weight[i + 1])[0] for i in range(1, last)]
    codes = [semantic[:, 0], *residual.unbind(1)]
    hidden = torch.zeros(4, lm.cfg.hidden)
    _, _, feedback = frame_outputs(codes, torch.zeros(2, dtype=torch.bool), semantic_embed, residual_embeds,
                                   depth.embed.weight, depth.code_row(last), hidden, [hidden[0::2]] * last)
    ref = encoders._embed_audio_frame(lm_ref, depth_ref, torch.cat((semantic, residual), dim=1))
    assert_close(feedback[0::2, None], ref, "feedback embedding, conditional rows")
    assert torch.equal(feedback[0::2], feedback[1::2])


# ---------------------------------------------------------------------------------------------------------------
# Condition encoder


@pytest.mark.parametrize("frames", [1, 7, 100, 199, 200])
def test_condition_encoder(models, frames: int) -> None:
    ours, ref = models("condition_encoder")
    gen = torch.Generator().manual_seed(frames)
    x = torch.randn(2, frames, ours.cfg.streams * ours.cfg.hidden, generator=gen)
    out = ours(x)
    expected = {1: 3, 7: 24, 100: 344, 199: 685, 200: 689}[frames]
    assert contract.latent_length(frames) == expected
    assert out.shape == (2, expected, ours.cfg.out_dim)
    assert_close(out, ref(x), f"condition, {frames} frames")
    assert_close(ours.project(ours.mix(x)), out, "mix + project")


def test_condition_encoder_refuses_frames_of_another_width(models) -> None:
    ours, _ = models("condition_encoder")
    width = ours.cfg.streams * ours.cfg.hidden
    message = f"{ours.cfg.streams} streams of {ours.cfg.hidden}, {width} wide; got {width + 1}"
    with pytest.raises(ValueError, match=message):
        ours.mix(torch.randn(3, width + 1))


# ---------------------------------------------------------------------------------------------------------------
# DiT


@pytest.mark.parametrize(
    ("length", "timesteps"),
    [(1, (0.0, 1.0)), (24, (1 / 30, 29 / 30)), (344, (0.5, 0.2)), (689, (0.0, 0.9))],
)
def test_dit_velocity(models, length: int, timesteps: tuple[float, float]) -> None:
    ours, ref = models("dit")
    gen = torch.Generator().manual_seed(length)
    latents = torch.randn(2, ours.cfg.channels, length, generator=gen)
    condition = torch.randn(2, length, ours.cfg.condition, generator=gen)
    condition[1] *= 0.1  # two different conditions in one batch
    t = torch.tensor(timesteps)
    velocity = ours(latents, t, condition)
    ref_velocity = ref(latents, t, condition, return_dict=False)[0]
    assert velocity.shape == latents.shape
    assert_close(velocity, ref_velocity, f"velocity, length {length}")
    # Rows are independent: each row alone gives the same velocity.
    assert_close(ours(latents[1:], t[1:], condition[1:]), ref_velocity[1:], "row 1 alone")


def test_dit_unconditional_branch(models) -> None:
    ours, ref = models("dit")
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(2, ours.cfg.channels, 30, generator=gen)
    condition = torch.randn(2, 30, ours.cfg.condition, generator=gen)
    condition[1] = 0.0  # the uncond branch is conditioned on zeros
    t = torch.full((2,), 0.4)
    assert_close(ours(latents, t, condition), ref(latents, t, condition, return_dict=False)[0], "cond + uncond")


# ---------------------------------------------------------------------------------------------------------------
# Vocoder


@pytest.mark.parametrize(("batch", "length"), [(1, 1), (2, 20), (1, 689)])
def test_vocoder_waveform(models, batch: int, length: int) -> None:
    ours, ref = models("vocoder")
    gen = torch.Generator().manual_seed(length)
    latents = torch.randn(batch, contract.LATENT_CHANNELS, length, generator=gen)
    waveform = ours(latents)
    assert waveform.shape == (batch, 2, length * contract.LATENT_HOP)
    assert_close(waveform, ref(latents), f"waveform, {length} latents")
