"""Capacity: KV bytes per token, live headroom and saturation, the latency knee, reuse savings.

* :mod:`agent.capacity.kvbytes` - the KV-cache shape of a model (bytes per token) from a
  Hugging Face ``config.json`` or GGUF metadata.
* :mod:`agent.capacity.engine_facts` - what the engines themselves report about their KV
  pool (vLLM ``cache_config_info``, llama.cpp ``/props`` and ``/slots``).
* :mod:`agent.capacity.knee` - TTFT/ITL histograms by KV-occupancy band.
* :mod:`agent.capacity.live` - the derived ``capacity`` sampler that turns the engines'
  latest samples into headroom, saturation concurrency, time to saturation, the knee and
  prefix-cache savings.
* :mod:`agent.capacity.plan` - ``kvpressure plan``: what-if answers for a model and an
  accelerator memory size.
"""
