"""The depth decoder's new positions for every code, computed once: calls 2..7 of a frame look them up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import contract
from ..kernels.skinny_linear import MAX_ROWS
from ..models.depth_decoder import DepthDecoder
from ..models.fusion import hot
from .frame import both_rows, embed_codes

BUILD_SONGS = MAX_ROWS // 2  # codes per call while building: both rows of each fill the skinny GEMM's 128 rows


class DepthInputs:
    """What a cached depth call after the first takes from the code drawn before it, computed once for every code: the
    projected position (its position embedding added) and the first block's q | k | v of it, side by side in one
    table row. Calls 2..7 of a frame gather these rows instead of reading the projection and first qkv weights (134 MB
    a call at full size).

    Rows follow the depth decoder's embedding table (``code_row(codebook) + code``) for codebooks 1..6, the ones whose
    code feeds a later call. Built with the frame's own functions in chunks of 128 rows, which on CUDA run the skinny
    GEMM, whose arithmetic per row does not depend on the others: each row holds the bits a frame of up to 32 songs
    computes for it (past that the frame's GEMMs run cuBLAS). A snapshot of the weights at build time: weights changed
    afterwards need a new table."""

    @torch.no_grad()
    def __init__(self, depth: DepthDecoder) -> None:
        hidden, weight = depth.cfg.hidden, depth.embed.weight
        self.table = weight.new_empty(self.rows(depth), 4 * hidden)
        with torch.inference_mode():  # as the frame step calls the hot functions: no compilation of their own
            self._fill(depth)

    def _fill(self, depth: DepthDecoder) -> None:
        hidden, weight, first = depth.cfg.hidden, depth.embed.weight, depth.blocks[0]
        for codebook in range(1, contract.NUM_CODEBOOKS - 1):
            position = depth.positions.weight[codebook + 1]
            for start in range(0, depth.cfg.codes, BUILD_SONGS):
                codes = torch.arange(start, min(start + BUILD_SONGS, depth.cfg.codes), device=weight.device)
                projected = embed_codes(codes, depth.code_row(codebook), weight, depth.projection.weight, position)[1]
                at = slice(depth.code_row(codebook) + start, depth.code_row(codebook) + start + len(codes))
                self.table[at, :hidden] = projected[0::2]
                self.table[at, hidden:] = first.qkv_of(projected[:, None])[0::2]

    @staticmethod
    def rows(depth: DepthDecoder) -> int:
        return (contract.NUM_CODEBOOKS - 2) * depth.cfg.codes

    @staticmethod
    def bytes_needed(depth: DepthDecoder) -> int:
        return DepthInputs.rows(depth) * 4 * depth.cfg.hidden * depth.embed.weight.element_size()

    def lookup(
        self, codes: torch.Tensor, first_row: int, embed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For [songs] codes of the codebook whose code 0 is row first_row: their embedding (rows of `embed`), projected
        position [2 * songs, hidden] and first-block q | k | v [2 * songs, 3 * hidden], both rows of each song."""
        return gather_code_inputs(codes, first_row, embed, self.table)


@hot
def gather_code_inputs(
    codes: torch.Tensor, first_row: int, embed: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows first_row + code of the embedding table and of DepthInputs' table (split into its two parts), for both rows
    of each song. The projected positions come back contiguous, as the first depth call's: a strided view would
    compile the depth blocks' residual_mlp once more (dynamo guards its row stride)."""
    index = both_rows(codes) + first_row
    row = F.embedding(index, table)
    return F.embedding(index, embed), row[:, : embed.shape[1]].contiguous(), row[:, embed.shape[1] :]
