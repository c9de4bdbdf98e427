"""The checkpoint's prompt rules: caption cleaning, lyrics normalization, template and token ids."""

from __future__ import annotations

import logging
import math
import re
import unicodedata

from tokenizers import Tokenizer

from . import contract
from .contract import AUDIO_CFG, MAX_PROMPT_TOKENS
from .errors import InputError

log = logging.getLogger(__name__)
PROMPT_FIELDS = "caption + lyrics"  # as the token-limit error names them; other endpoints rename them

# `<|a b c|>` in a caption: the model never sees user-written special tokens.
_TAG = re.compile(r"<\|([^|]*)\|>")
# Markdown, applied line by line (in this order).
_HEADER = re.compile(r"^\s{0,3}#{1,6}\s+")
_BULLET = re.compile(r"^\s*[*+-]\s+")
_STAR_BULLET = re.compile(r"^\s*\*\s+")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")
_ITALIC = re.compile(r"(?<!\*)\*([^*\n]+)\*(?!\*)")
# Applied to the whole caption.
_RULE = re.compile(r"^\s*[-*_]{3,}\s*$", re.MULTILINE)
_BLANK_RUN = re.compile(r"\n{2,}")
# Lyrics: structural tags at the start of a line, and any bracketed span (may cross lines).
_LINE_TAGS = re.compile(r"^[ \t]*((?:\[[^\]]+\][ \t]*)+)")
_BRACKETED = re.compile(r"\[([^\]]+)\]")
# Text checks: surrogate code points (half a UTF-16 pair) cannot be encoded as UTF-8 or tokenized.
_SURROGATE = re.compile("[\ud800-\udfff]")
_INVISIBLE = ("Cc", "Cf")  # Unicode control and format characters (NUL, zero-width space, byte-order mark, ...)
# Length limits, far above real captions and lyrics: they bound the cleaning work before the token count can be
# known (clean_caption's regexes take quadratic time on some text: long runs of blank lines, deeply nested bold).
MAX_CAPTION_CHARS = 5_000
MAX_LYRICS_CHARS = 20_000


def _rewrite_tag(match: re.Match[str]) -> str:
    """`<|word rest|>` -> "word is rest"; a single word (or nothing) stays as itself."""
    inner = match.group(1).strip()
    words = inner.split(None, 1)
    return f"{words[0]} is {words[1]}" if len(words) == 2 else inner


def _clean_line(line: str) -> str:
    """Strip one caption line's header, bullet, bold and italic markers and its trailing whitespace."""
    line = _STAR_BULLET.sub("", _BULLET.sub("", _HEADER.sub("", line)))
    while "**" in line:
        unbolded = _BOLD.sub(r"\1", line)
        if unbolded == line:
            break
        line = unbolded
    return _ITALIC.sub(r"\1", line).rstrip()


def clean_caption(text: str) -> str:
    """The caption exactly as the checkpoint was trained to read it."""
    text = "\n".join(_clean_line(line) for line in _TAG.sub(_rewrite_tag, text).splitlines())
    text = _RULE.sub("", text).replace("• ", "").replace("    ", "")
    return _BLANK_RUN.sub("\n", text)


def _keep_line_tags(line: str) -> str:
    """A line opening with `[tags]` keeps only those tags; any other line is unchanged."""
    match = _LINE_TAGS.match(line)
    return match.group(1).strip() if match else line


def dropped_lyrics(text: str) -> list[int]:
    """The lines (numbered from 1) whose text normalize_lyrics drops: whatever follows the tags of a line that opens
    with tags."""
    lines = enumerate(text.split("\n"), start=1)
    return [n for n, line in lines if (match := _LINE_TAGS.match(line)) and line[match.end() :].strip()]


def warn_dropped_lyrics(lyrics: str, **context: object) -> None:
    """Log which lines lose their text after a [tag], as the reference drops it and no user expects it (by line
    number: no lyrics in the log)."""
    if lines := dropped_lyrics(lyrics):
        log.warning("lyrics after a [tag] on the same line are dropped: put them on the next line",
                    extra={"lines": lines[:20], **context})


def normalize_lyrics(text: str) -> str:
    """The lyrics exactly as the checkpoint was trained to read them."""
    text = "\n".join(_keep_line_tags(line) for line in text.split("\n"))
    text = text.replace("] ", "]\n").replace(" [", "\n[").replace(" ^ ", "\n")
    # No span reaches past the last "]": leaving the rest out spares _BRACKETED a scan to the end from each "[".
    end = text.rfind("]") + 1
    text = _BRACKETED.sub(lambda match: f"[{match.group(1).lower()}]", text[:end]) + text[end:]
    return "[start]\n" + text


def prompt_text(caption: str, lyrics: str) -> str:
    """The full special-token prompt for a (caption, lyrics) pair."""
    return (
        f"<|im_start|><|caption_start|>{clean_caption(caption)}<|caption_end|>"
        f"<|lyrics_start|>{normalize_lyrics(lyrics)}<|lyrics_end|><|im_end|><|audio_start|>"
    )


def check_text(field: str, value: object, max_chars: int) -> None:
    """Raise InputError unless `value` is valid Unicode text of at most `max_chars` characters with something visible
    in it (not only whitespace, control and format characters such as NUL or a zero-width space)."""
    if not isinstance(value, str):
        raise InputError(f"{field} must be a non-empty string, got {type(value).__name__}: {value!r:.80}")
    if not value:
        raise InputError(f"{field} must be a non-empty string, got an empty string")
    if len(value) > max_chars:
        raise InputError(f"{field} is {len(value)} characters long; the limit is {max_chars} characters")
    if all(ch.isspace() or unicodedata.category(ch) in _INVISIBLE for ch in value):
        raise InputError(f"{field} must be a non-empty string, got only whitespace or invisible characters "
                         f"({value!r:.80})")
    surrogate = _SURROGATE.search(value)
    if surrogate:
        raise InputError(
            f"{field} is not valid Unicode: a lone surrogate {surrogate.group()!r} at character {surrogate.start()}"
        )


def encode_prompt(tokenizer: Tokenizer, caption: str, lyrics: str) -> tuple[list[int], list[int]]:
    """(cond_ids, uncond_ids) of the prompt; uncond keeps the first and the last two ids, the rest is audio_cfg."""
    check_text("caption", caption, MAX_CAPTION_CHARS)
    check_text("lyrics", lyrics, MAX_LYRICS_CHARS)
    cond = tokenizer.encode(prompt_text(caption, lyrics), add_special_tokens=True).ids
    if len(cond) > MAX_PROMPT_TOKENS:
        raise InputError(
            f"the prompt ({PROMPT_FIELDS}) is {len(cond)} tokens long; the limit is {MAX_PROMPT_TOKENS} tokens"
        )
    return cond, unconditional_ids(cond)


def unconditional_ids(cond: list[int]) -> list[int]:
    """The unconditional row: every position but the first and the last two replaced by audio_cfg."""
    return cond[:1] + [AUDIO_CFG] * (len(cond) - 3) + cond[-2:]


def _shown(value: object) -> str:
    """A refused value as error messages quote it: short, and no decimal string of a huge int (Python refuses)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    return f"{value!r:.80}"


def frames_for_duration(duration: object) -> int:
    """Requested frames for a duration in seconds (validated), truncated as the reference does (8.04 s: 200)."""
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or (
        isinstance(duration, float) and not math.isfinite(duration)
    ):
        raise InputError(f"duration must be a finite number of seconds, got {_shown(duration)}")
    if duration <= 0 or duration > contract.MAX_DURATION_S:
        raise InputError(f"duration must be in (0, {contract.MAX_DURATION_S:g}] seconds, got {_shown(duration)}")
    frames = min(int(duration * contract.FRAME_RATE), contract.MAX_FRAMES)
    if frames == 0:
        raise InputError(f"duration {float(duration)!r} s is shorter than one frame (1/{contract.FRAME_RATE} s)")
    return frames


def duration_for_frames(frames: int) -> float:
    """A duration that frames_for_duration turns into exactly `frames` (1 to MAX_FRAMES): frames / 25, nudged up where
    it falls a hair short in floating point (29 / 25 * 25 < 29)."""
    duration = frames / contract.FRAME_RATE
    while int(duration * contract.FRAME_RATE) < frames:
        duration = math.nextafter(duration, math.inf)
    return duration


def check_seed(seed: object) -> int:
    if not contract.is_seed(seed):
        raise InputError(f"seed must be an integer in [0, 2**64), got {_shown(seed)}")
    return seed


# Euler steps a request may ask for (the checkpoint's are 30). A window renders in time proportional to its steps
# and holds stage 1 meanwhile: 200 keeps that under ~7 windows' time for the songs beside it.
MAX_STEPS = 200


def check_steps(steps: object) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise InputError(f"steps must be an integer in [1, {MAX_STEPS}], got {_shown(steps)}")
    return steps
