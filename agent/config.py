"""Agent configuration: a YAML file validated with pydantic, and an embedded default.

``load(path)`` returns a :class:`Config` or raises :class:`ConfigError` whose message names
the file, the field path and what was expected, e.g.::

    /etc/kvpressure/kvpressure.yaml: engines[0].type: expected one of 'auto', 'vllm', ...

Durations accept seconds as a number or a string with a unit (``"250ms"``, ``"1s"``,
``"2m"``).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal
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

ENGINE_TYPES = ("auto", "vllm", "sglang", "llamacpp", "tgi", "trtllm", "triton")
EngineType = Literal["auto", "vllm", "sglang", "llamacpp", "tgi", "trtllm", "triton"]

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


class SamplersConfig(_Model):
    """Which samplers run."""

    host: HostSamplerConfig = HostSamplerConfig()
    engines: SamplerToggle = SamplerToggle()
    gpu: SamplerToggle = SamplerToggle()


class GpuConfig(_Model):
    """The GPU sampler's NVML binding and accelerator-stall thresholds.

    Attributes:
        binding: ``nvml`` (the real library from nvidia-ml-py) or ``fake:<profile>`` (a
            recorded-behaviour fake for tests and demos, e.g. ``fake:h200``).
        idle_utilization_below: a GPU whose utilization ratio is below this while its
            engine has requests waiting is stalled ``idle_with_queue``.
        memory_bound_bandwidth_above: bandwidth utilization ratio above which, with SM
            occupancy below ``memory_bound_sm_below``, the GPU is stalled ``memory_bound``.
        memory_bound_sm_below: see above.
        data_movement_window_s: window for bytes-per-token and tokens-per-byte.
    """

    binding: str = Field(default="nvml", pattern=r"^(nvml|fake:[a-z0-9_.-]+)$")
    idle_utilization_below: float = Field(default=0.10, ge=0, le=1)
    memory_bound_bandwidth_above: float = Field(default=0.60, ge=0, le=1)
    memory_bound_sm_below: float = Field(default=0.30, ge=0, le=1)
    data_movement_window_s: Seconds = Field(default=30.0, ge=1, le=3600)


class EngineConfig(_Model):
    """One inference engine to scrape.

    Attributes:
        url: base URL of the engine's HTTP server, e.g. ``http://127.0.0.1:8000``.
        type: engine kind; ``auto`` detects it from the metric prefixes.
        name: the ``engine`` label value; defaults to the type (or ``engine`` for auto).
        cgroup: cgroup v2 path (relative to /sys/fs/cgroup) whose PSI is reported with
            ``scope=<name>``.
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


class Config(_Model):
    """The whole agent configuration (see ``agent/default.yaml`` for the defaults)."""

    listen: str = "127.0.0.1:9470"
    interval_s: Seconds = Field(default=1.0, ge=0.1, le=3600)
    procfs_root: str = "/proc"
    sysfs_root: str = "/sys"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    samplers: SamplersConfig = SamplersConfig()
    engines: list[EngineConfig] = []
    discovery: DiscoveryConfig = DiscoveryConfig()
    timeline: TimelineConfig = TimelineConfig()
    gpu: GpuConfig = GpuConfig()

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

    @property
    def listen_host(self) -> str:
        """The host part of ``listen`` (brackets of an IPv6 literal removed)."""
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def listen_port(self) -> int:
        """The port part of ``listen``."""
        return int(self.listen.rpartition(":")[2])


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
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: (top level): expected a mapping of settings")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: {_loc(e['loc'])}: {_expected(e)}" for e in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def load(path: str | Path) -> Config:
    """Read and validate the configuration file at ``path``.

    Raises:
        ConfigError: the file is unreadable or invalid (see :func:`parse`).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return parse(text, str(path))


def default_text() -> str:
    """Return the embedded default configuration (``agent/default.yaml``) as YAML text."""
    return resources.files("agent").joinpath("default.yaml").read_text(encoding="utf-8")


def load_default() -> Config:
    """Return the embedded default configuration."""
    return parse(default_text(), "<embedded default>")
