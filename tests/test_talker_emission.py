"""The talker's frame budget, stops and window hand-off, step by step, with the model's frame step scripted.

The model is replaced by a script (which step of which song draws audio_end), so songs of any length up to the
9000-frame cap run in about a second and the engine's own bookkeeping is what is tested against the contract:
  - step 0 (right after <|audio_start|>) is sampled and fed back but its frame is not emitted; frame j is step j's;
  - audio_end stops the song, its own frame not emitted; audio_end drawn at step 0 leaves no frame (the reference
    raises for it: "generated zero audio frames");
  - budget = min(requested, 9000, max_model_len - prompt tokens), and a song stops at exactly its budget;
  - a full window of 200 frames starting at s goes out in the step that brings frame s + 201 (it is then known not to
    be the song's last), the rest when the song ends, the final one marked last;
  - each window carries the frame conditioning of its own frames [start, start + frames).
"""

from __future__ import annotations

import pytest
import torch

from music3serve import contract
from music3serve.acoustic.windows import song_windows
from music3serve.models.language_model import LanguageModelConfig
from music3serve.talker import engine as engine_module
from music3serve.talker.config import TalkerConfig
from music3serve.talker.engine import Talker
from music3serve.talker.events import SongFailed, SongFinished, WindowReady

HIDDEN = 8
VOCAB = 64


class PromptModel(torch.nn.Module):
    """A language model for prefill only: its hidden states are the prompt embeddings (the frame steps are
    scripted and never call it)."""

    def __init__(self):
        super().__init__()
        self.cfg = LanguageModelConfig(hidden=HIDDEN, layers=1, heads=1, kv_heads=1, head_dim=4, mlp=HIDDEN, eps=1e-6,
                                       rope_theta=1e6, vocab=VOCAB, max_positions=contract.MAX_CONTEXT)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        return x


def scripted_step(audio_end_at: dict[int, int]):
    """A stand-in for talker/step.py's FrameStep on the same buffers: step k of the song in pair p (k counted by the
    pair's frame counter, 0 right after <|audio_start|>) draws the codes [k] * 8, or audio_end when
    audio_end_at[seed] == k; its frame conditioning row is (seed, k, 0, ...). Positions are the real step's
    business (its KV rows); the engine only moves them with the pairs."""

    class ScriptedStep:
        def __init__(self, lm, depth, mix, slots, capture_sizes, use_graphs, depth_cache):
            songs = slots.pairs
            self.hidden = torch.zeros(2 * songs, lm.cfg.hidden)
            self.positions = torch.full((2 * songs,), slots.scratch, dtype=torch.int64)
            self.seeds = torch.zeros(songs, dtype=torch.int64)
            self.frames = torch.zeros(songs, dtype=torch.int64)
            self.codes = torch.zeros(songs, contract.NUM_CODEBOOKS, dtype=torch.int64)
            self.ended = torch.zeros(songs, dtype=torch.bool)
            self.mixed = torch.zeros(songs, lm.cfg.hidden)
            self.stream = None

        def __call__(self, rows: int) -> None:
            songs = rows // 2
            seeds, k = self.seeds[:songs], self.frames[:songs]
            self.codes[:songs] = k[:, None]
            self.mixed[:songs, :2] = torch.stack([seeds, k], dim=1)
            if audio_end_at:
                self.ended[:songs] = torch.tensor([audio_end_at.get(seed, -1) for seed in seeds.tolist()]) == k
            self.frames[:songs] += 1

    return ScriptedStep


@pytest.fixture
def make_talker(monkeypatch):
    def make(audio_end_at: dict[int, int] | None = None, **config) -> Talker:
        monkeypatch.setattr(engine_module, "FrameStep", scripted_step(audio_end_at or {}))
        config = TalkerConfig(**{"max_num_seqs": 4, "depth_cache": False, **config})
        return Talker(PromptModel(), torch.nn.Module(), None, config)

    return make


def prompt(tokens: int) -> tuple[list[int], list[int]]:
    cond = [(5 + i) % VOCAB for i in range(tokens)]
    return cond, [cond[0]] + [1] * (tokens - 1)


def run(talker: Talker, songs: dict[str, tuple[int, int, int]]) -> list[tuple[dict[str, int], list]]:
    """Submit songs (id -> (seed, requested frames, prompt tokens)) and step until the talker is idle; per step, the
    frames each song (those submitted before too) had emitted after it (a finished song: its final count) and the
    step's events."""
    for song, (seed, requested, tokens) in songs.items():
        talker.submit(song, *prompt(tokens), seed, requested)
    ids = list(talker.songs)
    history, final = [], {}
    for _ in range(contract.MAX_FRAMES + 100):
        if not talker.busy:
            return history
        events = talker.step()
        final.update({e.song: e.frames for e in events if isinstance(e, SongFinished)})
        frames = {song: talker.songs[song].frames if song in talker.songs else final.get(song, 0) for song in ids}
        history.append((frames, events))
    raise AssertionError("the talker never went idle")


def sent(history, song: str) -> list[tuple[int, WindowReady]]:
    """(frames the song had emitted when it went out, window) for each of the song's windows, in order."""
    return [(frames[song], e) for frames, events in history for e in events
            if isinstance(e, WindowReady) and e.song == song]


def finished(history, song: str) -> list:
    return [e for _, events in history for e in events if isinstance(e, (SongFinished, SongFailed)) and e.song == song]


def check_song(history, song: str, seed: int, frames: int, ended_by: str) -> None:
    """The song emitted frames 1..frames (steps 1..frames: step 0's frame is never emitted), its windows are the
    contract's for that length, each non-last one sent once frame start + 201 existed and the rest at the end, each
    carrying the conditioning of its own frames."""
    (done,) = finished(history, song)
    assert isinstance(done, SongFinished) and (done.frames, done.ended_by) == (frames, ended_by)
    assert torch.equal(done.codes, torch.arange(1, frames + 1)[:, None].expand(frames, contract.NUM_CODEBOOKS))
    windows = sent(history, song)
    assert [w.window for _, w in windows] == song_windows(frames)
    for at, w in windows:
        window = w.window
        assert at == (frames if window.last else window.start + contract.WINDOW_FRAMES + 1), window
        steps = torch.arange(window.start + 1, window.start + window.frames + 1, dtype=torch.float32)
        assert torch.equal(w.mixed[:, 0], torch.full((window.frames,), float(seed))), window
        assert torch.equal(w.mixed[:, 1], steps), window
    # The last window goes out in the step that reports the song finished, before the report.
    (events,) = [events for _, events in history if any(e is done for e in events)]
    order = [id(e) for e in events]
    assert id(windows[-1][1]) in order and order.index(id(windows[-1][1])) < order.index(id(done))


LENGTHS = [1, 100, 199, 200, 201, 202, 300, 301, 450]


@pytest.mark.parametrize("frames", LENGTHS)
def test_a_song_stopped_by_its_budget_emits_its_frames_and_windows_on_time(make_talker, frames):
    talker = make_talker()
    assert talker.submit("a", *prompt(12), 3, frames) == frames
    history = run(talker, {})
    check_song(history, "a", 3, frames, "budget")


@pytest.mark.parametrize("frames", LENGTHS)
def test_a_song_stopped_by_audio_end_emits_the_frames_before_it(make_talker, frames):
    """audio_end drawn at step frames + 1: the song has frames 1..frames, the audio_end step's frame is not one."""
    talker = make_talker({7: frames + 1})
    history = run(talker, {"a": (7, 1000, 12)})
    check_song(history, "a", 7, frames, "audio_end")


def test_audio_end_on_the_step_after_the_budget_is_not_read(make_talker):
    """The step queued after the song's last frame is dropped: the song ends by its budget, with every frame."""
    talker = make_talker({7: 201})
    history = run(talker, {"a": (7, 200, 12)})
    check_song(history, "a", 7, 200, "budget")


def test_audio_end_on_the_first_sampled_step_leaves_no_song(make_talker):
    """The first sampled frame is never emitted; audio_end there ends the song with no frame: it fails (the
    reference raises "generated zero audio frames"), with no window and no finished song."""
    talker = make_talker({7: 0})
    history = run(talker, {"a": (7, 300, 12), "b": (8, 5, 12)})
    (failed,) = finished(history, "a")
    assert isinstance(failed, SongFailed) and "before its first frame" in failed.message
    assert sent(history, "a") == []
    check_song(history, "b", 8, 5, "budget")  # the other song is unaffected


def test_audio_end_on_step_one_leaves_no_frame_either(make_talker):
    """Step 1's frame would be the first emitted one: audio_end there also leaves the song without a frame."""
    talker = make_talker({7: 1})
    history = run(talker, {"a": (7, 300, 12)})
    (failed,) = finished(history, "a")
    assert isinstance(failed, SongFailed) and sent(history, "a") == []


@pytest.mark.parametrize(
    ("requested", "tokens", "max_model_len", "budget"),
    [
        (300, 12, contract.MAX_CONTEXT, 300),  # the request, when it fits
        (9000, 12, contract.MAX_CONTEXT, 9000),
        (9001, 12, contract.MAX_CONTEXT, 9000),  # the 9000-frame (6 min) cap
        (20000, 1240, contract.MAX_CONTEXT, 9000),  # 1240 + 9000 = 10240: both caps meet
        (20000, 1241, contract.MAX_CONTEXT, 8999),  # the context is the tighter one
        (9000, 5000, contract.MAX_CONTEXT, 5240),  # a prompt of 5000 tokens leaves 5240 frames
        (300, 60, 64, 4),  # a smaller max_model_len
        (300, 63, 64, 1),  # one position left: one frame
    ],
)
def test_the_budget_is_the_tightest_cap(make_talker, requested, tokens, max_model_len, budget):
    talker = make_talker(max_model_len=max_model_len)
    assert talker.submit("a", *prompt(tokens), 5, requested) == budget


@pytest.mark.parametrize(("requested", "tokens", "max_model_len"), [(9500, 12, contract.MAX_CONTEXT), (300, 60, 64),
                                                                    (300, 63, 64)])
def test_a_song_stops_at_exactly_its_budget(make_talker, requested, tokens, max_model_len):
    """The longest song (6 min: 9000 frames, 89 windows, the last at frame 8800) and songs capped by the context."""
    talker = make_talker(max_model_len=max_model_len)
    budget = talker.submit("a", *prompt(tokens), 5, requested)
    history = run(talker, {})
    check_song(history, "a", 5, budget, "budget")
    if requested == 9500:
        assert budget == contract.MAX_FRAMES and len(sent(history, "a")) == 89
        assert sent(history, "a")[-1][1].window.start == 8800


def test_songs_that_join_and_leave_keep_their_own_frames_and_windows(make_talker):
    """Four songs through two pairs: the later ones wait for rows and the pairs are packed when a song leaves; each
    song's frames, stop and windows stay its own (its seed's script, its own conditioning rows)."""
    talker = make_talker({11: 150, 13: 250}, max_num_seqs=4)
    songs = {"a": (11, 400, 12), "b": (12, 230, 20), "c": (13, 400, 7), "d": (14, 205, 9)}
    history = run(talker, songs)
    check_song(history, "a", 11, 149, "audio_end")
    check_song(history, "b", 12, 230, "budget")
    check_song(history, "c", 13, 249, "audio_end")
    check_song(history, "d", 14, 205, "budget")
