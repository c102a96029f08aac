"""KV bytes per token: the arithmetic pinned for real model configs and the real GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpressure.agent.capacity import kvbytes as kb
from kvpressure.agent.capacity.engine_facts import from_llamacpp, from_vllm_metrics

FIX = Path(__file__).parent / "fixtures" / "capacity"
HF = FIX / "hf"
CACHE = Path(os.environ.get("KVPRESSURE_CACHE", Path.home() / ".cache" / "kvpressure"))
GEMMA_GGUF = Path(os.environ.get("KVPRESSURE_MODEL", CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"))


def hf(name: str, dtype: str = "auto") -> kb.KVShape:
    return kb.shape_from_hf_config(HF / f"{name}.json", dtype)


# --- the pinned numbers ---------------------------------------------------------------------


def test_llama_31_8b_fp16_is_128_kib_per_token():
    s = hf("llama-3.1-8b", "fp16")
    # 2 (K,V) x 32 layers x 8 KV heads x 128 head dim x 2 B
    assert s.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert (s.layers, s.full_layers, s.kv_heads, s.key_dim) == (32, 32, 8, 128)
    assert s.marginal_bytes_per_token == 131072
    assert s.sequence_bytes(8192) == 8192 * 131072  # 1 GiB for an 8k context
    assert hf("llama-3.1-8b").dtype == "bfloat16"  # auto = torch_dtype, also 2 B
    assert hf("llama-3.1-8b").bytes_per_token == 131072


def test_qwen25_7b_gqa_four_kv_heads():
    s = hf("qwen2.5-7b-instruct")
    # head_dim = 3584 / 28 = 128; sliding_window is present but use_sliding_window is false
    assert s.bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344
    assert s.window is None and s.window_layers == 0
    assert any("use_sliding_window is false" in n for n in s.notes)


def test_gemma2_9b_head_dim_256_and_alternating_window():
    s = hf("gemma-2-9b", "bf16")
    assert s.bytes_per_token == 2 * 42 * 8 * 256 * 2 == 344064
    assert (s.full_layers, s.window_layers, s.window) == (21, 21, 4096)
    assert s.marginal_bytes_per_token == 2 * 21 * 8 * 256 * 2 == 172032
    # 8k context: 21 layers keep 8192 tokens, 21 layers keep the 4096-token window
    assert s.sequence_bytes(8192) == (21 * 8192 + 21 * 4096) * 8192
    assert s.sequence_bytes(8192, windowed=False) == 8192 * 344064
    assert hf("gemma-2-9b").element_bytes == 4.0  # its torch_dtype is float32


def test_dtype_changes_scale_linearly_and_llamacpp_quant_types_count_scales():
    assert hf("llama-3.1-8b", "fp8").bytes_per_token == 65536
    assert hf("llama-3.1-8b", "float32").bytes_per_token == 262144
    assert hf("llama-3.1-8b", "q8_0").bytes_per_token == 131072 / 2 * 34 / 32  # 69632
    assert hf("llama-3.1-8b", "q4_0").bytes_per_token == 131072 / 2 * 18 / 32
    with pytest.raises(kb.ModelShapeError, match="unknown KV dtype"):
        hf("llama-3.1-8b", "int3")


def test_mistral_window_on_every_layer_caps_a_sequence():
    s = hf("mistral-7b-v0.1")
    assert s.bytes_per_token == 131072
    assert (s.full_layers, s.window_layers, s.window) == (0, 32, 4096)
    assert s.marginal_bytes_per_token == 0
    assert s.sequence_bytes(32768) == s.sequence_bytes(4096) == 4096 * 131072


def test_deepseek_v3_mla_one_latent_per_layer():
    s = hf("deepseek-v3")
    assert s.latent_dim == 512 + 64
    assert s.bytes_per_token == 61 * 576 * 2 == 70272
    assert any("MLA" in n for n in s.notes)


def test_hybrids_count_attention_layers_only():
    jamba = hf("jamba-v0.1")
    assert (jamba.full_layers, jamba.stateless_layers) == (4, 28)
    assert jamba.bytes_per_token == 2 * 4 * 8 * 128 * 2 == 16384
    qnext = hf("qwen3-next-80b-a3b")
    assert (qnext.full_layers, qnext.stateless_layers) == (12, 36)
    assert qnext.bytes_per_token == 2 * 12 * 2 * 256 * 2 == 24576


def test_layer_types_and_multimodal_text_config():
    g270 = hf("gemma-3-270m")
    assert (g270.full_layers, g270.window_layers, g270.window) == (3, 15, 512)
    assert g270.bytes_per_token == 18432
    g4b = hf("gemma-3-4b-it")  # Gemma3ForConditionalGeneration: shape under text_config
    assert (g4b.layers, g4b.full_layers, g4b.window_layers, g4b.window) == (34, 5, 29, 1024)
    assert g4b.bytes_per_token == 2 * 34 * 4 * 256 * 2 == 139264
    assert g4b.marginal_bytes_per_token == 2 * 5 * 4 * 256 * 2


def test_mha_and_mqa_defaults():
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kb.shape_from_hf_config(base, "f16").kv_heads == 4
    assert kb.shape_from_hf_config({**base, "multi_query": True}, "f16").kv_heads == 1
    with pytest.raises(kb.ModelShapeError, match="num_hidden_layers"):
        kb.shape_from_hf_config({"num_attention_heads": 4}, "f16")
    with pytest.raises(kb.ModelShapeError, match="head_dim nor hidden_size"):
        kb.shape_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4}, "f16")


def test_dense_weight_estimate_llama_31_8b():
    est = kb.estimate_hf_weights_bytes(json.loads((HF / "llama-3.1-8b.json").read_text()))
    assert est is not None
    b, how = est
    assert b / 2 == pytest.approx(8.03e9, rel=0.01)  # 8.03 B parameters x 2 B
    assert "dense estimate" in how


# DeepSeek-V3's published config.json carries this block (the fixture trims it): its weights
# ship in FP8, 1 byte per parameter.
DEEPSEEK_FP8 = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
    "weight_block_size": [128, 128],
}  # fmt: skip
MIXTRAL_8X7B = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def test_moe_weight_estimates_count_every_expert():
    ds = json.loads((HF / "deepseek-v3.json").read_text())
    b, how = kb.estimate_hf_weights_bytes(ds)  # MLA attention, 3 dense + 58 MoE layers
    assert b / 2 == pytest.approx(671e9, rel=0.005)  # DeepSeek-V3: 671 B parameters, bf16
    assert "MoE estimate: 256 experts + 1 shared x 58 layers" in how
    b8, how8 = kb.estimate_hf_weights_bytes({**ds, "quantization_config": DEEPSEEK_FP8})
    assert b8 == pytest.approx(671e9, rel=0.005) and "fp8 8-bit" in how8  # ~625 GiB as shipped
    bm, _ = kb.estimate_hf_weights_bytes(MIXTRAL_8X7B)
    assert bm / 2 == pytest.approx(46.7e9, rel=0.005)  # Mixtral-8x7B: 46.7 B parameters


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "jamba-v0.1"])
def test_hybrid_models_weights_are_not_guessed(name):
    assert kb.estimate_hf_weights_bytes(json.loads((HF / f"{name}.json").read_text())) is None


def test_unknown_quantization_is_not_guessed():
    assert (
        kb.estimate_hf_weights_bytes(
            {**MIXTRAL_8X7B, "quantization_config": {"quant_method": "mystery"}}
        )
        is None
    )


# --- GGUF -------------------------------------------------------------------------------------


def _write_gguf(path: Path, arch: str, kv: dict[str, object], vocab: int = 3000) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in kv.items():
        key = k.format(arch=arch)
        if isinstance(v, list):
            w.add_array(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_uint32(key, int(v))  # type: ignore[call-overload]
    w.add_name("tiny " + arch)
    w.add_token_list([f"tok{i}" for i in range(vocab)])  # a tokenizer array to skip
    w.add_token_scores([0.0] * vocab)
    w.add_tensor("t", np.zeros((4,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_reader_agrees_with_the_gguf_package(tmp_path):
    import gguf

    p = tmp_path / "m.gguf"
    _write_gguf(
        p,
        "llama",
        {
            "{arch}.block_count": 32,
            "{arch}.attention.head_count": 32,
            "{arch}.attention.head_count_kv": 8,
            "{arch}.embedding_length": 4096,
            "{arch}.context_length": 131072,
        },
    )
    mine = kb.read_gguf_metadata(p)
    ref = gguf.GGUFReader(str(p))
    for key in ("general.architecture", "llama.block_count", "llama.attention.head_count_kv"):
        assert mine[key] == ref.fields[key].contents()
    assert mine["tokenizer.ggml.tokens"] is None  # skipped, not materialised
    s = kb.shape_from_gguf(p)  # key/value length default to 4096 / 32; f16 KV
    assert s.bytes_per_token == 131072 and s.dtype == "f16"
    assert kb.shape_from_gguf(p, "q8_0").bytes_per_token == 69632


def test_gguf_per_layer_kv_heads_mark_recurrent_layers(tmp_path):
    p = tmp_path / "jamba.gguf"
    kvs = [8 if i % 8 == 4 else 0 for i in range(32)]
    _write_gguf(
        p,
        "jamba",
        {
            "{arch}.block_count": 32,
            "{arch}.attention.head_count": 32,
            "{arch}.attention.head_count_kv": kvs,
            "{arch}.embedding_length": 4096,
        },
    )
    s = kb.shape_from_gguf(p)
    assert (s.full_layers, s.stateless_layers, s.bytes_per_token) == (4, 28, 16384)


def test_gguf_errors(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 30)
    with pytest.raises(kb.ModelShapeError, match="bad magic"):
        kb.read_gguf_metadata(bad)
    trunc = tmp_path / "t.gguf"
    trunc.write_bytes(b"GGUF\x03\0\0\0" + b"\0" * 4)
    with pytest.raises(kb.ModelShapeError, match="truncated"):
        kb.read_gguf_metadata(trunc)
    with pytest.raises(kb.ModelShapeError, match="architecture"):
        kb.shape_from_gguf_metadata({})


@pytest.mark.skipif(
    not GEMMA_GGUF.is_file(), reason=f"{GEMMA_GGUF} missing (scripts/ensure-llamacpp)"
)
def test_gemma3_270m_gguf_from_the_pypi_package():
    """The model the e2e tests serve: its real metadata, pinned.

    llama-server -c 2048 -np 4 allocates 6.00 MiB (512 cells x 4 seqs x 3 layers) + 30.00 MiB
    (512 cells x 4 seqs x 15 SWA layers) of f16 KV: 36 MiB / 2048 cells = 18,432 B per token.
    """
    s = kb.shape_from_gguf(GEMMA_GGUF)
    assert s.architecture == "gemma3" and s.model == "Gemma 3 270m"
    assert (s.layers, s.kv_heads, s.key_dim, s.value_dim) == (18, 1, 256, 256)
    assert (s.full_layers, s.window_layers, s.window) == (3, 15, 512)
    assert s.bytes_per_token == 2 * 18 * 1 * 256 * 2 == 18432
    assert s.marginal_bytes_per_token == 3072
    assert 4 * s.sequence_bytes(512) == 36 * 1024 * 1024  # the server's KV buffers
    assert s.bytes_per_token == hf("gemma-3-270m", "f16").bytes_per_token  # GGUF == HF config


# --- engine-reported ----------------------------------------------------------------------------


def test_vllm_cache_config_info_capture():
    (e,) = from_vllm_metrics((FIX / "vllm_cache_config_info.txt").read_text())
    assert (e.capacity_tokens, e.num_blocks, e.block_size) == (6144, 48, 128)
    assert e.max_concurrency == 3.0 and e.kv_dtype == "auto"
    assert e.kv_memory_bytes is None and e.bytes_per_token is None


def test_vllm_bytes_per_token_when_memory_is_reported():
    from kvpressure.agent.capacity.engine_facts import from_vllm_cache_config

    e = from_vllm_cache_config(
        {"num_gpu_blocks": "1000", "block_size": "16", "kv_cache_memory_bytes": "2097152000"}
    )
    assert e.capacity_tokens == 16000 and e.bytes_per_token == 131072


def test_llamacpp_props_and_slots_capture():
    props = json.loads((FIX / "llamacpp_props.json").read_text())
    slots = json.loads((FIX / "llamacpp_slots_load.json").read_text())
    e = from_llamacpp(props, slots)
    assert (e.capacity_tokens, e.slots, e.tokens_per_slot) == (2048, 4, 512)
    assert e.model_path == "/models/gemma-3-270m-q4_k_m.gguf"
    assert from_llamacpp(props).capacity_tokens == 2048
    assert from_llamacpp(props, unified=True).capacity_tokens == 512


def test_gguf_mla_and_linear_attention_hybrid(tmp_path):
    ds = tmp_path / "ds.gguf"
    _write_gguf(
        ds,
        "deepseek2",
        {  # an MLA-converted DeepSeek-V3 GGUF's attention keys
            "{arch}.block_count": 61,
            "{arch}.attention.head_count": 128,
            "{arch}.attention.head_count_kv": 1,
            "{arch}.attention.key_length": 576,
            "{arch}.attention.value_length": 512,
            "{arch}.attention.key_length_mla": 192,
            "{arch}.attention.value_length_mla": 128,
            "{arch}.attention.kv_lora_rank": 512,
            "{arch}.rope.dimension_count": 64,
        },
    )
    s = kb.shape_from_gguf(ds, "bf16")
    assert s.latent_dim == 576 and s.bytes_per_token == 70272  # == the HF config figure
    assert s.bytes_per_token == hf("deepseek-v3").bytes_per_token
    qn = tmp_path / "qn.gguf"
    _write_gguf(
        qn,
        "qwen3next",
        {
            "{arch}.block_count": 48,
            "{arch}.attention.head_count": 16,
            "{arch}.attention.head_count_kv": 2,
            "{arch}.attention.key_length": 256,
            "{arch}.attention.value_length": 256,
            "{arch}.full_attention_interval": 4,
        },
    )
    s = kb.shape_from_gguf(qn, "bf16")
    assert (s.full_layers, s.stateless_layers, s.bytes_per_token) == (12, 36, 24576)
