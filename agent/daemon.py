"""The daemon: builds samplers from the config, runs each on its own schedule, serves HTTP.

Scheduling: every sampler runs on its own daemon thread (:class:`SamplerRunner`), starting
a collection every ``interval_s`` seconds (missed ticks are skipped, never queued). A
watchdog on the event loop marks a sampler down (``kvpressure_sampler_up 0``, reason
``timeout``) as soon as a collection runs past its ``timeout_s``; the stuck thread delays
nothing else, and its late result is discarded. The HTTP server (aiohttp), engine
auto-discovery and signal handling run on the asyncio loop.

Signals: SIGTERM/SIGINT stop the agent within 2 s; SIGHUP reloads the config file (an
invalid file is rejected with a logged error and the last good config keeps running).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psutil
from aiohttp import web

from agent import logs
from agent.api import attribution_routes, make_app
from agent.attribution.store import AttributionStore
from agent.config import Config, ConfigError, EngineConfig, load, read_token
from agent.listener import (
    IDLE_TIMEOUT_S,
    BoundedSite,
    ConnectionCap,
    ServerLog,
    install_accept_error_handler,
)
from agent.requests.metrics import RequestMetrics
from agent.requests.otlp_receiver import PATH as OTLP_PATH
from agent.requests.otlp_receiver import OtlpReceiver
from agent.requests.proxy import RequestProxy
from agent.requests.record import RequestStream
from agent.samplers.base import Sampler
from agent.samples import Batch
from agent.sdnotify import Notifier
from agent.state import AgentState, SamplerReport
from agent.timeline import Timeline
from agent.webconfig import WebSecurity, load_web_config
from exporters.prometheus import make_registry

if TYPE_CHECKING:
    from exporters.otlp import OtlpExport

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.5
PROXY_DRAIN_S = 3600.0
"""Longest a proxy removed by a reload waits for its requests in flight before closing."""


class SamplerRunner:
    """Runs one sampler on its own daemon thread and publishes its reports.

    Args:
        sampler: the sampler to run.
        state: where reports go.
        spec: a hashable description of how the sampler was built; the daemon keeps the
            runner across reloads when the spec is unchanged (so counter state survives).
    """

    def __init__(self, sampler: Sampler, state: AgentState, spec: object) -> None:
        self.sampler = sampler
        self.spec = spec
        self._state = state
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._main, name=f"sampler-{sampler.name}", daemon=True
        )
        self._lock = threading.Lock()
        self._running_since: float | None = None
        self._timed_out = False

    def start(self) -> None:
        """Start the sampler thread."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop after its current collection; does not wait."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread; True when it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def check_timeout(self, now: float) -> None:
        """Mark the sampler down if its current collection has run past its timeout."""
        with self._lock:
            since = self._running_since
            if since is None or self._timed_out or now - since <= self.sampler.timeout_s:
                return
            self._timed_out = True
        log.warning(
            "sampler timed out; its result will be discarded",
            extra={"kv": {"sampler": self.sampler.name, "timeout_s": self.sampler.timeout_s}},
        )
        self._state.publish(
            SamplerReport(self.sampler.name, time.time(), now - since, False, "timeout")
        )

    def collect_once(self) -> SamplerReport:
        """Run one collection now and return its report (also used by tests)."""
        ts = time.time()
        t0 = time.monotonic()
        batch = Batch()
        try:
            self.sampler.collect(batch)
        except Exception as exc:  # noqa: BLE001 - a sampler failure must not kill its thread
            dur = time.monotonic() - t0
            log.warning(
                "sampler failed",
                extra={
                    "kv": {"sampler": self.sampler.name, "error": f"{type(exc).__name__}: {exc}"}
                },
            )
            return SamplerReport(self.sampler.name, ts, dur, False, type(exc).__name__)
        return SamplerReport(self.sampler.name, ts, time.monotonic() - t0, True, "", batch)

    def _main(self) -> None:
        interval = self.sampler.interval_s
        next_t = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                self._running_since = time.monotonic()
                self._timed_out = False
            report = self.collect_once()
            with self._lock:
                self._running_since = None
                late = self._timed_out
            if not late and not self._stop.is_set():
                self._state.publish(report)
            next_t += interval
            now = time.monotonic()
            if next_t < now:  # skip missed ticks instead of bursting to catch up
                next_t = now + interval - ((now - next_t) % interval)
            self._stop.wait(next_t - now)
        with contextlib.suppress(Exception):
            self.sampler.close()


@dataclass(frozen=True)
class _EngineSpec:
    name: str
    url: str
    type: str
    interval_s: float


def _engine_cgroups(cfg: Config) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in cfg.engines:
        scope = e.cgroup or e.unit
        if scope:
            out[e.label] = scope
    return out


class _Once:
    def __init__(self, runners: dict[str, SamplerRunner], state: AgentState) -> None:
        self.runners = runners
        self.state = state

    def tick(self) -> None:
        order = sorted(
            self.runners,
            key=lambda n: (
                n not in ("host", "gpu") and not n.startswith("engine:"),
                not n.startswith("engine:"),
                n,
            ),
        )
        for name in order:
            self.state.publish(self.runners[name].collect_once())

    def close(self) -> None:
        for r in self.runners.values():
            r.sampler.close()


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
        probe: Callable[[str], str | None] | None = None,
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
        self.state = AgentState(
            Timeline(config.timeline.points_per_series, config.timeline.max_series)
        )
        self._registry = make_registry(self.state)
        self._runners: dict[str, SamplerRunner] = {}
        self._discovered: dict[str, EngineConfig] = {}
        self._probe = probe
        self._extra = {s.name: s for s in extra_samplers}
        self._stopping: asyncio.Event | None = None
        self._site_runner: web.AppRunner | None = None
        self._listen: str | None = None
        self._listen_addr: tuple[str, int] | None = None
        self.api_cap: ConnectionCap | None = None
        self.bound_port: int | None = None
        self.notifier = Notifier()
        # Per-request data: one stream, fed by the OTLP receiver and the proxies, read by
        # the request-metrics sampler (and the attribution engine, as its own consumer).
        self.request_stream = RequestStream()
        otlp = config.otlp_receiver
        self.otlp_receiver = OtlpReceiver(
            self.request_stream,
            otlp.max_body_bytes,
            otlp.service_engines,
            otlp.enabled,
            bearer_token=read_token(otlp.bearer_token_file) if otlp.bearer_token_file else None,
        )
        if self.web is not None:
            # With a bearer token the receiver checks its own clients: an exporter cannot
            # send basic auth and a bearer token in one Authorization header.
            self.web.exempt = self._otlp_checks_itself
        self.request_metrics = RequestMetrics(
            self.request_stream, [self.otlp_receiver], interval_s=config.interval_s
        )
        self.proxies: dict[str, RequestProxy] = {}
        self._proxies_lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        # Attribution: the store (history, slow counts) outlives sampler rebuilds on reload.
        self.attributions = AttributionStore(
            config.attribution.recent_requests, config.attribution.recent_attributions
        )
        self.otlp_export: OtlpExport | None = None
        self._otlp_spec: object = None

    @property
    def registry(self) -> object:
        """The Prometheus registry ``/metrics`` renders."""
        return self._registry

    def pipeline_once(self) -> _Once:
        """Build every stage the config asks for, to run tick by tick on the caller's thread."""
        self._apply_otlp_export(self.config)
        runners = {
            name: SamplerRunner(factory(), self.state, spec)
            for name, (spec, factory) in self._desired(self.config).items()
        }
        return _Once(runners, self.state)

    # ---- sampler set ---------------------------------------------------------------
    def _desired(self, cfg: Config) -> dict[str, tuple[object, Callable[[], Sampler]]]:
        """Return sampler name -> (spec, factory) for everything ``cfg`` asks for."""
        out: dict[str, tuple[object, Callable[[], Sampler]]] = {}
        for name, extra in self._extra.items():
            out[name] = (("extra", id(extra)), lambda s=extra: s)  # type: ignore[misc]
        if cfg.samplers.host.enabled:
            interval = cfg.samplers.host.interval_s or cfg.interval_s
            cgroups = _engine_cgroups(cfg)
            memory_cgroup = cfg.samplers.host.memory_cgroup
            spec = (
                "host",
                cfg.procfs_root,
                cfg.sysfs_root,
                tuple(sorted(cgroups.items())),
                interval,
                memory_cgroup,
            )

            def host_factory() -> Sampler:
                from agent.samplers.host import HostSampler

                return HostSampler(
                    procfs_root=cfg.procfs_root,
                    sysfs_root=cfg.sysfs_root,
                    engine_cgroups=cgroups,
                    interval_s=interval,
                    memory_cgroup=memory_cgroup,
                )

            out["host"] = (spec, host_factory)
        if cfg.samplers.gpu.enabled:
            gpu_interval = cfg.samplers.gpu.interval_s or cfg.interval_s
            gpu_spec = ("gpu", cfg.gpu, gpu_interval)  # GpuConfig is frozen: hashable

            def gpu_factory() -> Sampler:
                from agent.podresources import make_client
                from agent.samplers.gpu import GpuSampler

                socket = cfg.gpu.pod_resources_socket
                return GpuSampler(
                    binding=cfg.gpu.binding,
                    interval_s=gpu_interval,
                    thresholds=cfg.gpu,
                    state_view=self.state.latest,
                    engine_pids=self._engine_pids,
                    pod_names=make_client(socket) if socket else None,
                )

            out["gpu"] = (gpu_spec, gpu_factory)
        if cfg.samplers.engines.enabled:
            interval = cfg.samplers.engines.interval_s or cfg.interval_s
            for e in [*cfg.engines, *self._discovered.values()]:
                espec = _EngineSpec(e.label, e.url, e.type, interval)

                def engine_factory(s: _EngineSpec = espec) -> Sampler:
                    from agent.samplers.engines import make_engine_sampler

                    return make_engine_sampler(
                        name=s.name, url=s.url, engine_type=s.type, interval_s=s.interval_s
                    )

                out[f"engine:{e.label}"] = (espec, engine_factory)
        req_interval = cfg.interval_s

        def requests_factory() -> Sampler:
            self.request_metrics.interval_s = req_interval  # same object: counts survive
            self.request_metrics.timeout_s = max(req_interval, 2.0)
            return self.request_metrics

        out["requests"] = (("requests", req_interval), requests_factory)
        if cfg.samplers.capacity.enabled:
            cap_interval = cfg.samplers.capacity.interval_s or cfg.interval_s
            cap_spec = ("capacity", cap_interval, cfg.capacity.model_dump_json())

            def capacity_factory() -> Sampler:
                from agent.capacity.live import CapacitySampler, ModelSource

                return CapacitySampler(
                    self.state,
                    interval_s=cap_interval,
                    window_s=cfg.capacity.window_s,
                    models={
                        k: ModelSource(m.model, m.kv_dtype) for k, m in cfg.capacity.engines.items()
                    },
                    auto_gguf=cfg.capacity.auto_gguf,
                    stream=self.request_stream,  # consumer "capacity": the latency knee
                )

            out["capacity"] = (cap_spec, capacity_factory)
        out.update(self._attribution_samplers(cfg))
        return out

    def _attribution_samplers(self, cfg: Config) -> dict[str, tuple[object, Callable[[], Sampler]]]:
        """The ``attribution`` sampler and, with OTLP export on, the ``otlp-export`` one."""
        out: dict[str, tuple[object, Callable[[], Sampler]]] = {}
        export = self.otlp_export
        if export is not None:
            from exporters.otlp import OtlpExportSampler

            out["otlp-export"] = (
                ("otlp-export", id(export), cfg.interval_s),
                lambda: OtlpExportSampler(export, cfg.interval_s),
            )
        acfg = cfg.attribution
        if not acfg.enabled:
            return out
        intervals = [cfg.interval_s, cfg.samplers.host.interval_s, cfg.samplers.engines.interval_s]
        settle = acfg.settle_s if acfg.settle_s is not None else 2 * max(i or 0 for i in intervals)

        def factory() -> Sampler:
            from agent.attribution import make_sampler

            return make_sampler(
                acfg, self.request_stream, self.state.timeline, self.attributions,
                interval_s=cfg.interval_s, settle_s=settle, span_sink=export,
            )  # fmt: skip

        return {**out, "attribution": (("attribution", acfg, settle, id(export)), factory)}

    def _apply_otlp_export(self, cfg: Config) -> None:
        """Start, keep or replace the OTLP exporter so it matches ``cfg.otlp_export``."""
        spec = cfg.otlp_export if cfg.otlp_export.endpoint else None
        key = (spec, cfg.attribution.span_parent) if spec is not None else None
        if key == self._otlp_spec:
            return
        old, self.otlp_export, self._otlp_spec = self.otlp_export, None, key
        if old is not None:
            old.shutdown(0.5)
        if spec is None:
            return
        from exporters.otlp import OtlpExport

        self.otlp_export = OtlpExport(
            self.state, spec.endpoint, spec.headers, spec.interval_s, spec.queue_size,
            spec.timeout_s, cfg.attribution.span_parent, export_metrics=spec.metrics,
        )  # fmt: skip
        self.otlp_export.start()
        log.info("OTLP export on", extra={"kv": {"endpoint": spec.endpoint}})

    def _engine_pids(self) -> dict[int, str]:
        """Map the PID listening on each local engine's port to the engine's name.

        Source: ``psutil.net_connections(kind="tcp")`` (``/proc/net/tcp*`` and each
        process's fds); only engines on loopback addresses can be resolved. Returns ``{}``
        when the connections cannot be read (no permission, no procfs).
        """
        ports: dict[int, str] = {}
        for e in [*self.config.engines, *self._discovered.values()]:
            parts = urlsplit(e.url)
            if parts.hostname in ("127.0.0.1", "localhost", "::1") and parts.port:
                ports[parts.port] = e.label
        if not ports:
            return {}
        try:
            conns = psutil.net_connections(kind="tcp")
        except (psutil.Error, OSError):
            return {}
        return {
            c.pid: ports[c.laddr.port]
            for c in conns
            if c.pid and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports
        }

    def _apply(self, cfg: Config) -> None:
        """Start, keep or stop runners so they match ``cfg``."""
        self._apply_otlp_export(cfg)
        desired = self._desired(cfg)
        for name in list(self._runners):
            if name not in desired or desired[name][0] != self._runners[name].spec:
                runner = self._runners.pop(name)
                runner.stop()
                self.state.remove(name)
                log.info("sampler stopped", extra={"kv": {"sampler": name}})
        for name, (spec, factory) in desired.items():
            if name in self._runners:
                continue
            try:
                sampler = factory()
            except Exception as exc:  # noqa: BLE001 - one bad sampler must not stop the rest
                log.error(
                    "sampler could not be created",
                    extra={"kv": {"sampler": name, "error": f"{type(exc).__name__}: {exc}"}},
                )
                self.state.publish(SamplerReport(name, time.time(), 0.0, False, "init"))
                continue
            runner = SamplerRunner(sampler, self.state, spec)
            self._runners[name] = runner
            runner.start()
            log.info(
                "sampler started",
                extra={"kv": {"sampler": name, "interval_s": sampler.interval_s}},
            )

    # ---- discovery -----------------------------------------------------------------
    async def _discover_once(self) -> None:
        cfg = self.config
        if not (cfg.discovery.enabled and cfg.samplers.engines.enabled):
            return
        probe = self._probe
        if probe is None:
            from agent.samplers.engines import probe as default_probe

            probe = default_probe
        known = {e.instance for e in cfg.engines} | {e.instance for e in self._discovered.values()}
        names = {e.label for e in cfg.engines} | set(self._discovered)
        changed = False
        for port in cfg.discovery.ports:
            url = f"http://{cfg.discovery.host}:{port}"
            if f"{cfg.discovery.host}:{port}" in known:
                continue
            try:
                kind = await asyncio.to_thread(probe, url)
            except Exception:  # noqa: BLE001 - a probe error means "nothing there"
                kind = None
            if not kind:
                continue
            name = kind if kind not in names else f"{kind}-{port}"
            names.add(name)
            self._discovered[name] = EngineConfig(url=url, type=kind, name=name)  # type: ignore[arg-type]
            log.info("engine discovered", extra={"kv": {"engine": name, "url": url, "type": kind}})
            changed = True
        if changed:
            self._apply(cfg)

    async def _discovery_loop(self) -> None:
        while True:
            try:
                await self._discover_once()
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
                await self._apply_proxies(new)
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

    def _otlp_checks_itself(self, request: web.Request) -> bool:
        """True for ``/v1/traces`` while the OTLP receiver has a bearer token."""
        return request.path == OTLP_PATH and self.otlp_receiver.bearer_token is not None

    def _adopt(self, new: Config, token: bytes | None = None) -> None:
        old = self.config
        self.config = new
        if new.web_config_file != old.web_config_file:
            log.warning(
                "web_config_file changed; TLS and basic auth change at the next start",
                extra={"kv": {"web_config_file": new.web_config_file or ""}},
            )
        if new.discovery != old.discovery or not new.discovery.enabled:
            self._discovered.clear()
        logs.set_level(new.log_level)
        if self.api_cap is not None:
            self.api_cap.max_connections = new.max_connections
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
            log.error(
                "cannot listen on the reloaded address; still listening on the old one",
                extra={
                    "kv": {
                        "address": f"{host}:{port}",
                        "listening": self._listen,
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                },
            )

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
        cap = ConnectionCap(f"api {listen_host}:{listen_port}", self.config.max_connections)
        middlewares = [cap.middleware]
        if self.web is not None and self.web.auth_required:
            middlewares.append(self.web.middleware)
        app = make_app(self.state, self._registry, routes, middlewares=middlewares)
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=0.5,
            keepalive_timeout=IDLE_TIMEOUT_S,
            logger=ServerLog(cap.name),
        )
        await runner.setup()
        ssl_context = self.web.ssl_context if self.web is not None else None
        site = BoundedSite(runner, listen_host, listen_port, cap, ssl_context)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        old, self._site_runner = self._site_runner, runner
        self.api_cap = cap
        self._listen = f"{listen_host}:{listen_port}"
        self._listen_addr = (listen_host, listen_port)
        self.bound_port = site.port
        log.info("listening", extra={"kv": {"address": f"{listen_host}:{self.bound_port}"}})
        if old is not None:
            await old.cleanup()

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
            await self._apply_proxies(self.config)
        if not self._stopping.is_set():
            self._apply(self.config)
        tasks = [
            asyncio.create_task(self._discovery_loop()),
            asyncio.create_task(self._watchdog()),
            asyncio.create_task(self._systemd_loop()),
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
        return f"listening on {self._listen}; {up}/{len(self._runners)} samplers up"

    async def _systemd_loop(self) -> None:
        """Send WATCHDOG=1 at half of WatchdogSec, and a STATUS= line every 10 s.

        The ping is skipped while every sampler is timed out, so systemd restarts an agent
        whose samplers are all wedged (a hung driver call) rather than one that is merely
        busy.
        """
        if not self.notifier.enabled:
            return
        interval = self.notifier.watchdog_interval_s or 10.0
        last_status = 0.0
        while True:
            reports = self.state.reports()
            all_stuck = bool(reports) and all(r.reason == "timeout" for r in reports)
            if self.notifier.watchdog_interval_s and not all_stuck:
                self.notifier.watchdog()
            now = time.monotonic()
            if now - last_status >= 10.0:
                self.notifier.status(self._status_line())
                last_status = now
            await asyncio.sleep(min(interval, 10.0))

    def request_stop(self) -> None:
        """Ask :meth:`run` to return (thread-safe only from the loop's thread)."""
        if self._stopping is not None:
            self._stopping.set()

    async def _watchdog(self) -> None:
        while True:
            now = time.monotonic()
            for r in list(self._runners.values()):
                r.check_timeout(now)
            await asyncio.sleep(0.1)

    async def _apply_proxies(self, cfg: Config) -> None:
        """Start, reconfigure or stop request proxies so they match ``cfg.proxies``.

        A proxy whose ``listen`` stays is reconfigured in place (its listener stays open;
        requests in flight finish on the old settings). New addresses are bound first; then
        proxies whose ``listen`` went stop listening at once and finish their requests in
        flight in the background. When a new address cannot be bound (e.g. a port typo),
        the error is logged and the proxies this reload would have removed keep serving, so
        a bad reload does not leave clients without a proxy. Reloads apply one after
        another, in the order they came.
        """
        async with self._proxies_lock:
            wanted = {p.listen: p for p in cfg.proxies}
            all_bound = True
            for listen, p in wanted.items():
                kept = self.proxies.get(listen)
                if kept is not None:
                    kept.cap.max_connections = cfg.max_connections
                    spec = (p.listen, p.upstream, p.engine, p.connect_timeout_s, p.preconnect)
                    if spec != kept.spec:
                        await kept.reconfigure(
                            p.upstream, p.engine, p.connect_timeout_s, p.preconnect
                        )
                    continue
                proxy = RequestProxy(
                    p.listen,
                    p.upstream,
                    p.engine,
                    self.request_stream,
                    p.connect_timeout_s,
                    preconnect=p.preconnect,
                    max_client_connections=cfg.max_connections,
                )
                try:
                    await proxy.start()
                except OSError as exc:
                    all_bound = False
                    log.error(
                        "proxy could not listen",
                        extra={"kv": {"listen": listen, "error": f"{type(exc).__name__}: {exc}"}},
                    )
                    continue
                self.proxies[listen] = proxy
            gone = [listen for listen in self.proxies if listen not in wanted]
            if gone and not all_bound:
                log.error(
                    "proxies kept until a reload binds every new address",
                    extra={"kv": {"listen": ",".join(gone)}},
                )
                return
            for listen in gone:
                proxy = self.proxies.pop(listen)
                await proxy.stop_listening()
                log.info("proxy stopped listening", extra={"kv": {"listen": listen}})
                task = asyncio.get_running_loop().create_task(self._retire_proxy(proxy))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def _retire_proxy(self, proxy: RequestProxy) -> None:
        try:
            await proxy.drain(PROXY_DRAIN_S)
        finally:  # also when the agent's stop cancels the drain
            await proxy.close()
        log.info("proxy stopped", extra={"kv": {"listen": proxy.listen}})

    async def _shutdown(self) -> None:
        # Proxies still draining after a reload stop draining: every proxy gets the same
        # short grace (RequestProxy.close), so the stop stays within SHUTDOWN_GRACE_S-ish.
        for task in self._retiring:
            task.cancel()
        await asyncio.gather(
            *self._retiring,
            *(proxy.close() for proxy in self.proxies.values()),
            return_exceptions=True,
        )
        self.proxies.clear()
        if self.otlp_export is not None:
            await asyncio.to_thread(self.otlp_export.shutdown, 0.5)
        runners = list(self._runners.values())
        for r in runners:
            r.stop()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for r in runners:
            await asyncio.to_thread(r.join, max(0.0, deadline - time.monotonic()))
        if self._site_runner is not None:
            await self._site_runner.cleanup()
        self.notifier.close()
        log.info("stopped")
