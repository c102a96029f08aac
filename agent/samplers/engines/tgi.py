"""Hugging Face Text Generation Inference (TGI) mapping (router ``/metrics``).

Source: TGI's metrics reference (``docs/source/reference/metrics.md``). TGI metrics carry
no model label (one model per router); the ``model`` label is absent. Histograms are in
seconds; ``tgi_batch_*`` histograms carry ``method`` = prefill or decode, matched on the
parsed value, so IBM's TGIS-compatible fork that writes ``{'method': 'prefill'}`` (case 15)
matches too.

=============================================  =================================================
catalogue metric                               TGI metric
=============================================  =================================================
``kvpressure_engine_requests_waiting``         ``tgi_queue_size``
``kvpressure_engine_requests_running``         ``tgi_batch_current_size`` (requests in the
                                               running batch)
``kvpressure_engine_batch_max_tokens``         ``tgi_batch_current_max_tokens`` (token budget
                                               reserved by the running batch)
``kvpressure_engine_requests_completed_total`` ``tgi_request_success``
``kvpressure_engine_prompt_tokens_total``      ``tgi_request_input_length_sum`` (finished
                                               requests only)
``kvpressure_engine_generation_tokens_total``  ``tgi_request_generated_tokens_sum`` (finished
                                               requests only)
``kvpressure_engine_latency_seconds{phase}``   ``tgi_request_duration`` (e2e),
                                               ``tgi_request_queue_duration`` (queue),
                                               ``tgi_request_inference_duration`` (inference),
                                               ``tgi_request_mean_time_per_token_duration``
                                               (itl: per-request mean), and per batch
                                               ``tgi_batch_forward_duration{method}``
                                               (batch_prefill, batch_decode)
=============================================  =================================================

Cannot provide: any KV metric (usage, tokens, capacity: KV occupancy is absent, never 0),
TTFT, preemptions, prefix-cache reuse, per-request prefill/decode durations.
"""

from __future__ import annotations

from kvpressure.agent.samplers.engines.normalize import EngineMapping, Rule, latency

MAPPING = EngineMapping(
    engine_type="tgi",
    prefixes=("tgi_",),
    model_labels=("model_name", "model"),
    rules=(
        Rule("kvpressure_engine_requests_waiting", ("tgi_queue_size",)),
        Rule("kvpressure_engine_requests_running", ("tgi_batch_current_size",)),
        Rule("kvpressure_engine_batch_max_tokens", ("tgi_batch_current_max_tokens",)),
        Rule(
            "kvpressure_engine_requests_completed_total",
            ("tgi_request_success",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_prompt_tokens_total",
            ("tgi_request_input_length_sum",),
            kind="counter",
        ),
        Rule(
            "kvpressure_engine_generation_tokens_total",
            ("tgi_request_generated_tokens_sum",),
            kind="counter",
        ),
        latency("e2e", "tgi_request_duration"),
        latency("queue", "tgi_request_queue_duration"),
        latency("inference", "tgi_request_inference_duration"),
        latency("itl", "tgi_request_mean_time_per_token_duration"),
        latency(
            "batch_prefill", "tgi_batch_forward_duration", method="prefill|{'method': 'prefill'}"
        ),
        latency("batch_decode", "tgi_batch_forward_duration", method="decode|{'method': 'decode'}"),
    ),
)
"""The TGI :class:`~agent.samplers.engines.normalize.EngineMapping`."""
