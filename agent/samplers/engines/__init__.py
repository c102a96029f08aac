"""Inference-engine samplers: scrape an engine's metrics and map them to the catalogue.

Layout:

* :mod:`.exposition`: fetch-independent parsing and response classification;
* :mod:`.normalize`: the one normalizer, driven by per-engine :class:`EngineMapping` tables;
* one mapping module per engine: :mod:`.vllm`, :mod:`.sglang`, :mod:`.llamacpp`,
  :mod:`.tgi`, :mod:`.trtllm` (``trtllm-serve``), :mod:`.triton` (Triton with the
  TensorRT-LLM backend), and :mod:`.kvtiers` (LMCache and Dynamo KVBM, KV-tier sources);
* :mod:`.registry`: :data:`ENGINE_TYPES`, re-exported here;
* :mod:`.base`: :class:`EngineSampler`, :func:`probe`, :func:`engine_type_from_families`.

A new engine is a mapping module, its fixtures under ``tests/fixtures/engines/<engine>/``
and a golden test; the normalizer does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvpressure.agent.pipeline import (
    ENGINE_GAUGE_SAMPLER,
    ENGINE_SAMPLER,
    Context,
    Plan,
    Stage,
    register,
)
from kvpressure.agent.samplers.engines.base import (
    AUTO,
    EngineGaugeSampler,
    EngineSampler,
    engine_type_from_families,
    probe,
)
from kvpressure.agent.samplers.engines.normalize import EngineMapping, Rule
from kvpressure.agent.samplers.engines.registry import ENGINE_TYPES

if TYPE_CHECKING:
    import httpx

__all__ = [
    "AUTO",
    "ENGINE_TYPES",
    "EngineGaugeSampler",
    "EngineMapping",
    "EngineSampler",
    "Rule",
    "engine_type_from_families",
    "make_engine_sampler",
    "probe",
]


def make_engine_sampler(
    name: str,
    url: str,
    engine_type: str = AUTO,
    interval_s: float = 1.0,
    timeout_s: float | None = None,
    transport: httpx.BaseTransport | None = None,
    pod_labels: Callable[[str], Mapping[str, str]] | None = None,
) -> EngineSampler:
    """Build the sampler for one configured engine endpoint.

    Args:
        name: the engine's configured name (the ``engine`` label).
        url: its base URL, e.g. ``http://127.0.0.1:8000``.
        engine_type: a key of :data:`ENGINE_TYPES` or ``"auto"``.
        interval_s: seconds between collections.
        timeout_s: collection budget in seconds (default ``max(interval_s, 2.0)``).
        transport: optional ``httpx`` transport (tests).
        pod_labels: the engine's pod labels by engine name (:class:`EngineSampler`).

    Returns:
        An :class:`EngineSampler`.

    Raises:
        ValueError: ``engine_type`` is unknown.
    """
    return EngineSampler(
        name,
        url,
        engine_type=engine_type,
        interval_s=interval_s,
        timeout_s=timeout_s,
        transport=transport,
        pod_labels=pod_labels,
    )


@register(
    "engines",
    Stage.SOURCE,
    "each configured or discovered engine's /metrics, mapped to the catalogue",
    label="engine",
)
def _plan(ctx: Context) -> list[Plan]:
    interval = ctx.interval_s("engines")
    gauges = ctx.config.samplers.engines.gauges_interval_s
    out: list[Plan] = []
    for e in ctx.engines:
        # the gauge sampler reads its engine sampler's state: both share one spec, so a
        # change to either rebuilds both
        spec = ("engine", e.label, e.url, e.type, interval, gauges)
        built: list[EngineSampler] = []

        def build(
            name: str = e.label,
            url: str = e.url,
            kind: str = e.type,
            built: list[EngineSampler] = built,
        ) -> EngineSampler:
            sampler = make_engine_sampler(
                name=name,
                url=url,
                engine_type=kind,
                interval_s=interval,
                pod_labels=ctx.engine_pods,
            )
            built[:] = [sampler]
            return sampler

        out.append(Plan(f"{ENGINE_SAMPLER}{e.label}", spec, build))
        if gauges and gauges < interval:

            def build_gauges(
                built: list[EngineSampler] = built, every: float = gauges
            ) -> EngineGaugeSampler:
                if not built:
                    raise RuntimeError("the engine sampler was not built")
                return built[0].gauge_sampler(every)

            out.append(Plan(f"{ENGINE_GAUGE_SAMPLER}{e.label}", spec, build_gauges))
    return out
