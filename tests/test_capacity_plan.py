"""``kvpressure plan``: parsing, the arithmetic of the answers, agent snapshots, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpressure.agent.capacity import plan as pl
from kvpressure.agent.capacity.kvbytes import flat_shape, shape_from_hf_config
from kvpressure.agent.cli import main

HF = Path(__file__).parent / "fixtures" / "capacity" / "hf"
GIB = 1024**3


def test_parse_sizes_tokens_bandwidths_tiers():
    assert pl.parse_size("80GiB") == 80 * GIB
    assert pl.parse_size("80GB") == 80e9
    assert pl.parse_size("80G") == 80 * GIB
    assert pl.parse_size("1.5TiB") == 1.5 * 1024**4
    assert pl.parse_size("4096") == 4096
    assert pl.parse_tokens("2k") == 2048 and pl.parse_tokens("32K") == 32768
    assert pl.parse_tokens("8192") == 8192
    assert pl.parse_bandwidth("50GB/s") == 50e9
    assert pl.parse_tier("dram=512GiB@50GB/s") == ("dram", 512 * GIB, 50e9)
    assert pl.parse_tier("ssd@3GB/s") == ("ssd", None, 3e9)
    for bad in ("lots", "-1k"):
        with pytest.raises(ValueError):
            pl.parse_tokens(bad)
    with pytest.raises(ValueError):
        pl.parse_size("eighty")
    with pytest.raises(ValueError):
        pl.parse_tier("dram")


def llama_inputs(**kw: object) -> pl.PlanInputs:
    shape = shape_from_hf_config(HF / "llama-3.1-8b.json", "fp16")
    base: dict[str, object] = {
        "shape": shape,
        "contexts": [2048, 8192, 32768],
        "concurrency": 16,
        "memory_bytes": 80 * GIB,
        "weights_bytes": 16 * GIB,
        "overhead_bytes": 2 * GIB,
        "tiers": [pl.Tier("dram", 512 * GIB, 50e9, "--tier")],
        "prefill_seconds_per_token": 1e-4,
    }
    base.update(kw)
    return pl.PlanInputs(**base)  # type: ignore[arg-type]


def test_llama_8b_on_80gib_budget_fit_and_doubling():
    p = pl.make_plan(llama_inputs())
    budget = 80 * GIB * 0.9 - 16 * GIB - 2 * GIB  # 54 GiB
    assert p["kv_budget"]["bytes"] == pytest.approx(budget)
    assert p["kv_budget"]["tokens"] == pytest.approx(budget / 131072)  # 442,368 tokens
    rows = {r["context_tokens"]: r for r in p["contexts"]}
    assert rows[8192]["kv_bytes_per_request"] == 1 * GIB  # 8k x 128 KiB
    assert rows[8192]["fit"] == 54
    assert rows[32768]["fit"] == 13
    now, dbl = rows[32768]["now"], rows[32768]["doubled"]
    assert dbl["kv_demand_bytes"] == 2 * now["kv_demand_bytes"]  # doubling users doubles KV
    assert (now["queued"], dbl["queued"]) == (3, 19)
    assert dbl["occupancy"] == 1.0 and dbl["band"] == "95-100"
    assert now["tail_ttft_s"] is None  # no observed knee without an agent
    (t,) = p["tiers"]
    assert t["extra_tokens"] == 512 * GIB / 131072
    assert t["extra_requests"]["8192"] == 512
    assert t["reload_seconds_per_token"] == pytest.approx(131072 / 50e9)  # 2.6 us
    assert t["reload_vs_recompute"] == pytest.approx(1e-4 / (131072 / 50e9))
    text = pl.render_plan(p)
    assert "128.0 KiB" in text and "131,072 B" in text and "doubled (32 users)" in text


def test_no_budget_and_no_room_are_errors():
    with pytest.raises(ValueError, match="no KV budget"):
        pl.make_plan(llama_inputs(memory_bytes=None))
    with pytest.raises(ValueError, match="no room for KV"):
        pl.make_plan(llama_inputs(memory_bytes=16 * GIB))


SNAP = {
    "samples": [
        {"name": "kvpressure_engine_up", "labels": {"engine": "vllm"}, "value": 1},
        {
            "name": "kvpressure_engine_info",
            "labels": {"engine": "vllm", "type": "vllm", "model": "llama"},
            "value": 1,
        },
        {
            "name": "kvpressure_engine_kv_cache_capacity_tokens",
            "labels": {"engine": "vllm"},
            "value": 65536,
        },
        {
            "name": "kvpressure_engine_kv_cache_usage_ratio",
            "labels": {"engine": "vllm"},
            "value": 0.5,
        },
        {"name": "kvpressure_engine_requests_running", "labels": {"engine": "vllm"}, "value": 8},
        {
            "name": "kvpressure_engine_prompt_seconds_total",
            "labels": {"engine": "vllm"},
            "value": 10,
        },
        {
            "name": "kvpressure_engine_prompt_tokens_total",
            "labels": {"engine": "vllm"},
            "value": 150000,
        },
        {
            "name": "kvpressure_engine_prefix_cache_hit_tokens_total",
            "labels": {"engine": "vllm"},
            "value": 50000,
        },
        {
            "name": "kvpressure_kv_bytes_per_token",
            "labels": {"engine": "vllm", "model": "llama"},
            "value": 131072,
        },
        {"name": "kvpressure_gpu_memory_total_bytes", "labels": {"gpu": "0"}, "value": 80 * GIB},
        {"name": "kvpressure_host_memory_available_bytes", "labels": {}, "value": 400 * GIB},
        {
            "name": "kvpressure_memory_tier_bytes",
            "labels": {"tier": "cxl", "state": "free"},
            "value": 128 * GIB,
        },
    ]
}


def _knee(phase: str, band: str, le_counts: list[tuple[str, float]], total: float) -> list[dict]:
    lab = {"engine": "vllm", "phase": phase, "band": band}
    out = [
        {
            "name": "kvpressure_kv_occupancy_latency_seconds_bucket",
            "labels": {**lab, "le": le},
            "value": c,
        }
        for le, c in le_counts
    ]
    out.append(
        {"name": "kvpressure_kv_occupancy_latency_seconds_count", "labels": lab, "value": total}
    )
    out.append(
        {"name": "kvpressure_kv_occupancy_latency_seconds_sum", "labels": lab, "value": total * 0.1}
    )
    return out


def snapshot_with_knee() -> dict:
    snap = json.loads(json.dumps(SNAP))
    snap["samples"] += _knee("ttft", "0-50", [("0.1", 90), ("0.25", 100), ("+Inf", 100)], 100)
    snap["samples"] += _knee("ttft", "95-100", [("1.0", 50), ("5.0", 100), ("+Inf", 100)], 100)
    snap["samples"] += _knee("itl", "95-100", [("0.01", 0), ("0.05", 100), ("+Inf", 100)], 100)
    return snap


def test_live_from_snapshot_and_engine_choice():
    live = pl.live_from_snapshot(snapshot_with_knee())
    assert live.engine == "vllm" and live.capacity_tokens == 65536
    assert live.used_tokens == 32768  # ratio x capacity
    assert live.prefill_seconds_per_token == pytest.approx(10 / 100000)  # hits excluded
    assert live.gpu_memory_bytes == 80 * GIB and live.cxl_free_bytes == 128 * GIB
    assert {(s.phase, s.band) for s in live.knee} == {
        ("ttft", "0-50"),
        ("ttft", "95-100"),
        ("itl", "95-100"),
    }
    with pytest.raises(ValueError, match="no engine 'x'"):
        pl.live_from_snapshot(SNAP, "x")
    two = json.loads(json.dumps(SNAP))
    two["samples"].append({"name": "kvpressure_engine_up", "labels": {"engine": "b"}, "value": 1})
    with pytest.raises(ValueError, match="pass --engine"):
        pl.live_from_snapshot(two)


def test_plan_with_agent_uses_engine_capacity_and_the_knee():
    live = pl.live_from_snapshot(snapshot_with_knee())
    shape = flat_shape(131072, "llama", "agent")
    p = pl.make_plan(
        pl.PlanInputs(
            shape=shape,
            contexts=[8192],
            concurrency=4,
            live=live,
            output_tokens=100,
            tiers=pl.default_tiers(live),
        )
    )
    assert p["kv_budget"]["tokens"] == 65536  # engine-reported, not estimated
    (row,) = p["contexts"]
    assert row["fit"] == 8
    now, dbl = row["now"], row["doubled"]
    assert now["band"] == "50-80" and now["knee_band_used"] == "0-50"  # nearest lower band
    assert now["queued"] == 0 and now["tail_ttft_s"] == pytest.approx(
        0.25 * 0 + 0.25 - 0.0, abs=0.1
    )
    assert dbl["band"] == "95-100" and dbl["queued"] == 0
    # 16 users: 16 x 8k = 131,072 tokens > 65,536: 8 queue, one wave of service
    p16 = pl.make_plan(
        pl.PlanInputs(shape=shape, contexts=[8192], concurrency=16, live=live, output_tokens=100)
    )
    d16 = p16["contexts"][0]["now"]
    assert d16["queued"] == 8 and d16["queue_waves"] == 1
    service = d16["ttft_p50_s"] + 100 * d16["itl_p50_s"]
    assert d16["tail_ttft_s"] == pytest.approx(d16["ttft_p99_s"] + service)
    tiers = {t["tier"]: t for t in p["tiers"]}
    assert tiers["dram"]["capacity_from"] == "agent" and tiers["cxl"]["capacity_from"] == "agent"
    assert "ssd" not in tiers  # no SSD tier found or given: none assumed
    assert any(n.startswith("tiers not shown: ssd") for n in p["notes"])


def test_llamacpp_fit_is_the_slot_count():
    live = pl.LiveFacts(engine="llamacpp", engine_type="llamacpp", capacity_tokens=2048, slots=4)
    shape = flat_shape(18432)
    p = pl.make_plan(
        pl.PlanInputs(shape=shape, contexts=[300, 512, 1024], concurrency=4, live=live)
    )
    assert [r["fit"] for r in p["contexts"]] == [4, 4, 0]  # 1024 > a 512-token slot
    refused = p["contexts"][2]["now"]
    assert refused["queued"] is None and refused["tail_ttft_s"] is None
    assert p["contexts"][0]["doubled"]["queued"] == 4  # 8 users on 4 slots: 4 wait
    assert any("slots" in n for n in p["notes"])


def test_cli_plan_hf_config_json(capsys):
    rc = main(
        [
            "plan",
            "--hf-config",
            str(HF / "llama-3.1-8b.json"),
            "--kv-dtype",
            "fp16",
            "--gpu-memory",
            "80GiB",
            "--context",
            "8k",
            "--concurrency",
            "8",
            "--json",
            "--tier",
            "dram=256GiB@50GB/s",
            "--prefill-rate",
            "0.0001",
        ]
    )
    assert rc == 0
    p = json.loads(capsys.readouterr().out)
    assert p["model"]["bytes_per_token"] == 131072
    # weights: the dense estimate (8.03 B params x 2 B), overhead 2 GiB
    assert p["kv_budget"]["bytes"] == pytest.approx(80 * GIB * 0.9 - 2 * 8.03e9 - 2 * GIB, rel=0.01)
    assert p["contexts"][0]["fit"] == 55  # 55.0 GiB / 1 GiB per 8k request


def test_cli_plan_errors(capsys, tmp_path):
    assert main(["plan", "--hf-config", str(HF / "llama-3.1-8b.json")]) == 1
    assert "no KV budget" in capsys.readouterr().err
    assert main(["plan", "--gguf", str(tmp_path / "none.gguf"), "--gpu-memory", "8GiB"]) == 1
    assert main(["plan", "--hf-config", str(HF / "llama-3.1-8b.json"), "--context", "x"]) == 2
    assert main(["plan", "--gpu-memory", "80GiB"]) == 1
    assert "no model shape" in capsys.readouterr().err
    assert main(["plan", "--agent", "http://127.0.0.1:9", "--gpu-memory", "8GiB"]) == 1
    assert "no agent answering" in capsys.readouterr().err


def test_cli_plan_with_agent_and_live_gpu(monkeypatch, capsys):
    monkeypatch.setattr(
        pl,
        "fetch_live",
        lambda url, engine=None: pl.live_from_snapshot(snapshot_with_knee(), engine),
    )
    rc = main(
        [
            "plan",
            "--agent",
            "http://agent",
            "--live-gpu",
            "--context",
            "2k,8k",
            "--concurrency",
            "4",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "engine-reported capacity 65,536 tokens" in out
    assert "knee ttft band 95-100%" in out
    assert "dram" in out and "cxl" in out
    assert "so it differs from `kvpressure explain`'s p99" in out  # says why they disagree


def test_readme_plan_example_runs_as_printed_from_a_clean_clone(capsys):
    """The README's `kvpressure plan` example names a file the repository ships, and prints
    what the README shows."""
    import re
    import shlex

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    m = re.search(r"```console\n\$ (kvpressure plan (?:[^\n]*\\\n)*[^\n]*)\n(.*?)```", readme, re.S)
    assert m, "no `kvpressure plan` example in the README"
    argv = shlex.split(m.group(1).replace("\\\n", " "))[1:]
    path = Path(argv[argv.index("--hf-config") + 1])
    assert (root / path).is_file(), f"the README's example names {path}, which is not shipped"
    argv[argv.index("--hf-config") + 1] = str(root / path)
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip() == m.group(2).rstrip()


def test_deepseek_v3_on_8_h200_subtracts_its_moe_weights(tmp_path, capsys):
    """The issue's case: 8 x 141 GiB no longer prints "weights 0 B"."""
    cfg = json.loads((Path(__file__).parent / "fixtures/capacity/hf/deepseek-v3.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}  # as published
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["plan", "--hf-config", str(tmp_path), "--gpu-memory", "141GiB", "--gpus", "8"]
    assert main(argv) == 0
    budget = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("KV budget"))
    assert "weights 624.9 GiB (671.03 B parameters (MoE estimate" in budget
    assert "KV budget    374.3 GiB" in budget  # 8 x 141 x 0.9 - 624.9 - 16


def test_weights_that_cannot_be_estimated_are_said_loudly(capsys):
    hf = Path(__file__).parent / "fixtures/capacity/hf/qwen3-next-80b-a3b.json"
    assert main(["plan", "--hf-config", str(hf), "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "weights UNKNOWN (not subtracted: pass --weights)" in out
    assert "weights 0 B" not in out
    assert "weights unknown and NOT subtracted, so the KV budget is too high" in out


def test_tiers_neither_found_nor_given_are_not_assumed(capsys):
    hf = Path(__file__).parent / "fixtures/capacity/hf/llama-3.1-8b.json"
    assert (
        main(["plan", "--hf-config", str(hf), "--gpu-memory", "80GiB", "--tier", "ssd=1TiB"]) == 0
    )
    out = capsys.readouterr().out
    rows = [x.split()[0] for x in out.split("TIER ", 1)[1].splitlines()[1:] if x and x[0] != "n"]
    assert "cxl" not in rows and "ssd" in rows and "assumed" not in out
    assert "tiers not shown: cxl (neither found on this host nor given" in out


def test_plan_agent_llamacpp_reads_name_and_kv_dtype_from_the_gguf_it_serves(tmp_path, capsys):
    """`plan --agent` for llama.cpp: the GGUF named by the engine's /props gives the model's
    name, layout and KV dtype, not "(agent, ?)" and "KV dtype unknown"."""
    import http.server
    import threading

    from test_capacity_kvbytes import _write_gguf

    gguf_path = tmp_path / "tiny-llama.gguf"
    _write_gguf(gguf_path, "llama", {
        "{arch}.block_count": 32, "{arch}.attention.head_count": 32,
        "{arch}.attention.head_count_kv": 8, "{arch}.embedding_length": 4096,
        "{arch}.context_length": 131072,
    })  # fmt: skip
    docs: dict[str, object] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(docs.get(self.path, {})).encode()
            self.send_response(200 if self.path in docs else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    inst = f"127.0.0.1:{srv.server_address[1]}"
    eng = {"engine": "llamacpp", "instance": inst}
    docs["/props"] = {"model_path": str(gguf_path), "total_slots": 4}
    docs["/api/v1/snapshot"] = {"samples": [
        {"name": "kvpressure_engine_up", "labels": eng, "value": 1},
        {"name": "kvpressure_engine_info",
         "labels": {**eng, "type": "llamacpp", "model": "tiny-llama.gguf"}, "value": 1},
        {"name": "kvpressure_engine_kv_cache_capacity_tokens", "labels": eng, "value": 8192},
        {"name": "kvpressure_kv_bytes_per_token", "labels": eng, "value": 131072},
    ]}  # fmt: skip
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert main(["plan", "--agent", f"http://{inst}", "--context", "2k"]) == 0
    finally:
        srv.shutdown()
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert "(agent, ?)" not in head and "unknown" not in head
    assert "(gguf, llama), KV dtype f16" in head
    assert "KV per token 128.0 KiB" in out  # the GGUF's layout agrees with the agent's figure
    assert f"layout read from {gguf_path}, the GGUF llamacpp serves" in out


def test_without_an_agent_cxl_is_shown_only_when_this_host_has_it(tmp_path):
    """CPU-less NUMA nodes (CXL expanders) are read as the agent reads them; none, no tier."""
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    (proc).mkdir()
    (proc / "meminfo").write_text("MemTotal: 16000000 kB\nMemFree: 8000000 kB\n"
                                  "MemAvailable: 9000000 kB\n")  # fmt: skip
    nodes = sys_ / "devices/system/node"
    for n, cpus, total, free in ((0, "0-7\n", 12000000, 6000000), (1, "\n", 4000000, 3500000)):
        (nodes / f"node{n}").mkdir(parents=True)
        (nodes / f"node{n}/cpulist").write_text(cpus)
        (nodes / f"node{n}/meminfo").write_text(
            f"Node {n} MemTotal: {total} kB\nNode {n} MemFree: {free} kB\n"
        )
    cxl = pl.local_cxl_free(str(sys_), str(proc))
    assert cxl == 3500000 * 1024
    tiers = {t.name: t for t in pl.default_tiers(None, [], 9e9, cxl)}
    assert tiers["cxl"].capacity_from == "this host" and tiers["cxl"].capacity_bytes == cxl
    assert "ssd" not in tiers
    (nodes / "node1/cpulist").write_text("8-15\n")  # the same node with CPUs: plain DRAM
    assert pl.local_cxl_free(str(sys_), str(proc)) is None
    assert "cxl" not in {t.name for t in pl.default_tiers(None, [], 9e9, None)}
