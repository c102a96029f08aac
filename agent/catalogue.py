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

from dataclasses import dataclass, replace
from typing import Final, Literal, cast

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
        "listed in kvpressure_source_unsupported. A host source read once a second while "
        "the host samples faster (cpu, engine_cpu, diskstats, netdev, snmp, numa) keeps its "
        "last read's state, and its series their last values, between reads.",
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
        "Samples of new series dropped because the timeline's series cap was reached and no "
        "series had gone unwritten long enough to give its place.",
    ),
    _m(
        "kvpressure_timeline_evicted_series_total",
        "counter",
        "1",
        "Series forgotten by the timeline, by reason (stale = not written for 15 min, cap = "
        "gave its place to a new series at the cap).",
        ("reason",),
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
        "kvpressure_cgroup_memory_used_bytes",
        "gauge",
        "bytes",
        "Memory charged to an engine's cgroup (v2 memory.current; scope=<engine>, for "
        "engines configured with a cgroup).",
        ("scope",),
        "",
        "host",
    ),
    _m(
        "kvpressure_cgroup_memory_limit_bytes",
        "gauge",
        "bytes",
        "An engine's cgroup memory limit: limit=max (memory.max, the hard limit) or "
        "limit=high (memory.high, the reclaim threshold); absent when unlimited.",
        ("scope", "limit"),
        "",
        "host",
    ),
    _m(
        "kvpressure_cgroup_memory_events_total",
        "counter",
        "1",
        "An engine's cgroup memory.events: high (reclaimed above memory.high), max (usage "
        "hit memory.max), oom, oom_kill.",
        ("scope", "event"),
        "",
        "host",
    ),
    _m(
        "kvpressure_host_cpu_seconds_total",
        "counter",
        "seconds",
        "CPU time of all CPUs by mode (user, nice, system, idle, iowait, irq, softirq, "
        "steal), from the cpu line of /proc/stat. The host's busy CPU is every mode but "
        "idle and iowait.",
        ("mode",),
        "system.cpu.time",
        "host",
    ),
    _m(
        "kvpressure_engine_process_cpu_seconds_total",
        "counter",
        "seconds",
        "CPU time (user + system) of an engine's own processes: usage_usec of its cgroup's "
        "cpu.stat when engines[].cgroup/unit is set, else the processes listening on a "
        "loopback engine's port and their descendants (/proc/PID/stat). Absent for an engine "
        "whose processes the agent cannot see.",
        ("engine", "instance"),
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
        ("tier", "node", "state", "engine", "instance"),
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
        "Device memory used (nvmlDeviceGetMemoryInfo_v2 used). On a unified-memory part whose "
        "NVML total is the system's memory: the sum of its processes' memory instead.",
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
        "GPU memory held by a process (nvmlDeviceGetComputeRunningProcesses and "
        "nvmlDeviceGetGraphicsRunningProcesses, one row per PID), PID in the agent's PID "
        "namespace (NSpid), joined to the engine the agent knows at that PID. In Kubernetes "
        "pod_uid from /proc/PID/cgroup, and namespace, pod, container from the kubelet "
        "pod-resources socket's assignment of the device; each absent when unknown.",
        (*GPU_LABELS, "pid", "process", "engine", "pod_uid", "namespace", "pod", "container"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_values_dropped_total",
        "counter",
        "1",
        "Impossible NVML values dropped, the rest of the sample kept: reason="
        "process_pid_invalid (PID 0, 4294967295 or above Linux's pid limit), "
        "process_duplicate (a PID listed twice by one call; one row kept), "
        "process_memory_above_total (a process holding more than the device), "
        "memory_above_total (used, free or reserved above the total: the memory reading), "
        "utilization_out_of_range (utilization outside 0-100 %).",
        (*GPU_LABELS, "reason"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_engine_disagreement",
        "gauge",
        "1",
        "1 while an engine's own GPU reading (Triton nv_gpu_memory_*) disagrees with NVML for "
        "the same GPU uuid (total: more than 1 %; used: more than 5 % of the total and 1 GiB), "
        "else 0; NVML's value is the one exported. signal=memory_total|memory_used.",
        (*GPU_LABELS, "engine", "signal"),
        "",
        "gpu",
    ),
    _m(
        "kvpressure_gpu_unified_memory_available_bytes",
        "gauge",
        "bytes",
        "Unified-memory parts (GB10, GH200 reporting system memory, ...): memory available to "
        "the GPU, which is the host's MemAvailable (/proc/meminfo), shared with the CPU.",
        GPU_LABELS,
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
        "kvpressure_engine_pod_info",
        "info",
        "1",
        "The Kubernetes pod of an engine whose GPU process the agent joined to it (engine "
        "PID or an ancestor): pod_uid from /proc/PID/cgroup, namespace, pod, container from "
        "the kubelet pod-resources socket when configured; join engine series on engine. "
        "Always 1; absent outside Kubernetes.",
        ("engine", "pod_uid", "namespace", "pod", "container"),
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
        "kvpressure_engine_series_merged_total",
        "counter",
        "1",
        "Exposition samples folded into another instead of being summed as a second fact: "
        "reason=duplicate (a repeated series, same name and labels: the last copy is kept), "
        "per_process (rows differing only by a pid label: counters summed, gauges take the "
        "live value).",
        ("engine", "instance", "reason"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_models_dropped",
        "gauge",
        "1",
        "Models over the per-engine model cap (32) in the last scrape, whose samples were "
        "dropped; the kept ones are those under the most pressure (KV usage, running, "
        "waiting).",
        ("engine", "instance"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_label_values_dropped_total",
        "counter",
        "1",
        "Values of the model label (or of a label kept from the engine: reason, uuid) "
        "refused because the engine already had 64 distinct values of it within 15 min; "
        "their samples are dropped, so a label that churns cannot grow memory or series. "
        "Counted once per scrape for each refused value.",
        ("engine", "instance", "label"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_gpu_memory_used_bytes",
        "gauge",
        "bytes",
        "GPU memory used as the engine itself reports it (Triton nv_gpu_memory_used_bytes), "
        "by GPU uuid; kvpressure_gpu_memory_used_bytes (NVML) is the reference.",
        ("engine", "instance", "uuid"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_gpu_memory_total_bytes",
        "gauge",
        "bytes",
        "GPU memory total as the engine itself reports it (Triton nv_gpu_memory_total_bytes), "
        "by GPU uuid; kvpressure_gpu_memory_total_bytes (NVML) is the reference.",
        ("engine", "instance", "uuid"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_counters_withheld",
        "gauge",
        "1",
        "Per-model traffic counters (completed requests, prompt/generation tokens, request "
        "durations) not exported in the last scrape: 0 for a model whose other traffic "
        "counters moved, so the engine does not count them at that level (not zero traffic).",
        ("engine", "instance"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_stats_stale",
        "gauge",
        "1",
        "1 when the engine's statistics are stale: neither its prompt and generation token "
        "counters nor its running, KV usage and KV tokens gauges have changed for 30 s while "
        "the gauges claimed running requests or KV usage >= 90 % (vLLM keeps its last "
        "gauges after every request aborted); 0 otherwise. Then "
        "source stats is in error (reason stale) and attribution does not use its KV, queue "
        "and preemption metrics as evidence. Absent for an engine without token counters.",
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
        "kvpressure_engine_finished_requests_total",
        "counter",
        "1",
        "Requests the engine finished, any reason, counted with their preemptions (vLLM "
        "request_num_preemptions_count).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_finished_requests_preemptions_total",
        "counter",
        "1",
        "Preemptions of the finished requests, added when each finishes (vLLM "
        "request_num_preemptions_sum); with kvpressure_engine_finished_requests_total it says "
        "how often the one request that finished between two scrapes was preempted.",
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
    # --- engines: queues, KV capacity and tiers, latency (issue 3) ----------------------
    _m(
        "kvpressure_engine_requests_waiting_by_reason",
        "gauge",
        "requests",
        "Waiting requests by reason (vLLM num_requests_waiting_by_reason: capacity = waiting "
        "for KV or batch room, deferred = LoRA budget, KV transfer, blocked).",
        (*ENGINE_LABELS, "reason"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_requests_paused",
        "gauge",
        "requests",
        "Requests paused by the scheduler (TensorRT-LLM num_paused_requests, Triton "
        "inflight_batcher paused_requests).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_requests_rejected_total",
        "counter",
        "1",
        "Requests refused at admission by a queue limit, by reason (vLLM admission_rejections).",
        (*ENGINE_LABELS, "reason"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_requests_completed_total",
        "counter",
        "1",
        "Requests the engine finished (vLLM request_success, SGLang num_requests, TGI "
        "request_success, TensorRT-LLM request_success, Triton nv_inference_request_success).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_external_prefix_cache_queried_tokens_total",
        "counter",
        "tokens",
        "Prompt tokens looked up in an external KV cache through a KV connector (vLLM "
        "external_prefix_cache_queries; LMCache num_requested_tokens).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_external_prefix_cache_hit_tokens_total",
        "counter",
        "tokens",
        "Prompt tokens served from an external KV cache through a KV connector (vLLM "
        "external_prefix_cache_hits; LMCache num_hit_tokens; Dynamo KVBM matched_tokens).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_prefix_cache_hit_ratio",
        "gauge",
        "ratio",
        "Prefix-cache hit ratio: hit / queried prompt tokens over the last 60 s where the "
        "engine counts both (vLLM), else the engine's own hit-rate gauge (SGLang "
        "cache_hit_rate, TensorRT-LLM kv_cache_hit_rate).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_prefix_cache_tier_hit_tokens_total",
        "counter",
        "tokens",
        "Cached prompt tokens by the tier that supplied them: device, kv_host, kv_disk, "
        "kv_remote, p2p, external (vLLM prompt_tokens_cached_by_source, SGLang "
        "cached_tokens{cache_source}, TensorRT-LLM prompt_cache_hit_tokens{cache_tier}, "
        "LMCache l2/l3/remote hit tokens).",
        (*ENGINE_LABELS, "tier"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_evictable_tokens",
        "gauge",
        "tokens",
        "KV-cache tokens held only for prefix reuse and evictable on demand (SGLang "
        "kv_evictable_tokens).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_free_tokens",
        "gauge",
        "tokens",
        "Free KV-cache tokens (SGLang kv_available_tokens; TensorRT-LLM free blocks x tokens "
        "per block).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_block_size_tokens",
        "gauge",
        "tokens",
        "Tokens per KV-cache block (vLLM cache_config_info block_size, TensorRT-LLM "
        "kv_cache_tokens_per_block, Triton kv_cache_block_metrics tokens_per).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_blocks",
        "gauge",
        "1",
        "KV-cache blocks by state=total|used|free (vLLM cache_config_info num_gpu_blocks; "
        "TensorRT-LLM kv_cache_{max,used,free}_blocks; Triton kv_cache_block_metrics).",
        (*ENGINE_LABELS, "state"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_capacity_bytes",
        "gauge",
        "bytes",
        "Memory given to the KV cache (vLLM cache_config_info kv_cache_memory_bytes, when set).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_cache_max_concurrency",
        "gauge",
        "requests",
        "Requests of full model length the KV cache holds at once (vLLM cache_config_info "
        "kv_cache_max_concurrency).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_tier_usage_ratio",
        "gauge",
        "ratio",
        "Fill of an offload tier's KV pool, tier=kv_host|kv_disk (vLLM "
        "kv_offload_cpu_cache_usage_perc, TensorRT-LLM kv_cache_host_utilization).",
        (*ENGINE_LABELS, "tier"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_tier_hit_ratio",
        "gauge",
        "ratio",
        "Hit ratio of an offload tier as the source reports it (Dynamo KVBM "
        "host_cache_hit_rate/disk_cache_hit_rate, LMCache retrieve_hit_rate).",
        (*ENGINE_LABELS, "tier"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_offload_bytes_total",
        "counter",
        "bytes",
        "KV bytes moved between the device and an offload tier, direction=offload (device "
        "to tier) or onboard (tier to device) (vLLM kv_offload_store/load_bytes, "
        "TensorRT-LLM kv_cache_offload/onboard_bytes, LMCache remote write/read bytes).",
        (*ENGINE_LABELS, "tier", "direction"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_offload_blocks_total",
        "counter",
        "1",
        "KV blocks moved to (offload) or from (onboard) an offload tier (Dynamo KVBM "
        "offload_blocks_*/onboard_blocks_*).",
        (*ENGINE_LABELS, "tier", "direction"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_offload_tokens_total",
        "counter",
        "tokens",
        "KV tokens moved to (offload) or from (onboard) an offload tier (SGLang HiCache "
        "evicted_tokens/load_back_tokens).",
        (*ENGINE_LABELS, "tier", "direction"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_tier_evictions_total",
        "counter",
        "1",
        "Evictions from an offload tier (LMCache local_cpu_evict_count).",
        (*ENGINE_LABELS, "tier"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_batch_max_tokens",
        "gauge",
        "tokens",
        "Token budget of the running batch (TGI batch_current_max_tokens, TensorRT-LLM "
        "max_num_tokens_runtime).",
        ENGINE_LABELS,
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_latency_seconds",
        "gauge",
        "seconds",
        "Windowed latency percentiles (p50, p95, p99) from the engine's histograms over the "
        "last 60 s, absent with fewer than 5 observations; phase=ttft|itl|e2e|queue|"
        "prefill|decode|inference|batch_prefill|batch_decode.",
        (*ENGINE_LABELS, "phase", "percentile"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_latency_window_observations",
        "gauge",
        "1",
        "Observations in the window behind kvpressure_engine_latency_seconds (last 60 s of "
        "the engine's histogram); below 5 the percentiles are absent.",
        (*ENGINE_LABELS, "phase"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_request_latency_seconds",
        "histogram",
        "seconds",
        "The engine's own latency histograms re-exported cumulative (reset-aware) in one "
        "bucket layout per phase whatever the engine, so histogram_quantile can combine "
        "instances: OpenTelemetry GenAI advisory buckets of gen_ai.server.time_to_first_token "
        "(ttft), time_per_output_token (itl) and request.duration (the other phases). An engine "
        "bucket bound that is not a target bound counts in the next target bound above it "
        "(never under-reports); phase as in kvpressure_engine_latency_seconds.",
        (*ENGINE_LABELS, "phase"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_block_residency_seconds",
        "gauge",
        "seconds",
        "Windowed percentiles (p50, p95, p99) of KV block residency, event=lifetime|"
        "idle_before_evict|reuse_gap (vLLM --kv-cache-metrics histograms), absent when off.",
        (*ENGINE_LABELS, "event", "percentile"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_kv_block_residency_window_observations",
        "gauge",
        "1",
        "Observations in the window behind kvpressure_engine_kv_block_residency_seconds; "
        "below 5 the percentiles are absent.",
        (*ENGINE_LABELS, "event"),
        "",
        "engine",
    ),
    _m(
        "kvpressure_engine_request_duration_seconds_total",
        "counter",
        "seconds",
        "Cumulative request time by phase=request|queue|compute (Triton "
        "nv_inference_*_duration_us, microseconds converted to seconds).",
        (*ENGINE_LABELS, "phase"),
        "",
        "engine",
    ),
    # --- requests -----------------------------------------------------------------------
    _m(
        "kvpressure_request_latency_seconds",
        "histogram",
        "seconds",
        "Per-request latency by phase (ttft, e2e, itl, queue, prefill, decode), from the request "
        "proxies (TTFT = first content chunk, itl = each gap between content chunks) and "
        "OTLP spans (vLLM gen_ai.latency.*, GenAI client spans, TGI). Buckets 1 ms to 120 s.",
        ("engine", "phase"),
        "",
        "requests",
    ),
    _m(
        "kvpressure_requests_total",
        "counter",
        "1",
        "Finished requests by outcome (ok, client_error, server_error, upstream_down, "
        "cancelled, context_exceeded = llama.cpp exceed_context_size_error, kv_exhausted = "
        "llama.cpp 'Context size has been exceeded').",
        ("engine", "outcome"),
        "",
        "requests",
    ),
    _m(
        "kvpressure_request_tokens_total",
        "counter",
        "tokens",
        "Tokens of finished requests by direction (input, output, cached; cached is the part of "
        "input served from the prefix cache), from OpenAI usage, llama.cpp timings or spans.",
        ("engine", "direction"),
        "",
        "requests",
    ),
    _m(
        "kvpressure_proxy_upstream_connect_seconds",
        "histogram",
        "seconds",
        "Time a proxied request waited for a new TCP connection to its engine; requests sent "
        "on a kept-alive or pre-opened (preconnect) connection waited for none.",
        ("engine",),
        "",
        "requests",
    ),
    _m(
        "kvpressure_request_records_dropped_total",
        "counter",
        "1",
        "Request records dropped because a consumer's bounded queue was full.",
        ("consumer",),
        "",
        "requests",
    ),
    _m(
        "kvpressure_otlp_requests_total",
        "counter",
        "1",
        "OTLP/HTTP trace exports received at /v1/traces by result (ok, partial, bad_request, "
        "too_large, unsupported_media_type, busy = 503 while the decode slots are full, "
        "read_timeout = 408 for a body that did not arrive within 10 s, unauthorized = 401 "
        "without the otlp_receiver.bearer_token_file token).",
        ("result",),
        "",
        "requests",
    ),
    _m(
        "kvpressure_otlp_spans_received_total",
        "counter",
        "1",
        "Spans in decoded OTLP exports by result: record (became a request record), ignored "
        "(not an LLM request span), rejected (LLM span with unusable values; partial_success).",
        ("result",),
        "",
        "requests",
    ),
    _m(
        "kvpressure_otlp_span_attributes_dropped_total",
        "counter",
        "1",
        "Timing or token attributes of received LLM spans dropped as unusable (negative, a -1 "
        "sentinel, NaN, infinite, not a number), by attribute key; the span and its valid "
        "fields are kept.",
        ("attribute",),
        "",
        "requests",
    ),
    # --- capacity -----------------------------------------------------------------------
    _m(
        "kvpressure_kv_bytes_per_token",
        "gauge",
        "bytes",
        "KV-cache bytes one token occupies in every attention layer of the served model "
        "(2 x attention layers x KV heads x head dim x KV dtype bytes; MLA: latent width), from "
        "the configured GGUF or HF config.json, or llama.cpp's model_path GGUF.",
        ("engine", "model"),
        "",
        "capacity",
    ),
    _m(
        "kvpressure_kv_headroom_tokens",
        "gauge",
        "tokens",
        "KV-cache tokens still free: capacity - used tokens (vLLM: capacity x (1 - usage ratio)).",
        ("engine",),
        "",
        "capacity",
    ),
    _m(
        "kvpressure_kv_headroom_bytes",
        "gauge",
        "bytes",
        "KV-cache headroom in bytes: headroom tokens x kvpressure_kv_bytes_per_token.",
        ("engine",),
        "",
        "capacity",
    ),
    _m(
        "kvpressure_kv_request_tokens",
        "gauge",
        "tokens",
        "KV-cache tokens per running request: used tokens / running requests; absent when "
        "nothing runs.",
        ("engine",),
        "",
        "capacity",
    ),
    _m(
        "kvpressure_kv_saturation_concurrency",
        "gauge",
        "requests",
        "Concurrent requests that fit: KV capacity / tokens per request at its largest (mean "
        "prompt + output tokens of requests finished in the capacity window, else the window's "
        "peak of used tokens / running requests), capped at the slot count where the engine "
        "has slots (llama.cpp); absent when nothing runs.",
        ("engine",),
        "",
        "capacity",
    ),
    _m(
        "kvpressure_kv_time_to_saturation_seconds",
        "gauge",
        "seconds",
        "Projected seconds until the KV cache is full: headroom / growth rate of used tokens "
        "(least squares over the capacity window); absent unless used tokens grow.",
        ("engine",),
        "",
        "capacity",
    ),
    _m(
        "kvpressure_kv_occupancy_latency_seconds",
        "histogram",
        "seconds",
        "The latency knee: TTFT and inter-token latency (phase=ttft|itl) by the KV-occupancy "
        "band they were observed in (band=0-50|50-80|80-90|90-95|95-100, percent). From the "
        "request stream; without one, ITL only, per cycle from the decode counters.",
        ("engine", "phase", "band"),
        "",
        "capacity",
    ),
    _m(
        "kvpressure_prefix_cache_saved_seconds_total",
        "counter",
        "seconds",
        "Prefill seconds saved by prefix-cache hits: delta hit tokens x measured prefill "
        "seconds per computed prompt token (engine prompt seconds / computed prompt tokens).",
        ("engine",),
        "",
        "capacity",
    ),
    # --- attribution --------------------------------------------------------------------
    _m(
        "kvpressure_slow_requests_total",
        "counter",
        "1",
        "Slow requests (a phase, queue, prefill, TTFT, time per output token or longest "
        "inter-token gap, above the fitted cost of a request of its size on the engine; while "
        "the fit warms up, TTFT/TPOT/e2e above its SLO) by primary cause: memory, storage, "
        "network, concurrency, prefill_interference, compute, engine_restart, gpu_fault or "
        "unknown "
        "(agent/attribution).",
        ("engine", "cause"),
        "",
        "attribution",
    ),
    _m(
        "kvpressure_attribution_score",
        "gauge",
        "1",
        "Score (0-1) of each cause over the latest complete attribution window (default 10 s): "
        "the strongest rule's weight x ramp(value, threshold, saturation); rules in the README.",
        ("engine", "cause"),
        "",
        "attribution",
    ),
    _m(
        "kvpressure_attribution_pending_records",
        "gauge",
        "1",
        "Request records waiting to be attributed (held until their end is one sampling "
        "interval old, while a request their engine ran beside them has not finished (at "
        "most 30 s after their end), or beyond the per-cycle limit).",
        (),
        "",
        "attribution",
    ),
    _m(
        "kvpressure_attribution_dropped_records_total",
        "counter",
        "1",
        "Request records dropped unattributed because the attribution backlog was full.",
        (),
        "",
        "attribution",
    ),
    _m(
        "kvpressure_otlp_exported_total",
        "counter",
        "1",
        "Items delivered to the OTLP endpoint by signal (traces: spans, metrics: data points).",
        ("signal",),
        "",
        "attribution",
    ),
    _m(
        "kvpressure_otlp_export_dropped_total",
        "counter",
        "1",
        "Items the OTLP exporter dropped by signal: spans pushed out of the full queue or in a "
        "failed export (traces), data points of a failed export (metrics).",
        ("signal",),
        "",
        "attribution",
    ),
    _m(
        "kvpressure_otlp_export_queue_spans",
        "gauge",
        "1",
        "Spans waiting in the OTLP exporter's bounded queue.",
        (),
        "",
        "attribution",
    ),
)

POD_LABELS = ("pod_uid", "namespace", "pod", "container")
"""Labels of an engine's pod on every series of the engine sampler (``engine`` and
``instance`` labelled), when the PID listening on the engine's port is in a pod
(:class:`agent.kube.EnginePods`); absent otherwise."""
_ALL = tuple(
    replace(m, labels=(*m.labels, *POD_LABELS))
    if m.area == "engine"
    and m.name.startswith("kvpressure_engine_")
    and {"engine", "instance"} <= set(m.labels)
    else m
    for m in _ALL
)
CATALOGUE: dict[str, Metric] = {m.name: m for m in _ALL}
"""Every exported metric by name."""


def get(name: str) -> Metric:
    """Return the catalogue entry for ``name``.

    Raises:
        KeyError: ``name`` is not in the catalogue.
    """
    return CATALOGUE[name]


HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def metric_of_sample(sample_name: str) -> Metric | None:
    """The catalogue metric a sample name belongs to.

    Args:
        sample_name: a sample's name: a gauge's, counter's or info metric's own name, or a
            histogram's ``<name>_bucket`` / ``_count`` / ``_sum``.

    Returns:
        The metric, or ``None`` when the name is not catalogued (a histogram's bare name is
        not a sample name either).
    """
    m = CATALOGUE.get(sample_name)
    if m is not None:
        return None if m.kind == "histogram" else m
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample_name.removesuffix(suffix)
        if base != sample_name:
            h = CATALOGUE.get(base)
            if h is not None and h.kind == "histogram":
                return h
    return None


def histogram_names(name: HistogramName) -> tuple[SampleName, SampleName, SampleName]:
    """The ``_bucket``, ``_count`` and ``_sum`` sample names of catalogued histogram ``name``.

    Raises:
        KeyError: ``name`` is not a histogram of the catalogue (only reachable by a caller
            that bypasses the type checker: :data:`HistogramName` lists them all).
    """
    m = CATALOGUE.get(name)
    if m is None or m.kind != "histogram":
        raise KeyError(f"{name!r} is not a catalogued histogram")
    names = (f"{name}_bucket", f"{name}_count", f"{name}_sum")
    return cast("tuple[SampleName, SampleName, SampleName]", names)


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


# ---- names: one constant per metric, and every sample name (tests/test_catalogue.py) ----
BUILD_INFO: Final = "kvpressure_build_info"
SAMPLER_UP: Final = "kvpressure_sampler_up"
SAMPLER_DURATION_SECONDS: Final = "kvpressure_sampler_duration_seconds"
SAMPLER_FAILURES_TOTAL: Final = "kvpressure_sampler_failures_total"
SOURCE_UP: Final = "kvpressure_source_up"
SOURCE_UNSUPPORTED: Final = "kvpressure_source_unsupported"
TIMELINE_SERIES: Final = "kvpressure_timeline_series"
TIMELINE_DROPPED_SAMPLES_TOTAL: Final = "kvpressure_timeline_dropped_samples_total"
TIMELINE_EVICTED_SERIES_TOTAL: Final = "kvpressure_timeline_evicted_series_total"
EXPORTER_UNKNOWN_SAMPLES_TOTAL: Final = "kvpressure_exporter_unknown_samples_total"
CONFIG_RELOADS_TOTAL: Final = "kvpressure_config_reloads_total"
HOST_MEMORY_TOTAL_BYTES: Final = "kvpressure_host_memory_total_bytes"
HOST_MEMORY_AVAILABLE_BYTES: Final = "kvpressure_host_memory_available_bytes"
HOST_MEMINFO_TOTAL_BYTES: Final = "kvpressure_host_meminfo_total_bytes"
HOST_MEMINFO_AVAILABLE_BYTES: Final = "kvpressure_host_meminfo_available_bytes"
HOST_CGROUP_MEMORY_LIMIT_BYTES: Final = "kvpressure_host_cgroup_memory_limit_bytes"
HOST_CGROUP_MEMORY_USED_BYTES: Final = "kvpressure_host_cgroup_memory_used_bytes"
HOST_SWAP_TOTAL_BYTES: Final = "kvpressure_host_swap_total_bytes"
HOST_SWAP_USED_BYTES: Final = "kvpressure_host_swap_used_bytes"
HOST_MAJOR_PAGE_FAULTS_TOTAL: Final = "kvpressure_host_major_page_faults_total"
HOST_SWAP_IN_PAGES_TOTAL: Final = "kvpressure_host_swap_in_pages_total"
HOST_SWAP_OUT_PAGES_TOTAL: Final = "kvpressure_host_swap_out_pages_total"
HOST_ALLOCSTALLS_TOTAL: Final = "kvpressure_host_allocstalls_total"
PSI_STALL_SECONDS_TOTAL: Final = "kvpressure_psi_stall_seconds_total"
PSI_AVG10_RATIO: Final = "kvpressure_psi_avg10_ratio"
CGROUP_MEMORY_USED_BYTES: Final = "kvpressure_cgroup_memory_used_bytes"
CGROUP_MEMORY_LIMIT_BYTES: Final = "kvpressure_cgroup_memory_limit_bytes"
CGROUP_MEMORY_EVENTS_TOTAL: Final = "kvpressure_cgroup_memory_events_total"
HOST_CPU_SECONDS_TOTAL: Final = "kvpressure_host_cpu_seconds_total"
ENGINE_PROCESS_CPU_SECONDS_TOTAL: Final = "kvpressure_engine_process_cpu_seconds_total"
DISK_READ_BYTES_TOTAL: Final = "kvpressure_disk_read_bytes_total"
DISK_WRITTEN_BYTES_TOTAL: Final = "kvpressure_disk_written_bytes_total"
DISK_READS_COMPLETED_TOTAL: Final = "kvpressure_disk_reads_completed_total"
DISK_WRITES_COMPLETED_TOTAL: Final = "kvpressure_disk_writes_completed_total"
DISK_IO_TIME_SECONDS_TOTAL: Final = "kvpressure_disk_io_time_seconds_total"
DISK_IO_TIME_WEIGHTED_SECONDS_TOTAL: Final = "kvpressure_disk_io_time_weighted_seconds_total"
NET_RECEIVE_BYTES_TOTAL: Final = "kvpressure_net_receive_bytes_total"
NET_TRANSMIT_BYTES_TOTAL: Final = "kvpressure_net_transmit_bytes_total"
NET_RECEIVE_ERRORS_TOTAL: Final = "kvpressure_net_receive_errors_total"
NET_TRANSMIT_ERRORS_TOTAL: Final = "kvpressure_net_transmit_errors_total"
NET_RECEIVE_DROPS_TOTAL: Final = "kvpressure_net_receive_drops_total"
NET_TRANSMIT_DROPS_TOTAL: Final = "kvpressure_net_transmit_drops_total"
NET_TCP_RETRANSMITTED_SEGMENTS_TOTAL: Final = "kvpressure_net_tcp_retransmitted_segments_total"
MEMORY_TIER_BYTES: Final = "kvpressure_memory_tier_bytes"
GPU_UP: Final = "kvpressure_gpu_up"
GPU_INFO: Final = "kvpressure_gpu_info"
GPU_MEMORY_TOTAL_BYTES: Final = "kvpressure_gpu_memory_total_bytes"
GPU_MEMORY_USED_BYTES: Final = "kvpressure_gpu_memory_used_bytes"
GPU_MEMORY_RESERVED_BYTES: Final = "kvpressure_gpu_memory_reserved_bytes"
GPU_MEMORY_FREE_BYTES: Final = "kvpressure_gpu_memory_free_bytes"
GPU_UTILIZATION_RATIO: Final = "kvpressure_gpu_utilization_ratio"
GPU_MEMORY_BANDWIDTH_UTILIZATION_RATIO: Final = "kvpressure_gpu_memory_bandwidth_utilization_ratio"
GPU_SM_OCCUPANCY_RATIO: Final = "kvpressure_gpu_sm_occupancy_ratio"
GPU_PCIE_BYTES_TOTAL: Final = "kvpressure_gpu_pcie_bytes_total"
GPU_NVLINK_BYTES_TOTAL: Final = "kvpressure_gpu_nvlink_bytes_total"
GPU_CLOCK_EVENT_ACTIVE: Final = "kvpressure_gpu_clock_event_active"
GPU_POWER_WATTS: Final = "kvpressure_gpu_power_watts"
GPU_TEMPERATURE_CELSIUS: Final = "kvpressure_gpu_temperature_celsius"
GPU_PROCESS_MEMORY_BYTES: Final = "kvpressure_gpu_process_memory_bytes"
GPU_VALUES_DROPPED_TOTAL: Final = "kvpressure_gpu_values_dropped_total"
GPU_ENGINE_DISAGREEMENT: Final = "kvpressure_gpu_engine_disagreement"
GPU_UNIFIED_MEMORY_AVAILABLE_BYTES: Final = "kvpressure_gpu_unified_memory_available_bytes"
GPU_XID_ERRORS_TOTAL: Final = "kvpressure_gpu_xid_errors_total"
ACCELERATOR_STALL_SECONDS_TOTAL: Final = "kvpressure_accelerator_stall_seconds_total"
DATA_MOVEMENT_BYTES_PER_TOKEN: Final = "kvpressure_data_movement_bytes_per_token"  # noqa: S105
TOKENS_PER_BYTE: Final = "kvpressure_tokens_per_byte"
ENGINE_UP: Final = "kvpressure_engine_up"
ENGINE_INFO: Final = "kvpressure_engine_info"
ENGINE_POD_INFO: Final = "kvpressure_engine_pod_info"
ENGINE_SCRAPE_SAMPLES: Final = "kvpressure_engine_scrape_samples"
ENGINE_PARSE_ERRORS_TOTAL: Final = "kvpressure_engine_parse_errors_total"
ENGINE_RESTARTS_TOTAL: Final = "kvpressure_engine_restarts_total"
ENGINE_SERIES_MERGED_TOTAL: Final = "kvpressure_engine_series_merged_total"
ENGINE_MODELS_DROPPED: Final = "kvpressure_engine_models_dropped"
ENGINE_LABEL_VALUES_DROPPED_TOTAL: Final = "kvpressure_engine_label_values_dropped_total"
ENGINE_GPU_MEMORY_USED_BYTES: Final = "kvpressure_engine_gpu_memory_used_bytes"
ENGINE_GPU_MEMORY_TOTAL_BYTES: Final = "kvpressure_engine_gpu_memory_total_bytes"
ENGINE_COUNTERS_WITHHELD: Final = "kvpressure_engine_counters_withheld"
ENGINE_STATS_STALE: Final = "kvpressure_engine_stats_stale"
ENGINE_KV_CACHE_USAGE_RATIO: Final = "kvpressure_engine_kv_cache_usage_ratio"
ENGINE_KV_CACHE_USED_TOKENS: Final = "kvpressure_engine_kv_cache_used_tokens"
ENGINE_KV_CACHE_CAPACITY_TOKENS: Final = "kvpressure_engine_kv_cache_capacity_tokens"
ENGINE_SLOTS: Final = "kvpressure_engine_slots"
ENGINE_REQUESTS_RUNNING: Final = "kvpressure_engine_requests_running"
ENGINE_REQUESTS_WAITING: Final = "kvpressure_engine_requests_waiting"
ENGINE_PREEMPTIONS_TOTAL: Final = "kvpressure_engine_preemptions_total"
ENGINE_FINISHED_REQUESTS_TOTAL: Final = "kvpressure_engine_finished_requests_total"
ENGINE_FINISHED_REQUESTS_PREEMPTIONS_TOTAL: Final = (
    "kvpressure_engine_finished_requests_preemptions_total"
)
ENGINE_PREFIX_CACHE_QUERIED_TOKENS_TOTAL: Final = (
    "kvpressure_engine_prefix_cache_queried_tokens_total"
)
ENGINE_PREFIX_CACHE_HIT_TOKENS_TOTAL: Final = "kvpressure_engine_prefix_cache_hit_tokens_total"
ENGINE_PROMPT_TOKENS_TOTAL: Final = "kvpressure_engine_prompt_tokens_total"
ENGINE_GENERATION_TOKENS_TOTAL: Final = "kvpressure_engine_generation_tokens_total"
ENGINE_PROMPT_SECONDS_TOTAL: Final = "kvpressure_engine_prompt_seconds_total"
ENGINE_GENERATION_SECONDS_TOTAL: Final = "kvpressure_engine_generation_seconds_total"
ENGINE_REQUESTS_WAITING_BY_REASON: Final = "kvpressure_engine_requests_waiting_by_reason"
ENGINE_REQUESTS_PAUSED: Final = "kvpressure_engine_requests_paused"
ENGINE_REQUESTS_REJECTED_TOTAL: Final = "kvpressure_engine_requests_rejected_total"
ENGINE_REQUESTS_COMPLETED_TOTAL: Final = "kvpressure_engine_requests_completed_total"
ENGINE_EXTERNAL_PREFIX_CACHE_QUERIED_TOKENS_TOTAL: Final = (
    "kvpressure_engine_external_prefix_cache_queried_tokens_total"
)
ENGINE_EXTERNAL_PREFIX_CACHE_HIT_TOKENS_TOTAL: Final = (
    "kvpressure_engine_external_prefix_cache_hit_tokens_total"
)
ENGINE_PREFIX_CACHE_HIT_RATIO: Final = "kvpressure_engine_prefix_cache_hit_ratio"
ENGINE_PREFIX_CACHE_TIER_HIT_TOKENS_TOTAL: Final = (
    "kvpressure_engine_prefix_cache_tier_hit_tokens_total"
)
ENGINE_KV_CACHE_EVICTABLE_TOKENS: Final = "kvpressure_engine_kv_cache_evictable_tokens"
ENGINE_KV_CACHE_FREE_TOKENS: Final = "kvpressure_engine_kv_cache_free_tokens"
ENGINE_KV_CACHE_BLOCK_SIZE_TOKENS: Final = "kvpressure_engine_kv_cache_block_size_tokens"
ENGINE_KV_CACHE_BLOCKS: Final = "kvpressure_engine_kv_cache_blocks"
ENGINE_KV_CACHE_CAPACITY_BYTES: Final = "kvpressure_engine_kv_cache_capacity_bytes"
ENGINE_KV_CACHE_MAX_CONCURRENCY: Final = "kvpressure_engine_kv_cache_max_concurrency"
ENGINE_KV_TIER_USAGE_RATIO: Final = "kvpressure_engine_kv_tier_usage_ratio"
ENGINE_KV_TIER_HIT_RATIO: Final = "kvpressure_engine_kv_tier_hit_ratio"
ENGINE_KV_OFFLOAD_BYTES_TOTAL: Final = "kvpressure_engine_kv_offload_bytes_total"
ENGINE_KV_OFFLOAD_BLOCKS_TOTAL: Final = "kvpressure_engine_kv_offload_blocks_total"
ENGINE_KV_OFFLOAD_TOKENS_TOTAL: Final = "kvpressure_engine_kv_offload_tokens_total"
ENGINE_KV_TIER_EVICTIONS_TOTAL: Final = "kvpressure_engine_kv_tier_evictions_total"
ENGINE_BATCH_MAX_TOKENS: Final = "kvpressure_engine_batch_max_tokens"
ENGINE_LATENCY_SECONDS: Final = "kvpressure_engine_latency_seconds"
ENGINE_LATENCY_WINDOW_OBSERVATIONS: Final = "kvpressure_engine_latency_window_observations"
ENGINE_REQUEST_LATENCY_SECONDS: Final = "kvpressure_engine_request_latency_seconds"
ENGINE_KV_BLOCK_RESIDENCY_SECONDS: Final = "kvpressure_engine_kv_block_residency_seconds"
ENGINE_KV_BLOCK_RESIDENCY_WINDOW_OBSERVATIONS: Final = (
    "kvpressure_engine_kv_block_residency_window_observations"
)
ENGINE_REQUEST_DURATION_SECONDS_TOTAL: Final = "kvpressure_engine_request_duration_seconds_total"
REQUEST_LATENCY_SECONDS: Final = "kvpressure_request_latency_seconds"
REQUESTS_TOTAL: Final = "kvpressure_requests_total"
REQUEST_TOKENS_TOTAL: Final = "kvpressure_request_tokens_total"
PROXY_UPSTREAM_CONNECT_SECONDS: Final = "kvpressure_proxy_upstream_connect_seconds"
REQUEST_RECORDS_DROPPED_TOTAL: Final = "kvpressure_request_records_dropped_total"
OTLP_REQUESTS_TOTAL: Final = "kvpressure_otlp_requests_total"
OTLP_SPANS_RECEIVED_TOTAL: Final = "kvpressure_otlp_spans_received_total"
OTLP_SPAN_ATTRIBUTES_DROPPED_TOTAL: Final = "kvpressure_otlp_span_attributes_dropped_total"
KV_BYTES_PER_TOKEN: Final = "kvpressure_kv_bytes_per_token"  # noqa: S105
KV_HEADROOM_TOKENS: Final = "kvpressure_kv_headroom_tokens"
KV_HEADROOM_BYTES: Final = "kvpressure_kv_headroom_bytes"
KV_REQUEST_TOKENS: Final = "kvpressure_kv_request_tokens"
KV_SATURATION_CONCURRENCY: Final = "kvpressure_kv_saturation_concurrency"
KV_TIME_TO_SATURATION_SECONDS: Final = "kvpressure_kv_time_to_saturation_seconds"
KV_OCCUPANCY_LATENCY_SECONDS: Final = "kvpressure_kv_occupancy_latency_seconds"
PREFIX_CACHE_SAVED_SECONDS_TOTAL: Final = "kvpressure_prefix_cache_saved_seconds_total"
SLOW_REQUESTS_TOTAL: Final = "kvpressure_slow_requests_total"
ATTRIBUTION_SCORE: Final = "kvpressure_attribution_score"
ATTRIBUTION_PENDING_RECORDS: Final = "kvpressure_attribution_pending_records"
ATTRIBUTION_DROPPED_RECORDS_TOTAL: Final = "kvpressure_attribution_dropped_records_total"
OTLP_EXPORTED_TOTAL: Final = "kvpressure_otlp_exported_total"
OTLP_EXPORT_DROPPED_TOTAL: Final = "kvpressure_otlp_export_dropped_total"
OTLP_EXPORT_QUEUE_SPANS: Final = "kvpressure_otlp_export_queue_spans"
SampleName = Literal[
    "kvpressure_build_info",
    "kvpressure_sampler_up",
    "kvpressure_sampler_duration_seconds",
    "kvpressure_sampler_failures_total",
    "kvpressure_source_up",
    "kvpressure_source_unsupported",
    "kvpressure_timeline_series",
    "kvpressure_timeline_dropped_samples_total",
    "kvpressure_timeline_evicted_series_total",
    "kvpressure_exporter_unknown_samples_total",
    "kvpressure_config_reloads_total",
    "kvpressure_host_memory_total_bytes",
    "kvpressure_host_memory_available_bytes",
    "kvpressure_host_meminfo_total_bytes",
    "kvpressure_host_meminfo_available_bytes",
    "kvpressure_host_cgroup_memory_limit_bytes",
    "kvpressure_host_cgroup_memory_used_bytes",
    "kvpressure_host_swap_total_bytes",
    "kvpressure_host_swap_used_bytes",
    "kvpressure_host_major_page_faults_total",
    "kvpressure_host_swap_in_pages_total",
    "kvpressure_host_swap_out_pages_total",
    "kvpressure_host_allocstalls_total",
    "kvpressure_psi_stall_seconds_total",
    "kvpressure_psi_avg10_ratio",
    "kvpressure_cgroup_memory_used_bytes",
    "kvpressure_cgroup_memory_limit_bytes",
    "kvpressure_cgroup_memory_events_total",
    "kvpressure_host_cpu_seconds_total",
    "kvpressure_engine_process_cpu_seconds_total",
    "kvpressure_disk_read_bytes_total",
    "kvpressure_disk_written_bytes_total",
    "kvpressure_disk_reads_completed_total",
    "kvpressure_disk_writes_completed_total",
    "kvpressure_disk_io_time_seconds_total",
    "kvpressure_disk_io_time_weighted_seconds_total",
    "kvpressure_net_receive_bytes_total",
    "kvpressure_net_transmit_bytes_total",
    "kvpressure_net_receive_errors_total",
    "kvpressure_net_transmit_errors_total",
    "kvpressure_net_receive_drops_total",
    "kvpressure_net_transmit_drops_total",
    "kvpressure_net_tcp_retransmitted_segments_total",
    "kvpressure_memory_tier_bytes",
    "kvpressure_gpu_up",
    "kvpressure_gpu_info",
    "kvpressure_gpu_memory_total_bytes",
    "kvpressure_gpu_memory_used_bytes",
    "kvpressure_gpu_memory_reserved_bytes",
    "kvpressure_gpu_memory_free_bytes",
    "kvpressure_gpu_utilization_ratio",
    "kvpressure_gpu_memory_bandwidth_utilization_ratio",
    "kvpressure_gpu_sm_occupancy_ratio",
    "kvpressure_gpu_pcie_bytes_total",
    "kvpressure_gpu_nvlink_bytes_total",
    "kvpressure_gpu_clock_event_active",
    "kvpressure_gpu_power_watts",
    "kvpressure_gpu_temperature_celsius",
    "kvpressure_gpu_process_memory_bytes",
    "kvpressure_gpu_values_dropped_total",
    "kvpressure_gpu_engine_disagreement",
    "kvpressure_gpu_unified_memory_available_bytes",
    "kvpressure_gpu_xid_errors_total",
    "kvpressure_accelerator_stall_seconds_total",
    "kvpressure_data_movement_bytes_per_token",
    "kvpressure_tokens_per_byte",
    "kvpressure_engine_up",
    "kvpressure_engine_info",
    "kvpressure_engine_pod_info",
    "kvpressure_engine_scrape_samples",
    "kvpressure_engine_parse_errors_total",
    "kvpressure_engine_restarts_total",
    "kvpressure_engine_series_merged_total",
    "kvpressure_engine_models_dropped",
    "kvpressure_engine_label_values_dropped_total",
    "kvpressure_engine_gpu_memory_used_bytes",
    "kvpressure_engine_gpu_memory_total_bytes",
    "kvpressure_engine_counters_withheld",
    "kvpressure_engine_stats_stale",
    "kvpressure_engine_kv_cache_usage_ratio",
    "kvpressure_engine_kv_cache_used_tokens",
    "kvpressure_engine_kv_cache_capacity_tokens",
    "kvpressure_engine_slots",
    "kvpressure_engine_requests_running",
    "kvpressure_engine_requests_waiting",
    "kvpressure_engine_preemptions_total",
    "kvpressure_engine_finished_requests_total",
    "kvpressure_engine_finished_requests_preemptions_total",
    "kvpressure_engine_prefix_cache_queried_tokens_total",
    "kvpressure_engine_prefix_cache_hit_tokens_total",
    "kvpressure_engine_prompt_tokens_total",
    "kvpressure_engine_generation_tokens_total",
    "kvpressure_engine_prompt_seconds_total",
    "kvpressure_engine_generation_seconds_total",
    "kvpressure_engine_requests_waiting_by_reason",
    "kvpressure_engine_requests_paused",
    "kvpressure_engine_requests_rejected_total",
    "kvpressure_engine_requests_completed_total",
    "kvpressure_engine_external_prefix_cache_queried_tokens_total",
    "kvpressure_engine_external_prefix_cache_hit_tokens_total",
    "kvpressure_engine_prefix_cache_hit_ratio",
    "kvpressure_engine_prefix_cache_tier_hit_tokens_total",
    "kvpressure_engine_kv_cache_evictable_tokens",
    "kvpressure_engine_kv_cache_free_tokens",
    "kvpressure_engine_kv_cache_block_size_tokens",
    "kvpressure_engine_kv_cache_blocks",
    "kvpressure_engine_kv_cache_capacity_bytes",
    "kvpressure_engine_kv_cache_max_concurrency",
    "kvpressure_engine_kv_tier_usage_ratio",
    "kvpressure_engine_kv_tier_hit_ratio",
    "kvpressure_engine_kv_offload_bytes_total",
    "kvpressure_engine_kv_offload_blocks_total",
    "kvpressure_engine_kv_offload_tokens_total",
    "kvpressure_engine_kv_tier_evictions_total",
    "kvpressure_engine_batch_max_tokens",
    "kvpressure_engine_latency_seconds",
    "kvpressure_engine_latency_window_observations",
    "kvpressure_engine_request_latency_seconds_bucket",
    "kvpressure_engine_request_latency_seconds_count",
    "kvpressure_engine_request_latency_seconds_sum",
    "kvpressure_engine_kv_block_residency_seconds",
    "kvpressure_engine_kv_block_residency_window_observations",
    "kvpressure_engine_request_duration_seconds_total",
    "kvpressure_request_latency_seconds_bucket",
    "kvpressure_request_latency_seconds_count",
    "kvpressure_request_latency_seconds_sum",
    "kvpressure_requests_total",
    "kvpressure_request_tokens_total",
    "kvpressure_proxy_upstream_connect_seconds_bucket",
    "kvpressure_proxy_upstream_connect_seconds_count",
    "kvpressure_proxy_upstream_connect_seconds_sum",
    "kvpressure_request_records_dropped_total",
    "kvpressure_otlp_requests_total",
    "kvpressure_otlp_spans_received_total",
    "kvpressure_otlp_span_attributes_dropped_total",
    "kvpressure_kv_bytes_per_token",
    "kvpressure_kv_headroom_tokens",
    "kvpressure_kv_headroom_bytes",
    "kvpressure_kv_request_tokens",
    "kvpressure_kv_saturation_concurrency",
    "kvpressure_kv_time_to_saturation_seconds",
    "kvpressure_kv_occupancy_latency_seconds_bucket",
    "kvpressure_kv_occupancy_latency_seconds_count",
    "kvpressure_kv_occupancy_latency_seconds_sum",
    "kvpressure_prefix_cache_saved_seconds_total",
    "kvpressure_slow_requests_total",
    "kvpressure_attribution_score",
    "kvpressure_attribution_pending_records",
    "kvpressure_attribution_dropped_records_total",
    "kvpressure_otlp_exported_total",
    "kvpressure_otlp_export_dropped_total",
    "kvpressure_otlp_export_queue_spans",
]
"""A sample's name: a catalogue metric, or a histogram's ``_bucket``/``_count``/``_sum``.

Every emission is typed by it (:meth:`agent.samples.Batch.add`, :class:`agent.samples.Sample`,
the engine mapping tables' ``Rule``/``Derived``/``WindowRatio``), so a misspelt metric name is
a ``mypy`` error, not a sample the exporter drops at run time (``tests/test_typing.py``).
``tests/test_pipeline.py`` checks it lists exactly the catalogue's sample names, in order."""

HistogramName = Literal[
    "kvpressure_engine_request_latency_seconds",
    "kvpressure_request_latency_seconds",
    "kvpressure_proxy_upstream_connect_seconds",
    "kvpressure_kv_occupancy_latency_seconds",
]
"""A catalogued histogram's own name (its samples are :func:`histogram_names`); checked
against the catalogue like :data:`SampleName`."""

if __name__ == "__main__":  # python -m kvpressure.agent.catalogue README.md
    import sys

    print("updated" if update_readme(sys.argv[1]) else "unchanged")
