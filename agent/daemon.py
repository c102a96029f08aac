"""The daemon: runs the pipeline (:mod:`agent.pipeline`) and serves HTTP.

The stages come from the registry: :func:`agent.pipeline.plan` says which samplers the config
asks for, :class:`agent.scheduler.Runners` runs each on its own thread (derived stages with
``after`` right after those sources' reports) with a watchdog. The HTTP server (aiohttp),
engine auto-discovery (:mod:`agent.discovery`), the request proxies
(:mod:`agent.requests.proxies`) and signal handling run on the asyncio loop.

Signals: SIGTERM/SIGINT stop the agent within 2 s; SIGHUP reloads the config file (an
invalid file is rejected with a logged error and the last good config keeps running).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from kvpressure.agent import logs, pipeline
from kvpressure.agent.api import api_routes, attribution_routes
from kvpressure.agent.attribution.store import AttributionStore
from kvpressure.agent.config import Config, ConfigError, load, read_token
from kvpressure.agent.discovery import Discovery, Probe, engine_pids
from kvpressure.agent.httpd import HttpServer, install_accept_error_handler
from kvpressure.agent.kube import EnginePods, PodNameJoin
from kvpressure.agent.pipeline import Sampler
from kvpressure.agent.requests.otlp_receiver import OtlpReceiver
from kvpressure.agent.requests.proxies import ProxySet
from kvpressure.agent.requests.record import RequestStream
from kvpressure.agent.scheduler import Once, Runners, SamplerRunner
from kvpressure.agent.sdnotify import Notifier
from kvpressure.agent.state import AgentState
from kvpressure.agent.timeline import Timeline
from kvpressure.agent.webconfig import WebSecurity, load_web_config
from kvpressure.exporters.otlp_slot import ExportSlot
from kvpressure.exporters.prometheus import make_registry

if TYPE_CHECKING:  # aiohttp is imported only when a proxy is configured (agent.httpd)
    from kvpressure.agent.requests.proxy import RequestProxy

__all__ = ["SHUTDOWN_GRACE_S", "Daemon", "SamplerRunner"]

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.5


class Daemon:
    """The running agent.

    Args:
        config: the validated configuration.
        config_path: the file to re-read on SIGHUP; ``None`` when running on the embedded
            default (SIGHUP then only logs that there is nothing to reload).
        probe: ``probe(url) -> engine type | None`` used by auto-discovery; injectable for
            tests, defaults to :func:`agent.samplers.engines.probe`.
        extra_samplers: samplers to run besides those the config asks for (embedding,
            tests); they are kept across reloads.
        overrides: top-level settings given on the command line (``listen``,
            ``log_level``); they replace the file's at every reload too.

    Raises:
        ConfigError: ``web_config_file`` is set and cannot be loaded.
    """

    def __init__(
        self,
        config: Config,
        config_path: str | Path | None = None,
        probe: Probe | None = None,
        extra_samplers: Sequence[Sampler] = (),
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        # TLS and basic auth of the listener, read once at start (agent.webconfig).
        self.web: WebSecurity | None = (
            load_web_config(config.web_config_file) if config.web_config_file else None
        )
        self._overrides = dict(overrides or {})
        self._reload_lock = asyncio.Lock()
        self._reloads: set[asyncio.Task[bool]] = set()
        self.config_path = Path(config_path) if config_path else None
        self._extra = {s.name: s for s in extra_samplers}
        # The timeline keeps only what the stages that run read back (agent.pipeline).
        self.state = AgentState(
            Timeline(
                config.timeline.points_per_series,
                config.timeline.max_series,
                kept=self.timeline_reads(config),
            )
        )
        self.registry: CollectorRegistry = make_registry(self.state)
        self._runners = Runners(self.state)
        self._discovery = Discovery(probe)
        self._stopping: asyncio.Event | None = None
        self._listen: str | None = None
        self._listen_addr: tuple[str, int] | None = None
        self.api_server: HttpServer | None = None
        self.bound_port: int | None = None
        self.notifier = Notifier()
        # Per-request data: one stream, fed by the OTLP receiver and the proxies, read by
        # the derived stages that subscribe to it (requests, capacity, attribution).
        self.request_stream = RequestStream()
        otlp = config.otlp_receiver
        self.otlp_receiver = OtlpReceiver(
            self.request_stream,
            otlp.max_body_bytes,
            otlp.service_engines,
            otlp.enabled,
            bearer_token=read_token(otlp.bearer_token_file) if otlp.bearer_token_file else None,
        )
        self.state.add_health("otlp-receiver", self.otlp_receiver.health_samples)
        if self.web is not None:
            # With a bearer token the receiver checks its own clients: an exporter cannot
            # send basic auth and a bearer token in one Authorization header.
            self.web.exempt = self.otlp_receiver.checks_itself
        self._proxies = ProxySet(self.request_stream)
        # Attribution: the store (history, slow counts) outlives sampler rebuilds on reload.
        self.attributions = AttributionStore(
            config.attribution.recent_requests, config.attribution.recent_attributions
        )
        self._export = ExportSlot(self.state)
        # Each engine's pod (its listening PID's cgroup), put on its series as labels; the
        # names are joined from each published GPU report's process rows (kube.PodNameJoin).
        self.pod_names = PodNameJoin()
        self.state.on_publish(self.pod_names.take)
        self.engine_pods = EnginePods(self._engine_pids, names=self.pod_names.get)

    def _engine_pids(self) -> dict[int, str]:
        return engine_pids((*self.config.engines, *self._discovery.found.values()))

    @property
    def proxies(self) -> dict[str, RequestProxy]:
        """The request proxies listening now, by ``listen`` address."""
        return self._proxies.proxies

    # ---- the pipeline ----------------------------------------------------------------
    def plans(self, cfg: Config) -> dict[str, pipeline.Planned]:
        """Every sampler ``cfg`` asks for (:func:`agent.pipeline.plan`), by ``sampler`` label."""
        engines = (*cfg.engines, *self._discovery.found.values())
        ctx = pipeline.Context(
            config=cfg,
            state=self.state,
            requests=self.request_stream,
            attributions=self.attributions,
            engines=engines,
            engine_pids=self._engine_pids,
            engine_pods=self.engine_pods.labels,
            engine_processes=self.engine_pods.pids,
            span_sink=self._export.export,
        )
        return pipeline.plan(ctx)

    def timeline_reads(self, cfg: Config) -> frozenset[str]:
        """The metric names the timeline keeps under ``cfg``.

        What ``cfg``'s enabled stages read back (:func:`agent.pipeline.timeline_reads`)
        and what the extra samplers declare (:attr:`agent.pipeline.Sampler.timeline_reads`).
        """
        extra = (s.timeline_reads for s in self._extra.values())
        return pipeline.timeline_reads(cfg).union(*extra)

    def pipeline_once(self) -> Once:
        """Build every stage the config asks for, to run tick by tick on the caller's thread."""
        self._export.apply(self.config.otlp_export, self.config.attribution.span_parent)
        self.state.timeline.set_kept(self.timeline_reads(self.config))
        return Once(self.plans(self.config), self.state)

    def _apply(self, cfg: Config) -> None:
        """Start, keep or stop runners so they match ``cfg``, and the timeline's names.

        A name a starting stage reads is kept before it starts; a name only a stopping
        stage read is dropped once the stage was asked to stop (a collection of it still
        in flight may fail on that name; a stopped runner publishes no report).
        """
        self._export.apply(cfg.otlp_export, cfg.attribution.span_parent)
        timeline = self.state.timeline
        kept = self.timeline_reads(cfg)
        if timeline.kept is not None:
            timeline.set_kept(kept | timeline.kept)
        self._runners.apply(self.plans(cfg), self._extra)
        timeline.set_kept(kept)

    async def _discovery_loop(self) -> None:
        while True:
            try:
                if await self._discovery.once(self.config):
                    self._apply(self.config)
            except Exception:
                log.exception("engine discovery failed")
            await asyncio.sleep(self.config.discovery.interval_s)

    # ---- reload --------------------------------------------------------------------
    def reload(self) -> bool:
        """Re-read the config file and apply it if valid, on the calling thread.

        For embedding and tests; SIGHUP uses :meth:`reload_async`, which reads the file off
        the event loop and also moves the listener and the proxies.

        Returns:
            True when the new config was applied; False when there is no file or it was
            rejected (counted ``kvpressure_config_reloads_total{result="invalid"}``, one
            error line logged; the last good config keeps running).
        """
        read = self._read_config()
        if read is None:
            return False
        self._adopt(*read)
        return True

    async def reload_async(self) -> bool:
        """Reload as SIGHUP does: read off the loop, apply, move the listener and proxies.

        Reloads run one after another, in the order they came. Whatever happens, systemd
        gets ``READY=1`` at the end (it was told ``RELOADING=1`` when the signal came), so
        the unit never stays "reloading". A listen address that cannot be bound is logged
        and the agent keeps its current listener; the next reload tries again.

        Returns:
            True when the new config was applied.
        """
        async with self._reload_lock:
            adopted = False
            try:
                read = await asyncio.to_thread(self._read_config)
                if read is None:
                    return False
                new, token = read
                self._adopt(new, token)
                adopted = True
                if (new.listen_host, new.listen_port) != self._listen_addr:
                    await self._rebind(new.listen_host, new.listen_port)
                await self._proxies.apply(new)
                return True
            except Exception as exc:  # noqa: BLE001 - a reload must never kill the agent
                if adopted:  # counted ok already: the config is in force, a listener is not
                    log.error(
                        "config reload applied, but moving the listeners failed",
                        extra={"kv": {"error": f"{type(exc).__name__}: {exc}"[:500]}},
                    )
                else:
                    self._reject(exc, "config reload failed while applying")
                return False
            finally:
                self.notifier.ready(self._status_line())

    def _read_config(self) -> tuple[Config, bytes | None] | None:
        """Load the file with the overrides and the OTLP bearer token; None (counted) if bad."""
        if self.config_path is None:
            log.info("SIGHUP: running on the embedded default; nothing to reload")
            return None
        try:
            new = load(self.config_path, self._overrides)
            path = new.otlp_receiver.bearer_token_file
            return new, read_token(path) if path else None
        except Exception as exc:  # noqa: BLE001 - ConfigError, or whatever a file provokes
            self._reject(exc, "config reload rejected; keeping the last good config")
            return None

    def _reject(self, exc: Exception, message: str) -> None:
        self.state.count_reload("invalid")
        error = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        log.error(message, extra={"kv": {"error": error[:500]}})

    def _adopt(self, new: Config, token: bytes | None = None) -> None:
        old = self.config
        self.config = new
        if new.web_config_file != old.web_config_file:
            log.warning(
                "web_config_file changed; TLS and basic auth change at the next start",
                extra={"kv": {"web_config_file": new.web_config_file or ""}},
            )
        if new.discovery != old.discovery or not new.discovery.enabled:
            self._discovery.found.clear()
        logs.set_level(new.log_level)
        if self.api_server is not None:
            self.api_server.max_connections = new.max_connections
        pipeline.warn_starved(new)
        self._apply(new)
        otlp = new.otlp_receiver
        self.otlp_receiver.configure(
            otlp.enabled, otlp.max_body_bytes, otlp.service_engines, bearer_token=token
        )
        self.state.count_reload("ok")
        log.info("config reloaded", extra={"kv": {"path": str(self.config_path)}})

    async def _rebind(self, host: str, port: int) -> None:
        try:
            await self._serve(host, port)
        except OSError as exc:
            kv = {"address": f"{host}:{port}", "listening": self._listen, "error": f"{exc!r}"}
            log.error("cannot listen on the reloaded address; keeping the old", extra={"kv": kv})

    # ---- HTTP ----------------------------------------------------------------------
    def _engine_labels(self) -> set[str]:
        """Engine labels the samplers report now (``kvpressure_engine_up``), for ``explain``."""
        return {
            v for labels in self.state.latest("kvpressure_engine_up") for k, v in labels
            if k == "engine"
        }  # fmt: skip

    async def _serve(self, listen_host: str, listen_port: int) -> None:
        """Serve the agent's HTTP API on ``listen_host:listen_port``, then close the old one.

        Raises:
            OSError: the address cannot be bound; the current listener (if any) stays.
        """
        routes = [
            *self.otlp_receiver.routes(),
            *attribution_routes(
                self.attributions,
                self.config.attribution.window_s,
                started=self.state.started,
                min_score=self.config.attribution.min_score,
                known_engines=self._engine_labels,
            ),
        ]
        middlewares = []
        if self.web is not None and self.web.auth_required:
            middlewares.append(self.web.middleware)
        server = HttpServer(
            f"api {listen_host}:{listen_port}",
            api_routes(self.state, self.registry, routes),
            middlewares,
            max_connections=self.config.max_connections,
        )
        ssl_context = self.web.ssl_context if self.web is not None else None
        self.bound_port = await server.start(listen_host, listen_port, ssl_context)
        old, self.api_server = self.api_server, server
        self._listen = f"{listen_host}:{listen_port}"
        self._listen_addr = (listen_host, listen_port)
        log.info("listening", extra={"kv": {"address": f"{listen_host}:{self.bound_port}"}})
        if old is not None:
            await old.close()

    # ---- main ----------------------------------------------------------------------
    async def run(self, ready: Callable[[], None] | None = None) -> None:
        """Run until SIGTERM/SIGINT (or :meth:`request_stop`).

        Args:
            ready: called once the HTTP listener is up and the samplers are started.

        Raises:
            OSError: the listen address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        install_accept_error_handler(loop)
        self._stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stopping.set)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        await self._serve(self.config.listen_host, self.config.listen_port)
        # A SIGTERM that came while the listener was being bound (signals are handled only
        # at awaits) stops the start-up here: no proxy or sampler is started only to be
        # stopped again.
        if not self._stopping.is_set():
            await self._proxies.apply(self.config)
        if not self._stopping.is_set():
            pipeline.warn_starved(self.config)
            self._apply(self.config)
        tasks = [
            asyncio.create_task(self._discovery_loop()),
            asyncio.create_task(self._watchdog()),
            asyncio.create_task(self.notifier.keepalive(self._all_stuck, self._status_line)),
        ]
        self.notifier.ready(self._status_line())
        if ready:
            ready()
        try:
            await self._stopping.wait()
        finally:
            log.info("shutting down")
            self.notifier.stopping()
            for t in tasks:
                t.cancel()
            await self._shutdown()

    def _on_hup(self) -> None:
        self.notifier.reloading()
        task = asyncio.get_running_loop().create_task(self.reload_async())
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    def _status_line(self) -> str:
        reports = self.state.reports()
        up = sum(1 for r in reports if r.ok)
        return f"listening on {self._listen}; {up}/{len(self._runners.runners)} samplers up"

    def _all_stuck(self) -> bool:
        reports = self.state.reports()
        return bool(reports) and all(r.reason == "timeout" for r in reports)

    def request_stop(self) -> None:
        """Ask :meth:`run` to return (thread-safe only from the loop's thread)."""
        if self._stopping is not None:
            self._stopping.set()

    async def _watchdog(self) -> None:
        while True:
            self._runners.check_timeouts(time.monotonic())
            await asyncio.sleep(0.1)

    async def _shutdown(self) -> None:
        await self._proxies.close()
        if self._export.export is not None:
            await asyncio.to_thread(self._export.export.shutdown, 0.5)
        runners = self._runners.stop()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for r in runners:
            await asyncio.to_thread(r.join, max(0.0, deadline - time.monotonic()))
        if self.api_server is not None:
            await self.api_server.close()
        self.notifier.close()
        log.info("stopped")
