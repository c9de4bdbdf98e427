"""The diffusers 0.42.1 reference run on the same GPU, full size, random weights (needs diffusers)."""

from __future__ import annotations

import time

import torch

from .. import contract
from .common import FULL_CONFIGS, time_ms


def _default_dtype(dtype: torch.dtype):
    class _Scope:
        def __enter__(self):
            self.saved = torch.get_default_dtype()
            torch.set_default_dtype(dtype)

        def __exit__(self, *exc):
            torch.set_default_dtype(self.saved)

    return _Scope()


@torch.inference_mode()
def diffusers_frame_ms(device: str = "cuda", frames: int = 25, prompt_tokens: int = 300) -> float:
    """Milliseconds per frame of the reference autoregressive step (bf16), one song."""
    from diffusers import MiniMaxMusic3RVQDepthDecoder
    from diffusers.modular_pipelines.minimax_music3.encoders import MiniMaxMusic3AutoregressiveStep
    from transformers import Qwen3Config, Qwen3ForCausalLM

    lm_cfg = dict(FULL_CONFIGS["language_model"], tie_word_embeddings=False)
    with _default_dtype(torch.bfloat16), torch.device(device):
        lm = Qwen3ForCausalLM(Qwen3Config(**lm_cfg)).eval()
        depth = MiniMaxMusic3RVQDepthDecoder(**FULL_CONFIGS["depth_decoder"]).eval()
    pipe = MiniMaxMusic3AutoregressiveStep().init_pipeline()
    pipe.update_components(language_model=lm, rvq_depth_decoder=depth)
    ids = torch.randint(0, 151643, (1, prompt_tokens), device=device)
    text_ids = torch.cat([ids, ids.clone().fill_(contract.AUDIO_CFG)])
    generator = torch.Generator(device).manual_seed(0)

    def song(n: int) -> None:
        pipe(text_ids=text_ids, audio_duration=n / contract.FRAME_RATE, generator=generator, output="frame_hiddens")

    song(3)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    song(frames)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return elapsed / (frames + 1) * 1e3  # the models are freed on return


@torch.inference_mode()
def diffusers_dit_ms(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, tf32: bool = False) -> float:
    """Milliseconds of one single-branch reference DiT call on a full 689-column window."""
    from diffusers import MiniMaxMusic3Transformer1DModel

    with _default_dtype(dtype), torch.device(device):
        dit = MiniMaxMusic3Transformer1DModel(**FULL_CONFIGS["dit"]).eval()
    length = contract.latent_length(contract.WINDOW_FRAMES)
    x = torch.randn(1, 128, length, device=device, dtype=dtype)
    cond = torch.randn(1, length, 2048, device=device, dtype=dtype)
    t = torch.full((1,), 0.5, device=device, dtype=dtype)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        return time_ms(lambda: dit(hidden_states=x, timestep=t, encoder_hidden_states=cond, return_dict=False))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
