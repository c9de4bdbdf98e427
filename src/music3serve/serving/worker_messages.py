"""The messages between the engine and its stage-1 worker: the two channels' names, and a window to render or its
rendered PCM as a connector message and back."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..acoustic.payloads import RenderedWindow, WindowPayload
from ..acoustic.windows import Window
from .connectors import Message

WINDOWS, PCM = "stage0_to_stage1", "stage1_to_engine"


def window_meta(song: str, w: Window) -> dict[str, Any]:
    """A window of a song as a message's meta (JSON values)."""
    return {"song": song, "index": w.index, "start": w.start, "frames": w.frames, "last": w.last}


def meta_window(meta: dict[str, Any]) -> Window:
    return Window(meta["index"], meta["start"], meta["frames"], meta["last"])


def window_message(payload: WindowPayload) -> Message:
    meta = {**window_meta(payload.song, payload.window), "seed": payload.seed, "steps": payload.steps}
    return Message("window", meta, {"mixed": payload.mixed.float().cpu()})


def window_payload(message: Message) -> WindowPayload:
    m = message.meta
    return WindowPayload(m["song"], m["seed"], meta_window(m), message.tensors["mixed"], m["steps"])


def chunk_message(out: RenderedWindow) -> Message:
    return Message("chunk", window_meta(out.song, out.window), {"pcm": out.pcm})


def chunk_window(message: Message) -> RenderedWindow:
    pcm = torch.from_numpy(np.asarray(message.tensors["pcm"]))
    return RenderedWindow(message.meta["song"], meta_window(message.meta), pcm, torch.empty(0))
