"""When the talker hands a window to the acoustic stage.

A window of 200 frames starting at s goes out once frame s + 201 exists: by then it is known not to be
the song's last window (the contract's window starts are range(0, frames - 100, 100)). The remaining
windows go out when the song ends, the final one marked last.
"""

from __future__ import annotations

from .. import contract
from ..acoustic.windows import Window, song_windows


class WindowTracker:
    def __init__(self) -> None:
        self.sent = 0  # windows handed on so far

    def ready(self, frames: int) -> list[Window]:
        """Windows that became ready now that the song has `frames` frames and goes on."""
        out = []
        while frames >= self.sent * contract.WINDOW_HOP + contract.WINDOW_FRAMES + 1:
            start = self.sent * contract.WINDOW_HOP
            out.append(Window(self.sent, start, contract.WINDOW_FRAMES, last=False))
            self.sent += 1
        return out

    def finish(self, frames: int) -> list[Window]:
        """The windows not yet handed on when the song ends with `frames` frames."""
        remaining = song_windows(frames)[self.sent :]
        self.sent += len(remaining)
        return remaining
