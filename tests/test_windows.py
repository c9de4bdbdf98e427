"""Window geometry of stage 1 against the contract's formulas, written out here independently of the helpers."""

from __future__ import annotations

import pytest
import torch

from music3serve.acoustic.windows import Window, carry_span, crop_waveform, is_song_window, song_samples, song_windows

HOP = 512  # waveform samples per latent column


def expected_latent(frames: int) -> int:
    """int(frames * 44100/24000 * 960/512): the ratio is exactly 441/128, so an integer floor."""
    return frames * 441 // 128


def expected_starts(frames: int) -> list[int]:
    """One window up to 200 frames; otherwise starts 0, 100, ... below frames - 100."""
    if frames <= 200:
        return [0]
    starts, start = [], 0
    while start < frames - 100:
        starts.append(start)
        start += 100
    return starts


def expected_geometry(frames: int) -> list[dict]:
    starts = expected_starts(frames)
    out = []
    for i, start in enumerate(starts):
        last = i == len(starts) - 1
        count = min(200, frames - start)
        length = expected_latent(count)
        left = 0 if i == 0 else 86 * HOP
        right = 0 if last else 258 * HOP
        out.append(dict(index=i, start=start, frames=count, last=last, latent=length, crop=(left, right),
                        samples=length * HOP - left - right))
    return out


# Written out by hand from the contract, to catch a mistake shared by the formulas above and the code.
LITERAL = {
    1: [(0, 1, 3)],
    100: [(0, 100, 344)],
    199: [(0, 199, 685)],
    200: [(0, 200, 689)],
    201: [(0, 200, 689), (100, 101, 347)],
    300: [(0, 200, 689), (100, 200, 689)],
    450: [(0, 200, 689), (100, 200, 689), (200, 200, 689), (300, 150, 516)],
}
# Whole-song samples: sum of 512 L per window, minus 86 * 512 left of every window but the first and 258 * 512
# right of every window but the last.
LITERAL_SAMPLES = {
    1: 3 * 512, 100: 344 * 512, 199: 685 * 512, 200: 689 * 512,
    201: (689 + 347 - 344) * 512, 300: (2 * 689 - 344) * 512, 9000: (89 * 689 - 88 * 344) * 512,
}


@pytest.mark.parametrize("frames", [1, 100, 199, 200, 201, 300, 450, 9000])
def test_windows_follow_the_contract(frames):
    windows = song_windows(frames)
    expected = expected_geometry(frames)
    assert len(windows) == len(expected)
    for window, exp in zip(windows, expected):
        assert (window.index, window.start, window.frames, window.last) == (
            exp["index"], exp["start"], exp["frames"], exp["last"])
        assert window.latent_length == exp["latent"]
        assert window.crop == exp["crop"]
    assert song_samples(frames) == sum(e["samples"] for e in expected)
    if frames in LITERAL:
        assert [(w.start, w.frames, w.latent_length) for w in windows] == LITERAL[frames]
    if frames in LITERAL_SAMPLES:
        assert song_samples(frames) == LITERAL_SAMPLES[frames]


def test_long_song_geometry():
    windows = song_windows(9000)
    assert len(windows) == 89 and windows[-1].start == 8800 and windows[-1].last
    assert all(w.frames == 200 and w.latent_length == 689 for w in windows)
    assert sum(w.last for w in windows) == 1
    # Every window's kept part follows the previous one: consecutive windows overlap by 344 columns, cropped
    # 258 on the left one's right and 86 on the right one's left.
    kept = [(w.latent_length - (86 if w.index else 0) - (0 if w.last else 258)) for w in windows]
    assert kept[0] == 689 - 258 and kept[-1] == 689 - 86 and set(kept[1:-1]) == {689 - 344}


@pytest.mark.parametrize("length", [3, 344, 347, 516, 689])
def test_carry_span(length):
    start = max(0, length - 344)
    assert carry_span(length) == (start, max(start, length - 172))
    if length == 689:
        assert carry_span(length) == (345, 517)


def test_latent_formula_in_float_order_matches_the_integer_floor():
    for frames in range(1, 9001):
        assert int(frames * 44100 / 24000 * 960 / 512) == expected_latent(frames)


def test_every_window_length_has_the_contracts_latent_length():
    """L = int(frames * 44100/24000 * 960/512), i.e. floor(441 frames / 128), for every length a window can have:
    1..200 frames (a song's only window, or the last of a longer one). 128 frames (5.12 s) are exactly 441 columns
    of 512 samples, where a ratio off by a hair would floor to 440; 127 and 129 frames fall between columns."""
    lengths = {w.frames: w.latent_length for frames in range(1, 401) for w in song_windows(frames)}
    assert sorted(lengths) == list(range(1, 201))
    assert all(length == expected_latent(frames) for frames, length in lengths.items())
    assert (lengths[127], lengths[128], lengths[129]) == (437, 441, 444)


@pytest.mark.parametrize("frames", [1, 201, 450])
def test_crop_waveform_keeps_the_right_samples(frames):
    total = []
    for window, exp in zip(song_windows(frames), expected_geometry(frames)):
        n = exp["latent"] * HOP
        wave = torch.arange(n, dtype=torch.float64).expand(2, n)
        kept = crop_waveform(wave, window)
        left, right = exp["crop"]
        assert kept.shape == (2, n - left - right)
        assert kept[0, 0] == left and kept[1, -1] == n - right - 1
        total.append(kept.shape[-1])
    assert sum(total) == song_samples(frames)


def test_is_song_window_knows_the_windows_of_every_song():
    ours = {w for frames in range(1, 1201) for w in song_windows(frames)}  # every window of index < 10
    assert all(is_song_window(w) for w in ours)
    candidates = {Window(i, s, f, last) for i in range(-1, 10) for s in (100 * i, 100 * i + 1) for f in range(0, 202)
                  for last in (False, True)}
    assert {w for w in candidates if is_song_window(w)} == {w for w in candidates if w in ours}


def test_the_talker_hands_each_window_on_once_frame_201_of_it_exists():
    """Window i (frames 100 i ..) goes out with frame 100 i + 201, not a frame sooner or later; at the end, the rest."""
    from music3serve.talker.windows import WindowTracker

    tracker = WindowTracker()
    assert all(tracker.ready(frames) == [] for frames in range(1, 201))
    assert tracker.ready(201) == [Window(0, 0, 200, False)]
    assert all(tracker.ready(frames) == [] for frames in range(202, 301))
    assert tracker.ready(301) == [Window(1, 100, 200, False)]
    assert tracker.ready(520) == [Window(2, 200, 200, False), Window(3, 300, 200, False)]  # two steps' worth at once
    assert tracker.finish(520) == song_windows(520)[4:] and tracker.finish(520) == []
