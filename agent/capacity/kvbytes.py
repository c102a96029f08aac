"""KV-cache bytes per token from a model's shape: Hugging Face ``config.json`` or GGUF.

The arithmetic, per token and per attention layer that stores it::

    standard / GQA / MQA : 2 (K and V) x kv_heads x head_dim x dtype_bytes
                           (K and V head dims may differ: kv_heads x (k_dim + v_dim))
    MLA (DeepSeek-V2/V3) : (kv_lora_rank + qk_rope_head_dim) x dtype_bytes
                           (one compressed latent per layer, no per-head K/V)

and a sequence of ``n`` tokens holds::

    full_layers x n x layer_bytes + window_layers x min(n, window) x layer_bytes

Check: Llama-3.1-8B with fp16 KV is 2 x 32 x 8 x 128 x 2 B = 131,072 B (128 KiB) per token.

What is exact and what is approximate:

* **Dense, GQA, MQA** (Llama, Qwen2/2.5 with ``use_sliding_window: false``, Mixtral): exact
  for the K/V tensors; engines add block/page rounding (vLLM rounds a sequence up to its
  block size) and a little padding, not counted here.
* **Sliding window** (Mistral-7B-v0.1 on every layer; Gemma-2 on every other layer; Gemma-3
  on 5 of every 6; layer lists in ``layer_types``): the window layers hold at most
  ``window`` tokens of a sequence. :attr:`KVShape.bytes_per_token` counts every attention
  layer (what a token costs while the context is shorter than the window, and what an
  engine that does not shrink window layers allocates: llama.cpp ``--swa-full``, vLLM
  without its hybrid allocator); :meth:`KVShape.sequence_bytes` applies the window. Engines
  keep a little more than the window (llama.cpp keeps ``window + n_ubatch`` cells), so the
  windowed figure is a lower bound.
* **MLA** (``kv_lora_rank`` set): the latent-cache figure is exact for engines that cache
  the latent (vLLM/SGLang MLA backends, llama.cpp with MLA-converted GGUFs); an engine that
  expands per-head K/V uses far more.
* **Hybrid** (Jamba, Qwen3-Next, Nemotron-H, Granite-4 hybrids, ``layer_types`` entries
  such as ``linear_attention`` or ``mamba``): linear-attention and state-space layers hold
  a fixed-size state per sequence, no per-token KV; they are counted in
  :attr:`KVShape.stateless_layers` and excluded. Their per-sequence state (often a few MiB)
  is not included.
* **KV dtype**: ``auto`` means the model's ``torch_dtype`` (vLLM's rule); llama.cpp's KV
  default is ``f16`` whatever the weights' quantization. Block-quantized llama.cpp cache
  types count their scales (``q8_0`` = 34 B per 32 values = 1.0625 B).

GGUF metadata is read with the ``gguf`` package's constants (magic, value types, key
names) by a header-only reader: ``gguf.GGUFReader`` indexes every field, including
tokenizer arrays of 262,144 strings, which takes 10-15 s for a 250 MB file on a 2-core
host; :func:`read_gguf_metadata` skips arrays it does not need and reads the same values in
milliseconds (``tests/test_capacity_kvbytes.py`` checks both agree).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0,
    "fp32": 4.0,
    "f32": 4.0,
    "float16": 2.0,
    "fp16": 2.0,
    "f16": 2.0,
    "half": 2.0,
    "bfloat16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "fp8_inc": 1.0,
    "int8": 1.0,
    # llama.cpp block-quantized cache types (-ctk/-ctv): bytes per block / 32 values
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
"""Bytes per stored K/V element by dtype name (lower case)."""

LLAMACPP_DEFAULT_KV_DTYPE = "f16"
"""llama.cpp's default ``--cache-type-k``/``--cache-type-v``."""

GGUF_SWA_PATTERN: dict[str, int] = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2}
"""Architectures whose sliding-window layout llama.cpp hard-codes: in every group of ``n``
layers the first ``n - 1`` use the window and the last one full attention."""


class ModelShapeError(ValueError):
    """A config or GGUF file lacks what the KV arithmetic needs (the message says what)."""


def dtype_bytes(name: str) -> float:
    """Return the bytes per K/V element of dtype ``name`` (case-insensitive).

    Raises:
        ModelShapeError: unknown dtype name.
    """
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ModelShapeError(f"unknown KV dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True, slots=True)
class KVShape:
    """The KV-cache shape of a model: what one token costs in each attention layer.

    Attributes:
        source: ``hf_config``, ``gguf`` or ``engine``.
        model: a display name (``general.name``, ``_name_or_path``, the file name).
        architecture: ``model_type`` or ``general.architecture``.
        layers: all decoder layers.
        full_layers: attention layers that keep every token of a sequence.
        window_layers: sliding-window (or chunked) attention layers, which keep at most
            ``window`` tokens of a sequence.
        stateless_layers: linear-attention/state-space layers with no per-token KV.
        window: the sliding window in tokens; ``None`` without window layers.
        kv_heads: KV heads per layer (``0`` for MLA).
        key_dim: per-head key dimension (``0`` for MLA).
        value_dim: per-head value dimension (``0`` for MLA).
        latent_dim: MLA latent width per token and layer (``kv_lora_rank +
            qk_rope_head_dim``); ``None`` for per-head K/V.
        dtype: the KV dtype name.
        element_bytes: bytes per stored element for ``dtype``.
        notes: what is approximate for this model, in words.
        flat_bytes_per_token: set only for an engine-reported shape whose layers are
            unknown: the bytes per token the engine reported.
    """

    source: str
    model: str | None
    architecture: str | None
    layers: int
    full_layers: int
    window_layers: int
    stateless_layers: int
    window: int | None
    kv_heads: int
    key_dim: int
    value_dim: int
    latent_dim: int | None
    dtype: str
    element_bytes: float
    notes: tuple[str, ...] = ()
    flat_bytes_per_token: float | None = field(default=None)

    @property
    def layer_token_bytes(self) -> float:
        """Bytes one token occupies in one attention layer."""
        if self.flat_bytes_per_token is not None:
            return self.flat_bytes_per_token
        if self.latent_dim is not None:
            return self.latent_dim * self.element_bytes
        return self.kv_heads * (self.key_dim + self.value_dim) * self.element_bytes

    @property
    def bytes_per_token(self) -> float:
        """Bytes per token while every attention layer holds it (contexts within the window).

        The figure engines that do not shrink window layers allocate per token of context,
        and the pinned check figure (Llama-3.1-8B fp16: 131,072).
        """
        if self.flat_bytes_per_token is not None:
            return self.flat_bytes_per_token
        return (self.full_layers + self.window_layers) * self.layer_token_bytes

    @property
    def marginal_bytes_per_token(self) -> float:
        """Bytes each further token adds once a sequence is longer than the window."""
        if self.flat_bytes_per_token is not None:
            return self.flat_bytes_per_token
        return self.full_layers * self.layer_token_bytes

    def sequence_bytes(self, tokens: int, windowed: bool = True) -> float:
        """Return the KV bytes of one sequence of ``tokens`` tokens.

        Args:
            tokens: prompt plus generated tokens.
            windowed: apply the sliding window (``False``: every attention layer keeps every
                token, as llama.cpp ``--swa-full`` does).
        """
        if self.flat_bytes_per_token is not None or not windowed or self.window is None:
            return tokens * self.bytes_per_token
        ltb = self.layer_token_bytes
        return (self.full_layers * tokens + self.window_layers * min(tokens, self.window)) * ltb

    def with_dtype(self, dtype: str) -> KVShape:
        """Return the same shape with another KV dtype.

        Raises:
            ModelShapeError: unknown dtype name.
        """
        return replace(self, dtype=dtype.lower(), element_bytes=dtype_bytes(dtype))

    def as_dict(self) -> dict[str, Any]:
        """Return the shape and its derived byte counts as a JSON-ready dict."""
        return {
            "source": self.source,
            "model": self.model,
            "architecture": self.architecture,
            "layers": self.layers,
            "full_attention_layers": self.full_layers,
            "window_layers": self.window_layers,
            "stateless_layers": self.stateless_layers,
            "window_tokens": self.window,
            "kv_heads": self.kv_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "latent_dim": self.latent_dim,
            "kv_dtype": self.dtype,
            "element_bytes": self.element_bytes,
            "bytes_per_token": self.bytes_per_token,
            "marginal_bytes_per_token": self.marginal_bytes_per_token,
            "notes": list(self.notes),
        }


def flat_shape(bytes_per_token: float, model: str | None = None, source: str = "engine") -> KVShape:
    """Return a shape that only knows its bytes per token (engine-reported, agent metric)."""
    return KVShape(
        source=source,
        model=model,
        architecture=None,
        layers=0,
        full_layers=0,
        window_layers=0,
        stateless_layers=0,
        window=None,
        kv_heads=0,
        key_dim=0,
        value_dim=0,
        latent_dim=None,
        dtype="unknown",
        element_bytes=0.0,
        notes=("bytes per token as reported; layer layout unknown, no sliding window applied",),
        flat_bytes_per_token=bytes_per_token,
    )


# ---- Hugging Face config.json ------------------------------------------------------------


def _int(cfg: Mapping[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, bool):
            continue
        if isinstance(v, int) and v > 0:
            return v
        if isinstance(v, float) and v > 0 and v.is_integer():
            return int(v)
    return None


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a (possibly multimodal) config."""
    for key in ("text_config", "llm_config", "language_config"):
        sub = cfg.get(key)
        if isinstance(sub, Mapping) and _int(sub, "num_hidden_layers", "n_layer", "num_layers"):
            merged = dict(sub)
            for k in ("torch_dtype", "dtype", "_name_or_path"):
                merged.setdefault(k, cfg.get(k))
            return merged
    return cfg


def _layer_kinds(cfg: Mapping[str, Any], layers: int, notes: list[str]) -> list[str]:
    """Classify each layer as ``full``, ``window`` or ``none`` (no per-token KV)."""
    mt = str(cfg.get("model_type") or "").lower()
    window = _int(cfg, "sliding_window")
    types = cfg.get("layer_types")
    if isinstance(types, Sequence) and not isinstance(types, str) and len(types) == layers:
        out = []
        for t in types:
            s = str(t).lower()
            if s in ("full_attention", "attention", "global"):
                out.append("full")
            elif s in ("sliding_attention", "chunked_attention", "local", "sliding"):
                out.append("window")
            else:  # linear_attention, mamba, conv, ...
                out.append("none")
        notes.append("layer kinds from layer_types")
        return out
    blocks = cfg.get("layers_block_type")
    if isinstance(blocks, Sequence) and not isinstance(blocks, str) and len(blocks) == layers:
        notes.append("layer kinds from layers_block_type")
        return ["full" if str(b).lower() == "attention" else "none" for b in blocks]
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and len(pattern) == layers:
        notes.append("layer kinds from hybrid_override_pattern ('*' = attention)")
        return ["full" if ch == "*" else "none" for ch in pattern]
    period = _int(cfg, "attn_layer_period")
    if period is not None:  # Jamba
        offset = cfg.get("attn_layer_offset")
        off = offset if isinstance(offset, int) else 0
        notes.append(f"hybrid: attention on layers i % {period} == {off}, the rest Mamba")
        return ["full" if i % period == off else "none" for i in range(layers)]
    interval = _int(cfg, "full_attention_interval")
    if interval is not None:  # Qwen3-Next
        notes.append(f"hybrid: full attention every {interval}th layer, the rest linear attention")
        return ["full" if (i + 1) % interval == 0 else "none" for i in range(layers)]
    if window is None:
        return ["full"] * layers
    if "use_sliding_window" in cfg and not cfg.get("use_sliding_window"):
        notes.append("sliding_window ignored: use_sliding_window is false")
        return ["full"] * layers
    swa_pattern = _int(cfg, "sliding_window_pattern", "_sliding_window_pattern")
    if swa_pattern is not None:  # Gemma-3, Cohere2: every n-th layer is global
        notes.append(f"sliding window {window} on {swa_pattern - 1} of every {swa_pattern} layers")
        return ["full" if (i + 1) % swa_pattern == 0 else "window" for i in range(layers)]
    if mt == "gemma2":
        notes.append(f"sliding window {window} on every other layer (Gemma-2)")
        return ["window" if i % 2 == 0 else "full" for i in range(layers)]
    if cfg.get("use_sliding_window") and _int(cfg, "max_window_layers") is not None:
        mwl = _int(cfg, "max_window_layers") or 0
        notes.append(f"sliding window {window} on layers >= max_window_layers ({mwl})")
        return ["window" if i >= mwl else "full" for i in range(layers)]
    notes.append(f"sliding window {window} on every layer")
    return ["window"] * layers


def shape_from_hf_config(
    config: Mapping[str, Any] | str | Path, kv_dtype: str = "auto", name: str | None = None
) -> KVShape:
    """Return the KV shape described by a Hugging Face ``config.json``.

    Args:
        config: the decoded JSON, or a path to ``config.json`` (or its directory).
        kv_dtype: the engine's KV dtype; ``auto`` uses the config's ``torch_dtype``
            (``dtype`` in newer files), else ``bfloat16`` with a note.
        name: display name; defaults to ``_name_or_path`` or the directory name.

    Raises:
        ModelShapeError: the config lacks layers or attention heads, or names an unknown
            dtype.
        OSError: the file cannot be read.
        ValueError: the file is not JSON.
    """
    if not isinstance(config, Mapping):
        p = Path(config)
        if p.is_dir():
            p = p / "config.json"
        config = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(config, Mapping):
            raise ModelShapeError(f"{p}: expected a JSON object")
        stem = p.parent.name if p.name == "config.json" else p.stem
        name = name or str(config.get("_name_or_path") or stem) or None
    cfg = _text_config(config)
    notes: list[str] = []
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    if layers is None:
        raise ModelShapeError("config has no num_hidden_layers")
    heads = _int(cfg, "num_attention_heads", "n_head", "num_heads")
    # dtype
    if kv_dtype.lower() == "auto":
        td = cfg.get("torch_dtype") or cfg.get("dtype")
        if isinstance(td, str) and td:
            dtype = td.lower().removeprefix("torch.")
        else:
            dtype = "bfloat16"
            notes.append("no torch_dtype in config: assumed bfloat16 (2 B)")
    else:
        dtype = kv_dtype.lower()
    elem = dtype_bytes(dtype)
    kinds = _layer_kinds(cfg, layers, notes)
    window = _int(cfg, "sliding_window", "attention_chunk_size") if "window" in kinds else None
    kv_lora = _int(cfg, "kv_lora_rank")
    arch = str(cfg.get("model_type") or "") or None
    base = {
        "source": "hf_config",
        "model": name or (str(cfg.get("_name_or_path")) if cfg.get("_name_or_path") else None),
        "architecture": arch,
        "layers": layers,
        "full_layers": kinds.count("full"),
        "window_layers": kinds.count("window"),
        "stateless_layers": kinds.count("none"),
        "window": window,
        "dtype": dtype,
        "element_bytes": elem,
    }
    if kv_lora is not None:
        rope = _int(cfg, "qk_rope_head_dim") or 0
        notes.append(
            f"MLA: one latent of kv_lora_rank {kv_lora} + qk_rope_head_dim {rope} per layer "
            "(engines that cache the latent); per-head K/V expansion would be far larger"
        )
        return KVShape(
            **base,  # type: ignore[arg-type]
            kv_heads=0,
            key_dim=0,
            value_dim=0,
            latent_dim=kv_lora + rope,
            notes=tuple(notes),
        )
    if heads is None:
        raise ModelShapeError("config has no num_attention_heads")
    kv_heads = _int(
        cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"
    )
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
        if not cfg.get("multi_query"):
            notes.append("no num_key_value_heads: multi-head attention (KV heads = heads)")
    head_dim = _int(cfg, "head_dim", "attention_head_size")
    if head_dim is None:
        hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
        if hidden is None:
            raise ModelShapeError("config has neither head_dim nor hidden_size")
        head_dim = hidden // heads
    value_dim = _int(cfg, "v_head_dim") or head_dim
    return KVShape(
        **base,  # type: ignore[arg-type]
        kv_heads=kv_heads,
        key_dim=head_dim,
        value_dim=value_dim,
        latent_dim=None,
        notes=tuple(notes),
    )


_HYBRID_KEYS = (
    "layer_types", "full_attention_interval", "attn_layer_period", "mamba_d_state",
    "linear_num_key_heads", "ssm_cfg", "hybrid_override_pattern",
)  # fmt: skip
"""Config keys of hybrid (linear-attention / state-space) models, whose weights are not
estimated: their non-attention blocks differ per family."""


def _attention_params(cfg: Mapping[str, Any], hidden: int, heads: int) -> int | None:
    """Attention weights of one layer: MLA (DeepSeek) or grouped-query attention."""
    if cfg.get("kv_lora_rank"):
        kv_rank = _int(cfg, "kv_lora_rank")
        nope = _int(cfg, "qk_nope_head_dim")
        rope = _int(cfg, "qk_rope_head_dim")
        v_dim = _int(cfg, "v_head_dim")
        if None in (kv_rank, nope, rope, v_dim):
            return None
        assert kv_rank and nope and rope and v_dim
        q_rank = _int(cfg, "q_lora_rank")
        q = (
            (hidden * q_rank + q_rank * heads * (nope + rope))
            if q_rank
            else (hidden * heads * (nope + rope))
        )
        kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
        return q + kv + heads * v_dim * hidden
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    hd = _int(cfg, "head_dim") or hidden // heads
    return hidden * heads * hd + 2 * hidden * kv_heads * hd + heads * hd * hidden


def estimate_hf_weights_bytes(config: Mapping[str, Any]) -> tuple[float, str] | None:
    """Estimate a decoder's weight bytes from its config; ``None`` when unsure.

    Formula (Llama-like blocks, gated MLP)::

        params = vocab x hidden x (1 if tied else 2)
               + layers x attention                     # q, k, v, o (or MLA's low-rank q/kv)
               + dense_layers x 3 x hidden x intermediate
               + moe_layers x (experts + shared) x 3 x hidden x moe_intermediate
               + moe_layers x hidden x experts          # the router

    times ``torch_dtype`` bytes, or the ``quantization_config``'s bits (``fp8`` methods: 8;
    ``bits`` / ``w_bit`` for GPTQ/AWQ; scales are not counted). Dense models have
    ``moe_layers = 0``; mixture-of-experts models count every expert
    (``num_local_experts``, ``n_routed_experts`` or ``num_experts``) plus
    ``n_shared_experts``, with ``moe_intermediate_size`` (else ``intermediate_size``) per
    expert, and ``first_k_dense_replace`` dense layers first.
    Llama-3.1-8B gives 8.03 B parameters, Mixtral-8x7B 46.7 B, DeepSeek-V3 671 B (its
    multi-token-prediction module is not counted). Hybrid models (linear attention, state
    space; see :data:`_HYBRID_KEYS`) and MoE layouts this does not know
    (``decoder_sparse_step`` other than 1, ``mlp_only_layers``) return ``None``: pass the
    weight size explicitly.

    Returns:
        ``(bytes, how)`` or ``None``.
    """
    cfg = _text_config(config)
    if any(cfg.get(k) for k in _HYBRID_KEYS) or cfg.get("mlp_only_layers"):
        return None
    if (_int(cfg, "decoder_sparse_step") or 1) != 1:
        return None
    layers = _int(cfg, "num_hidden_layers")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    inter = _int(cfg, "intermediate_size")
    vocab = _int(cfg, "vocab_size")
    experts = next(
        (
            v
            for k in ("num_local_experts", "n_routed_experts", "num_experts")
            if (v := _int(cfg, k))
        ),
        None,
    )
    moe_inter = _int(cfg, "moe_intermediate_size") or inter
    if None in (layers, hidden, heads, vocab) or (inter is None and experts is None):
        return None
    assert layers and hidden and heads and vocab
    attn = _attention_params(cfg, hidden, heads)
    if attn is None:
        return None
    tied = bool(cfg.get("tie_word_embeddings", False))
    params = vocab * hidden * (1 if tied else 2) + layers * attn
    how = "dense estimate"
    if experts:
        if moe_inter is None:
            return None
        dense_layers = min(layers, _int(cfg, "first_k_dense_replace") or 0)
        if dense_layers and inter is None:
            return None
        shared = _int(cfg, "n_shared_experts") or 0
        shared_mlp = 3 * hidden * (_int(cfg, "shared_expert_intermediate_size") or 0)
        moe_layers = layers - dense_layers
        params += dense_layers * 3 * hidden * (inter or 0)
        params += moe_layers * (
            (experts + shared) * 3 * hidden * moe_inter + shared_mlp + hidden * experts
        )
        how = f"MoE estimate: {experts} experts" + (f" + {shared} shared" if shared else "")
        how += f" x {moe_layers} layers, all resident"
    else:
        assert inter
        params += layers * 3 * hidden * inter
    td = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    qc = config.get("quantization_config") or cfg.get("quantization_config")
    if isinstance(qc, Mapping) and qc:
        method = str(qc.get("quant_method", ""))
        bits = qc.get("bits") or qc.get("w_bit") or (8 if "fp8" in method else None)
        if not isinstance(bits, int | float) or bits <= 0:
            return None  # a quantization this does not know: do not guess
        elem, td = bits / 8, f"{method or 'quantized'} {bits:g}-bit"
    else:
        try:
            elem = dtype_bytes(str(td))
        except ModelShapeError:
            return None
    return params * elem, f"{params / 1e9:.2f} B parameters ({how}) x {elem:g} B ({td})"


# ---- GGUF ------------------------------------------------------------------------------------

_MAX_SMALL_ARRAY = 65536


def _read_exact(f: BinaryIO, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise ModelShapeError("truncated GGUF header")
    return b


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Read a GGUF file's key/value metadata, skipping large arrays (tokenizer vocabularies).

    Uses the ``gguf`` package's magic number, value types and key layout (GGUF v2/v3,
    little-endian). Scalars and strings are returned as Python values; arrays of scalars up
    to 65,536 entries as lists (per-layer head counts); larger arrays and arrays of strings
    as ``None`` (present but not read).

    Raises:
        ModelShapeError: not a GGUF file, an unsupported version, or a truncated header.
        OSError: the file cannot be read.
    """
    from gguf.constants import GGUF_MAGIC, GGUFValueType

    scalar = {
        GGUFValueType.UINT8: "<B",
        GGUFValueType.INT8: "<b",
        GGUFValueType.UINT16: "<H",
        GGUFValueType.INT16: "<h",
        GGUFValueType.UINT32: "<I",
        GGUFValueType.INT32: "<i",
        GGUFValueType.FLOAT32: "<f",
        GGUFValueType.BOOL: "<?",
        GGUFValueType.UINT64: "<Q",
        GGUFValueType.INT64: "<q",
        GGUFValueType.FLOAT64: "<d",
    }

    def read_value(f: BinaryIO, vtype: int) -> Any:
        t = GGUFValueType(vtype)
        if t in scalar:
            fmt = scalar[t]
            return struct.unpack(fmt, _read_exact(f, struct.calcsize(fmt)))[0]
        if t == GGUFValueType.STRING:
            (n,) = struct.unpack("<Q", _read_exact(f, 8))
            return _read_exact(f, n).decode("utf-8", errors="replace")
        if t == GGUFValueType.ARRAY:
            itype, count = struct.unpack("<IQ", _read_exact(f, 12))
            it = GGUFValueType(itype)
            if it in scalar:
                size = struct.calcsize(scalar[it])
                if count <= _MAX_SMALL_ARRAY:
                    raw = _read_exact(f, size * count)
                    return list(struct.unpack("<" + scalar[it][1] * count, raw))
                f.seek(size * count, 1)
                return None
            for _ in range(count):  # strings or nested arrays: walk and skip
                if it == GGUFValueType.STRING:
                    (n,) = struct.unpack("<Q", _read_exact(f, 8))
                    f.seek(n, 1)
                else:
                    read_value(f, itype)
            return None
        raise ModelShapeError(f"unknown GGUF value type {vtype}")

    out: dict[str, Any] = {}
    with Path(path).open("rb") as f:
        magic, version = struct.unpack("<II", _read_exact(f, 8))
        if magic != GGUF_MAGIC:
            raise ModelShapeError(f"{path}: not a GGUF file (bad magic)")
        if version not in (2, 3):
            raise ModelShapeError(f"{path}: GGUF version {version} not supported")
        _n_tensors, n_kv = struct.unpack("<QQ", _read_exact(f, 16))
        for _ in range(n_kv):
            (klen,) = struct.unpack("<Q", _read_exact(f, 8))
            key = _read_exact(f, klen).decode("utf-8", errors="replace")
            (vtype,) = struct.unpack("<I", _read_exact(f, 4))
            try:
                out[key] = read_value(f, vtype)
            except ValueError as exc:  # GGUFValueType(bad)
                raise ModelShapeError(f"{path}: bad value type for {key}: {exc}") from None
    return out


def _per_layer(value: Any, layers: int) -> list[int] | None:
    if isinstance(value, list) and len(value) == layers:
        return [int(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * layers
    return None


def shape_from_gguf_metadata(
    meta: Mapping[str, Any], kv_dtype: str = LLAMACPP_DEFAULT_KV_DTYPE, name: str | None = None
) -> KVShape:
    """Return the KV shape described by GGUF metadata (see :func:`read_gguf_metadata`).

    Keys read (``{arch}`` = ``general.architecture``): ``{arch}.block_count``,
    ``{arch}.attention.head_count_kv`` (a number, or a per-layer array where ``0`` marks a
    layer without attention, as in Jamba/Nemotron-H GGUFs), ``{arch}.attention.head_count``,
    ``{arch}.attention.key_length``/``value_length`` (default ``embedding_length /
    head_count``), ``{arch}.attention.sliding_window`` and
    ``{arch}.attention.sliding_window_pattern`` (else llama.cpp's built-in pattern for
    Gemma-2/3, Cohere2, gpt-oss), ``{arch}.full_attention_interval`` (Qwen3-Next), and for
    MLA ``{arch}.attention.kv_lora_rank`` with ``key_length_mla`` + ``rope.dimension_count``.

    Args:
        meta: the metadata.
        kv_dtype: the engine's KV cache type (llama.cpp default ``f16``).
        name: display name; defaults to ``general.name``.

    Raises:
        ModelShapeError: missing architecture, block count or head counts; unknown dtype.
    """
    from gguf.constants import Keys

    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelShapeError("GGUF has no general.architecture")

    def key(template: str) -> str:
        return template.format(arch=arch)

    def newer(group: object, attr: str, template: str) -> str:
        # keys added in later gguf releases: the spelling is part of the GGUF format
        return key(str(getattr(group, attr, template)))

    layers = meta.get(key(Keys.LLM.BLOCK_COUNT))
    if not isinstance(layers, int) or layers <= 0:
        raise ModelShapeError(f"GGUF has no {key(Keys.LLM.BLOCK_COUNT)}")
    notes: list[str] = []
    heads_l = _per_layer(meta.get(key(Keys.Attention.HEAD_COUNT)), layers)
    kv_l = _per_layer(meta.get(key(Keys.Attention.HEAD_COUNT_KV)), layers)
    if kv_l is None:
        kv_l = heads_l
    if kv_l is None or heads_l is None:
        raise ModelShapeError(f"GGUF has no {key(Keys.Attention.HEAD_COUNT)}")
    elem = dtype_bytes(kv_dtype)
    embd = meta.get(key(Keys.LLM.EMBEDDING_LENGTH))
    ref_heads = max(heads_l) or 1
    default_dim = embd // ref_heads if isinstance(embd, int) else None
    k_dim = meta.get(key(Keys.Attention.KEY_LENGTH)) or default_dim
    v_dim = meta.get(key(Keys.Attention.VALUE_LENGTH)) or default_dim
    if not isinstance(k_dim, int) or not isinstance(v_dim, int):
        raise ModelShapeError("GGUF has neither key_length nor embedding_length")
    kinds = ["full" if kv > 0 else "none" for kv in kv_l]
    if "none" in kinds:
        notes.append("layers with head_count_kv 0 hold no per-token KV (recurrent/SSM)")
    interval = meta.get(
        newer(Keys.LLM, "FULL_ATTENTION_INTERVAL", "{arch}.full_attention_interval")
    )
    if isinstance(interval, int) and interval > 0:
        kinds = ["full" if (i + 1) % interval == 0 else "none" for i in range(layers)]
        notes.append(f"hybrid: full attention every {interval}th layer, the rest linear attention")
    window = meta.get(key(Keys.Attention.SLIDING_WINDOW))
    window = window if isinstance(window, int) and window > 0 else None
    if window is not None:
        pattern = meta.get(
            newer(
                Keys.Attention, "SLIDING_WINDOW_PATTERN", "{arch}.attention.sliding_window_pattern"
            )
        )
        if isinstance(pattern, list) and len(pattern) == layers:
            kinds = [
                "window" if (bool(p) and k == "full") else k
                for p, k in zip(pattern, kinds, strict=True)
            ]
            notes.append(f"sliding window {window} per sliding_window_pattern")
        elif arch in GGUF_SWA_PATTERN:
            n = GGUF_SWA_PATTERN[arch]
            kinds = [
                "window" if (i % n < n - 1 and k == "full") else k for i, k in enumerate(kinds)
            ]
            notes.append(
                f"sliding window {window} on {n - 1} of every {n} layers (llama.cpp's {arch} "
                f"layout); llama.cpp keeps window + n_ubatch cells per sequence there"
            )
        else:
            notes.append(f"sliding_window {window} present but treated as full attention")
            window = None
    if "window" not in kinds:
        window = None
    kv_heads = max(kv_l)
    if len({kv for kv in kv_l if kv > 0}) > 1:
        notes.append("KV heads differ per layer: the largest count is used for every layer")
    base = {
        "source": "gguf",
        "model": name
        or (meta.get("general.name") if isinstance(meta.get("general.name"), str) else None),
        "architecture": arch,
        "layers": layers,
        "full_layers": kinds.count("full"),
        "window_layers": kinds.count("window"),
        "stateless_layers": kinds.count("none"),
        "window": window,
        "dtype": kv_dtype.lower(),
        "element_bytes": elem,
    }
    kv_lora = meta.get(key(Keys.Attention.KV_LORA_RANK))
    k_mla = meta.get(newer(Keys.Attention, "KEY_LENGTH_MLA", "{arch}.attention.key_length_mla"))
    if isinstance(kv_lora, int) and kv_lora > 0 and isinstance(k_mla, int):
        rope = meta.get(key(Keys.Rope.DIMENSION_COUNT))
        rope = rope if isinstance(rope, int) else 0
        notes.append(f"MLA: latent {kv_lora} + rope {rope} per layer (llama.cpp MLA cache)")
        return KVShape(
            **base,  # type: ignore[arg-type]
            kv_heads=0,
            key_dim=0,
            value_dim=0,
            latent_dim=kv_lora + rope,
            notes=tuple(notes),
        )
    return KVShape(
        **base,  # type: ignore[arg-type]
        kv_heads=kv_heads,
        key_dim=k_dim,
        value_dim=v_dim,
        latent_dim=None,
        notes=tuple(notes),
    )


def shape_from_gguf(
    path: str | Path, kv_dtype: str = LLAMACPP_DEFAULT_KV_DTYPE, name: str | None = None
) -> KVShape:
    """Read ``path``'s metadata and return its KV shape (see :func:`shape_from_gguf_metadata`).

    Raises:
        ModelShapeError: not a usable GGUF file.
        OSError: the file cannot be read.
    """
    return shape_from_gguf_metadata(read_gguf_metadata(path), kv_dtype, name)


def load_shape(path: str | Path, kv_dtype: str = "auto") -> KVShape:
    """Return the shape of a GGUF file or a Hugging Face config (file or directory).

    Args:
        path: ``*.gguf``, ``config.json`` or a directory holding ``config.json``.
        kv_dtype: ``auto`` means the HF config's dtype, or llama.cpp's ``f16`` for GGUF.

    Raises:
        ModelShapeError: unusable file.
        OSError: unreadable file.
        ValueError: a config that is not JSON.
    """
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        dt = LLAMACPP_DEFAULT_KV_DTYPE if kv_dtype.lower() == "auto" else kv_dtype
        return shape_from_gguf(p, dt)
    return shape_from_hf_config(p, kv_dtype)


def fmt_bytes(v: float) -> str:
    """Format a byte count with binary units (``128.0 KiB``); integers below 1 KiB as ``B``."""
    if not math.isfinite(v):
        return "-"
    x = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(x) < 1024 or unit == "PiB":
            return f"{x:.0f} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return "-"  # pragma: no cover
