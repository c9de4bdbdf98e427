"""One talker frame for a batch of songs: semantic code, the 7 depth-decoder codes, conditioning, feedback.

Rows are interleaved pairs: row 2i is song i's conditional row, row 2i + 1 its unconditional row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import contract
from ..models.depth_decoder import DepthDecoder, DepthKV
from ..models.language_model import LanguageModel
from .sampling import guided_draw


@dataclass
class Frame:
    codes: torch.Tensor  # [songs, 8]: c0 (semantic code, or -1 where audio_end was drawn) and c1..c7
    ended: torch.Tensor  # [songs] bool: audio_end was drawn, the song stops before this frame
    conditioning: torch.Tensor  # [songs, 8 * hidden]: LM hidden and 7 depth hiddens of the conditional row
    feedback: torch.Tensor  # [2 * songs, hidden]: input embedding of the next step, both rows


def both_rows(per_song: torch.Tensor) -> torch.Tensor:
    """[songs] -> [2 * songs]: the same value for a song's cond and uncond rows (no host sync)."""
    return per_song[:, None].expand(-1, 2).reshape(-1)


def sample_semantic(lm: LanguageModel, hidden: torch.Tensor, seeds: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """Legal column drawn per song (0 = audio_end, 1 + k = code k) from the pair hiddens [2 * songs, hidden]."""
    return guided_draw(lm.logits(hidden), contract.AR_CFG_SCALE, contract.AR_TOP_K, seeds, frames, 0,
                       cond_top_k=contract.AR_CFG_TOP_K)


def talker_frame(
    lm: LanguageModel,
    depth: DepthDecoder,
    hidden: torch.Tensor,
    seeds: torch.Tensor,
    frames: torch.Tensor,
    depth_cache: bool,
) -> Frame:
    """Everything one frame step does after the backbone, for songs keyed by (seed, frame index). The 7 depth
    calls recompute their whole sequence, or with `depth_cache` run only the new position on cached keys."""
    column = sample_semantic(lm, hidden, seeds, frames)
    ended = column == 0
    semantic = (column - 1).clamp_min(0)
    semantic_embed = lm.embed_codes(both_rows(semantic))
    sequence = [depth.project(hidden), depth.project(semantic_embed)]
    cache = DepthKV(in_buffers=hidden.is_cuda) if depth_cache else None
    codes, depth_hiddens, residual_embeds = [semantic], [], []
    for codebook in range(1, contract.NUM_CODEBOOKS):
        new = sequence[cache.length :] if cache is not None else sequence
        out = depth(torch.stack(new, dim=1), cache)[:, -1]
        depth_hiddens.append(out[0::2])
        code = guided_draw(depth.head_logits(out, codebook), contract.AR_CFG_SCALE, contract.AR_TOP_K, seeds, frames,
                           codebook)
        codes.append(code)
        residual_embeds.append(depth.embed_residual(both_rows(code), codebook))
        if codebook < contract.NUM_CODEBOOKS - 1:
            sequence.append(depth.project(residual_embeds[-1]))
    residual = torch.stack(residual_embeds, dim=1).sum(dim=1)
    feedback = (semantic_embed + residual.to(semantic_embed.dtype)) * contract.NUM_CODEBOOKS**-0.5
    conditioning = torch.cat([hidden[0::2], *depth_hiddens], dim=-1)
    codes_t = torch.stack(codes, dim=1)
    codes_t[:, 0] = torch.where(ended, -1, codes_t[:, 0])
    return Frame(codes_t, ended, conditioning, feedback)
