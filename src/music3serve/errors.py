"""Errors a user can act on: each message says what was wrong and where."""

import secrets


class Music3Error(Exception):
    """Base class of every error music3serve raises on purpose."""


class InputError(Music3Error, ValueError):
    """A request (caption, lyrics, duration, seed, ...) that cannot be served as given."""


class EngineBusy(Music3Error):
    """The engine holds as many songs (running and waiting) as it takes; try again later."""


class CheckpointError(Music3Error):
    """A model folder that is missing, incomplete, corrupted or not the MiniMax-Music3 layout."""


class NonFiniteAudio(Music3Error, FloatingPointError):
    """A window rendered to NaN or infinite audio: the song's own content (or the weights) is at fault, not the
    device, so the same request fails again."""


def error_text(error: BaseException) -> str:
    """An error's text for users: its message alone (a repr such as `RuntimeError('...')` shows internals), or its
    type's name where it has no message."""
    return str(error) or type(error).__name__


def public_text(error: BaseException) -> tuple[str, str | None]:
    """An error's text for a client, and the reference to log its traceback under: our own errors (Music3Error) tell
    what went wrong, with no reference; any other's text may show internals (paths, scoped song ids), so the client
    gets a short reference to the server's log instead."""
    if isinstance(error, Music3Error):
        return error_text(error), None
    reference = secrets.token_hex(4)
    return f"an unexpected error (reference {reference} in the server's log)", reference


def install_hint(extra: str) -> str:
    """How to add one of the package's extras (music3serve installs from its source tree)."""
    return f"pip install -e '.[{extra}]' in the music3serve source tree"
