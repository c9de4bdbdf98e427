"""The talker engine on the CPU: batch invariance, offline equality, stops, chunked prefill, cancel, windows."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from music3serve import contract
from music3serve.acoustic.windows import song_windows
from music3serve.checkpoint import load_models
from music3serve.errors import InputError
from music3serve.kernels.skinny_linear import MAX_ROWS
from music3serve.kernels.skinny_linear_kernel import program_rows
from music3serve.models import layers
from music3serve.pipeline import Pipeline
from music3serve.prompt import encode_prompt
from music3serve.talker.config import TalkerConfig
from music3serve.talker.engine import Talker
from music3serve.talker.events import SongFailed, SongFinished, WindowReady
from music3serve.models.depth_decoder import DepthKV
from music3serve.talker.depth_inputs import DepthInputs
from music3serve.talker.memory_check import device_bytes
from music3serve.talker.frame import talker_frame
from music3serve.talker.slots import SlotCache

from failing_prefill import FailingPrefill  # tests/ is on the import path (no package)

# (caption, lyrics, frames, seed): prompts of different lengths.
SONGS = [
    ("dreamy synth-pop", "[verse]\nneon skies", 230, 11),
    ("acoustic folk ballad with a long description of guitars and harmonica", "[verse]\nroad\n[chorus]\nhome", 41, 12),
    ("drum and bass", "[intro]\n[verse]\nfast fast fast fast", 67, 13),
    ("jazz trio", "[verse]\nblue\nnotes", 25, 14),
    ("metal", "[verse]\nloud", 33, 15),
    ("ambient drone", "[verse]\nslow breath " * 5, 48, 16),
    ("k-pop", "[chorus]\nhey", 29, 17),
    ("lofi hip hop beats to study to", "[verse]\nrain", 52, 18),
]


@pytest.fixture(scope="module")
def models(tiny_dir: Path):
    return load_models(tiny_dir, talker_dtype=torch.float32)


def prompt(models, index: int) -> tuple[list[int], list[int]]:
    caption, lyrics, _, _ = SONGS[index]
    return encode_prompt(models.tokenizer, caption, lyrics)


def run(models, plan: dict[int, int], config: TalkerConfig | None = None, cancel: dict[int, int] | None = None):
    """Run songs (index -> step at which it arrives) to completion; returns finished, windows, failures."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, config or TalkerConfig())
    finished, windows, failed = {}, {}, {}
    step = 0
    while step <= max(plan.values()) or talker.busy:
        for index, arrival in plan.items():
            if arrival == step:
                _, _, frames, seed = SONGS[index]
                talker.submit(str(index), *prompt(models, index), seed, frames)
        for index, at in (cancel or {}).items():
            if at == step:
                assert talker.cancel(str(index))
        for event in talker.step():
            if isinstance(event, WindowReady):
                windows.setdefault(int(event.song), []).append(event)
            elif isinstance(event, SongFinished):
                finished[int(event.song)] = event
            else:
                failed[int(event.song)] = event
        step += 1
    return finished, windows, failed


def mixed_song(windows: list[WindowReady]) -> torch.Tensor:
    """The song's mixed conditioning reassembled from its windows."""
    frames = windows[-1].window.start + windows[-1].window.frames
    out = torch.full((frames, windows[0].mixed.shape[1]), float("nan"))
    for w in windows:
        out[w.window.start : w.window.start + w.window.frames] = w.mixed
    return out


@pytest.fixture(scope="module")
def solo(models):
    """Song 0 alone."""
    finished, windows, _ = run(models, {0: 0})
    return finished[0], mixed_song(windows[0])


@pytest.mark.parametrize("others", [1, 3, 7])
def test_song_is_the_same_beside_other_songs(models, solo, others):
    plan = {0: 2} | {i: (i * 5) % 9 for i in range(1, others + 1)}
    finished, windows, failed = run(models, plan, TalkerConfig(max_num_seqs=16, max_num_batched_tokens=64))
    assert not failed and set(finished) == set(plan)
    assert torch.equal(finished[0].codes, solo[0].codes)
    torch.testing.assert_close(mixed_song(windows[0]), solo[1], rtol=1e-5, atol=1e-6)


def test_engine_equals_offline_pipeline(models, solo):
    pipe = Pipeline(models)
    _, _, frames, seed = SONGS[0]
    codes, conditioning, ended_by = pipe.talk(*prompt(models, 0), frames, seed)
    assert ended_by == solo[0].ended_by == "budget" and solo[0].frames == frames
    assert torch.equal(solo[0].codes, codes)
    torch.testing.assert_close(solo[1], models.condition_encoder.mix(conditioning), rtol=1e-5, atol=1e-6)


def test_windows_follow_the_contract(models, solo):
    _, windows, _ = run(models, {0: 0})
    assert [w.window for w in windows[0]] == song_windows(solo[0].frames)


def test_chunked_prefill_equals_prefill_at_once(models, solo):
    tokens = len(prompt(models, 0)[0])
    finished, windows, _ = run(models, {0: 0}, TalkerConfig(max_num_batched_tokens=2 * (tokens // 3) + 2))
    assert torch.equal(finished[0].codes, solo[0].codes)
    torch.testing.assert_close(mixed_song(windows[0]), solo[1], rtol=1e-5, atol=1e-6)


def test_songs_queue_when_rows_are_full_and_pairs_stay_packed(models, solo):
    # Two pairs for four songs: later songs wait for rows, and song 0 arrives while another is mid-prefill.
    finished, _, failed = run(models, {1: 0, 3: 0, 0: 1, 2: 1}, TalkerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    assert not failed and set(finished) == {0, 1, 2, 3}
    assert torch.equal(finished[0].codes, solo[0].codes)


def test_cancel_frees_rows_and_leaves_others_alone(models, solo):
    finished, _, _ = run(models, {3: 0, 0: 0, 5: 1}, TalkerConfig(max_num_seqs=6), cancel={3: 10})
    assert 3 not in finished and {0, 5} <= set(finished)
    assert torch.equal(finished[0].codes, solo[0].codes)


def test_budget_is_capped_by_the_context(models):
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig(max_model_len=64))
    cond, uncond = prompt(models, 0)
    assert talker.submit("a", cond, uncond, 1, 9000) == 64 - len(cond)
    roomy = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    assert roomy.submit("long", cond, uncond, 1, 9500) == contract.MAX_FRAMES  # the 9000-frame cap, room for more
    with pytest.raises(InputError, match="already in use"):
        talker.submit("a", cond, uncond, 1, 10)
    with pytest.raises(InputError, match="max_model_len"):
        talker.submit("b", cond * 40, uncond * 40, 1, 10)


@pytest.mark.parametrize("room", [1, 3])
def test_a_song_that_fills_the_context_equals_the_offline_pipeline(models, room):
    """A budget capped by max_model_len runs to its last position (the step queued after the song's last frame
    lands on the scratch position) and gives the offline pipeline's song of that budget."""
    cond, uncond = prompt(models, 0)
    config = TalkerConfig(max_model_len=len(cond) + room)
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, config)
    assert talker.submit("a", cond, uncond, 11, 9000) == room
    events = []
    while talker.busy:
        events += talker.step()
    (finished,) = [e for e in events if isinstance(e, SongFinished)]
    windows = [e for e in events if isinstance(e, WindowReady)]
    codes, conditioning, ended_by = Pipeline(models).talk(cond, uncond, room, 11)
    assert finished.ended_by == ended_by == "budget" and finished.frames == room
    assert torch.equal(finished.codes, codes)
    assert [w.window for w in windows] == song_windows(room)
    torch.testing.assert_close(mixed_song(windows), models.condition_encoder.mix(conditioning), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def ending_models(ending_dir: Path):
    return load_models(ending_dir, talker_dtype=torch.float32)


def test_audio_end_stops_a_song_like_the_offline_pipeline(ending_models):
    finished, windows, failed = run(ending_models, {i: 0 for i in range(4)}, TalkerConfig(max_num_seqs=8))
    pipe = Pipeline(ending_models)
    ended = 0
    for index in finished:
        _, _, frames, seed = SONGS[index]
        codes, _, ended_by = pipe.talk(*prompt(ending_models, index), frames, seed)
        assert finished[index].ended_by == ended_by and torch.equal(finished[index].codes, codes)
        assert [w.window for w in windows[index]] == song_windows(codes.shape[0])
        ended += ended_by == "audio_end"
    assert ended >= 1, "the boosted audio_end logit should end at least one song early"
    assert all(isinstance(f, SongFailed) and "first frame" in f.message for f in failed.values())


def test_a_song_mid_prefill_moves_with_the_packing_and_stays_the_same(models, solo, monkeypatch):
    # Songs 3 and 4 decode in pairs 0 and 1 while song 0 prefills 8 tokens a step in pair 2; song 4 ends
    # first, so song 0's partial prompt must move down to the freed pair before its next chunk.
    from music3serve.talker.slots import SlotCache

    relocations, in_prefill = [], [False]
    move_pair, prefill = SlotCache.move_pair, Talker._prefill

    def spy_prefill(self):
        in_prefill[0] = True
        try:
            return prefill(self)
        finally:
            in_prefill[0] = False

    def spy_move(self, source, target, filled):
        if in_prefill[0]:
            relocations.append((source, target, filled))
        return move_pair(self, source, target, filled)

    monkeypatch.setattr(Talker, "_prefill", spy_prefill)
    monkeypatch.setattr(SlotCache, "move_pair", spy_move)
    finished, _, failed = run(models, {3: 0, 4: 0, 0: 27}, TalkerConfig(max_num_seqs=6, max_num_batched_tokens=8))
    assert relocations, "the scenario no longer exercises the relocation of a song mid-prefill"
    assert not failed and torch.equal(finished[0].codes, solo[0].codes)


def test_cached_depth_calls_equal_recomputed_ones(models, solo):
    """Recomputing the whole depth sequence in each of the 7 depth calls, for a song beside three others, gives the
    codes and conditioning of the solo run's calls on cached keys (one new position each, the default)."""
    assert TalkerConfig().depth_cache
    plan = {0: 2, 1: 0, 2: 1, 3: 4}
    finished, windows, failed = run(models, plan, TalkerConfig(max_num_seqs=8, depth_cache=False))
    assert not failed
    assert torch.equal(finished[0].codes, solo[0].codes)
    torch.testing.assert_close(mixed_song(windows[0]), solo[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("depth_cache", [True, False, "table"], ids=["cached", "recomputed", "looked up"])
def test_a_frame_needs_no_more_depth_positions_than_its_eight_codes(models, depth_cache):
    """A depth decoder with exactly 8 learned positions (the least the loader accepts) writes the frame it writes
    with 16: no depth call reads past position 7, nor does building the table of looked-up positions. Cached, the
    keys and values sit in buffers of 8 positions instead of 16, and the CPU's reference attention, which sums over
    the whole buffer, rounds the conditioning another way (measured 6e-7)."""
    depth = copy.deepcopy(models.depth_decoder)
    depth.positions = torch.nn.Embedding.from_pretrained(depth.positions.weight[: contract.NUM_CODEBOOKS].clone())
    depth.cfg = dataclasses.replace(depth.cfg, positions=contract.NUM_CODEBOOKS)
    lm = models.language_model
    hidden = torch.randn(4, lm.cfg.hidden, generator=torch.Generator().manual_seed(0))
    seeds, frames = torch.tensor([3, 4]), torch.tensor([5, 6])
    tables = (DepthInputs(models.depth_decoder), DepthInputs(depth)) if depth_cache == "table" else (None, None)
    want = talker_frame(lm, models.depth_decoder, hidden, seeds, frames, bool(depth_cache), tables[0])
    got = talker_frame(lm, depth, hidden, seeds, frames, bool(depth_cache), tables[1])
    for name in ("codes", "ended", "feedback"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    if depth_cache:
        torch.testing.assert_close(got.conditioning, want.conditioning, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got.conditioning, want.conditioning)


def test_depth_decoder_cache_equals_recompute_position_by_position(models):
    """Cached calls (decode attention on buffers, run here by its torch reference) give the recomputed hidden states,
    and their buffers hold the keys and values that one call over the whole sequence writes."""
    from music3serve.models.depth_decoder import DepthKV

    depth = models.depth_decoder
    projected = torch.randn(4, 8, depth.cfg.hidden, generator=torch.Generator().manual_seed(0))
    at_once = DepthKV()
    whole = depth(projected, at_once)
    cache = DepthKV()
    steps = [depth(projected[:, :2], cache)] + [depth(projected[:, t : t + 1], cache) for t in range(2, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-6)
    assert cache.length == at_once.length == 8
    for keys, whole_keys in zip(cache.keys + cache.values, at_once.keys + at_once.values):
        torch.testing.assert_close(keys[:, :, :8], whole_keys[:, :, :8], rtol=1e-5, atol=1e-6)
    # the first block's keys and values come straight from the inputs: the same bits
    assert torch.equal(cache.keys[0][:, :, :8], at_once.keys[0][:, :, :8])
    assert torch.equal(cache.values[0][:, :, :8], at_once.values[0][:, :, :8])
    with pytest.raises(ValueError, match="one new position"):
        depth(projected[:, :2], cache)


@pytest.fixture(scope="module")
def bf16_models(tiny_dir: Path):
    return load_models(tiny_dir, talker_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("songs", [1, 3, 8])
def test_looked_up_depth_inputs_equal_computed_ones(models, bf16_models, dtype, songs):
    """A frame whose depth calls 2..7 take their new position and first q, k, v from DepthInputs (the engine's default)
    equals the frame that computes them on the same buffers: bit for bit in bf16; in float32 the CPU's GEMM rounds 2
    rows other than 16, so the conditioning agrees to float32 precision and the codes exactly."""
    chosen = models if dtype == torch.float32 else bf16_models
    lm, depth = chosen.language_model, chosen.depth_decoder
    inputs = DepthInputs(depth)
    hidden = torch.randn(2 * songs, lm.cfg.hidden, generator=torch.Generator().manual_seed(songs)).to(dtype)
    seeds, frames = torch.arange(songs) + 7, torch.arange(songs) + 2
    computed = talker_frame(lm, depth, hidden, seeds, frames, True)
    looked_up = talker_frame(lm, depth, hidden, seeds, frames, True, inputs)
    for name in ("codes", "ended", "feedback"):
        assert torch.equal(getattr(computed, name), getattr(looked_up, name)), name
    if dtype == torch.bfloat16:
        assert torch.equal(computed.conditioning, looked_up.conditioning)
    else:
        torch.testing.assert_close(computed.conditioning, looked_up.conditioning, rtol=1e-5, atol=1e-6)


def test_depth_inputs_rows_are_each_codes_position_and_first_projections(models):
    """Row code_row(c) + k holds code k of codebook c projected, with position c + 1's embedding, then the first
    block's normed q | k | v of that: the whole table against torch ops written out; codebook 7 feeds no later call
    and has no rows. Its bytes are what the talker's memory check counts."""
    depth = models.depth_decoder
    inputs, hidden, block = DepthInputs(depth), depth.cfg.hidden, depth.blocks[0]
    codebooks = contract.NUM_CODEBOOKS - 2
    assert inputs.table.shape == (codebooks * depth.cfg.codes, 4 * hidden)
    embedded = depth.embed.weight[: codebooks * depth.cfg.codes].view(codebooks, depth.cfg.codes, hidden)
    positions = depth.positions.weight[2 : codebooks + 2, None]
    with torch.no_grad():
        projected = (depth.projection(embedded) + positions).reshape(-1, hidden)
        qkv = block.qkv(block.attn_norm(projected))
    torch.testing.assert_close(inputs.table[:, :hidden], projected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inputs.table[:, hidden:], qkv, rtol=1e-5, atol=1e-5)
    table_bytes = inputs.table.numel() * inputs.table.element_size()
    assert DepthInputs.bytes_needed(depth) == table_bytes
    lm = models.language_model
    without = device_bytes(lm, depth, TalkerConfig(depth_cache=False))
    assert device_bytes(lm, depth, TalkerConfig()) - without == table_bytes


@pytest.mark.parametrize("part", ["projected", "qkv"])
def test_the_engine_reads_its_depth_inputs(models, solo, part):
    """The talker's frames take the new depth positions and their first q, k, v from its table: spoiling either part
    of the table changes the song (a table built but never read would leave it as it was)."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    hidden = models.depth_decoder.cfg.hidden
    columns = slice(0, hidden) if part == "projected" else slice(hidden, None)
    talker.step_fn.depth_inputs.table[:, columns] *= 3
    _, _, frames, seed = SONGS[0]
    talker.submit("0", *prompt(models, 0), seed, frames)
    codes = []
    while talker.busy:
        codes += [e.codes for e in talker.step() if isinstance(e, SongFinished)]
    assert not torch.equal(codes[0], solo[0].codes)


def test_depth_inputs_serve_cached_calls_only(models):
    """A table with recomputed depth calls, and first q, k, v given to a call that is not a cached one after the
    first (no cache, or a cache's first call), are refused."""
    lm, depth = models.language_model, models.depth_decoder
    inputs, hidden = DepthInputs(depth), torch.zeros(2, lm.cfg.hidden)
    with pytest.raises(ValueError, match="cached depth calls"):
        talker_frame(lm, depth, hidden, torch.tensor([1]), torch.tensor([0]), False, inputs)
    projected, qkv = torch.zeros(2, 2, depth.cfg.hidden), inputs.table[:2, depth.cfg.hidden :]
    for cache, x in ((None, projected[:, :1]), (None, projected), (DepthKV(), projected)):
        with pytest.raises(ValueError, match="first_qkv is for a cached depth call after the first"):
            depth(x, cache, first_qkv=qkv)


def test_prefill_warm_up_leaves_no_trace(models, solo):
    """warm_prefill (run at start-up on CUDA) writes into pair 0's KV rows; the first song there is unchanged."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    talker.warm_prefill()
    assert talker.slots.k[:, :2, :, :4].abs().sum() > 0  # the warm-up did write where song 0 goes
    _, _, frames, seed = SONGS[0]
    talker.submit("0", *prompt(models, 0), seed, frames)
    codes = []
    while talker.busy:
        codes += [e.codes for e in talker.step() if isinstance(e, SongFinished)]
    assert torch.equal(codes[0], solo[0].codes)


def test_prefill_warm_up_runs_every_row_tile_a_prompt_can(models, monkeypatch):
    """On CUDA a prefill chunk's linear layers run the skinny GEMM in programs of ROW_TILE or 2 * ROW_TILE rows (a
    compiled kernel each) by the chunk's row count; warm_prefill runs the row counts of both, so no prompt compiles
    one in the first song. Recorded on the CPU from the rows each linear layer is given."""
    rows = set()

    def record(x: torch.Tensor) -> bool:
        rows.add(x.numel() // x.shape[-1])
        return False

    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    monkeypatch.setattr(layers, "_skinny", record)
    talker.warm_prefill()

    def programs(counts) -> set[int]:
        return {program_rows(r, k_over_warps) for r in counts if r <= MAX_ROWS for k_over_warps in (False, True)}

    assert programs(rows) == programs(range(1, MAX_ROWS + 1))


def test_a_step_in_flight_for_a_cancelled_song_is_dropped_even_if_its_id_is_reused(models, solo):
    """Events trail the device by one step. Song 0 is cancelled while the step that completes its first window is
    queued, and a new song takes the same id at once: that step's window must not surface (under either song),
    and the new song equals the solo run."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    _, _, frames, seed = SONGS[0]
    talker.submit("0", *prompt(models, 0), seed, frames)
    first_window = song_windows(solo[0].codes.shape[0])[0]
    while talker.songs["0"].frames < first_window.frames:
        assert talker.step() == []
    assert talker._in_flight is not None and talker._in_flight.songs[0] is talker.songs["0"]
    assert talker.cancel("0")
    talker.submit("0", *prompt(models, 0), seed, frames)
    assert talker.step() == []
    finished, windows = [], []
    while talker.busy:
        for event in talker.step():
            (windows if isinstance(event, WindowReady) else finished).append(event)
    assert len(finished) == 1 and torch.equal(finished[0].codes, solo[0].codes)
    assert torch.equal(mixed_song(windows), solo[1])


def test_kv_slots_past_the_machine_memory_fail_at_startup_on_the_cpu(models, monkeypatch):
    """The CPU has no gpu_memory_utilization, but KV slots larger than the machine's memory fail with the numbers
    before anything is allocated (they failed with a bare allocator traceback)."""
    from music3serve.errors import Music3Error

    monkeypatch.setattr("music3serve.talker.memory_check.host_memory", lambda: 1 << 20)
    with pytest.raises(Music3Error, match=r"talker needs .* GiB of KV for 16 rows of .* tokens \+ .* GiB of frame "
                                          r"conditioning for 8 songs, more than this machine's 0\.0 GiB of memory: "
                                          r"lower max_num_seqs or max_model_len"):
        Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig(max_num_seqs=16))


def test_frame_conditioning_is_counted_in_the_memory_check(models, monkeypatch):
    """Each decoding song holds a float32 buffer of its budget + 1 mixed frames (~147 MB at full size); slots whose
    KV fits but whose conditioning does not fail at startup (they ran out of memory at admission)."""
    from music3serve.errors import Music3Error
    from music3serve.talker.slots import SlotCache

    lm, config = models.language_model, TalkerConfig(max_num_seqs=16, max_model_len=256)
    kv = SlotCache.bytes_needed(lm.cfg, 8, 256, lm.embed.weight.dtype)
    conditioning = 8 * 256 * lm.cfg.hidden * 4
    monkeypatch.setattr("music3serve.talker.memory_check.host_memory", lambda: kv + conditioning - 1)
    with pytest.raises(Music3Error, match=r"GiB of frame conditioning for 8 songs, more than this machine's"):
        Talker(lm, models.depth_decoder, models.condition_encoder, config)
    monkeypatch.setattr("music3serve.talker.memory_check.host_memory", lambda: kv + conditioning)
    Talker(lm, models.depth_decoder, models.condition_encoder, config)


@pytest.mark.parametrize("bad_id", [-1, "vocab"])
def test_a_prompt_token_outside_the_vocabulary_is_refused_at_admission(models, bad_id):
    """An id past the embedding table (on CUDA a device-side assert that ends the process's CUDA context) or a
    negative one is an input error at submit."""
    from music3serve.errors import InputError

    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    bad = models.language_model.cfg.vocab if bad_id == "vocab" else bad_id
    with pytest.raises(InputError, match="prompt token ids must lie in"):
        talker.submit("s", [1, bad, 2], [1, 3, 2], seed=0, requested_frames=4)
    assert not talker.busy and not talker.songs


@pytest.mark.parametrize("frames", [0, -3])
def test_a_budget_below_one_frame_is_refused_at_admission(models, frames):
    """A song asking for no frames is an input error at submit; admitted, its conditioning buffer had budget + 1 rows
    and a later step raised for every song in the batch."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    with pytest.raises(InputError, match="at least one frame"):
        talker.submit("a", *prompt(models, 0), 1, frames)
    assert not talker.busy and not talker.songs


def test_a_prefill_budget_below_one_pair_token_fails_at_startup(models):
    """max_num_batched_tokens counts both rows of a pair: below 2 no prompt token could ever be prefilled and every
    song would wait forever, so the talker refuses the config at startup."""
    from music3serve.errors import Music3Error

    with pytest.raises(Music3Error, match="max_num_batched_tokens"):
        Talker(models.language_model, models.depth_decoder, models.condition_encoder,
               TalkerConfig(max_num_batched_tokens=1))


@pytest.mark.parametrize("budget", [6, 7])
def test_a_step_prefills_no_more_prompt_tokens_than_its_budget(models, budget):
    """max_num_batched_tokens counts both rows: a step prefills at most budget // 2 tokens of each row, spread over
    the songs waiting, so a prompt of N tokens alone takes ceil(N / (budget // 2)) steps to prefill."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder,
                    TalkerConfig(max_num_batched_tokens=budget))
    for index in (0, 1):
        talker.submit(str(index), *prompt(models, index), seed=index, requested_frames=5)
    songs = [talker.songs["0"], talker.songs["1"]]
    steps_to_prefill = {}
    for step in range(1, 100):
        before = sum(song.prefilled for song in songs)
        talker.step()
        assert 0 < 2 * (sum(song.prefilled for song in songs) - before) <= budget, step
        for song in songs:
            if song.prefilled == song.ids.shape[1]:
                steps_to_prefill.setdefault(song.id, step)
        if len(steps_to_prefill) == 2:
            break
    assert steps_to_prefill["0"] == math.ceil(songs[0].ids.shape[1] / (budget // 2))


def test_a_failed_prefill_fails_only_its_song(models, solo):
    """Song 1's prompt (33 tokens, prefilled at once) runs out of memory while song 0 decodes and song 5 waits
    behind it: song 1 alone fails, with the reason, and the others finish as if it had never come."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig(max_num_seqs=4))
    talker.lm = FailingPrefill(models.language_model, len(prompt(models, 1)[0]))
    finished, failed, events = {}, {}, []
    for index in (0, 1, 5):
        _, _, frames, seed = SONGS[index]
        talker.submit(str(index), *prompt(models, index), seed, frames)
        events += talker.step()
    while talker.busy:
        events += talker.step()
    for event in events:
        if isinstance(event, SongFinished):
            finished[event.song] = event
        elif isinstance(event, SongFailed):
            failed[event.song] = event
    assert set(failed) == {"1"} and "out of memory for this prompt" in failed["1"].message
    assert set(finished) == {"0", "5"} and torch.equal(finished["0"].codes, solo[0].codes)
    assert not talker.songs and not talker.active


def test_a_failed_prefill_is_reported_even_when_its_step_then_fails(models):
    """Song 1's prefill fails, then the frame launch of the same step raises (say a sticky device error): the step's
    SongFailed for song 1 was lost with it, and song 1, gone from the talker, was never failed (its client waited
    forever). It now comes with the next step."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig(max_num_seqs=4))
    talker.submit("0", *prompt(models, 0), SONGS[0][3], SONGS[0][2])
    talker.step()
    talker.lm = FailingPrefill(models.language_model, len(prompt(models, 1)[0]))
    talker.submit("1", *prompt(models, 1), SONGS[1][3], SONGS[1][2])
    launch = talker._launch

    def failing_launch():
        talker._launch = launch
        raise RuntimeError("injected launch failure")

    talker._launch = failing_launch
    with pytest.raises(RuntimeError, match="injected launch failure"):
        talker.step()
    talker.cancel("0")  # what the serving engine does with the songs decoding in a failed step
    assert talker.busy
    events = talker.step()
    assert [(type(e), e.song) for e in events] == [(SongFailed, "1")] and "out of memory" in events[0].message
    assert not talker.busy and not talker.songs


def test_a_failed_prefill_alone_keeps_the_talker_busy_until_a_step_reports_it(models) -> None:
    """Song 0 (its step in flight) is cancelled and song 1's prefill fails in a step whose read-back of song 0's step
    then raises: nothing waits, decodes or is in flight, only song 1's failure is left to report. The talker stays
    busy until the next step reports it; idle, the serving loop would wait on its control queue and song 1's caller
    would hear nothing (until some other song came)."""
    config = TalkerConfig(max_num_seqs=2, depth_cache=False)  # one pair; no depth lookup table (8 s to build here)
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, config)
    talker.submit("0", *prompt(models, 0), SONGS[0][3], SONGS[0][2])
    talker.step()  # song 0 decodes, its first frame step in flight
    assert talker.cancel("0")
    talker.lm = FailingPrefill(models.language_model, len(prompt(models, 1)[0]))
    talker.submit("1", *prompt(models, 1), SONGS[1][3], SONGS[1][2])
    collect = talker._collect

    def failing_collect(done):
        talker._collect = collect
        raise RuntimeError("injected read-back failure")

    talker._collect = failing_collect
    with pytest.raises(RuntimeError, match="injected read-back failure"):
        talker.step()
    assert not talker.waiting and not talker.active and talker._in_flight is None and not talker.songs
    assert talker.busy
    events = talker.step()
    assert [(type(e), e.song) for e in events] == [(SongFailed, "1")] and "out of memory" in events[0].message
    assert not talker.busy


def test_a_song_cancelled_mid_prefill_gives_its_rows_back(models):
    """A prompt prefilled in chunks and cancelled between two of them: nothing of it stays queued or holds rows, and
    the one pair takes the next song, which comes out as it does alone."""
    config = TalkerConfig(max_num_seqs=2, max_num_batched_tokens=8)
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, config)
    talker.submit("a", *prompt(models, 1), 1, 5)
    talker.step()
    assert 0 < talker.songs["a"].prefilled < talker.songs["a"].ids.shape[1]
    assert talker.cancel("a")
    assert not talker.waiting and not talker.active and not talker.busy
    _, _, frames, seed = SONGS[3]
    talker.submit("b", *prompt(models, 3), seed, frames)
    codes = []
    while talker.busy:
        codes += [e.codes for e in talker.step() if isinstance(e, SongFinished)]
    alone, _, _ = run(models, {3: 0}, config)
    assert torch.equal(codes[0], alone[3].codes)


def test_admission_at_the_context_boundary(models) -> None:
    """The prompt and the frames share max_model_len positions: a prompt of max_model_len - 1 tokens is admitted with
    a budget of one frame (that song runs to its end in test_a_song_that_fills_the_context_equals_the_offline_pipeline);
    one of exactly max_model_len tokens, or max_model_len + 1, leaves no frame and is refused at submit with the
    numbers, queueing nothing (admitted, it had a budget of 0 or less)."""
    cond, uncond = prompt(models, 0)
    max_model_len = len(cond) + 1
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder,
                    TalkerConfig(max_model_len=max_model_len))
    for extra in (1, 2):  # prompts of max_model_len and max_model_len + 1 tokens
        longer_cond, longer_uncond = cond + cond[-1:] * extra, uncond + uncond[-1:] * extra
        with pytest.raises(InputError, match=f"^the prompt has {max_model_len + extra - 1} tokens and leaves no frames "
                                             f"within max_model_len {max_model_len}$"):
            talker.submit(f"long{extra}", longer_cond, longer_uncond, 1, 100)
        assert not talker.busy and not talker.songs
    assert talker.submit("fits", cond, uncond, 1, 100) == 1
    assert [song.budget for song in talker.waiting] == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_bytes_needed_counts_the_scratch_position(models, dtype: torch.dtype) -> None:
    """SlotCache.bytes_needed, which the startup memory check adds up, is what the cache allocates: K and V of
    [layers, 2 * pairs, kv_heads, max_model_len + 1, head_dim], the + 1 being the scratch position padded rows
    write. Left out, a cache whose scratch column tipped it past the memory limit would pass the check."""
    cfg, pairs, max_model_len = models.language_model.cfg, 3, 17
    cache = SlotCache(cfg, pairs, max_model_len, dtype, "cpu")
    assert cache.k.shape == (cfg.layers, 2 * pairs, cfg.kv_heads, max_model_len + 1, cfg.head_dim)
    allocated = sum(t.numel() * t.element_size() for t in (cache.k, cache.v))
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert allocated == 2 * cfg.layers * 2 * pairs * cfg.kv_heads * (max_model_len + 1) * cfg.head_dim * itemsize
    assert SlotCache.bytes_needed(cfg, pairs, max_model_len, dtype) == allocated


def test_a_failed_prefill_is_reported_before_the_other_events_of_its_step(models) -> None:
    """A step in which song 1's prefill fails and song 0 (decoding) ends: the step's events give song 1's SongFailed
    first, as it happened first (the prefill runs before the frame step whose results end song 0), then song 0's
    windows and its SongFinished."""
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    budget = 3
    talker.submit("0", *prompt(models, 0), 1, budget)
    while talker.songs["0"].frames < budget - 1:  # the next step reads its last frame
        assert talker.step() == []
    talker.lm = FailingPrefill(models.language_model, len(prompt(models, 1)[0]))
    talker.submit("1", *prompt(models, 1), 2, 5)
    events = talker.step()
    assert [(type(e), e.song) for e in events] == [(SongFailed, "1")] + [(type(e), "0") for e in events[1:]]
    assert "out of memory for this prompt" in events[0].message
    assert isinstance(events[-1], SongFinished) and events[-1].frames == budget
    assert not talker.songs and talker.step() == [] and not talker.busy  # the step queued past song 0's end: dropped
