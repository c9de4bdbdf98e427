"""GPU: the talker in bf16, through the kernels the engine runs (skinny GEMMs, decode attention over the KV slots,
the depth decoder's key/value buffers, fused hot paths), strays from the float32 reference no further than the
reference itself does in bf16 on the same GPU (transformers' Qwen3 and diffusers' depth decoder, teacher-forced on
the same tokens). The measured errors go into docs/precision.md; `pytest -s` prints them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from music3serve import contract
from music3serve.bench.common import FULL_CONFIGS
from music3serve.checkpoint import load_component
from music3serve.checkpoint_layout import COMPONENTS, load_config
from music3serve.models.depth_decoder import DepthKV
from music3serve.models.fusion import disable_fusion, enable_fusion
from music3serve.models.layers import linear
from music3serve.talker.slots import SlotCache
from music3serve.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

# Ours may be this many times further from float32 than the reference's own bf16 run. Measured on the H200
# (docs/precision.md): RMS ratio 1.00, max ratio 0.93-1.27 at the released widths; equal logits at the tiny ones.
RATIO = 1.5
LEGAL_ROWS = [contract.AUDIO_END, *range(contract.AUDIO_CODE_OFFSET, contract.AUDIO_CODE_OFFSET + contract.SEMANTIC_CODES)]
PROMPT, DECODE_STEPS = 40, 24
DEVICE = "cuda"


def errors(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """max |ours - ref| / max |ref| (at bf16 logits mostly the last rounding of the largest one) and the RMS of
    ours - ref over the RMS of ref (every logit's drift)."""
    diff, ref = ours.double() - ref.double(), ref.double()
    return (diff.abs().max() / ref.abs().max()).item(), (diff.square().mean() / ref.square().mean()).sqrt().item()


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """Gives back the models' memory after each test: the engine tests that follow size their KV cache and check their
    weights' share from what the card has free."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint with the talker at the released widths (the depth decoder whole, the language model's
    first four layers): the GEMMs' long sums and the decode attention's 128-wide heads and splits."""
    overrides = {"language_model": {**FULL_CONFIGS["language_model"], "num_hidden_layers": 4},
                 "depth_decoder": FULL_CONFIGS["depth_decoder"]}
    return write_tiny_checkpoint(tmp_path_factory.mktemp("wide") / "checkpoint", seed=0, overrides=overrides)


@pytest.fixture(params=["tiny", "wide"])
def checkpoint(request) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture
def fused():
    """The engine's hot paths compiled, as on CUDA in production."""
    enable_fusion()
    yield
    disable_fusion()


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A two-row prompt ending in audio_start and the code tokens then fed back one per step, per row."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, contract.AUDIO_CODE_OFFSET, (2, PROMPT), generator=gen)
    prompt[:, -1] = contract.AUDIO_START
    codes = torch.randint(0, contract.SEMANTIC_CODES, (2, DECODE_STEPS), generator=gen) + contract.AUDIO_CODE_OFFSET
    return prompt, codes


@torch.inference_mode()
def our_lm_logits(root: Path, prompt: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Legal logits [steps + 1, 2, columns] after the prompt (prefilled into a slot pair) and after each code."""
    lm = load_component(root, "language_model", DEVICE, torch.bfloat16)
    slots = SlotCache(lm.cfg, 1, PROMPT + DECODE_STEPS, torch.bfloat16, DEVICE)
    prompt, codes = prompt.to(DEVICE), codes.to(DEVICE)
    hidden = lm(lm.embed(prompt), torch.arange(PROMPT, device=DEVICE), slots.prefill(0, 0))[:, -1]
    out = [lm.logits(hidden)]
    for step in range(DECODE_STEPS):
        positions = torch.full((2,), PROMPT + step, device=DEVICE)
        hidden = lm(lm.embed(codes[:, step : step + 1]), positions[:, None], slots.decode(2, positions))[:, 0]
        out.append(lm.logits(hidden))
    return torch.stack(out).cpu()


@torch.inference_mode()
def reference_lm_logits(root: Path, dtype: torch.dtype, prompt: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    ref = transformers.Qwen3ForCausalLM.from_pretrained(root / COMPONENTS["language_model"].folder, dtype=dtype).to(DEVICE)
    out = ref(input_ids=prompt.to(DEVICE), use_cache=True)
    logits, past = [out.logits[:, -1, LEGAL_ROWS]], out.past_key_values
    for step in range(DECODE_STEPS):
        out = ref(input_ids=codes[:, step : step + 1].to(DEVICE), past_key_values=past, use_cache=True)
        logits.append(out.logits[:, -1, LEGAL_ROWS])
        past = out.past_key_values
    return torch.stack(logits).float().cpu()


def depth_inputs(hidden: int, seed: int) -> torch.Tensor:
    """A frame's depth sequence before projection [rows, 8, hidden] (backbone hidden, then code embeddings), bf16
    values so that every run reads the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, contract.NUM_CODEBOOKS, hidden, generator=gen).bfloat16()


@torch.inference_mode()
def our_depth_logits(root: Path, x: torch.Tensor) -> torch.Tensor:
    """Head logits [7, rows, codes] of the seven depth calls as the talker makes them (talker/frame.py): the first two
    positions projected in one GEMM, their position embeddings added after it; then one position at a time, its
    position embedding added in its projection GEMM's epilogue, on cached keys and values."""
    depth = load_component(root, "depth_decoder", DEVICE, torch.bfloat16)
    x, weight, positions = x.to(DEVICE), depth.projection.weight, depth.positions.weight
    cache = DepthKV()
    out = [depth(linear(x[:, :2], weight) + positions[:2], cache, positioned=True)[:, -1]]
    for t in range(2, contract.NUM_CODEBOOKS):
        new = linear(x[:, t], weight, residual=positions[t].expand(x.shape[0], -1))[:, None]
        out.append(depth(new, cache, positioned=True)[:, -1])
    return torch.stack([depth.head_logits(h, codebook) for codebook, h in enumerate(out, start=1)]).cpu()


@torch.inference_mode()
def reference_depth_logits(root: Path, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """The reference recomputes each call's whole sequence, as its pipeline does."""
    folder = COMPONENTS["depth_decoder"].folder
    ref = diffusers.MiniMaxMusic3RVQDepthDecoder.from_pretrained(root, subfolder=folder, dtype=dtype).to(DEVICE)
    projected = ref.projection(x.to(DEVICE, dtype))
    logits = [ref.audio_heads[t - 1](ref(projected[:, : t + 1])[:, -1]) for t in range(1, contract.NUM_CODEBOOKS)]
    return torch.stack(logits).float().cpu()


def check(what: str, ours: torch.Tensor, ref32: torch.Tensor, ref16: torch.Tensor) -> None:
    (ours_max, ours_rms), (ref_max, ref_rms) = errors(ours, ref32), errors(ref16, ref32)
    same = (ours == ref16).double().mean().item()
    print(f"\n| {what} | {ours_max:.3g} | {ref_max:.3g} | {ours_rms:.3g} | {ref_rms:.3g} | {ours_rms / ref_rms:.2f} "
          f"| {same:.1%} |")
    assert ours_max <= RATIO * ref_max, f"{what}: max error {ours_max:.3g}, the reference's bf16 {ref_max:.3g}"
    assert ours_rms <= RATIO * ref_rms, f"{what}: RMS error {ours_rms:.3g}, the reference's bf16 {ref_rms:.3g}"


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_language_model_logits_stay_as_close_as_the_references(checkpoint, fused, seed):
    name, root = checkpoint
    prompt, codes = tokens(seed)
    ref32, ref16 = (reference_lm_logits(root, dtype, prompt, codes) for dtype in (torch.float32, torch.bfloat16))
    check(f"{name} language model legal logits, seed {seed}", our_lm_logits(root, prompt, codes), ref32, ref16)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_depth_decoder_logits_stay_as_close_as_the_references(checkpoint, fused, seed):
    name, root = checkpoint
    x = depth_inputs(load_config(root, "depth_decoder").hidden, seed)
    ref32, ref16 = (reference_depth_logits(root, dtype, x) for dtype in (torch.float32, torch.bfloat16))
    check(f"{name} depth decoder head logits, seed {seed}", our_depth_logits(root, x), ref32, ref16)
