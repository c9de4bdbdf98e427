"""music3serve on Ray Serve, on the CPU: a local Ray (started once for the module) runs the application with two engine
replicas of the tiny checkpoint, each holding three songs; real HTTP clients talk to Ray's proxy.

Songs are compared with their solo runs through the plain server (`music3serve serve`'s app over one Engine): a song
batched with others differs from its solo run by float32 rounding only (tests/test_engine.py: at most PCM_MAX_ABS),
which is BATCH_LSB in the int16 the API sends."""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")
httpx = pytest.importorskip("httpx")

from music3serve.acoustic.windows import song_samples  # noqa: E402
from music3serve.serving.access import HostPolicy  # noqa: E402
from music3serve.serving.api import create_app  # noqa: E402
from music3serve.serving.deploy_config import load_deploy_config  # noqa: E402
from music3serve.prompt import frames_for_duration  # noqa: E402
from music3serve.serving.engine import Engine  # noqa: E402
from music3serve.serving.engine_limits import audio_bytes  # noqa: E402
from music3serve.serving.ray_app import APP_NAME, RayAppArgs, build  # noqa: E402
from polling import poll_until  # noqa: E402
from test_engine import PCM_MAX_ABS  # noqa: E402

SONG = {"caption": "synth pop, 120 bpm", "lyrics": "[verse]\nla la", "steps": 2, "format": "pcm"}
SHORT, LONG = 2, 10  # seconds: one window, two windows
SONGS_PER_REPLICA = 3  # the test deploy file's stage 0: 6 rows
QUEUED = 6  # max_queued_songs: Ray counts a burst's songs as queued until each is sent to a replica
BATCH_LSB = math.ceil(PCM_MAX_ABS * 32767) + 1  # rounding of the float difference, then of each int16 conversion
TIMEOUT = httpx.Timeout(120.0, connect=5.0)
DEPLOY = f"stages:\n  - stage_id: 0\n    max_num_seqs: {2 * SONGS_PER_REPLICA}\n  - stage_id: 1\n"


def descendants(root: int) -> set[int]:
    """Every live process under `root` (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def deploy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray") / "deploy.yaml"
    path.write_text(DEPLOY)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, deploy_file: Path):
    """The application on a local Ray; yields its URL and a stop() that shuts Serve and Ray down (also at the end)."""
    shm_before, others = set(os.listdir("/dev/shm")), descendants(os.getpid())  # say a resource tracker of earlier tests
    port = free_port()
    started = time.monotonic()
    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = RayAppArgs(model=str(tiny_dir), config=str(deploy_file), device="cpu", replicas=2,
                      max_queued_songs=QUEUED, health_check_period_s=1.0, cpus_per_replica=1)
    serve.run(build(args), name=APP_NAME, route_prefix="/")
    print(f"Ray and the application up in {time.monotonic() - started:.1f} s")
    state = {"stopped": False, "shm_before": shm_before}

    def stop() -> set[int]:
        """Shut down; returns the processes Ray ran under this one just before."""
        ours = descendants(os.getpid()) - others
        if not state["stopped"]:
            state["stopped"] = True
            serve.delete(APP_NAME)  # as `serve --ray` stops: the application first, which drains its songs
            serve.shutdown()
            ray.shutdown()
        return ours

    yield f"http://127.0.0.1:{port}", stop, state
    stop()


@pytest.fixture(scope="module")
def solo(tiny_dir: Path, deploy_file: Path, serve_http):
    """Each seed's song (SHORT s) as the plain server sends it, alone on its engine."""
    engine = Engine.from_pretrained(tiny_dir, load_deploy_config(deploy_file), device="cpu")
    try:
        with serve_http(create_app(engine)) as url:
            out = {}
            for seed in range(6):
                response = httpx.post(f"{url}/v1/songs", json={**SONG, "seed": seed, "duration": SHORT},
                                      timeout=TIMEOUT)
                assert response.status_code == 200, response.text
                out[seed] = np.frombuffer(response.content, "<i2")
            return out
    finally:
        engine.close()


class Listener(threading.Thread):
    """One streamed song read to its end in a thread: headers, bytes, and how it ended."""

    def __init__(self, url: str, headers: dict | None = None, **song) -> None:
        super().__init__(daemon=True)
        self.url, self.song, self.send_headers = url, {**SONG, **song}, headers
        self.status, self.headers, self.body, self.error = None, {}, b"", None
        self.accepted = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/songs", json=self.song, headers=self.send_headers,
                              timeout=TIMEOUT) as response:
                self.status, self.headers = response.status_code, response.headers
                self.accepted.set()
                for piece in response.iter_bytes():
                    self.body += piece
        except httpx.HTTPError as exc:  # a stream cut short
            self.error = exc
        finally:
            self.accepted.set()

    def finish(self) -> "Listener":
        self.join(120)
        assert not self.is_alive(), "the song did not end"
        return self


@pytest.mark.parametrize("example", ["serve_config.yaml", "rayservice.yaml"])
def test_the_example_configs_are_valid_serve_configs_with_valid_args(example):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    text = (Path(__file__).parents[1] / "examples" / "ray" / example).read_text()
    config = yaml.safe_load(text)
    config = yaml.safe_load(config["spec"]["serveConfigV2"]) if "spec" in config else config
    app = ServeDeploySchema.model_validate(config).applications[0]
    assert app.import_path == "music3serve.serving.ray_app:build"
    RayAppArgs.model_validate(app.args)


@pytest.mark.parametrize("argv, error", [
    (["--replicas", "2"], "--replicas applies to `serve --ray` only"),
    (["--ray", "--autoscale", "3:1"], "MIN:MAX replicas with 1 <= MIN <= MAX, got '3:1'"),
    (["--ray", "--replicas", "0"], "an integer >= 1, got '0'"),
])
def test_serve_ray_arguments_are_checked(argv, error, capsys):
    from music3serve import cli

    try:
        code = cli.main(["serve", "--tiny", *argv])
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    assert code == 2 and error in capsys.readouterr().err


def test_a_serve_config_gives_replicas_or_autoscale_not_both(monkeypatch):
    """The command line refuses --replicas with --autoscale; a Serve config's `args` did not (autoscale won, silently).
    The command line's --autoscale alone still reaches the application."""
    from pydantic import ValidationError

    from music3serve import cli
    from music3serve.serving import ray_app

    with pytest.raises(ValidationError, match="give replicas or autoscale, not both"):
        RayAppArgs.model_validate({"tiny": True, "replicas": 2, "autoscale": "1:2"})
    assert RayAppArgs.model_validate({"tiny": True, "autoscale": "1:2"}).autoscale == "1:2"
    built = []
    monkeypatch.setattr(ray_app, "serve_on_ray", lambda args, host, port: built.append(args))
    assert cli.main(["serve", "--tiny", "--ray", "--port", "0", "--autoscale", "1:3"]) == 0
    assert cli.main(["serve", "--tiny", "--ray", "--port", "0", "--replicas", "3"]) == 0
    assert [(args.autoscale, args.replicas) for args in built] == [("1:3", 1), (None, 3)]


def test_serve_ray_passes_its_access_flags_to_the_application(monkeypatch):
    """serve --ray's --api-key (or MUSIC3_API_KEY), --allowed-origins and --allowed-hosts reach the front's Access as
    `music3serve serve` builds it for the plain server, the proxy's --host deciding the loopback names."""
    from music3serve import cli
    from music3serve.serving import ray_app

    built = []
    monkeypatch.setattr(ray_app, "serve_on_ray", lambda args, host, port: built.append(args.access()))
    monkeypatch.setenv("MUSIC3_API_KEY", "from-env")
    argv = ["serve", "--tiny", "--ray", "--port", "0", "--allowed-origins", "https://app.example", "--allowed-hosts",
            "music.example"]
    assert cli.main(argv) == 0 and cli.main([*argv, "--api-key", "given", "--host", "0.0.0.0"]) == 0
    assert [a.api_keys for a in built] == [("from-env",), ("given",)]
    assert {a.allowed_origins for a in built} == {("https://app.example",)}
    assert [a.hosts for a in built] == [HostPolicy(True, ("music.example",)), HostPolicy(False, ("music.example",))]


def state_of(url: str, song: str) -> dict:
    return httpx.get(f"{url}/v1/songs/{song}", timeout=TIMEOUT).json()


def test_six_concurrent_songs_spread_over_both_replicas_and_equal_their_solo_runs(cluster, solo):
    url, _, _ = cluster
    songs = [Listener(url, seed=seed, duration=SHORT, stream=False) for seed in range(6)]
    replicas = set()
    for seed, song in enumerate(songs):
        song.finish()
        assert song.status == 200 and song.error is None, song.body[:300]
        replicas.add(song.headers["x-replica"])
        got = np.frombuffer(song.body, "<i2")
        assert got.shape == solo[seed].shape
        assert np.abs(got.astype(np.int32) - solo[seed]).max() <= BATCH_LSB
        assert state_of(url, song.headers["x-song-id"])["state"] == "done"
    assert len(replicas) == 2  # three songs fill a replica: the router used both
    # Each replica's engine metrics reach Ray's export (the node's metrics port), labelled by replica.
    took = {tag: sum(s.headers["x-replica"] == tag for s in songs) for tag in replicas}
    export = f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"

    def exported() -> dict[str, float]:
        found = re.findall(r'^ray_music3_requests_total\{.*replica="(\w+)".*\} ([0-9.]+)$', httpx.get(export).text,
                           re.MULTILINE)
        return {tag: float(value) for tag, value in found}

    poll_until(lambda: exported() == took, 60)


def test_the_first_window_arrives_before_the_song_ends(cluster):
    url, _, _ = cluster
    running: list[dict] = []
    with httpx.stream("POST", f"{url}/v1/songs", json={**SONG, "seed": 9, "duration": LONG}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        body = b""
        for piece in r.iter_bytes():
            body += piece
            if len(body) >= 4 * 44100 and not running:  # past the first second: the first window
                running.append(state_of(url, r.headers["x-song-id"]))
    # The replica's progress reached the front: the talker had written frames, stage 1 rendered the first window.
    assert running[0]["state"] == "running"
    assert running[0]["frames_written"] > 0 and running[0]["windows_rendered"] >= 1
    done = state_of(url, r.headers["x-song-id"])
    assert done["state"] == "done" and len(body) == 4 * done["samples_sent"]
    assert done["frames_written"] == done["frames"] >= running[0]["frames_written"]


def test_songs_past_the_slots_wait_past_the_queue_get_429_and_delete_reaches_either_replica(cluster):
    url, _, _ = cluster
    held = [Listener(url, seed=20 + i, duration=60) for i in range(2 * SONGS_PER_REPLICA)]
    for song in held:
        assert song.accepted.wait(120) and song.status == 200
    assert len({s.headers["x-replica"] for s in held}) == 2
    extra = []
    while len(extra) < QUEUED + 2:  # every slot is taken: the next QUEUED wait in Ray's queue, later ones are refused
        extra.append(Listener(url, seed=40 + len(extra), duration=SHORT, stream=False, id=f"queued-{len(extra)}"))
        time.sleep(0.5)
    refused = [s.finish() for s in extra if s.accepted.wait(2) and s.status is not None]
    assert len(refused) == len(extra) - QUEUED
    for song in refused:
        assert song.status == 429 and song.headers["retry-after"] == "10"
        assert "every engine replica holds its songs" in song.body.decode()
    waiting = [s for s in extra if s not in refused]
    # A waiting song cancelled before a replica takes it: its POST is answered 409 once it is taken (as on one engine).
    assert httpx.delete(f"{url}/v1/songs/{waiting[0].song['id']}", timeout=TIMEOUT).status_code == 204
    for song in held:  # DELETE through the proxy, whichever replica holds the song
        assert httpx.delete(f"{url}/v1/songs/{song.headers['x-song-id']}", timeout=TIMEOUT).status_code == 204
    for song in held:
        song.finish()
        assert state_of(url, song.headers["x-song-id"])["state"] == "cancelled"
    waited = [s.finish() for s in waiting]
    assert [s.status for s in waited] == [409] + [200] * (QUEUED - 1)  # none lost: they took the freed slots
    assert "was cancelled before it was accepted" in waited[0].body.decode()
    for song in waited[1:]:
        assert len(song.body) == 4 * state_of(url, song.headers["x-song-id"])["samples_sent"] > 0


def test_a_killed_replica_fails_its_own_songs_only_and_is_replaced(cluster):
    url, _, _ = cluster
    songs = [Listener(url, seed=60 + i, duration=LONG) for i in range(2 * SONGS_PER_REPLICA)]
    for song in songs:
        assert song.accepted.wait(120) and song.status == 200
    victim = songs[0].headers["x-replica"]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Music3Engine#{victim}", namespace="serve"), no_restart=True)
    for song in songs:
        song.finish()
        state = state_of(url, song.headers["x-song-id"])
        if song.headers["x-replica"] == victim:
            assert song.error is not None  # the stream is cut, not ended as if the song were over
            assert state["state"] == "failed"
            assert f"the engine replica {victim} holding the song stopped" in state["error"]
        else:
            assert song.error is None and state["state"] == "done"

    def two_running() -> bool:
        engines = serve.status().applications[APP_NAME].deployments["Music3Engine"]
        return engines.status == "HEALTHY" and engines.replica_states.get("RUNNING") == 2

    poll_until(two_running, 120)
    after = [Listener(url, seed=80 + i, duration=SHORT, stream=False) for i in range(2 * SONGS_PER_REPLICA)]
    for song in after:
        assert song.finish().status == 200
    replicas = {s.headers["x-replica"] for s in after}
    assert len(replicas) == 2 and victim not in replicas


def test_the_replica_benchmark_dry_runs_on_the_tiny_checkpoint(cluster, capsys):
    """bench/ray_replicas.sh's benchmark (several GPUs of one host), on the CPU with the tiny checkpoint: the
    plain server, one and two replicas (the second added to the running application), the split placement's
    scenarios. It replaces the application of the tests above, so it runs after them."""
    from music3serve.bench.ray_replicas import main

    url, _, _ = cluster
    rows = main(["--tiny", "--replicas", "1,2", "--port", url.rsplit(":", 1)[1]])
    assert [r[:2] for r in rows] == [["plain server", 1], ["Ray", 1], ["Ray", 2], ["Ray, split", 1], ["Ray, split", 1]]
    songs = [2, 2, 4, 1, 2]
    for r, count in zip(rows, songs):
        _, _, gpus, n, audio, wall, rate, _, p50, p95 = r
        assert gpus == 0 and n == count and audio == pytest.approx(count * 2.0, rel=0.01)
        assert 0 < p50 <= p95 <= wall and rate == pytest.approx(audio / wall)
    assert rows[2][7] == pytest.approx(rows[2][6] / (2 * rows[1][6]))
    assert "| Ray | 2 | 0 | 4 |" in capsys.readouterr().out


def test_api_keys_song_ownership_and_the_fronts_audio_budget_work_through_the_proxy(cluster, tiny_dir, deploy_file):
    """serve --ray --api-key: /v1/ needs a key through Ray's proxy, and a song belongs to the key that asked for it.
    The front holds at most max_unread_audio_gib of audio for clients: past it, 429 as on one engine."""
    url = f"{cluster[0]}/music"  # mounted under a prefix: its /v1/ routes need a key all the same
    minute = audio_bytes(frames_for_duration(60))
    args = RayAppArgs(model=str(tiny_dir), config=str(deploy_file), device="cpu", api_keys=["key-one", "key-two"],
                      max_unread_audio_gib=(minute + (1 << 20)) / 2**30)  # one minute of audio (and 1 MiB)
    serve.run(build(args), name=APP_NAME, route_prefix="/music")  # replaces the benchmark's application
    one, two = ({"Authorization": f"Bearer key-{n}"} for n in ("one", "two"))
    refused = httpx.post(f"{url}/v1/songs", json={**SONG, "duration": SHORT}, timeout=TIMEOUT)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json() == {"error": "this server needs an API key: send Authorization: Bearer <key>"}
    song = httpx.post(f"{url}/v1/songs", json={**SONG, "seed": 3, "duration": SHORT, "stream": False, "id": "mine"},
                      headers=one, timeout=TIMEOUT)
    assert song.status_code == 200 and song.headers["x-song-id"] == "mine" and song.headers["x-replica"]
    state = httpx.get(f"{url}/v1/songs/mine", headers=one, timeout=TIMEOUT).json()
    assert state["state"] == "done" and len(song.content) == 4 * state["samples_sent"] > 0
    assert httpx.get(f"{url}/v1/songs/mine", headers=two, timeout=TIMEOUT).status_code == 404  # the other key's ids
    # A minute-long song holds the budget until its client has read it: another is refused meanwhile.
    held = Listener(url, seed=4, duration=60, id="long", headers=one)
    assert held.accepted.wait(120) and held.status == 200
    busy = httpx.post(f"{url}/v1/songs", json={**SONG, "duration": 60}, headers=two, timeout=TIMEOUT)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "10"
    assert "of audio their callers have not read; this song's 20.2 MiB would pass" in busy.json()["error"]
    assert httpx.delete(f"{url}/v1/songs/long", headers=one, timeout=TIMEOUT).status_code == 204
    held.finish()
    # Every song's audio went back to the front's budget once read or cancelled.
    poll_until(lambda: re.search(r"^music3_unread_audio_bytes 0\.0$", httpx.get(f"{url}/metrics").text,
                                 re.MULTILINE), 30)


def test_the_front_has_everything_the_app_asks_of_an_engine():
    """Every `engine.X` the HTTP app's modules use is part of RemoteEngine (an attribute h31-style routes add to the
    app without adding it to the front fails here, not as a 500 under Ray)."""
    from music3serve.serving import api
    from music3serve.serving.ray_front import RemoteEngine

    # api.py and the serving modules it imports, and theirs (the uvicorn runner, server.py, is not used).
    app = Path(api.__file__)
    modules, todo = set(), [app]
    while todo:
        module = todo.pop()
        if module not in modules:
            modules.add(module)
            todo += [app.with_name(f"{name}.py") for name in re.findall(r"^from \.(\w+) import", module.read_text(),
                                                                        re.MULTILINE) if name != "engine"]
    used = set()
    for module in modules:
        used |= set(re.findall(r"\bengine\.([a-z_]\w*)", module.read_text())) - {"py"}  # not serving/engine.py
    front = RemoteEngine(engines=None)
    assert {"submit", "progress", "cancel", "hold_read_audio", "unavailable", "metrics"} <= used
    assert [name for name in sorted(used) if not hasattr(front, name)] == []


def test_shutdown_drains_the_songs_and_leaves_no_process_and_no_shared_memory(cluster):
    url, stop, state = cluster
    # A grace far above the song's time, so that a busy machine cannot cut it (the default is 10 s).
    args = RayAppArgs(tiny=True, replicas=1, shutdown_grace_s=120)
    serve.run(build(args), name=APP_NAME, route_prefix="/")  # the benchmark deleted it
    song = Listener(url, seed=99, duration=LONG)
    assert song.accepted.wait(120) and song.status == 200
    ours = stop()  # while the song runs: it gets shutdown_grace_s to finish
    assert ours, "Ray's processes run under the test process"
    song.finish()
    assert song.error is None and len(song.body) == 4 * song_samples(int(song.headers["x-frame-budget"]))  # all of it

    def gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() for pid in ours)

    poll_until(gone, 60)
    left = {e for e in set(os.listdir("/dev/shm")) - state["shm_before"] if any(str(p) in e for p in ours)}
    assert not left


def test_serve_ray_passes_model_names_and_quantization_to_the_application(monkeypatch):
    """--served-model-name and --quantization reach the application as on the plain server (they were dropped), and
    a bad name is refused by the application's own arguments too (a Serve config file has no command line)."""
    from music3serve import cli
    from music3serve.serving import ray_app

    built = []
    monkeypatch.setattr(ray_app, "serve_on_ray", lambda args, host, port: built.append(args))
    argv = ["serve", "--tiny", "--ray", "--port", "0", "--served-model-name", "music", "--quantization", "fp8"]
    assert cli.main(argv) == 0
    assert built[0].served_model_names == ["music"] and built[0].quantization == "fp8"
    assert {s.quantization for s in built[0].deploy().stages} == {"fp8"}
    assert cli.main(["serve", "--tiny", "--ray", "--port", "0", "--acoustic-dtype", "bfloat16"]) == 0
    assert built[1].deploy().stages[1].dtype == "bfloat16" and built[0].deploy().stages[1].dtype == "float32"
    with pytest.raises(ValueError, match="--served-model-name must be a name"):
        RayAppArgs(tiny=True, served_model_names=[" "])


def test_serve_ray_ends_on_sigterm_with_status_143_and_leaves_no_process(tiny_dir, cluster):
    """`music3serve serve --ray` stopped by SIGTERM (docker stop, systemd) unwinds as the plain server does: the
    application deleted, its Ray stopped, "terminated" and exit status 143. Ray's driver put in a handler of its own
    that dumped its stack and aborted (134). Runs after the module's Ray is down (`cluster`'s stop)."""
    import signal
    import subprocess
    import sys

    cluster[1]()
    port = free_port()
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}  # a local Ray of its own
    command = [sys.executable, "-m", "music3serve.cli", "serve", "--ray", "--model", str(tiny_dir), "--device", "cpu",
               "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        poll_until(lambda: process.poll() is not None or healthy(f"http://127.0.0.1:{port}"), 180)
        assert process.poll() is None, process.communicate()
        ray_processes = descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143 and "terminated" in stderr and "SIGTERM received" not in stderr, stderr[-2000:]
    assert ray_processes
    poll_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ray_processes), 60)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
