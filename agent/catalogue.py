"""The metric catalogue: every metric the agent exports, declared once.

Exporters, the README's metric table, dashboards and alert rules are all checked against
this list (see ``tests/test_catalogue.py``). A sampler that emits a name missing here is a
bug: the exporter drops the sample and counts it in
``kvpressure_exporter_unknown_samples_total``.

Naming follows Prometheus conventions: base units (bytes, seconds), ratios in 0-1 with
``_ratio``, counters with ``_total``. ``otel`` gives the OpenTelemetry instrument name
(``hw.*``/``system.*``/``gen_ai.*`` semantic conventions where one exists).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter", "histogram", "info"]

ENGINE_LABELS = ("engine", "instance", "model")
GPU_LABELS = ("gpu", "uuid", "mig")


@dataclass(frozen=True, slots=True)
class Metric:
    """One exported metric.

    Attributes:
        name: the Prometheus name, ``kvpressure_`` prefixed, with unit and ``_total``
            suffixes as Prometheus expects.
        kind: ``gauge``, ``counter``, ``histogram`` or ``info`` (a constant-1 gauge).
        unit: the base unit (``bytes``, ``seconds``, ``ratio``, ``tokens``, ``pages``,
            ``requests``, ``1`` for dimensionless counts).
        help: one-line help text, including the data source.
        labels: the label names the metric may carry (a label may be absent on a sample).
        otel: the OpenTelemetry instrument name used by the OTLP exporter.
        area: the README section the metric is listed under.
    """

    name: str
    kind: Kind
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    otel: str = ""
    area: str = "agent"


def _m(
    name: str,
    kind: Kind,
    unit: str,
    help_: str,
    labels: tuple[str, ...] = (),
    otel: str = "",
    area: str = "agent",
) -> Metric:
    return Metric(name, kind, unit, help_, labels, otel or name.removeprefix("kvpressure_"), area)


_ALL: tuple[Metric, ...] = (
    # --- agent self-metrics -------------------------------------------------------------
    _m("kvpressure_build_info", "info", "1", "Agent version; always 1.", ("version", "python")),
    _m(
        "kvpressure_sampler_up",
        "gauge",
        "1",
        "1 when the sampler's last collection succeeded within its timeout, else 0.",
        ("sampler",),
    ),
    _m(
        "kvpressure_sampler_duration_seconds",
        "gauge",
        "seconds",
        "Wall time of the sampler's last collection.",
        ("sampler",),
    ),
    _m(
        "kvpressure_sampler_failures_total",
        "counter",
        "1",
        "Collections that raised or timed out, by sampler.",
        ("sampler", "reason"),
    ),
    _m(
        "kvpressure_source_up",
        "gauge",
        "1",
        "1 when a source inside a sampler (a /proc file, an endpoint) was read in the last "
        "cycle, 0 when it failed. Sources the system does not have are absent here and "
        "listed in kvpressure_source_unsupported.",
        ("sampler", "source"),
    ),
    _m(
        "kvpressure_source_unsupported",
        "gauge",
        "1",
        "1 for each source the system does not provide, with the reason (e.g. kernel_without_psi).",
        ("sampler", "source", "reason"),
    ),
    _m(
        "kvpressure_timeline_series",
        "gauge",
        "1",
        "Series currently held in the in-memory timeline.",
    ),
    _m(
        "kvpressure_timeline_dropped_samples_total",
        "counter",
        "1",
        "Samples dropped because the timeline's series cap was reached.",
    ),
    _m(
        "kvpressure_exporter_unknown_samples_total",
        "counter",
        "1",
        "Samples dropped by the exporter because their name is not in the catalogue.",
    ),
    _m(
        "kvpressure_config_reloads_total",
        "counter",
        "1",
        "SIGHUP reloads by result (ok, invalid).",
        ("result",),
    ),
    # --- host ---------------------------------------------------------------------------
    _m(
        "kvpressure_host_memory_total_bytes",
        "gauge",
        "bytes",
        "Effective memory total: min(/proc/meminfo MemTotal, the agent's cgroup memory limit "
        "and its ancestors').",
        (),
        "system.memory.limit",
        "host",
    ),
    _m(
        "kvpressure_host_memory_available_bytes",
        "gauge",
        "bytes",
        "Effective available memory: MemAvailable, or min(cgroup limit - usage of the limiting "
        "cgroup, MemAvailable) when a cgroup limit is below MemTotal.",
        (),
        "system.memory.available",
        "host",
    ),
    _m(
        "kvpressure_host_meminfo_total_bytes",
        "gauge",
        "bytes",
        "MemTotal as /proc/meminfo shows it (the host's view inside a container).",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_host_meminfo_available_bytes",
        "gauge",
        "bytes",
        "MemAvailable as /proc/meminfo shows it.",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_host_cgroup_memory_limit_bytes",
        "gauge",
        "bytes",
        "Lowest memory limit of the agent's cgroup and its ancestors (v2 memory.max, v1 "
        "memory.limit_in_bytes); absent when unlimited.",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_host_cgroup_memory_used_bytes",
        "gauge",
        "bytes",
        "Memory charged to the agent's cgroup (v2 memory.current, v1 memory.usage_in_bytes).",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_host_swap_total_bytes",
        "gauge",
        "bytes",
        "SwapTotal from /proc/meminfo.",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_host_swap_used_bytes",
        "gauge",
        "bytes",
        "SwapTotal - SwapFree from /proc/meminfo.",
        (),
        "system.paging.usage",
        "host",
    ),
    _m(
        "kvpressure_host_major_page_faults_total",
        "counter",
        "1",
        "Major page faults (/proc/vmstat pgmajfault).",
        (),
        "system.paging.faults",
        "host",
    ),
    _m(
        "kvpressure_host_swap_in_pages_total",
        "counter",
        "pages",
        "Pages swapped in (/proc/vmstat pswpin).",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_host_swap_out_pages_total",
        "counter",
        "pages",
        "Pages swapped out (/proc/vmstat pswpout).",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_host_allocstalls_total",
        "counter",
        "1",
        "Direct-reclaim stalls: sum of /proc/vmstat allocstall_* (the memory-pressure "
        "fallback where PSI is unavailable).",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_psi_stall_seconds_total",
        "counter",
        "seconds",
        "Pressure stall time from /proc/pressure/* (scope=system) or an engine cgroup's "
        "*.pressure files (scope=<engine>). kind is some or full; system-level cpu full is "
        "undefined and never exported.",
        ("resource", "kind", "scope"),
        "",
        "host",
    ),
    _m(
        "kvpressure_psi_avg10_ratio",
        "gauge",
        "ratio",
        "PSI avg10 (share of the last 10 s with stalled tasks), as a 0-1 ratio.",
        ("resource", "kind", "scope"),
        "",
        "host",
    ),
    _m(
        "kvpressure_disk_read_bytes_total",
        "counter",
        "bytes",
        "Bytes read from a whole physical disk (/proc/diskstats sectors read x 512).",
        ("device",),
        "system.disk.io",
        "host",
    ),
    _m(
        "kvpressure_disk_written_bytes_total",
        "counter",
        "bytes",
        "Bytes written to a whole physical disk (/proc/diskstats sectors written x 512).",
        ("device",),
        "system.disk.io",
        "host",
    ),
    _m(
        "kvpressure_disk_reads_completed_total",
        "counter",
        "1",
        "Reads completed (/proc/diskstats).",
        ("device",),
        "system.disk.operations",
        "host",
    ),
    _m(
        "kvpressure_disk_writes_completed_total",
        "counter",
        "1",
        "Writes completed (/proc/diskstats).",
        ("device",),
        "system.disk.operations",
        "host",
    ),
    _m(
        "kvpressure_disk_io_time_seconds_total",
        "counter",
        "seconds",
        "Time the device had I/O in flight (/proc/diskstats ms doing I/O).",
        ("device",),
        "system.disk.io_time",
        "host",
    ),
    _m(
        "kvpressure_disk_io_time_weighted_seconds_total",
        "counter",
        "seconds",
        "Weighted time doing I/O; its rate is the average queue depth (/proc/diskstats).",
        ("device",),
        "system.disk.weighted_io_time",
        "host",
    ),
    _m(
        "kvpressure_net_receive_bytes_total",
        "counter",
        "bytes",
        "Bytes received per interface (/proc/net/dev).",
        ("interface",),
        "system.network.io",
        "host",
    ),
    _m(
        "kvpressure_net_transmit_bytes_total",
        "counter",
        "bytes",
        "Bytes transmitted per interface (/proc/net/dev).",
        ("interface",),
        "system.network.io",
        "host",
    ),
    _m(
        "kvpressure_net_receive_errors_total",
        "counter",
        "1",
        "Receive errors per interface (/proc/net/dev).",
        ("interface",),
        "system.network.errors",
        "host",
    ),
    _m(
        "kvpressure_net_transmit_errors_total",
        "counter",
        "1",
        "Transmit errors per interface (/proc/net/dev).",
        ("interface",),
        "system.network.errors",
        "host",
    ),
    _m(
        "kvpressure_net_receive_drops_total",
        "counter",
        "1",
        "Received packets dropped per interface (/proc/net/dev).",
        ("interface",),
        "system.network.dropped",
        "host",
    ),
    _m(
        "kvpressure_net_transmit_drops_total",
        "counter",
        "1",
        "Transmitted packets dropped per interface (/proc/net/dev).",
        ("interface",),
        "system.network.dropped",
        "host",
    ),
    _m(
        "kvpressure_net_tcp_retransmitted_segments_total",
        "counter",
        "1",
        "TCP segments retransmitted (/proc/net/snmp Tcp RetransSegs).",
        (),
        "",
        "host",
    ),
    _m(
        "kvpressure_memory_tier_bytes",
        "gauge",
        "bytes",
        "Memory per tier: tier=dram (NUMA node with CPUs), cxl (CPU-less NUMA node), swap; "
        "state=total|used|free. From /sys/devices/system/node/node*/meminfo and /proc/meminfo; "
        "node is absent for swap, and for dram when there is no NUMA sysfs.",
        ("tier", "node", "state"),
        "",
        "host",
    ),
    # --- GPU (NVML) ---------------------------------------------------------------------
    _m(
        "kvpressure_gpu_up",
        "gauge",
        "1",
        "1 when the GPU answered NVML this cycle; 0 when lost, timed out or the driver is "
        "unavailable (reason in kvpressure_source_up / logs).",
        GPU_LABELS,
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_info",
        "info",
        "1",
        "GPU identity: product name, driver and NVML versions, unified-memory flag; always 1.",
        (*GPU_LABELS, "name", "driver_version", "unified_memory"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_memory_total_bytes",
        "gauge",
        "bytes",
        "Device memory total (nvmlDeviceGetMemoryInfo_v2 total, v1 fallback). Absent where NVML "
        "reports memory as unsupported (unified-memory parts such as GB10).",
        GPU_LABELS,
        "hw.gpu.memory.limit",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_memory_used_bytes",
        "gauge",
        "bytes",
        "Device memory used (nvmlDeviceGetMemoryInfo_v2 used).",
        GPU_LABELS,
        "hw.gpu.memory.usage",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_memory_reserved_bytes",
        "gauge",
        "bytes",
        "Device memory reserved by the driver (nvmlMemory_v2 reserved; absent with v1).",
        GPU_LABELS,
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_memory_free_bytes",
        "gauge",
        "bytes",
        "Device memory free (nvmlDeviceGetMemoryInfo_v2 free).",
        GPU_LABELS,
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_utilization_ratio",
        "gauge",
        "ratio",
        "Share of the last sample period a kernel was running (nvmlDeviceGetUtilizationRates "
        "gpu / 100). Absent on MIG instances, where NVML does not report it.",
        GPU_LABELS,
        "hw.gpu.utilization",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_memory_bandwidth_utilization_ratio",
        "gauge",
        "ratio",
        "Memory-bandwidth utilization: GPM DRAM_BW_UTIL on Hopper and newer (source=gpm), "
        "else nvmlDeviceGetUtilizationRates memory / 100 (source=nvml).",
        (*GPU_LABELS, "source"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_sm_occupancy_ratio",
        "gauge",
        "ratio",
        "SM occupancy from GPM (NVML_GPM_METRIC_SM_OCCUPANCY / 100); absent without GPM.",
        GPU_LABELS,
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_pcie_bytes_total",
        "counter",
        "bytes",
        "PCIe bytes by direction (rx, tx), accumulated from NVML PCIe throughput field values.",
        (*GPU_LABELS, "direction"),
        "hw.gpu.io",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_nvlink_bytes_total",
        "counter",
        "bytes",
        "NVLink bytes by direction (rx, tx), from NVML NVLink throughput field values.",
        (*GPU_LABELS, "direction"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_clock_event_active",
        "gauge",
        "1",
        "1 while an NVML clocks event reason is active (sw_power_cap, hw_slowdown, "
        "sw_thermal_slowdown, hw_thermal_slowdown, hw_power_brake_slowdown, sync_boost, "
        "idle, applications_clocks_setting, display_clock_setting), else 0.",
        (*GPU_LABELS, "reason"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_power_watts",
        "gauge",
        "watts",
        "Power draw (nvmlDeviceGetPowerUsage, mW / 1000).",
        GPU_LABELS,
        "hw.gpu.power",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_temperature_celsius",
        "gauge",
        "celsius",
        "GPU die temperature (nvmlDeviceGetTemperature).",
        GPU_LABELS,
        "hw.gpu.temperature",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_process_memory_bytes",
        "gauge",
        "bytes",
        "GPU memory held by a process (nvmlDeviceGetComputeRunningProcesses), joined to the "
        "engine the agent knows at that PID.",
        (*GPU_LABELS, "pid", "process", "engine"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_xid_errors_total",
        "counter",
        "1",
        "XID errors seen through NVML events, by XID code.",
        (*GPU_LABELS, "xid"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_accelerator_stall_seconds_total",
        "counter",
        "seconds",
        "Seconds the GPU had requests running or waiting but did no useful compute, by reason "
        "(idle_with_queue, memory_bound, throttled); formula in the README.",
        (*GPU_LABELS, "reason"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_data_movement_bytes_per_token",
        "gauge",
        "bytes",
        "PCIe + NVLink bytes moved per token processed by the engines on the GPU, over the "
        "data-movement window.",
        GPU_LABELS,
        "",
        "gpu",
    ),
    _m(
        "kvpressure_tokens_per_byte",
        "gauge",
        "1",
        "Tokens processed over the window divided by the mean GPU memory in use.",
        GPU_LABELS,
        "",
        "gpu",
    ),
    # --- engines ------------------------------------------------------------------------
    _m(
        "kvpressure_engine_up",
        "gauge",
        "1",
        "1 when the engine's metrics endpoint answered with usable exposition, 0 when it "
        "failed (HTTP error, timeout, refused, JSON or garbage). The reason is in the logs "
        "and kvpressure_source_up.",
        ("engine", "instance"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_info",
        "info",
        "1",
        "The engine type and model an endpoint serves; always 1.",
        ("engine", "instance", "type", "model"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_scrape_samples",
        "gauge",
        "1",
        "Samples parsed from the engine's last metrics response.",
        ("engine", "instance"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_parse_errors_total",
        "counter",
        "1",
        "Exposition lines or families that could not be parsed and were skipped.",
        ("engine", "instance"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_restarts_total",
        "counter",
        "1",
        "Engine restarts seen as counter resets or a new process_start_time_seconds.",
        ("engine", "instance"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_usage_ratio",
        "gauge",
        "ratio",
        "Fraction of the engine's KV-cache capacity in use (0-1). vLLM kv_cache_usage_perc "
        "(or the deprecated gpu_cache_usage_perc); llama.cpp derived from /slots.",
        ENGINE_LABELS,
        "gen_ai.server.kv_cache.usage",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_used_tokens",
        "gauge",
        "tokens",
        "KV-cache tokens in use, where the engine lets us derive them (llama.cpp: n_prompt_tokens "
        "of each processing slot, generated tokens included, from /slots).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_capacity_tokens",
        "gauge",
        "tokens",
        "KV-cache capacity in tokens (llama.cpp: sum of the slots' n_ctx; vLLM: "
        "num_gpu_blocks x block_size from cache_config_info).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_slots",
        "gauge",
        "1",
        "Request slots (llama.cpp /slots): state=total|processing.",
        ("engine", "instance", "model", "state"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_requests_running",
        "gauge",
        "requests",
        "Requests being processed (vLLM num_requests_running, llama.cpp requests_processing).",
        ENGINE_LABELS,
        "gen_ai.server.requests.running",
        "engine",
    ),
    _m(
        "kvpressure_engine_requests_waiting",
        "gauge",
        "requests",
        "Requests queued for a slot or for KV space (vLLM num_requests_waiting, llama.cpp "
        "requests_deferred).",
        ENGINE_LABELS,
        "gen_ai.server.requests.waiting",
        "engine",
    ),
    _m(
        "kvpressure_engine_preemptions_total",
        "counter",
        "1",
        "Requests preempted to free KV space (vLLM num_preemptions).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_prefix_cache_queried_tokens_total",
        "counter",
        "tokens",
        "Prompt tokens looked up in the prefix cache.",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_prefix_cache_hit_tokens_total",
        "counter",
        "tokens",
        "Prompt tokens served from the prefix cache (llama.cpp prompt_tokens_cached_total).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_prompt_tokens_total",
        "counter",
        "tokens",
        "Prompt tokens as the engine counts them (vLLM: prefix-cache hits included; llama.cpp: "
        "computed tokens only).",
        ENGINE_LABELS,
        "gen_ai.server.usage.input_tokens",
        "engine",
    ),
    _m(
        "kvpressure_engine_generation_tokens_total",
        "counter",
        "tokens",
        "Generated (decode) tokens.",
        ENGINE_LABELS,
        "gen_ai.server.usage.output_tokens",
        "engine",
    ),
    _m(
        "kvpressure_engine_prompt_seconds_total",
        "counter",
        "seconds",
        "Time the engine spent in prefill (llama.cpp prompt_seconds_total).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_generation_seconds_total",
        "counter",
        "seconds",
        "Time the engine spent in decode (llama.cpp tokens_predicted_seconds_total).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
)

CATALOGUE: dict[str, Metric] = {m.name: m for m in _ALL}
"""Every exported metric by name."""


def get(name: str) -> Metric:
    """Return the catalogue entry for ``name``.

    Raises:
        KeyError: ``name`` is not in the catalogue.
    """
    return CATALOGUE[name]


def markdown_table() -> str:
    """Return the catalogue as the Markdown table embedded in the README.

    The README section between ``<!-- metrics:begin -->`` and ``<!-- metrics:end -->`` must
    equal this output (``tests/test_catalogue.py`` checks it; regenerate with
    ``kvpressure metrics``).
    """
    rows = ["| metric | type | unit | labels | description |", "|---|---|---|---|---|"]
    for m in _ALL:
        labels = ", ".join(m.labels) or "-"
        rows.append(f"| `{m.name}` | {m.kind} | {m.unit} | {labels} | {m.help} |")
    return "\n".join(rows)


def update_readme(path: str) -> bool:
    """Rewrite the metric table between the README's markers; True when it changed."""
    from pathlib import Path

    p = Path(path)
    text = p.read_text(encoding="utf-8")
    begin, end = "<!-- metrics:begin -->", "<!-- metrics:end -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{begin}\n{markdown_table()}\n{end}{tail}"
    if new != text:
        p.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":  # python -m agent.catalogue README.md
    import sys

    print("updated" if update_readme(sys.argv[1]) else "unchanged")
