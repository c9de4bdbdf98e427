"""music3serve as a Ray Serve application: engine replicas over GPUs and nodes behind one HTTP front.

Two deployments. `Music3Engine`: one Engine per replica, from the same deploy YAML as `music3serve serve`, asking Ray
for the GPUs its stages need (one colocated, two split, none on the CPU) and taking at most stage 0's songs at once
(`max_ongoing_requests`), so Ray's router queues the rest. `Music3Front`: the HTTP ingress, serving/api.py's app over
serving/ray_front.py's view of the engine replicas. `music3serve serve --ray` runs it; so does Ray Serve's own
`serve run` with a config file naming `music3serve.serving.ray_app:build` (examples/ray/). Docs: docs/scaling.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import threading
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator
from ray import serve
from ray.serve import Application

from ..cli_access import api_key, env_api_keys, host_name, origin
from ..cli_args import replica_range, served_model_names
from ..contract import SERVED_MODEL_NAMES
from ..errors import Music3Error
from ..model_location import resolve_model
from .access import Access, HostPolicy
from .api import create_app
from .deploy_config import DeployConfig, load_deploy_config, with_quantization, with_stage1_dtype
from .engine import Engine
from .engine_limits import MAX_SONGS
from .events import Event, SongRequest
from .ray_front import RemoteEngine, ReplicaHeader
from .ray_cluster import APP_NAME, on_ray
from .ray_progress import Progress, with_progress
from .ray_metrics import RayMetricsCopy
from .server import SHUTDOWN_GRACE_S

log = logging.getLogger(__name__)

CONTROL_REQUESTS = 64  # the front's requests beyond songs: status, cancel, health and metrics calls at once
RETRY_AFTER_S = 10  # as the plain server's 429


class EngineArgs(BaseModel):
    """What an engine replica is built from."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="checkpoint folder on every node (default: as `music3serve serve`)")
    tiny: bool = Field(False, description="the tiny random checkpoint, on the CPU")
    config: str | None = Field(None, description="deploy YAML on every node (default: the built-in one)")
    device: Literal["cpu", "cuda"] | None = Field(None, description="cpu: replicas take no GPU")
    random_weights: bool = Field(False, description="benchmarks: full-size random weights instead of a checkpoint")
    quantization: Literal["none", "fp8"] | None = Field(None, description="both stages (default: the deploy file's)")
    acoustic_dtype: Literal["float32", "bfloat16"] | None = Field(None, description="stage 1's dtype (default: the "
                                                                   "deploy file's)")

    def deploy(self) -> DeployConfig:
        """The deploy config, with `quantization` (both stages) and `acoustic_dtype` (stage 1) applied where given."""
        deploy = load_deploy_config(self.config)
        deploy = deploy if self.quantization is None else with_quantization(deploy, self.quantization)
        return deploy if self.acoustic_dtype is None else with_stage1_dtype(deploy, self.acoustic_dtype)

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu" or self.tiny


class RayAppArgs(EngineArgs):
    """The application's arguments: `music3serve serve --ray` fills them, a Serve config file gives them as `args`."""

    replicas: PositiveInt = 1
    autoscale: str | None = Field(None, description="MIN:MAX replicas, scaled by songs in flight (replaces replicas)")
    max_queued_songs: int = Field(64, ge=0, description="songs waiting for a replica; past them: 429")
    cpus_per_replica: float = Field(1.0, ge=0)
    health_check_period_s: PositiveFloat = 10.0
    shutdown_grace_s: PositiveFloat = SHUTDOWN_GRACE_S
    api_keys: list[str] = Field([], description="every /v1/ request must send one (Authorization: Bearer KEY); "
                                                "default: MUSIC3_API_KEY in the front's environment, else none")
    allowed_origins: list[str] = Field([], description="browser origins whose pages may call the API (CORS)")
    allowed_hosts: list[str] = Field([], description="Host header names to answer (against DNS rebinding)")
    host: str = Field("0.0.0.0", description="the address Ray's proxy listens on: on a loopback one, loopback Host "
                                             "names are answered besides allowed_hosts")
    served_model_names: list[str] = Field(list(SERVED_MODEL_NAMES), description="the `model` names requests may give")
    max_unread_audio_gib: PositiveFloat = Field(4.0, description="audio the front holds for clients that have not "
                                                                 "read it; past it: 429")

    @field_validator("autoscale")
    @classmethod
    def _min_max(cls, value: str | None) -> str | None:
        if value is not None:
            replica_range(value)
        return value

    @model_validator(mode="after")
    def _replicas_or_autoscale(self) -> "RayAppArgs":
        if self.autoscale is not None and "replicas" in self.model_fields_set:
            raise ValueError("give replicas or autoscale, not both (autoscale sets the replicas)")
        return self

    @field_validator("api_keys", "allowed_origins", "allowed_hosts")
    @classmethod
    def _as_on_the_command_line(cls, values: list[str], info: Any) -> list[str]:
        check = {"api_keys": api_key, "allowed_origins": origin, "allowed_hosts": host_name}[info.field_name]
        try:
            return [check(value) for value in values]
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("served_model_names")
    @classmethod
    def _model_names(cls, values: list[str]) -> list[str]:
        try:
            return list(served_model_names(values))
        except Music3Error as exc:
            raise ValueError(str(exc)) from None

    def access(self) -> Access:
        """The API's access settings, as `music3serve serve` builds them from its flags."""
        keys = self.api_keys or env_api_keys()
        return Access(tuple(keys), tuple(self.allowed_origins), HostPolicy.for_bind(self.host, self.allowed_hosts))

    def engine_args(self) -> EngineArgs:
        """The replicas' own arguments: a change of scale alone leaves the replicas running."""
        return EngineArgs(**self.model_dump(include=set(EngineArgs.model_fields)))


def gpus_per_replica(deploy: DeployConfig, on_cpu: bool) -> int:
    """The GPUs one engine takes: none on the CPU, one with both stages on one GPU, two split."""
    s0, s1 = deploy.stages
    return 0 if on_cpu else 1 if s0.devices == s1.devices else 2


def replica_deploy(deploy: DeployConfig) -> DeployConfig:
    """The deploy config inside a replica, whose GPUs Ray numbers from 0: stage 0 on its first, stage 1 on the same
    one (colocated) or its second (split)."""
    s0, s1 = deploy.stages
    stage1 = (0,) if s0.devices == s1.devices else (1,)
    return dataclasses.replace(deploy, stages=(dataclasses.replace(s0, devices=(0,)),
                                               dataclasses.replace(s1, devices=stage1)))


def engine_for(args: EngineArgs) -> Engine:
    """The engine one replica runs, on the GPUs Ray gave it (numbered from 0)."""
    deploy = replica_deploy(args.deploy())
    if args.random_weights:
        from ..bench.e2e import random_engine

        split = deploy.stages[0].devices != deploy.stages[1].devices
        return random_engine(deploy, "split" if split else "colocated")
    return Engine.from_pretrained(resolve_model(args.model, args.tiny), deploy, "cpu" if args.on_cpu else None)


class EngineReplica:
    """One Engine; each song is one streaming call: the replica's tag, then the engine's events (a refusal as the
    Music3Error itself)."""

    def __init__(self, args: EngineArgs) -> None:
        self.engine = engine_for(args)
        self.tag = serve.get_replica_context().replica_tag
        self.metrics = RayMetricsCopy(self.engine.metrics.registry)
        log.info("engine replica ready", extra={"replica": self.tag, "pid": os.getpid()})

    async def submit(self, request: SongRequest) -> AsyncIterator[Event | Progress | str | Music3Error]:
        yield self.tag
        try:
            async with contextlib.aclosing(with_progress(self.engine, self.engine.submit(request))) as events:
                async for event in events:
                    yield event
        except Music3Error as exc:
            yield exc

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine stopped serving (a stage died or hung) is replaced."""
        why = self.engine.unavailable()
        if why is not None:
            raise RuntimeError(f"the engine cannot serve: {why}")

    def __del__(self) -> None:  # Ray Serve's shutdown hook, after the songs in flight ended or the grace ran out
        if hasattr(self, "engine"):
            self.metrics.close()
            self.engine.close()


@serve.ingress()
class Front:
    """The HTTP ingress: serving/api.py's routes over the engine replicas, with X-Replica on a song's response."""

    def __init__(self, engines: Any, args: RayAppArgs) -> None:
        self.engine = RemoteEngine(engines, int(args.max_unread_audio_gib * 2**30))
        self.access, self.model_names = args.access(), tuple(args.served_model_names)

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.engine, access=self.access,  # type: ignore[arg-type]  # Engine-shaped (ray_front.py)
                         served_model_names=self.model_names)
        app.add_middleware(ReplicaHeader, engine=self.engine)
        return app

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.close()


def build(args: RayAppArgs | dict[str, Any]) -> Application:
    """The application (Ray Serve's builder: `import_path: music3serve.serving.ray_app:build`, its `args` a dict)."""
    args = RayAppArgs.model_validate(args) if isinstance(args, dict) else args
    deploy = args.deploy()  # a bad file fails here, not in every replica
    songs = deploy.stages[0].max_num_seqs // 2  # every song takes a cond/uncond pair of rows
    if args.autoscale:
        low, high = replica_range(args.autoscale)
        scaling: dict = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                                "target_ongoing_requests": songs}}
    else:
        scaling = {"num_replicas": args.replicas}
    grace = {"graceful_shutdown_timeout_s": args.shutdown_grace_s, "graceful_shutdown_wait_loop_s": 0.5}
    busy = {"status_code": 429, "retry_after_s": RETRY_AFTER_S}
    engines = serve.deployment(
        EngineReplica, name="Music3Engine", max_ongoing_requests=songs, max_queued_requests=args.max_queued_songs,
        ray_actor_options={"num_gpus": gpus_per_replica(deploy, args.on_cpu), "num_cpus": args.cpus_per_replica},
        health_check_period_s=args.health_check_period_s, backpressure_config=busy, **grace, **scaling,
    ).bind(args.engine_args())
    front = serve.deployment(
        Front, name="Music3Front", num_replicas=1, max_ongoing_requests=MAX_SONGS + CONTROL_REQUESTS,
        max_queued_requests=CONTROL_REQUESTS, backpressure_config=busy, ray_actor_options={"num_cpus": 0}, **grace,
    )
    return front.bind(engines, args)


def serve_on_ray(args: RayAppArgs, host: str, port: int) -> None:
    """`music3serve serve --ray`: the application, until Ctrl-C or SIGTERM."""
    build(args)  # the deploy file checked before Ray starts
    if not args.random_weights:
        resolve_model(args.model, args.tiny)  # the tiny checkpoint written once here, not raced by local replicas
    with on_ray(host, port):
        serve.run(build(args), name=APP_NAME, route_prefix="/")
        log.info("serving on Ray", extra={"url": f"http://{host}:{port}"})
        threading.Event().wait()  # until Ctrl-C (KeyboardInterrupt) or SIGTERM (the CLI's SystemExit)
