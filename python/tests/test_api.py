"""The public names, the selector and backends, KV-cache layout/spec, documentation, stubs."""

from __future__ import annotations

import ast
import inspect
import pathlib
import pydoc

import numpy as np
import pytest

import pagedattn
from frameworks import torch_or_skip

ATTENTION_ARGS = ["num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes",
                  "sliding_window", "logits_soft_cap", "attn_type", "kv_cache_dtype",
                  "block_size", "sinks", "kv_sharing_target_layer_name", "prefix", "dtype",
                  "device", "backend"]
FORWARD_ARGS = ["query", "key", "value", "kv_cache", "attn_metadata", "output", "return_lse"]


def test_attention_type_matches_vllm():
    assert pagedattn.AttentionType.DECODER == "decoder"
    assert pagedattn.AttentionType.ENCODER == "encoder"
    assert pagedattn.AttentionType.ENCODER_ONLY == "encoder_only"
    assert pagedattn.AttentionType.ENCODER_DECODER == "encoder_decoder"


def test_multiple_of():
    m = pagedattn.MultipleOf(16)
    assert m.base == 16 and m == pagedattn.MultipleOf(16) and m != pagedattn.MultipleOf(32)
    assert m != 16 and repr(m) == "MultipleOf(16)"
    assert pagedattn.MultipleOf(base=8).base == 8


@pytest.mark.parametrize("kv_cache_dtype, quantized", [
    ("auto", False), ("fp8", True), ("fp8_e4m3", True), ("fp8_e5m2", True),
    ("bfloat16", True), ("float16", True), ("float32", True)])
def test_is_quantized_kv_cache(kv_cache_dtype, quantized):
    assert pagedattn.is_quantized_kv_cache(kv_cache_dtype) is quantized
    pagedattn.validate_kv_cache_dtype(kv_cache_dtype)


def test_dtype_spellings():
    import ml_dtypes

    assert pagedattn.canonical_dtype("bf16") == "bfloat16"
    assert pagedattn.canonical_dtype(np.float16) == "float16"
    assert pagedattn.canonical_dtype(np.dtype("float32")) == "float32"
    assert pagedattn.canonical_dtype(ml_dtypes.bfloat16) == "bfloat16"
    assert pagedattn.canonical_dtype(ml_dtypes.float8_e4m3fn) == "float8_e4m3fn"
    assert pagedattn.kv_cache_storage_dtype("auto", "bfloat16") == "bfloat16"
    assert pagedattn.kv_cache_storage_dtype("fp8", "bfloat16") == "float8_e4m3fn"
    assert pagedattn.kv_cache_storage_dtype("fp8_e5m2", np.float16) == "float8_e5m2"


def test_torch_dtypes_are_accepted():
    torch = torch_or_skip()
    assert pagedattn.canonical_dtype(torch.bfloat16) == "bfloat16"
    layer = pagedattn.Attention(2, 32, None, dtype=torch.float16)
    assert layer.dtype == "float16"


def test_list_backends_and_find_backend():
    backends = pagedattn.list_backends()
    names = [b.name for b in backends]
    # The fp64 oracles come last: REFERENCE for standard layers, then REFERENCE_MLA for MLA layers.
    assert len(names) == len(set(names)) and names[-2:] == ["REFERENCE", "REFERENCE_MLA"]
    for b in backends:
        assert pagedattn.find_backend(b.name.lower()) == b
        assert b.get_name() == b.name and b.name in repr(b)
        assert isinstance(b.accept_output_buffer, bool)
        caps = b.capabilities()
        assert set(caps) == {"devices", "dtypes", "kv_cache_dtypes", "head_sizes", "attn_types",
                             "features"}
    assert pagedattn.find_backend("no-such-backend") is None


def test_get_attn_backend_returns_the_first_usable_backend():
    chosen = pagedattn.get_attn_backend(64, "bfloat16", "auto", 16)
    for b in pagedattn.list_backends():
        reasons = b.validate_configuration(64, "bfloat16", "auto", 16)
        if not reasons:
            assert b == chosen
            break
        assert b != chosen and all(isinstance(r, str) and r for r in reasons)
    # vLLM passes kv_cache_dtype=None for "auto"
    assert pagedattn.get_attn_backend(64, np.float32, None, 16) == \
        pagedattn.get_attn_backend(64, "float32", "auto", 16)


def test_backend_env_override(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_BACKEND", "REFERENCE")
    assert pagedattn.get_attn_backend(64, "bfloat16", "auto", 16).name == "REFERENCE"
    assert pagedattn.Attention(2, 64, None).backend.name == "REFERENCE"


def test_reference_backend_reports_why_it_cannot_run_on_cuda():
    reasons = pagedattn.find_backend("REFERENCE").validate_configuration(
        128, "bfloat16", device="cuda")
    assert reasons and any("cuda" in r.lower() for r in reasons)


def test_kv_cache_shape_and_stride_order():
    backend = pagedattn.get_attn_backend(64, "float16", "auto", 16)
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert pagedattn.get_kv_cache_layout() == "NHD"
    assert backend.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    pagedattn.set_kv_cache_layout("HND")
    try:
        assert pagedattn.get_kv_cache_layout() == "HND"
        assert backend.get_kv_cache_stride_order() == (0, 1, 3, 2, 4)
    finally:
        pagedattn.set_kv_cache_layout(None)
    assert pagedattn.get_kv_cache_layout() == "NHD"
    with pytest.raises(pagedattn.Error):
        pagedattn.set_kv_cache_layout("NCHW")


def test_supported_kernel_block_sizes():
    for backend in pagedattn.list_backends():
        sizes = backend.get_supported_kernel_block_sizes()
        assert sizes and all(isinstance(s, (int, pagedattn.MultipleOf)) for s in sizes)
        for s in sizes:
            size = s if isinstance(s, int) else s.base * 2
            assert backend.supports_block_size(size)


def test_attention_attributes():
    layer = pagedattn.Attention(8, 64, 0.125, num_kv_heads=2, sliding_window=128,
                                kv_cache_dtype="fp8", block_size=32, prefix="model.layers.3.attn",
                                dtype="bfloat16", alibi_slopes=np.linspace(0.1, 0.8, 8),
                                sinks=[0.0] * 8)
    assert (layer.num_heads, layer.head_size, layer.num_kv_heads, layer.block_size) == (8, 64, 2, 32)
    assert (layer.dtype, layer.device, layer.kv_cache_dtype) == ("bfloat16", "cpu", "fp8")
    assert layer.sliding_window == 128 and layer.logits_soft_cap is None
    assert layer.layer_name == "model.layers.3.attn" and layer.attn_type == "decoder"
    assert np.allclose(layer.alibi_slopes, np.linspace(0.1, 0.8, 8))
    assert layer.sinks == [0.0] * 8
    assert isinstance(layer.backend, pagedattn.AttentionBackend)
    spec = layer.kv_cache_spec
    assert isinstance(spec, pagedattn.KVCacheSpec)
    assert (spec.kind, spec.block_size, spec.num_kv_heads, spec.head_size) == \
        ("sliding_window", 32, 2, 64)
    assert spec.dtype == "float8_e4m3fn" and spec.sliding_window == 128
    assert spec.page_size_bytes == 2 * 32 * 2 * 64 * 1
    assert (layer.q_scale, layer.k_scale, layer.v_scale) == (1.0, 1.0, 1.0)
    layer.q_scale = 0.5
    assert layer.q_scale == 0.5
    assert "backend=" in repr(layer)


def test_help_explains_every_argument():
    text = pydoc.render_doc(pagedattn.Attention, renderer=pydoc.plaintext)
    doc = inspect.getdoc(pagedattn.Attention)
    for name in ATTENTION_ARGS:
        assert f"{name}:" in doc, name
        assert name in inspect.signature(pagedattn.Attention).parameters, name
    forward_doc = inspect.getdoc(pagedattn.Attention.forward)
    for name in FORWARD_ARGS:
        assert name in forward_doc and name in inspect.signature(pagedattn.Attention.forward).parameters
    assert "allocate_kv_cache" in text and "metadata_builder" in text
    for fn in (pagedattn.CommonAttentionMetadata, pagedattn.reshape_and_cache_flash,
               pagedattn.merge_attn_states, pagedattn.make_local_attention_virtual_batches,
               pagedattn.get_attn_backend, pagedattn.split_decodes_and_prefills,
               pagedattn.reorder_batch_to_split_decodes_and_prefills,
               pagedattn.use_cascade_attention):
        assert len(inspect.getdoc(fn) or "") > 80, fn


def test_vllm_keyword_names():
    sig = inspect.signature(pagedattn.Attention)
    assert list(sig.parameters)[:len(ATTENTION_ARGS)] == ATTENTION_ARGS
    defaults = {k: p.default for k, p in sig.parameters.items()}
    assert defaults["num_kv_heads"] is None and defaults["attn_type"] == "decoder"
    assert defaults["kv_cache_dtype"] == "auto" and defaults["block_size"] == 16
    assert defaults["prefix"] == "" and defaults["dtype"] == "bfloat16"
    assert defaults["device"] == "cpu" and defaults["backend"] is None
    assert list(inspect.signature(pagedattn.Attention.forward).parameters)[1:8] == FORWARD_ARGS
    assert list(inspect.signature(pagedattn.CommonAttentionMetadata).parameters)[:8] == [
        "query_start_loc", "seq_lens", "block_table", "slot_mapping", "num_computed_tokens",
        "max_query_len", "max_seq_len", "num_actual_tokens"]
    assert list(inspect.signature(pagedattn.reshape_and_cache_flash).parameters) == [
        "key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype", "k_scale",
        "v_scale"]
    assert list(inspect.signature(pagedattn.merge_attn_states).parameters) == [
        "output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_lse",
        "prefill_tokens_with_context"]


def test_every_public_name_exists_and_has_a_stub():
    stub = pathlib.Path(pagedattn.__file__).with_name("__init__.pyi")
    tree = ast.parse(stub.read_text())
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stubbed |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    stubbed |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    for name in pagedattn.__all__:
        assert hasattr(pagedattn, name), name
        assert name in stubbed, f"{name} is missing from __init__.pyi"
    assert pathlib.Path(pagedattn.__file__).with_name("py.typed").exists()


def test_device_queries():
    assert isinstance(pagedattn.built_with_cuda(), bool)
    assert pagedattn.cuda_device_count() >= 0
    if not pagedattn.built_with_cuda():
        assert pagedattn.cuda_device_count() == 0
    pagedattn.synchronize_cuda()
    previous = pagedattn.current_cuda_stream()
    pagedattn.set_current_cuda_stream(0)
    assert pagedattn.current_cuda_stream() == 0
    pagedattn.set_current_cuda_stream(previous)


def test_static_forward_context_checks_kv_sharing_targets():
    model = pagedattn.StaticForwardContext()
    args = dict(num_heads=4, head_size=32, scale=None, num_kv_heads=2, dtype="float32",
                backend="REFERENCE", static_forward_context=model)
    pagedattn.Attention(prefix="model.layers.0.attn", **args)
    pagedattn.Attention(prefix="model.layers.1.attn", kv_sharing_target_layer_name="model.layers.0.attn",
                        **args)
    assert len(model) == 2 and "model.layers.1.attn" in model
    assert model["model.layers.1.attn"].kv_sharing_target_layer_name == "model.layers.0.attn"
    assert model["model.layers.0.attn"].kv_cache_spec.head_size == 32
    cases = [
        (dict(prefix="model.layers.0.attn"), "prefix", ["already"]),
        (dict(prefix="model.layers.2.attn", kv_sharing_target_layer_name="model.layers.7.attn"),
         "kv_sharing_target_layer_name", ["model.layers.2.attn", "model.layers.7.attn", "earlier"]),
        (dict(prefix="model.layers.2.attn", kv_sharing_target_layer_name="model.layers.0.attn",
              sliding_window=64), "kv_sharing_target_layer_name",
         ["model.layers.0.attn", "model.layers.2.attn", "sliding_window 0 vs 64"]),
    ]
    for extra, argument, words in cases:
        with pytest.raises(pagedattn.Error) as e:
            pagedattn.Attention(**{**args, **extra})
        assert e.value.argument == argument
        for word in words:
            assert word in str(e.value), str(e.value)
    assert model.layer_names == ["model.layers.0.attn", "model.layers.1.attn"]
    with pytest.raises(pagedattn.Error, match="StaticForwardContext"):
        pagedattn.Attention(4, 32, None, prefix="model.layers.3.attn",
                            kv_sharing_target_layer_name="model.layers.0.attn")


def test_per_layer_parameters_and_global_hyperparameters():
    layers = [pagedattn.Attention(4, 64, 0.125, sliding_window=128, logits_soft_cap=30.0,
                                  prefix=f"layers.{i}.attn") for i in range(2)]
    per_layer = pagedattn.get_per_layer_parameters(layers)
    expected = pagedattn.PerLayerParameters(window_left=127, logits_soft_cap=30.0, sm_scale=0.125)
    assert per_layer == {"layers.0.attn": expected, "layers.1.attn": expected}
    assert pagedattn.infer_global_hyperparameters(per_layer) == expected
    per_layer["layers.1.attn"] = pagedattn.PerLayerParameters(sm_scale=0.125)
    with pytest.raises(pagedattn.Error, match="layers.1.attn") as e:
        pagedattn.infer_global_hyperparameters(per_layer)
    assert e.value.argument == "per_layer"
    with pytest.raises(pagedattn.Error, match="empty"):
        pagedattn.infer_global_hyperparameters({})
    with pytest.raises(pagedattn.Error, match="like an earlier layer"):
        pagedattn.get_per_layer_parameters([layers[0], layers[0]])
