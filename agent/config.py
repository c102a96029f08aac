"""Agent configuration: a YAML file validated with pydantic, and an embedded default.

``load(path)`` returns a :class:`Config` or raises :class:`ConfigError` whose message names
the file, the field path and what was expected, e.g.::

    /etc/kvpressure/kvpressure.yaml: engines[0].type: expected one of 'auto', 'vllm', ...

Durations accept seconds as a number or a string with a unit (``"250ms"``, ``"1s"``,
``"2m"``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import stat
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES: Final = 1024 * 1024
"""A config file larger than this (1 MiB; the shipped one is ~1.5 KiB) is refused unread."""

EngineType = Literal[
    "auto", "vllm", "sglang", "llamacpp", "tgi", "trtllm", "triton", "lmcache", "kvbm"
]
"""``auto`` and the keys of :data:`agent.samplers.engines.ENGINE_TYPES` (a test keeps them
equal: a new engine type is its mapping module, one line in the registry and one here)."""
ENGINE_TYPES: tuple[str, ...] = get_args(EngineType)

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _duration(value: Any) -> Any:
    """Turn ``"250ms"``/``"1s"``/``"2m"`` into seconds; numbers pass through."""
    if isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            raise ValueError("expected a duration such as 1, 0.5, '250ms', '1s' or '2m'")
        return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    return value


Seconds = Annotated[float, BeforeValidator(_duration)]


class ConfigError(Exception):
    """A configuration file could not be read or is invalid; the message says where and why."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplerToggle(_Model):
    """On/off switch and optional own interval for one sampler."""

    enabled: bool = True
    interval_s: Seconds | None = Field(default=None, ge=0.1, le=3600)


class HostSamplerConfig(SamplerToggle):
    """The host sampler's switch, interval and memory view.

    Attributes:
        memory_cgroup: ``self`` caps effective memory at the agent's own cgroup and its
            ancestors (agent inside the engine's container); ``none`` uses /proc/meminfo
            alone (agent in its own systemd unit or pod with a small memory limit).
    """

    memory_cgroup: Literal["self", "none"] = "self"


class EnginesSamplerConfig(SamplerToggle):
    """The engine samplers' switch, interval, and the fast path for their gauges.

    Attributes:
        gauges_interval_s: seconds between reads of each engine's KV-cache usage and
            running/waiting requests alone, between the full scrapes every ``interval_s``
            (:class:`agent.samplers.engines.base.EngineGaugeSampler`); ``null`` (default):
            no fast path, those gauges come with the full scrape.
    """

    gauges_interval_s: Seconds | None = Field(default=None, ge=0.05, le=3600)


class SamplersConfig(_Model):
    """Which stages run: one ``enabled``/``interval_s`` switch per registered stage.

    The keys are the names in the pipeline registry (:mod:`agent.pipeline`; a test keeps them
    equal). ``interval_s`` defaults to the global ``interval_s``; ``accelerator`` runs right
    after each GPU report whatever its interval; ``capacity``, whose inputs are engine
    samples, defaults to the slower of the global and the ``engines`` interval.
    """

    host: HostSamplerConfig = HostSamplerConfig()
    gpu: SamplerToggle = SamplerToggle()
    engines: EnginesSamplerConfig = EnginesSamplerConfig()
    accelerator: SamplerToggle = SamplerToggle()
    requests: SamplerToggle = SamplerToggle()
    capacity: SamplerToggle = SamplerToggle()
    attribution: SamplerToggle = SamplerToggle()


DEPRECATED_SWITCHES: Final = {("attribution", "enabled"): ("samplers", "attribution", "enabled")}
"""Old switches still read (with a warning): ``attribution.enabled``."""


class GpuConfig(_Model):
    """The GPU sampler's NVML binding and accelerator-stall thresholds.

    Attributes:
        binding: ``nvml`` (the real library from nvidia-ml-py) or ``fake:<profile>`` (a
            recorded-behaviour fake for tests and demos, e.g. ``fake:h200``), where the
            profile is a bundled name or a profile file's path
            (``fake:/path/profile.yaml``, e.g. one written by ``kvpressure gpu record``).
        idle_utilization_below: a GPU whose utilization ratio is below this while its
            engine has requests waiting is stalled ``idle_with_queue``.
        memory_bound_bandwidth_above: bandwidth utilization ratio above which, with SM
            occupancy below ``memory_bound_sm_below``, the GPU is stalled ``memory_bound``.
        memory_bound_sm_below: see above.
        data_movement_window_s: window for bytes-per-token and tokens-per-byte.
        pod_resources_socket: the kubelet's pod-resources socket
            (``/var/lib/kubelet/pod-resources/kubelet.sock``, mounted into the agent's pod);
            when set, per-process GPU memory of a process in a pod gets ``namespace``,
            ``pod`` and ``container`` from the kubelet's assignment of that GPU (needs the
            ``kubernetes`` extra, ``grpcio``). ``None``: off.
    """

    binding: str = Field(default="nvml", pattern=r"^(nvml|fake:.+)$")
    idle_utilization_below: float = Field(default=0.10, ge=0, le=1)
    memory_bound_bandwidth_above: float = Field(default=0.60, ge=0, le=1)
    memory_bound_sm_below: float = Field(default=0.30, ge=0, le=1)
    data_movement_window_s: Seconds = Field(default=30.0, ge=1, le=3600)
    pod_resources_socket: str | None = None

    @field_validator("binding")
    @classmethod
    def _check_binding(cls, v: str) -> str:
        if v.startswith("fake:"):
            from kvpressure.agent.samplers.fake_nvml import load_profile

            try:
                load_profile(v.removeprefix("fake:"))
            except (OSError, ValueError, yaml.YAMLError) as exc:
                raise ValueError(str(exc)) from None
        return v


class EngineConfig(_Model):
    """One inference engine to scrape.

    Attributes:
        url: base URL of the engine's HTTP server, e.g. ``http://127.0.0.1:8000``.
        type: engine kind; ``auto`` detects it from the metric prefixes.
        name: the ``engine`` label value; defaults to the type (or ``engine`` for auto).
        cgroup: cgroup v2 path (relative to /sys/fs/cgroup) whose PSI and memory (charge,
            limits, limit events) are reported with ``scope=<name>``.
        unit: systemd unit whose cgroup is used instead of ``cgroup``.
    """

    url: str
    type: EngineType = "auto"
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    cgroup: str | None = None
    unit: str | None = Field(default=None, pattern=r"^[A-Za-z0-9@_.:-]+\.(service|scope|slice)$")

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http(s) URL such as http://127.0.0.1:8000")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _one_scope(self) -> EngineConfig:
        if self.cgroup and self.unit:
            raise ValueError("set cgroup or unit, not both")
        return self

    @property
    def label(self) -> str:
        """The ``engine`` label value."""
        return self.name or (self.type if self.type != "auto" else "engine")

    @property
    def instance(self) -> str:
        """The ``instance`` label value (host:port)."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"


class DiscoveryConfig(_Model):
    """Auto-discovery of engines listening on loopback."""

    enabled: bool = True
    host: str = "127.0.0.1"
    ports: list[Annotated[int, Field(ge=1, le=65535)]] = [8000, 8080, 30000, 3000, 8002]
    interval_s: Seconds = Field(default=60.0, ge=1, le=86400)


class TimelineConfig(_Model):
    """Bounds of the in-memory timeline."""

    points_per_series: int = Field(default=1024, ge=16, le=1_000_000)
    max_series: int = Field(default=20000, ge=100, le=1_000_000)


def _check_host_port(v: str) -> str:
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected host:port such as 127.0.0.1:9470")
    return v


EngineLabel = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class ProxyConfig(_Model):
    """One streaming reverse proxy in front of an engine (``agent/requests/proxy.py``).

    Attributes:
        listen: ``host:port`` the proxy listens on; clients send their requests here.
        upstream: base URL of the engine, e.g. ``http://127.0.0.1:8080``.
        engine: the ``engine`` label of the proxied requests' metrics.
        connect_timeout_s: upstream TCP connect timeout; past it the client gets a 502
            and the request counts as ``upstream_down``.
        preconnect: after a request that needed a new upstream connection, open one spare
            connection for the next request (engines such as llama.cpp close the
            connection after every streamed response, so each request would otherwise wait
            for a connect); costs the engine one idle connection for up to 4 s.
    """

    listen: str
    upstream: str
    engine: EngineLabel
    connect_timeout_s: Seconds = Field(default=5.0, gt=0, le=60)
    preconnect: bool = True

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        return _check_host_port(v)

    @field_validator("upstream")
    @classmethod
    def _check_upstream(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http(s) URL such as http://127.0.0.1:8080")
        return v.rstrip("/")


class OtlpReceiverConfig(_Model):
    """The OTLP/HTTP trace receiver at ``/v1/traces`` on the agent's listener.

    Attributes:
        enabled: serve ``/v1/traces`` (404 when off).
        max_body_bytes: largest accepted export, compressed and decompressed (413 above).
        service_engines: resource ``service.name`` → ``engine`` label, e.g.
            ``{vllm-prod: vllm}``; spans of other services are labelled by their
            ``gen_ai.provider.name``/``gen_ai.system`` or the engine kind.
        bearer_token_file: a file holding the token exporters must send as
            ``Authorization: Bearer <token>`` (401 otherwise); read at start and at each
            reload (:func:`read_token`). Without it the receiver takes any export that
            reaches the listener (or passes its web-config basic auth).
    """

    enabled: bool = True
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    service_engines: dict[str, EngineLabel] = {}
    bearer_token_file: str | None = None


class AttributionConfig(_Model):
    """Slow-request detection and cause attribution (``agent/attribution/``).

    A request is slow when one of its phases (queue, prefill per uncached prompt token,
    time per output token, longest inter-token gap) costs more than a request of its size
    costs on this engine now: above ``max(baseline_factor x p<baseline_quantile> of the
    ratio value/expected, 1 + baseline_floor_s/expected) x expected``, the expected cost
    being a robust fit over the engine's last ``baseline_requests`` requests whose phase
    was not slow; or when its TTFT, TPOT or (without a TTFT) end-to-end latency exceeds
    its SLO. Before ``baseline_min_requests`` are known only the SLOs apply
    (``agent/attribution/detector.py``).

    Attributes:
        slo_ttft_s: TTFT objective, seconds.
        slo_e2e_s: end-to-end objective for requests without a TTFT, seconds.
        slo_tpot_s: time-per-output-token objective (decode seconds per token after the
            first), seconds.
        baseline_quantile: tail quantile of the rolling baseline.
        baseline_factor: multiplier on that quantile.
        baseline_requests: requests kept per engine and phase for the baseline.
        baseline_min_requests: requests needed before the baseline applies (warm-up).
        baseline_floor_s: lowest baseline threshold, seconds.
        lead_in_s: seconds before a request's start that its attribution reads too.
        window_s: length of the attributed windows (dashboards, ``explain``).
        settle_s: records are attributed once they ended this long ago; default: twice the
            longest interval of the sources that run (host, gpu, engines; the host's
            counters count as 1 s when it samples faster: it reads them once a second), so
            the sample covering the request's end exists.
        min_score: lowest score that names a primary cause (else ``unknown``).
        cold_start_s: slow requests this long after an engine restart are the restart's.
        span_parent: ``child`` of the source span, or a new trace with a ``link`` to it.
        recent_requests: request summaries kept for ``explain``.
        recent_attributions: slow-request attributions kept for ``explain``.
        thresholds: per-rule ``[threshold, saturation]`` overrides (rule names and defaults
            in ``agent/attribution/rules.py`` and the README).
    """

    slo_ttft_s: Seconds = Field(default=2.0, gt=0, le=3600)
    slo_e2e_s: Seconds = Field(default=30.0, gt=0, le=86400)
    slo_tpot_s: Seconds = Field(default=0.5, gt=0, le=3600)
    baseline_quantile: float = Field(default=0.99, gt=0, lt=1)
    baseline_factor: float = Field(default=1.5, ge=1, le=100)
    baseline_requests: int = Field(default=500, ge=10, le=100_000)
    baseline_min_requests: int = Field(default=30, ge=1, le=100_000)
    baseline_floor_s: Seconds = Field(default=0.05, ge=0, le=3600)
    lead_in_s: Seconds = Field(default=2.0, ge=0, le=600)
    window_s: Seconds = Field(default=10.0, ge=1, le=3600)
    settle_s: Seconds | None = Field(default=None, ge=0, le=600)
    min_score: float = Field(default=0.3, gt=0, le=1)
    cold_start_s: Seconds = Field(default=60.0, ge=0, le=3600)
    span_parent: Literal["child", "link"] = "child"
    recent_requests: int = Field(default=20000, ge=100, le=10_000_000)
    recent_attributions: int = Field(default=5000, ge=10, le=1_000_000)
    thresholds: dict[str, tuple[float, float]] = {}


class OtlpExportConfig(_Model):
    """OTLP/HTTP export of attribution spans and the metric catalogue (``exporters/otlp.py``).

    Attributes:
        endpoint: OTLP/HTTP base URL (``/v1/traces``, ``/v1/metrics`` are appended); empty
            turns export off.
        headers: extra HTTP headers, e.g. ``{authorization: "Bearer ..."}``.
        interval_s: metric export interval.
        queue_size: spans held while the endpoint is slow or down; beyond it the oldest are
            dropped and counted in ``kvpressure_otlp_export_dropped_total``.
        timeout_s: per-export timeout (retries included).
        metrics: export the metric snapshot too (spans are always exported).
    """

    endpoint: str = ""
    headers: dict[str, str] = {}
    interval_s: Seconds = Field(default=15.0, ge=1, le=3600)
    queue_size: int = Field(default=2048, ge=1, le=1_000_000)
    timeout_s: Seconds = Field(default=5.0, gt=0, le=120)
    metrics: bool = True

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, v: str) -> str:
        if v:
            parts = urlsplit(v)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("expected an http(s) URL such as http://127.0.0.1:4318")
        return v.rstrip("/")


class CapacityModelConfig(_Model):
    """The model an engine serves, for KV bytes per token (``agent/capacity``).

    Attributes:
        model: a ``.gguf`` file, a Hugging Face ``config.json``, or its directory.
        kv_dtype: the engine's KV dtype (``auto`` = the config's dtype, or ``f16`` for a
            GGUF as llama.cpp defaults; ``fp8``, ``bf16``, ``q8_0``, ...).
    """

    model: str
    kv_dtype: str = "auto"

    @field_validator("kv_dtype")
    @classmethod
    def _lower_dtype(cls, v: str) -> str:
        return v.lower()  # known names are checked by the capacity stage (pipeline check)


class CapacityConfig(_Model):
    """The derived capacity sampler (headroom, saturation, knee, reuse savings).

    Attributes:
        window_s: window of the used-token growth rate and the measured prefill rate.
        auto_gguf: read a llama.cpp engine's ``model_path`` as a GGUF for bytes per token.
        engines: ``engine`` label to the model it serves, e.g.
            ``{vllm: {model: /models/llama-3.1-8b/config.json, kv_dtype: fp8}}``.
    """

    window_s: Seconds = Field(default=60.0, ge=5, le=3600)
    auto_gguf: bool = True
    engines: dict[EngineLabel, CapacityModelConfig] = {}


class Config(_Model):
    """The whole agent configuration (see ``agent/default.yaml`` for the defaults)."""

    listen: str = "127.0.0.1:9470"
    max_connections: int = Field(default=1000, ge=1, le=100_000)
    web_config_file: str | None = None
    interval_s: Seconds = Field(default=1.0, ge=0.1, le=3600)
    procfs_root: str = "/proc"
    sysfs_root: str = "/sys"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    samplers: SamplersConfig = SamplersConfig()
    engines: list[EngineConfig] = []
    discovery: DiscoveryConfig = DiscoveryConfig()
    timeline: TimelineConfig = TimelineConfig()
    gpu: GpuConfig = GpuConfig()
    proxies: list[ProxyConfig] = []
    otlp_receiver: OtlpReceiverConfig = OtlpReceiverConfig()
    capacity: CapacityConfig = CapacityConfig()
    attribution: AttributionConfig = AttributionConfig()
    otlp_export: OtlpExportConfig = OtlpExportConfig()

    @model_validator(mode="before")
    @classmethod
    def _deprecated_switches(cls, data: Any) -> Any:
        """Move ``attribution.enabled`` to ``samplers.attribution.enabled``, with a warning."""
        if not isinstance(data, dict):
            return data
        for (section, key), (top, stage, new) in DEPRECATED_SWITCHES.items():
            sec = data.get(section)
            if not isinstance(sec, dict) or key not in sec:
                continue
            sec = dict(sec)
            value = sec.pop(key)
            samplers = dict(data.get(top) or {}) if isinstance(data.get(top), dict) else {}
            toggle = samplers.get(stage)
            toggle = dict(toggle) if isinstance(toggle, dict) else {}
            if new in toggle:
                log.warning("%s.%s is deprecated and ignored: %s.%s.%s is set",
                            section, key, top, stage, new)  # fmt: skip
            else:
                log.warning("%s.%s is deprecated; use %s.%s.%s", section, key, top, stage, new)
                toggle[new] = value
            samplers[stage] = toggle
            data = {**data, section: sec, top: samplers}
        return data

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("expected host:port such as 127.0.0.1:9470")
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> Config:
        seen: set[str] = {"system"}  # "system" is the PSI scope of the whole host
        for i, e in enumerate(self.engines):
            if e.label in seen:
                raise ValueError(f"engines[{i}]: engine name {e.label!r} is used twice; set name")
            seen.add(e.label)
        return self

    @model_validator(mode="after")
    def _unique_proxy_listens(self) -> Config:
        taken: list[str] = []
        for i, p in enumerate(self.proxies):
            if listen_overlaps(p.listen, self.listen):
                raise ValueError(
                    f"proxies[{i}]: listen {p.listen!r} is the agent's own address "
                    f"(listen {self.listen!r}); give the proxy another port"
                )
            if any(listen_overlaps(p.listen, t) for t in taken):
                raise ValueError(f"proxies[{i}]: listen {p.listen!r} is already used")
            taken.append(p.listen)
        return self

    @property
    def listen_host(self) -> str:
        """The host part of ``listen`` (brackets of an IPv6 literal removed)."""
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def listen_port(self) -> int:
        """The port part of ``listen``."""
        return int(self.listen.rpartition(":")[2])


_WILDCARD_HOSTS: Final = frozenset({"", "*", "0.0.0.0", "::"})
_LOOPBACK_NAMES: Final = {"localhost": "127.0.0.1", "ip6-localhost": "::1"}


def _endpoint(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]").lower()
    host = _LOOPBACK_NAMES.get(host, host)
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host))  # "::0001" and "::1" are one address
    return host, int(port) if port.isdigit() else -1


def listen_overlaps(a: str, b: str) -> bool:
    """Return True when two ``host:port`` listen addresses would take the same socket.

    Args:
        a: ``host:port`` (IPv6 in brackets).
        b: ``host:port``.

    Returns:
        True when the ports are equal and not 0 (an ephemeral port never clashes) and the
        hosts are the same address (``localhost`` is ``127.0.0.1``) or either is a wildcard
        (``0.0.0.0``, ``::``, empty), which binds every address.
    """
    (ha, pa), (hb, pb) = _endpoint(a), _endpoint(b)
    if pa != pb or pa <= 0:
        return False
    return ha == hb or ha in _WILDCARD_HOSTS or hb in _WILDCARD_HOSTS


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _expected(err: Any) -> str:
    msg = str(err["msg"])
    if err["type"] == "extra_forbidden":
        return "unknown setting (check the spelling; see the configuration reference)"
    if msg.startswith("Input should be "):
        return "expected " + msg.removeprefix("Input should be ")
    return msg.removeprefix("Value error, ")


def parse(text: str, source: str = "<string>") -> Config:
    """Parse and validate YAML configuration text.

    Args:
        text: the YAML document; an empty document means all defaults.
        source: the file name used in error messages.

    Raises:
        ConfigError: the YAML is malformed or a field is invalid. The message has one line
            per problem: ``<source>: <field path>: <what was expected>``.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(unknown line)"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: {where}: invalid YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{source}: (top level): invalid YAML: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer beyond Python's 4,300-digit limit
        raise ConfigError(f"{source}: (top level): invalid YAML: {str(exc)[:120]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: (top level): expected a mapping of settings")
    try:
        return _validate(data, source)
    except RecursionError:
        raise ConfigError(f"{source}: (top level): nested too deeply") from None


def _validate(data: Any, source: str) -> Config:
    """Validate ``data`` as a :class:`Config`, then run the stages' own checks.

    Raises:
        ConfigError: one line per problem, ``<source>: <field path>: <message>``.
    """
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: {_loc(e['loc'])}: {_expected(e)}" for e in exc.errors()]
        raise ConfigError("\n".join(lines)) from None
    from kvpressure.agent.pipeline import check_config  # the registry, not the stages, is imported

    problems = check_config(cfg)
    if problems:
        raise ConfigError("\n".join(f"{source}: {path}: {msg}" for path, msg in problems))
    return cfg


def read_text(path: str | Path, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """Read a config file's text, refusing anything that is not a small regular file.

    The file is opened non-blocking (a FIFO does not wait for a writer) and checked with
    ``fstat`` before any read, so a FIFO, a device (``/dev/zero``), a socket or a directory
    is refused at once; at most ``max_bytes + 1`` bytes are ever read.

    Args:
        path: the file.
        max_bytes: the largest file accepted, in bytes.

    Returns:
        The file's text (UTF-8).

    Raises:
        ConfigError: one line: the file cannot be opened, is not a regular file, is larger
            than ``max_bytes``, or is not UTF-8.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{path}: cannot read: not a regular file ({_file_kind(mode)})")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ConfigError(f"{path}: cannot read: larger than {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read: not UTF-8 (byte {exc.start})") from None


MAX_TOKEN_BYTES: Final = 4096
"""Largest bearer-token file read (:func:`read_token`)."""


def read_token(path: str | Path) -> bytes:
    """Read a bearer token: the file's text with surrounding whitespace removed.

    Args:
        path: a regular file of at most :data:`MAX_TOKEN_BYTES` (e.g. a mounted Secret).

    Returns:
        The token as UTF-8 bytes (compared in constant time by its user).

    Raises:
        ConfigError: the file is unreadable, not a regular file, too large, not UTF-8,
            empty, or the token holds whitespace or control characters (which no
            ``Authorization`` header could carry).
    """
    token = read_text(path, MAX_TOKEN_BYTES).strip()
    if not token:
        raise ConfigError(f"{path}: the bearer token file is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"{path}: the bearer token holds whitespace or control characters")
    return token.encode("utf-8")


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a file")


def load(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read and validate the configuration file at ``path``.

    Args:
        path: the YAML file (read with :func:`read_text`: a regular file of at most
            :data:`MAX_CONFIG_BYTES`).
        overrides: top-level settings that replace the file's (the command line's
            ``--listen`` and ``--log-level``), validated with the rest.

    Raises:
        ConfigError: the file is unreadable or invalid (see :func:`read_text` and
            :func:`parse`).
    """
    cfg = parse(read_text(path), str(path))
    return with_overrides(cfg, overrides, str(path)) if overrides else cfg


def with_overrides(cfg: Config, overrides: Mapping[str, Any], source: str = "<string>") -> Config:
    """Return ``cfg`` with top-level settings replaced by ``overrides``, validated again.

    Raises:
        ConfigError: an override is invalid (the message names it).
    """
    data = cfg.model_dump()
    data.update(overrides)
    return _validate(data, source)


def default_text() -> str:
    """Return the embedded default configuration (``agent/default.yaml``) as YAML text."""
    return resources.files("kvpressure.agent").joinpath("default.yaml").read_text(encoding="utf-8")


def load_default() -> Config:
    """Return the embedded default configuration."""
    return parse(default_text(), "<embedded default>")
