"""The engine types the agent knows, and how each is recognised from its metric names.

Engines are named ``vllm``, ``sglang``, ``llamacpp``, ``tgi``, ``trtllm`` and ``triton``
(DESIGN.md); ``lmcache`` and ``kvbm`` are KV-tier sources with an endpoint of their own.
Every type is one module holding an :class:`~agent.samplers.engines.normalize.EngineMapping`
(its ``Rule`` table); adding one is that module, its fixtures and a test, plus one line
here.
"""

from __future__ import annotations

from typing import Final

from kvpressure.agent.samplers.engines import kvtiers, llamacpp, sglang, tgi, triton, trtllm, vllm
from kvpressure.agent.samplers.engines.normalize import EngineMapping

ENGINE_TYPES: Final[dict[str, EngineMapping]] = {
    "vllm": vllm.MAPPING,
    "sglang": sglang.MAPPING,
    "llamacpp": llamacpp.MAPPING,
    "tgi": tgi.MAPPING,
    # trtllm-serve exports trtllm_* on /prometheus/metrics; Triton's TensorRT-LLM backend
    # exports the batch manager's stats as nv_trt_llm_* next to Triton's nv_inference_*.
    "trtllm": trtllm.MAPPING,
    "triton": triton.MAPPING,
    "lmcache": kvtiers.LMCACHE,
    "kvbm": kvtiers.KVBM,
}
"""Engine type name to its mapping."""

DETECTION_FALLBACK: Final = frozenset({"triton", "lmcache", "kvbm"})
"""Types that win detection only when no other type's prefix is present: a Triton server
running the vLLM backend exports ``vllm:*`` next to ``nv_inference_*`` and is a vLLM;
LMCache's families appear inside vLLM's (or SGLang's) own ``/metrics``; KVBM's port
serves only ``kvbm_*``."""
