"""One talker frame for a batch of songs: semantic code, the 7 depth-decoder codes, conditioning, feedback.

Rows are interleaved pairs: row 2i is song i's conditional row, row 2i + 1 its unconditional row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .. import contract
from ..models.depth_decoder import DepthDecoder, DepthKV
from ..models.fusion import hot
from ..models.language_model import LanguageModel
from ..models.layers import Weight, linear
from .sampling import guided_draw

if TYPE_CHECKING:
    from .depth_inputs import DepthInputs


@dataclass
class Frame:
    codes: torch.Tensor  # [songs, 8]: c0 (semantic code, or -1 where audio_end was drawn) and c1..c7
    ended: torch.Tensor  # [songs] bool: audio_end was drawn, the song stops before this frame
    conditioning: torch.Tensor  # [songs, 8 * hidden]: LM hidden and 7 depth hiddens of the conditional row
    feedback: torch.Tensor  # [2 * songs, hidden]: input embedding of the next step, both rows


def both_rows(per_song: torch.Tensor) -> torch.Tensor:
    """[songs] -> [2 * songs]: the same value for a song's cond and uncond rows (no host sync)."""
    return per_song[:, None].expand(-1, 2).reshape(-1)


def semantic_draw(hidden: torch.Tensor, head: Weight, seeds: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """Legal column drawn per song (0 = audio_end, 1 + k = code k) from the pair hiddens [2 * songs, hidden] and the
    LM's head weight (its logits in the head's dtype: the draw widens them itself)."""
    return guided_draw(linear(hidden, head), contract.AR_CFG_SCALE, contract.AR_TOP_K, seeds, frames, 0,
                       cond_top_k=contract.AR_CFG_TOP_K)


def embed_both_rows(codes: torch.Tensor, first_row: int, table: torch.Tensor) -> torch.Tensor:
    """[songs] codes -> [2 * songs, hidden]: row first_row + code of `table` for each song's two rows (the LM's
    embedding with first_row AUDIO_CODE_OFFSET for semantic codes, the depth decoder's with its code_row for residual
    ones)."""
    return F.embedding(both_rows(codes) + first_row, table)


@hot
def embed_codes(
    codes: torch.Tensor, first_row: int, table: torch.Tensor, projection: torch.Tensor, position: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """embed_both_rows, and that embedding's depth projection plus its position embedding `position` [hidden]: one
    fused gather, and the position added in the GEMM's epilogue, not by a kernel of its own."""
    embedded = embed_both_rows(codes, first_row, table)
    return embedded, linear(embedded, projection, residual=position.expand_as(embedded))


@hot
def first_depth_positions(
    hidden: torch.Tensor, head: Weight, seeds: torch.Tensor, frames: torch.Tensor, table: torch.Tensor,
    projection: Weight, positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The semantic draw from the pair hiddens, then audio_end flags, semantic codes, their embedding (both rows) and
    the depth decoder's first two positions [rows, 2, hidden] with their position embeddings `positions` [2, hidden],
    the backbone hidden and that embedding projected in one GEMM (one read of the projection weight). The draw is
    part of this graph: its guided_draw with the conditional top-k compiles no graph of its own."""
    column = semantic_draw(hidden, head, seeds, frames)
    ended = column == 0
    semantic = (column - 1).clamp_min(0)
    embedded = embed_both_rows(semantic, contract.AUDIO_CODE_OFFSET, table)
    projected = linear(torch.stack((hidden, embedded), dim=1), projection)
    return ended, semantic, embedded, projected + positions


@hot
def frame_outputs(
    codes: list[torch.Tensor], ended: torch.Tensor, semantic_embed: torch.Tensor, residual_embeds: list[torch.Tensor],
    last_table: torch.Tensor, last_row: int, hidden: torch.Tensor, depth_hiddens: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The frame's codes (c0 = -1 where the song ended), conditioning and feedback embedding. residual_embeds: those
    of c1..c6; c7's, which feeds no depth call, is gathered here (rows last_row + code of `last_table`), not by a
    compiled graph of its own."""
    last_embed = embed_both_rows(codes[-1], last_row, last_table)
    residual = torch.stack([*residual_embeds, last_embed], dim=1).sum(dim=1)
    feedback = (semantic_embed + residual.to(semantic_embed.dtype)) * contract.NUM_CODEBOOKS**-0.5
    conditioning = torch.cat([hidden[0::2], *depth_hiddens], dim=-1)
    codes_t = torch.stack([torch.where(ended, -1, codes[0]), *codes[1:]], dim=1)  # not in place: no guard on songs
    return codes_t, conditioning, feedback


def talker_frame(
    lm: LanguageModel,
    depth: DepthDecoder,
    hidden: torch.Tensor,
    seeds: torch.Tensor,
    frames: torch.Tensor,
    depth_cache: bool,
    inputs: DepthInputs | None = None,
) -> Frame:
    """Everything one frame step does after the backbone, for songs keyed by (seed, frame index). The 7 depth
    calls recompute their whole sequence, or with `depth_cache` run only the new position on cached keys (with
    `inputs`, whose rows then replace computing the new position and its first q, k, v)."""
    if inputs is not None and not depth_cache:
        raise ValueError("DepthInputs serve cached depth calls (depth_cache=True)")
    position_table = depth.positions.weight
    ended, semantic, semantic_embed, positions = first_depth_positions(
        hidden, lm.head.weight, seeds, frames, lm.embed.weight, depth.projection.weight, position_table[:2]
    )
    cache = DepthKV() if depth_cache else None
    codes, depth_hiddens, residual_embeds, qkv = [semantic], [], [], None
    for codebook in range(1, contract.NUM_CODEBOOKS):
        out = depth(positions, cache, positioned=True, first_qkv=qkv)[:, -1]  # those the cache lacks (all without one)
        depth_hiddens.append(out[0::2])
        logits = depth.head_logits(out, codebook, widen=False)
        code = guided_draw(logits, contract.AR_CFG_SCALE, contract.AR_TOP_K, seeds, frames, codebook)
        codes.append(code)
        if codebook == contract.NUM_CODEBOOKS - 1:  # the last code: embedded by frame_outputs
            break
        if inputs is not None:
            embedded, projected, qkv = inputs.lookup(code, depth.code_row(codebook), depth.embed.weight)
        else:
            embedded, projected = embed_codes(code, depth.code_row(codebook), depth.embed.weight,
                                              depth.projection.weight, position_table[codebook + 1])
        residual_embeds.append(embedded)
        new = projected[:, None]
        positions = new if cache is not None else torch.cat((positions, new), dim=1)
    codes_t, conditioning, feedback = frame_outputs(
        codes, ended, semantic_embed, residual_embeds, depth.embed.weight, depth.code_row(contract.NUM_CODEBOOKS - 1),
        hidden, depth_hiddens,
    )
    return Frame(codes_t, ended, conditioning, feedback)
