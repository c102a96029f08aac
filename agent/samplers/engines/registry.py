"""The engine types the agent knows, and how each is recognised from its metric names.

Engines are named ``vllm``, ``sglang``, ``llamacpp``, ``tgi``, ``trtllm`` and ``triton``
(DESIGN.md). Only ``vllm`` and ``llamacpp`` have a mapping yet; the others are recognised
by auto-detection and their samplers emit only ``kvpressure_engine_up`` and
``kvpressure_engine_info`` until their mapping lands. Adding one is a new module with an
:class:`~agent.samplers.engines.normalize.EngineMapping` (its ``Rule`` table) plus fixtures,
and a one-line change here.
"""

from __future__ import annotations

from typing import Final

from agent.samplers.engines import llamacpp, vllm
from agent.samplers.engines.normalize import EngineMapping

ENGINE_TYPES: Final[dict[str, EngineMapping]] = {
    "vllm": vllm.MAPPING,
    "sglang": EngineMapping("sglang", ("sglang:", "sglang_"), implemented=False),
    "llamacpp": llamacpp.MAPPING,
    "tgi": EngineMapping("tgi", ("tgi_",), implemented=False),
    # TensorRT-LLM: trtllm-serve exports trtllm_*; Triton's TensorRT-LLM backend exports the
    # engine's own metrics (KV blocks, in-flight batching) as nv_trt_llm_*.
    "trtllm": EngineMapping("trtllm", ("trtllm_", "nv_trt_llm_"), implemented=False),
    "triton": EngineMapping("triton", ("nv_inference_",), implemented=False),
}
"""Engine type name to its mapping (``implemented`` False: detection only)."""

DETECTION_FALLBACK: Final = frozenset({"triton"})
"""Types that win detection only when no other type's prefix is present: a Triton server
running the TensorRT-LLM backend exports both ``nv_inference_*`` and ``nv_trt_llm_*`` and is
detected as ``trtllm``, whose metrics say what the KV cache does."""
