"""The composition root: builds everything from one `Settings` and runs the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engines.base import Engine
from engines.manifest import Manifest
from engines.output import ScoreOutput
from engines.watchdog import Watchdog
from inference import grpc_service_pb2 as oip
from riskscoring.v1 import risk_scoring_pb2 as pb
from service.api.admission import Admission, admission_limit
from service.api.auth import AuthInterceptor, TokenSource
from service.api.health import DrainingHealth
from service.api.http1 import CallLane
from service.api.oip import InferenceServicer
from service.api.registration import generic_handler
from service.api.risk import RiskScoringServicer
from service.api.stream import MessageStreams
from service.api.tls import CertificateFiles
from service.batching.budget import Budget
from service.config import Settings
from service.models.experiments import Experiments
from service.models.loader import EngineFactory, VersionLoader, default_engines
from service.models.registry import ModelRegistry
from service.models.reload import ModelWatcher
from service.models.routing import RequestRouter
from service.prctl import end_with_parent
from service.telemetry import Metrics, Telemetry, setup_telemetry

__all__ = ["RiskServer", "build_server", "serve", "serve_processes"]

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["RiskScoring"].full_name,
    oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
)


def _server_version() -> str:
    try:
        return version("riskserve")
    except PackageNotFoundError:  # running from a source tree
        return "0+unknown"


@dataclass
class RiskServer:
    """A started server and the parts a graceful stop must reach."""

    server: grpc.aio.Server
    port: int
    registry: ModelRegistry
    health: health.aio.HealthServicer
    oip: InferenceServicer
    executor: ThreadPoolExecutor
    settings: Settings
    telemetry: Telemetry
    experiments: Experiments | None = None
    watcher: ModelWatcher | None = None
    certificates: CertificateFiles | None = None
    streams: MessageStreams | None = None
    lane: CallLane | None = None

    def roll_experiment_logs(self) -> None:
        """SIGUSR1: publish the experiment log files now, so a report sees every record."""
        if self.experiments is None:
            log.info("SIGUSR1: no experiment runs, so there is no log file to roll")
        else:
            self.experiments.roll()

    async def stop(self) -> None:
        """Refuse new work, let queued and in-flight requests finish, then stop."""
        grace_s = self.settings.shutdown_grace_s
        if self.watcher is not None:
            await self.watcher.close()
        self.oip.draining = True
        if self.streams is not None:
            # Streams stop reading and end once what they read is answered, within the grace.
            self.streams.drain()
        await self.health.enter_graceful_shutdown()
        # The server stops taking calls and waits for those in flight, which need the batchers.
        if self.lane is None:
            await self.server.stop(grace_s)
        else:
            await asyncio.gather(self.server.stop(grace_s), self.lane.close(grace_s))
        if self.experiments is not None:
            # Shadow jobs still need the challengers' batchers; the log flushes last.
            await self.experiments.close(grace_s)
        await self.registry.close(grace_s)
        self.executor.shutdown(wait=True, cancel_futures=False)
        await asyncio.to_thread(self.telemetry.shutdown)
        log.info("stopped")


def default_engine_workers() -> int:
    """Engine threads per model when not configured: half the cores, between 1 and 4.

    The event loop and gRPC's own threads need the other half. On two cores one worker gave
    lower p99 in most runs and more throughput at 16 callers than two (bench.compare): a
    second batch in flight only competes for the same cores and makes the batches smaller.
    """
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def _certificates(settings: Settings) -> CertificateFiles | None:
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    return CertificateFiles(
        settings.tls_cert_file,
        settings.tls_key_file,
        settings.tls_client_ca_file,
        settings.tls_reload_interval_s,
    )


def _auth(settings: Settings, metrics: Metrics) -> AuthInterceptor | None:
    tokens = None
    if settings.auth_token or settings.auth_tokens_file:
        tokens = TokenSource(settings.auth_token, settings.auth_tokens_file)
    if tokens is None and not settings.auth_client_names:
        return None
    return AuthInterceptor(tokens, settings.auth_client_names, metrics=metrics)


def _required_models(settings: Settings) -> tuple[str, ...]:
    """The default model must serve where the settings name it or its folder is there: every
    request that names no model goes to it. (The built-in default names the demo model, which
    a models folder of other models need not hold.)"""
    name = settings.default_model
    named = "default_model" in settings.model_fields_set
    return (name,) if named or (settings.models_dir / name).is_dir() else ()


def _with_watchdog(factory: EngineFactory, timeout_s: float) -> EngineFactory:
    """Each model's primary engines under a time limit where a call can hang; the fallback, and
    ONNX Runtime on the CPU, run as they are (the watchdog's thread hop costs two context
    switches a batch, a fifth of a small batch's engine time)."""

    def build(path: Path, manifest: Manifest, score: ScoreOutput) -> tuple[list[Engine], Engine]:
        engines, fallback = factory(path, manifest, score)
        return [
            Watchdog(e, timeout_s) if e is not fallback and e.can_hang else e for e in engines
        ], fallback

    return build


async def build_server(
    settings: Settings,
    engine_factory: EngineFactory | None = None,
    address: str | None = None,
    calls_path: str | None = None,
) -> RiskServer:
    """Load the models, wire the servicers and start listening.

    `engine_factory` builds each model version's engines; the default offers validated
    TensorRT plans and ONNX variants beside ONNX Runtime FP32, which is also the fallback.
    `address`, where given, is where the server listens in plaintext instead of the settings'
    host and port: a worker's socket behind the front, which holds the TLS. `calls_path`, where
    given, is the Unix socket of the worker's call lane, where the front sends unary calls and
    streams over HTTP/1.1 (`service.api.http1`).
    """
    telemetry = setup_telemetry(settings)
    # What a start that fails part-way has set going is stopped again, last first: in a
    # process that goes on (a test, an embedding program) its threads and ports would stay.
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(asyncio.to_thread, telemetry.shutdown)
        return await _build(settings, engine_factory, address, calls_path, telemetry, undo)


async def _build(
    settings: Settings,
    engine_factory: EngineFactory | None,
    address: str | None,
    calls_path: str | None,
    telemetry: Telemetry,
    undo: contextlib.AsyncExitStack,
) -> RiskServer:
    workers = settings.engine_workers or default_engine_workers()
    # Model loading and warm-up run here; each batcher runs its engine calls on its own threads.
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="model-loader")
    undo.callback(executor.shutdown, wait=True, cancel_futures=True)
    if engine_factory is None:
        engine_factory = default_engines(
            settings.engine_threads,
            max_concurrency=workers,
            tensorrt=settings.tensorrt,
            onnx_variants=settings.onnx_variants,
        )
    if settings.engine_timeout_ms > 0:
        engine_factory = _with_watchdog(engine_factory, settings.engine_timeout_ms / 1000)
    loader = VersionLoader(
        engine_factory,
        max_batch_rows=settings.max_batch_size,
        max_queue_rows=settings.max_queue_rows,
        workers=settings.engine_workers,
        max_queue_delay_s=settings.max_queue_delay_us / 1e6,
        inline_max_s=settings.engine_inline_max_us / 1e6,
        gather_s=settings.gather_us / 1e6,
        warmup_iterations=settings.warmup_iterations,
        degrade_on_deadline=settings.degrade_on_deadline,
        telemetry=telemetry,
    )
    registry = ModelRegistry(
        executor,
        loader,
        telemetry=telemetry,
        pinned_versions=settings.pinned_versions,
        required=_required_models(settings),
    )
    undo.push_async_callback(registry.close, 0.0)
    await registry.load_dir(settings.models_dir)
    experiments = None
    if settings.experiments_file is not None:
        experiments = Experiments(
            registry,
            settings.experiments_file,
            settings.shadow_log_prefix,
            max_queued_jobs=settings.shadow_max_queued_jobs,
            flush_interval_s=settings.shadow_flush_interval_s,
            max_file_bytes=settings.shadow_max_file_bytes,
            max_file_age_s=settings.shadow_max_file_age_s,
            pass_interval_s=settings.shadow_pass_interval_s,
            min_sampled_share=settings.shadow_min_sampled_share,
            shadow_cpus=settings.shadow_cpu_set,
            telemetry=telemetry,
        )
        undo.push_async_callback(experiments.close, 0.0)
        experiments.start()

    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 1 if settings.processes > 1 else 0),
        ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
    ]
    auth = _auth(settings, telemetry.metrics)
    interceptors: list[grpc.aio.ServerInterceptor] = [auth] if auth is not None else []
    server = grpc.aio.server(options=options, interceptors=interceptors)
    router = RequestRouter(registry, experiments)  # one routing rule for every path
    budget = Budget(settings.budget_s)  # every path's deadline comes from this one
    streams = MessageStreams(settings.max_stream_in_flight, budget)
    oip_servicer = InferenceServicer(
        registry, budget, _server_version(), telemetry, router, streams=streams
    )
    risk_servicer = RiskScoringServicer(
        registry,
        settings.default_model,
        budget,
        experiments,
        telemetry,
        router,
        streams=streams,
        explain_when=settings.explain_when,
    )
    # One bound over both APIs: they share the process's event loop and engines.
    admission = Admission(settings.max_requests_in_progress or admission_limit(budget))
    risk_servicer.admission = admission  # type: ignore[attr-defined]
    oip_servicer.admission = admission  # type: ignore[attr-defined]
    handlers = (
        generic_handler(risk_servicer, pb.DESCRIPTOR.services_by_name["RiskScoring"]),
        generic_handler(oip_servicer, oip.DESCRIPTOR.services_by_name["GRPCInferenceService"]),
    )
    server.add_generic_rpc_handlers(handlers)
    health_servicer = DrainingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in SERVICE_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    # "" and each model's name follow whether its serving version is loaded, from the start.
    registry.on_readiness(health_servicer.show_readiness)
    await registry.check_readiness()
    names = [*SERVICE_NAMES, health.SERVICE_NAME]
    if settings.reflection:
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)

    certificates = None if address is not None else _certificates(settings)
    if certificates is None:
        port = server.add_insecure_port(address or f"{settings.host}:{settings.port}")
    else:
        port = server.add_secure_port(
            f"{settings.host}:{settings.port}", certificates.credentials()
        )
    await server.start()
    undo.push_async_callback(server.stop, None)
    lane = None
    if calls_path is not None:
        lane = CallLane(handlers, interceptors, settings.max_message_bytes)
        await lane.start(calls_path)
        undo.push_async_callback(lane.close, 0.0)
    watcher = ModelWatcher(
        registry,
        settings.models_dir,
        interval_s=settings.reload_interval_s,
        drain_s=settings.reload_drain_s,
        telemetry=telemetry,
    )
    undo.push_async_callback(watcher.close)
    watcher.start()
    undo.pop_all()  # started: RiskServer.stop stops it all from here
    log.info("serving %s on %s", registry.names(), address or f"{settings.host}:{port}")
    return RiskServer(
        server,
        port,
        registry,
        health_servicer,
        oip_servicer,
        executor,
        settings,
        telemetry,
        experiments,
        watcher,
        certificates,
        streams,
        lane,
    )


def serve_processes(settings: Settings) -> int:
    """Fork `settings.processes` servers on one port before any gRPC state exists.

    Each child runs its own event loop, batchers and engines; the kernel spreads incoming
    connections across them. Metrics ports are offset by the child's index.
    """
    import multiprocessing

    context = multiprocessing.get_context("fork")
    children = []
    for index in range(settings.processes):
        metrics_port = settings.metrics_port
        if metrics_port:
            metrics_port += index
        child_settings = settings.model_copy(update={"metrics_port": metrics_port})
        child = context.Process(
            target=_run_child, args=(child_settings, os.getpid()), name=f"riskserve-{index}"
        )
        child.start()
        children.append(child)

    def forward(signum: int, frame: object) -> None:
        for child in children:
            if child.pid is not None and child.is_alive():
                # One that ended since is passed by: raised here, the error ended this
                # process, which then waited at exit for the children it had not told.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGUSR1, forward)
    for child in children:
        child.join()
    # A child ended by a signal (the OOM killer, a crash in an engine) has a negative exit code:
    # the shell's 128 + signal, not the 0 of a clean stop.
    codes = [child.exitcode or 0 for child in children]  # all joined: none is None
    return max((128 - code if code < 0 else code for code in codes), default=0)


def _run_child(settings: Settings, parent: int) -> None:
    # A parent killed outright (SIGKILL, the OOM killer) would leave this child serving on the
    # shared port for good, with no process to stop it.
    end_with_parent(parent)
    asyncio.run(serve(settings))


async def serve(
    settings: Settings,
    ready: asyncio.Event | None = None,
    address: str | None = None,
    calls_path: str | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then drain gracefully. `address` and `calls_path`: a
    worker's own sockets behind the front (build_server), which prints the service's address
    itself."""
    if settings.switch_interval_us:
        sys.setswitchinterval(settings.switch_interval_us / 1e6)
        log.info("thread switch interval %.0f µs", sys.getswitchinterval() * 1e6)
    if threading.current_thread() is threading.main_thread():
        # Until the handlers below are in place (the models load first), a reload or a log
        # roll waits: their default action would end the process.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    running = await build_server(settings, address=address, calls_path=calls_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if running.watcher is not None:
        loop.add_signal_handler(signal.SIGHUP, running.watcher.trigger)
    loop.add_signal_handler(signal.SIGUSR1, running.roll_experiment_logs)
    if address is None:  # after the handlers: a stop sent on seeing this line drains
        # One write of the whole line: the processes of RISKSERVE_PROCESSES share stdout, and
        # print() writes the text and its newline apart, so two lines could run together.
        sys.stdout.write(f"riskserve listening on {settings.host}:{running.port}\n")
        sys.stdout.flush()
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("signal received: draining for up to %.1f s", settings.shutdown_grace_s)
    await running.stop()
