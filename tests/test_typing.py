"""Metric names are typed by the catalogue: a misspelt name fails ``mypy``, not production.

Every way a sample is made takes a :data:`agent.catalogue.SampleName` (``Batch.add``,
``Batch.add_labelled``, ``Sample``, the engine tables' ``Rule``/``Derived``/``WindowRatio``), and
every name attribution reads (``@reads`` on a rule, the ``Signals`` lookups) is one too, or
a :data:`agent.catalogue.HistogramName` (``histogram_names``, ``Rule.export``). The proof runs
the project's own mypy configuration on a snippet holding each call twice, once spelt right and
once with a typo, and checks mypy rejects exactly the misspelt lines (a comparison of a
sample's name with a name no sample can have is rejected too: ``strict_equality``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

from kvpressure.agent import catalogue
from kvpressure.agent.samplers.engines import ENGINE_TYPES
from kvpressure.agent.samplers.engines.normalize import window_observations_name

ROOT = Path(__file__).resolve().parent.parent

# (statement spelt right, the same statement with a typo)
CASES = (
    (
        'Batch().add("kvpressure_gpu_memory_used_bytes", 1.0, gpu="0")',
        'Batch().add("kvpressure_gpu_memory_used_byte", 1.0, gpu="0")',
    ),
    (
        'Batch().add_labelled("kvpressure_gpu_up", 1.0, (("gpu", "0"),))',
        'Batch().add_labelled("kvpressure_gpu_upp", 1.0, (("gpu", "0"),))',
    ),
    ('Sample("kvpressure_engine_up", 1.0)', 'Sample("kvpressure_engin_up", 1.0)'),
    (
        'Rule("kvpressure_engine_kv_cache_usage_ratio", ("vllm:kv_cache_usage_perc",))',
        'Rule("kvpressure_engine_kv_cache_usage_ratoi", ("vllm:kv_cache_usage_perc",))',
    ),
    (
        'Derived("kvpressure_engine_kv_cache_capacity_tokens", 1.0)',
        'Derived("kvpressure_engine_kv_cache_capacity_token", 1.0)',
    ),
    (
        'WindowRatio("kvpressure_engine_prefix_cache_hit_ratio", '
        '"kvpressure_engine_prefix_cache_hit_tokens_total", '
        '"kvpressure_engine_prefix_cache_queried_tokens_total")',
        'WindowRatio("kvpressure_engine_prefix_cache_hit_ratio", '
        '"kvpressure_engine_prefix_cache_hits_tokens_total", '
        '"kvpressure_engine_prefix_cache_queried_tokens_total")',
    ),
    (
        'catalogue.histogram_names("kvpressure_request_latency_seconds")',
        'catalogue.histogram_names("kvpressure_request_latency_second")',
    ),
    ("Batch().add(catalogue.GPU_UP, 1.0)", "Batch().add(catalogue.GPU_UPP, 1.0)"),
    # attribution: what a rule declares it reads, and what it reads from the signals
    (
        'reads("kvpressure_engine_preemptions_total")',
        'reads("kvpressure_engine_preemption_total")',
    ),
    (
        'Signals({}).gauge_max("kvpressure_engine_kv_cache_usage_ratio", 0.0, 1.0)',
        'Signals({}).gauge_max("kvpressure_engine_kv_cache_usage_ratoi", 0.0, 1.0)',
    ),
    # reading: a comparison with a name no sample can have (mypy's strict_equality)
    (
        'assert Sample("kvpressure_gpu_up", 1.0).name == "kvpressure_gpu_up"',
        'assert Sample("kvpressure_gpu_up", 1.0).name != "kvpressure_gpu_upp"',
    ),
)

HEADER = """\
from kvpressure.agent import catalogue
from kvpressure.agent.attribution.rules import reads
from kvpressure.agent.attribution.signals import Signals
from kvpressure.agent.samplers.engines.normalize import Derived, Rule, WindowRatio
from kvpressure.agent.samples import Batch, Sample
"""


def test_a_misspelt_metric_name_is_a_mypy_error(tmp_path):
    lines = HEADER.splitlines()
    typo_lines = set()
    for right, wrong in CASES:
        lines.append(right)
        lines.append(wrong)
        typo_lines.add(len(lines))
    snippet = tmp_path / "snippet.py"
    snippet.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            "--hide-error-context",
            str(snippet),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    errors = [ln for ln in res.stdout.splitlines() if ": error: " in ln]
    bad = {int(ln.split(":")[1]) for ln in errors}
    assert res.returncode == 1, res.stdout + res.stderr
    assert bad == typo_lines, res.stdout
    # each typo is rejected for its name, not for something else on the line
    assert all("Literal[" in ln or "has no attribute" in ln for ln in errors), res.stdout


def test_name_types_list_exactly_the_catalogue():
    histograms = [n for n, m in catalogue.CATALOGUE.items() if m.kind == "histogram"]
    assert list(get_args(catalogue.HistogramName)) == histograms
    samples = set(get_args(catalogue.SampleName))
    for name in histograms:
        assert set(catalogue.histogram_names(name)) <= samples


def test_every_engine_table_name_is_a_catalogued_sample_name():
    """What the tables type statically, checked at run time too (the casts in normalize)."""
    samples = set(get_args(catalogue.SampleName))
    for mapping in ENGINE_TYPES.values():  # engines and the KV-tier sources
        for rule in mapping.rules:
            assert rule.canonical in samples, (mapping.engine_type, rule.canonical)
            if rule.kind == "histogram":
                assert window_observations_name(rule.canonical) in samples, rule.canonical
            if rule.export:
                assert rule.export in get_args(catalogue.HistogramName), rule.export
        for ratio in mapping.ratios:
            assert {ratio.canonical, ratio.numerator, ratio.denominator} <= samples
