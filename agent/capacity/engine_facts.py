"""What the engines themselves report about their KV pool.

* **vLLM** ``vllm:cache_config_info`` (an info gauge whose labels carry the cache config):
  capacity = ``kv_cache_size_tokens``, else ``num_gpu_blocks x block_size``; the KV dtype
  (``cache_dtype``), vLLM's own ``kv_cache_max_concurrency`` (requests of the model's full
  length that fit), and, where set, ``kv_cache_memory_bytes``, from which bytes per token
  follows as ``kv_cache_memory_bytes / capacity``.
* **llama.cpp** ``/props`` (``default_generation_settings.n_ctx`` = context per slot,
  ``total_slots``) and ``/slots``: capacity = ``n_ctx x total_slots`` when each slot has its
  own cells (the default, ``kv_unified = false``, ``-c`` split evenly). With
  ``--kv-unified`` every slot reports the whole pool as its ``n_ctx``; the pool is then
  ``n_ctx`` once, which ``/props`` cannot tell apart: pass ``unified=True``.

Neither engine reports bytes per token directly except vLLM with ``kv_cache_memory_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineKV:
    """An engine's own account of its KV pool.

    Attributes:
        engine_type: ``vllm`` or ``llamacpp``.
        capacity_tokens: tokens the pool holds; ``None`` when not reported.
        slots: llama.cpp request slots (the most requests that run at once).
        tokens_per_slot: llama.cpp context per slot.
        block_size: vLLM tokens per block.
        num_blocks: vLLM GPU blocks.
        kv_dtype: the KV dtype the engine says it uses (``auto`` = the model's dtype).
        kv_memory_bytes: bytes the engine gave the pool, where it says so.
        max_concurrency: the engine's own "requests of full model length that fit".
        model_path: llama.cpp ``model_path`` (a GGUF whose shape can be read).
    """

    engine_type: str
    capacity_tokens: int | None
    slots: int | None = None
    tokens_per_slot: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    kv_dtype: str | None = None
    kv_memory_bytes: int | None = None
    max_concurrency: float | None = None
    model_path: str | None = None

    @property
    def bytes_per_token(self) -> float | None:
        """``kv_memory_bytes / capacity_tokens`` when both are known."""
        if self.kv_memory_bytes and self.capacity_tokens:
            return self.kv_memory_bytes / self.capacity_tokens
        return None


def _pos_int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v > 0 else None
    if isinstance(v, str):
        try:
            n = int(v)
        except ValueError:
            return None
        return n if n > 0 else None
    return None


def _pos_float(v: object) -> float | None:
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if x > 0 else None


def from_vllm_cache_config(labels: Mapping[str, str]) -> EngineKV:
    """Read the labels of one ``vllm:cache_config_info`` sample.

    Args:
        labels: label name to value, as exposed (``"None"`` means unset).
    """
    blocks = _pos_int(labels.get("num_gpu_blocks"))
    size = _pos_int(labels.get("block_size"))
    tokens = _pos_int(labels.get("kv_cache_size_tokens"))
    if tokens is None and blocks is not None and size is not None:
        tokens = blocks * size
    return EngineKV(
        engine_type="vllm",
        capacity_tokens=tokens,
        block_size=size,
        num_blocks=blocks,
        kv_dtype=labels.get("cache_dtype") or None,
        kv_memory_bytes=_pos_int(labels.get("kv_cache_memory_bytes")),
        max_concurrency=_pos_float(labels.get("kv_cache_max_concurrency")),
    )


def from_vllm_metrics(text: str) -> list[EngineKV]:
    """Return one :class:`EngineKV` per ``vllm:cache_config_info`` sample of an exposition.

    Args:
        text: vLLM's ``/metrics`` body (Prometheus text format).
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: list[EngineKV] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info":
                out.append(from_vllm_cache_config(s.labels))
    return out


def from_llamacpp(props: Mapping[str, Any], slots: Any = None, unified: bool = False) -> EngineKV:
    """Read llama-server's ``/props`` (and optionally ``/slots``).

    Args:
        props: the decoded ``/props`` JSON.
        slots: the decoded ``/slots`` JSON list, if read (its ``n_ctx`` per slot wins).
        unified: the server runs with ``--kv-unified`` (one pool of ``n_ctx`` cells shared
            by every slot).
    """
    settings = props.get("default_generation_settings")
    n_ctx = _pos_int(settings.get("n_ctx")) if isinstance(settings, Mapping) else None
    total = _pos_int(props.get("total_slots"))
    if isinstance(slots, list) and slots:
        ctxs = [_pos_int(s.get("n_ctx")) for s in slots if isinstance(s, Mapping)]
        if ctxs and all(c is not None for c in ctxs):
            total = len(ctxs)
            n_ctx = max(c for c in ctxs if c is not None)
    capacity: int | None = None
    if n_ctx is not None:
        capacity = n_ctx if unified else (n_ctx * total if total else None)
    path = props.get("model_path")
    return EngineKV(
        engine_type="llamacpp",
        capacity_tokens=capacity,
        slots=total,
        tokens_per_slot=n_ctx,
        model_path=path if isinstance(path, str) and path else None,
    )
