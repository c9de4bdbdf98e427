"""A talker language model whose prefills run out of memory, shared by the talker's and the engine's tests."""

from __future__ import annotations

import torch


class FailingPrefill:
    """The language model, except that a prefill chunk of `tokens` tokens (every chunk: None) runs out of memory.
    Only the talker's prefills call it: its frame steps hold their own reference to the model."""

    def __init__(self, lm, tokens: int | None = None):
        self.lm, self.tokens = lm, tokens

    def __getattr__(self, name: str):
        return getattr(self.lm, name)

    def __call__(self, x, positions, attend):
        if self.tokens is None or x.shape[1] == self.tokens:
            raise torch.OutOfMemoryError("out of memory for this prompt (test)")
        return self.lm(x, positions, attend)
