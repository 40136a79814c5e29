"""pagedattn.Attention against the float64 NumPy oracle: causal with context, GQA/MQA, sliding
window, soft cap, ALiBi, sinks, empty queries; every dtype; every backend usable here; NumPy,
PyTorch CPU and (on a GPU machine) PyTorch CUDA tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pagedattn
from frameworks import attention_or_skip
from attention_oracle import (FP8_TOLERANCE, TOLERANCE, attend, cached_kv, fill_context,
                              make_batch, oracle_args, random_array, reference_forward, rel_err)

DTYPES = ["float32", "float16", "bfloat16"]

CASES = {
    "causal_context": dict(num_heads=4, num_kv_heads=4, head_size=64,
                           query_lens=[1, 1, 6, 17], context_lens=[9, 33, 0, 12]),
    "gqa": dict(num_heads=8, num_kv_heads=2, head_size=32,
                query_lens=[1, 4, 9], context_lens=[20, 3, 17]),
    "mqa": dict(num_heads=4, num_kv_heads=1, head_size=64,
                query_lens=[2, 1, 13], context_lens=[0, 47, 5]),
    "sliding_window": dict(num_heads=4, num_kv_heads=2, head_size=32, sliding_window=7,
                           query_lens=[1, 12, 5], context_lens=[30, 9, 0]),
    "soft_cap": dict(num_heads=4, num_kv_heads=2, head_size=64, logits_soft_cap=2.0, q_scale=3.0,
                     query_lens=[1, 8], context_lens=[25, 6]),
    "alibi": dict(num_heads=4, num_kv_heads=4, head_size=32, alibi=True,
                  query_lens=[1, 10, 3], context_lens=[22, 5, 0]),
    "sinks": dict(num_heads=4, num_kv_heads=2, head_size=32, sinks=True,
                  query_lens=[1, 7], context_lens=[14, 3]),
    "all_features": dict(num_heads=8, num_kv_heads=2, head_size=32, sliding_window=11,
                         logits_soft_cap=3.0, alibi=True, sinks=True,
                         query_lens=[1, 1, 9, 15], context_lens=[40, 2, 12, 0]),
    "block_size_32": dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=32,
                          query_lens=[1, 30], context_lens=[70, 40]),
    "empty_query": dict(num_heads=4, num_kv_heads=2, head_size=32,
                        query_lens=[1, 0, 5], context_lens=[18, 6, 3]),
}


def alibi_slopes(num_heads: int) -> list[float]:
    return [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]


def layer_kwargs(case: dict, rng) -> tuple[dict, dict]:
    """(Attention keyword arguments, oracle feature arguments) of a case."""
    kwargs = dict(num_kv_heads=case["num_kv_heads"], block_size=case.get("block_size", 16))
    oracle = {}
    if "sliding_window" in case:
        kwargs["sliding_window"] = oracle["window"] = case["sliding_window"]
    if "logits_soft_cap" in case:
        kwargs["logits_soft_cap"] = oracle["soft_cap"] = case["logits_soft_cap"]
    if case.get("alibi"):
        kwargs["alibi_slopes"] = oracle["alibi"] = alibi_slopes(case["num_heads"])
    if case.get("sinks"):
        kwargs["sinks"] = oracle["sinks"] = [float(x) for x in rng.standard_normal(case["num_heads"])]
    return kwargs, oracle


def make_layer(fw, dtype, num_heads, head_size, backend=None, **kwargs):
    """An Attention layer, or a skip when the requested backend (or, on CUDA, any backend)
    cannot run this configuration (it says why)."""
    if backend is not None:
        b = pagedattn.find_backend(backend)
        reasons = b.validate_configuration(
            head_size, dtype, kwargs.get("kv_cache_dtype", "auto"), kwargs.get("block_size", 16),
            has_sink=kwargs.get("sinks") is not None, device=fw.device,
            use_alibi=kwargs.get("alibi_slopes") is not None,
            use_sliding_window=kwargs.get("sliding_window") is not None,
            use_logits_soft_cap=kwargs.get("logits_soft_cap") is not None,
            attn_type=kwargs.get("attn_type", "decoder"),
            head_size_v=kwargs.get("head_size_v") or 0)
        if reasons:
            pytest.skip(f"{backend}: " + " ".join(reasons))
    return attention_or_skip(fw.device, num_heads, head_size, head_size ** -0.5, dtype=dtype,
                             backend=backend, **kwargs)


def prepare_cache(fw, layer, batch, head_size, head_size_v=None, k_scale=1.0, v_scale=1.0):
    """A cache poisoned with NaN everywhere but the batch's context, which holds its keys."""
    head_size_v = head_size_v or head_size
    cache = layer.allocate_kv_cache(batch.num_blocks, framework=fw.cache_framework())
    fw.fill(cache, float("nan"))
    host = fw.host(cache).astype(np.float32)
    fill_context(batch, host, head_size, head_size_v, k_scale, v_scale)
    fw.assign(cache, host)
    return cache


def backend_params():
    return [None] + [b.name for b in pagedattn.list_backends()]


@pytest.mark.parametrize("backend", backend_params(), ids=lambda b: b or "selected")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_float64_oracle(fw, rng, dtype, case, backend):
    c = CASES[case]
    kwargs, features = layer_kwargs(c, rng)
    hq, d = c["num_heads"], c["head_size"]
    layer = make_layer(fw, dtype, hq, d, backend=backend, **kwargs)
    batch = make_batch(rng, c["query_lens"], c["context_lens"], layer.block_size,
                       c["num_kv_heads"], d)
    cache = prepare_cache(fw, layer, batch, d)
    t = batch.num_tokens
    query = fw.array(rng.standard_normal((t, hq, d)) * c.get("q_scale", 1.0), dtype)
    k_new, v_new = batch.new_kv()
    key, value = fw.array(k_new, dtype), fw.array(v_new, dtype)
    output = fw.empty((t, hq, d), dtype)
    fw.fill(output, float("nan"))

    attn_metadata = layer.metadata_builder().build(batch.common())
    result, lse = layer.forward(query, key, value, cache, attn_metadata, output=output,
                                return_lse=True)

    assert result is output
    assert fw.is_tensor(lse) and tuple(lse.shape) == (hq, t)
    # The new tokens were written where slot_mapping says, exactly (same dtype).
    host_cache = fw.host(cache)
    for i, slot in enumerate(batch.slot_mapping):
        b, o = divmod(int(slot), batch.block_size)
        np.testing.assert_array_equal(host_cache[0, b, o], fw.host(key)[i])
        np.testing.assert_array_equal(host_cache[1, b, o], fw.host(value)[i])
    ref_out, ref_lse = reference_forward(batch, fw.host(query), host_cache,
                                         oracle_args(layer, **features), d)
    assert rel_err(fw.host(output), ref_out) <= TOLERANCE[dtype], layer.backend.name
    assert rel_err(fw.host(lse), ref_lse) <= max(TOLERANCE[dtype], 1e-5), layer.backend.name


@pytest.mark.parametrize("backend", backend_params(), ids=lambda b: b or "selected")
@pytest.mark.parametrize("chunk,block_size", [(32, 16), (16, 16), (64, 8)],
                         ids=["chunk32_block16", "chunk16_block16", "chunk64_block8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_local_attention_matches_float64_oracle(fw, rng, dtype, chunk, block_size,
                                                        backend):
    """attention_chunk_size = C (Llama 4): a query at position p sees the keys k <= p with
    k // C == p // C, through the layer's own metadata builder. One batch: an 80-token prefill,
    decodes beside and on chunk edges (positions 70, 64, 63), and prefill chunks that start inside
    a chunk."""
    hq, hkv, d = 4, 2, 64
    query_lens, context_lens = [80, 1, 1, 1, 30, 2], [0, 70, 64, 63, 20, 31]
    layer = make_layer(fw, dtype, hq, d, backend=backend, num_kv_heads=hkv, block_size=block_size,
                       attention_chunk_size=chunk)
    assert layer.kv_cache_spec.attention_chunk_size == chunk
    batch = make_batch(rng, query_lens, context_lens, block_size, hkv, d)
    cache = prepare_cache(fw, layer, batch, d)
    t = batch.num_tokens
    query = fw.array(rng.standard_normal((t, hq, d)), dtype)
    k_new, v_new = batch.new_kv()
    output = fw.empty((t, hq, d), dtype)
    fw.fill(output, float("nan"))
    # max_num_seqs = the real requests: the virtual ones are the builder's business.
    builder = layer.metadata_builder(max_num_seqs=len(query_lens))
    assert builder.cudagraph_support == "never" and not builder.supports_cascade
    layer.forward(query, fw.array(k_new, dtype), fw.array(v_new, dtype), cache,
                  builder.build(batch.common()), output=output)

    host_cache = fw.host(cache)
    ref_out, _ = reference_forward(batch, fw.host(query), host_cache,
                                   oracle_args(layer, chunk=chunk), d)
    causal_out, _ = reference_forward(batch, fw.host(query), host_cache, oracle_args(layer), d)
    assert rel_err(causal_out, ref_out) > 0.05  # the batch tells chunked from plain causal
    assert rel_err(fw.host(output), ref_out) <= TOLERANCE[dtype], layer.backend.name


def test_forward_allocates_output_beside_query(fw, rng):
    layer = make_layer(fw, "float32", 4, 32, num_kv_heads=2)
    batch = make_batch(rng, [3, 1], [0, 9], 16, 2, 32)
    cache = prepare_cache(fw, layer, batch, 32)
    query = fw.array(rng.standard_normal((4, 4, 32)), "float32")
    k, v = batch.new_kv()
    out = layer.forward(query, fw.array(k, "float32"), fw.array(v, "float32"), cache,
                        layer.metadata_builder().build(batch.common()))
    assert fw.is_tensor(out) and tuple(out.shape) == (4, 4, 32)
    ref, _ = reference_forward(batch, fw.host(query), fw.host(cache), oracle_args(layer), 32)
    assert rel_err(fw.host(out), ref) <= TOLERANCE["float32"]


def test_padded_batch_writes_the_actual_tokens(fw, rng):
    """query/key/value with more rows than num_actual_tokens (CUDA-graph padding): slot_mapping
    is padded with -1 and the first num_actual_tokens rows match the oracle."""
    layer = make_layer(fw, "bfloat16", 8, 64, num_kv_heads=2)
    batch = make_batch(rng, [1, 1, 4], [5, 30, 2], 16, 2, 64)
    cache = prepare_cache(fw, layer, batch, 64)
    t, pad = batch.num_tokens, 3
    query = fw.array(rng.standard_normal((t + pad, 8, 64)), "bfloat16")
    k, v = batch.new_kv()
    key = fw.array(np.concatenate([k, rng.standard_normal((pad, 2, 64))]), "bfloat16")
    value = fw.array(np.concatenate([v, rng.standard_normal((pad, 2, 64))]), "bfloat16")
    slots = np.concatenate([batch.slot_mapping, -np.ones(pad, dtype=np.int64)])
    common = pagedattn.CommonAttentionMetadata(batch.query_start_loc, batch.seq_lens,
                                               batch.block_table, slots)
    assert common.num_actual_tokens == t
    out = layer.forward(query, key, value, cache, layer.metadata_builder().build(common))
    assert tuple(out.shape) == (t + pad, 8, 64)
    ref, _ = reference_forward(batch, fw.host(query)[:t], fw.host(cache), oracle_args(layer), 64)
    assert rel_err(fw.host(out)[:t], ref) <= TOLERANCE["bfloat16"]


def test_hnd_layout(fw, rng, hnd_layout):
    layer = make_layer(fw, "float16", 4, 64, num_kv_heads=2, sliding_window=9)
    assert layer.backend.get_kv_cache_stride_order() == (0, 1, 3, 2, 4)
    batch = make_batch(rng, [1, 7], [20, 4], 16, 2, 64)
    cache = prepare_cache(fw, layer, batch, 64)
    # Logical shape, physical HND order: the head dim is outside the token-in-block dim.
    assert tuple(cache.shape) == (2, batch.num_blocks, 16, 2, 64)
    strides = cache.strides if isinstance(cache, np.ndarray) else cache.stride()
    if isinstance(cache, np.ndarray):
        strides = tuple(s // cache.itemsize for s in strides)
    assert strides[3] == 16 * 64 and strides[2] == 64
    query = fw.array(rng.standard_normal((batch.num_tokens, 4, 64)), "float16")
    k, v = batch.new_kv()
    out = layer.forward(query, fw.array(k, "float16"), fw.array(v, "float16"), cache,
                        layer.metadata_builder().build(batch.common()))
    ref, _ = reference_forward(batch, fw.host(query), fw.host(cache),
                               oracle_args(layer, window=9), 64)
    assert rel_err(fw.host(out), ref) <= TOLERANCE["float16"]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache(fw, rng, kv_cache_dtype):
    k_scale, v_scale = 0.5, 2.0  # powers of two: x / scale is exact before rounding to fp8
    layer = make_layer(fw, "bfloat16", 8, 64, num_kv_heads=2, kv_cache_dtype=kv_cache_dtype)
    layer.k_scale, layer.v_scale = k_scale, v_scale
    assert (layer.k_scale, layer.v_scale) == (k_scale, v_scale)
    name = "float8_e4m3fn" if kv_cache_dtype == "fp8" else "float8_e5m2"
    assert layer.kv_cache_storage_dtype == name and layer.kv_cache_spec.dtype == name
    batch = make_batch(rng, [1, 6], [25, 3], 16, 2, 64)
    cache = prepare_cache(fw, layer, batch, 64, k_scale=k_scale, v_scale=v_scale)
    assert str(cache.dtype).endswith(name)
    query = fw.array(rng.standard_normal((batch.num_tokens, 8, 64)), "bfloat16")
    k, v = batch.new_kv()
    key, value = fw.array(k, "bfloat16"), fw.array(v, "bfloat16")
    out = layer.forward(query, key, value, cache, layer.metadata_builder().build(batch.common()))
    # New tokens are stored as saturate(x / scale) in fp8 (round to nearest even).
    from pagedattn._tensors import numpy_dtype

    host_cache = fw.host(cache)
    for i, slot in enumerate(batch.slot_mapping):
        b, o = divmod(int(slot), batch.block_size)
        want_k = (fw.host(key)[i] / k_scale).astype(np.float32).astype(numpy_dtype(name))
        want_v = (fw.host(value)[i] / v_scale).astype(np.float32).astype(numpy_dtype(name))
        np.testing.assert_array_equal(host_cache[0, b, o], want_k.astype(np.float64))
        np.testing.assert_array_equal(host_cache[1, b, o], want_v.astype(np.float64))
    ref, _ = reference_forward(batch, fw.host(query), host_cache, oracle_args(layer), 64,
                               k_scale=k_scale, v_scale=v_scale)
    assert rel_err(fw.host(out), ref) <= FP8_TOLERANCE


def test_fused_fp8_output(fw, rng):
    # fp8_output=True: the selector takes a backend with fused fp8 output (CPU on the CPU, CUDA on
    # a GPU); forward(output_scale=) writes e4m3 = saturate(attention / scale).
    layer = make_layer(fw, "bfloat16", 8, 128, num_kv_heads=2, fp8_output=True)
    assert layer.backend.name in ("CPU", "CUDA")
    assert "fp8_output" in layer.backend.capabilities()["features"]
    batch = make_batch(rng, [1, 1, 37, 3], [700, 30, 0, 200], 16, 2, 128)
    cache = prepare_cache(fw, layer, batch, 128)
    query = fw.array(rng.standard_normal((batch.num_tokens, 8, 128)), "bfloat16")
    k, v = batch.new_kv()
    key, value = fw.array(k, "bfloat16"), fw.array(v, "bfloat16")
    scale = 1.0 / 64
    out = layer.forward(query, key, value, cache, layer.metadata_builder().build(batch.common()),
                        output_scale=fw.array([scale], "float32"))
    assert "float8_e4m3" in str(out.dtype)
    ref, _ = reference_forward(batch, fw.host(query), fw.host(cache), oracle_args(layer), 128)
    assert rel_err(fw.host(out) * scale, ref) <= FP8_TOLERANCE


def test_quantized_query_input(fw, rng):
    # An fp8 cache on a backend with "quant_query" (REFERENCE here, CUDA on a GPU) accepts a
    # float8_e4m3fn query holding q / q_scale; the output stays in the layer dtype.
    backend = "CUDA" if fw.device == "cuda" else "REFERENCE"
    layer = make_layer(fw, "bfloat16", 8, 64, backend=backend, num_kv_heads=2, kv_cache_dtype="fp8")
    assert layer.supports_quant_query_input
    assert "quant_query" in layer.backend.capabilities()["features"]
    batch = make_batch(rng, [1, 6, 1], [25, 3, 40], 16, 2, 64)
    cache = prepare_cache(fw, layer, batch, 64)
    q_scale = 0.0137  # not a power of two
    layer.q_scale = q_scale
    query = fw.array(rng.standard_normal((batch.num_tokens, 8, 64)) / q_scale, "float8_e4m3fn")
    k, v = batch.new_kv()
    key, value = fw.array(k, "bfloat16"), fw.array(v, "bfloat16")
    out = layer.forward(query, key, value, cache, layer.metadata_builder().build(batch.common()))
    assert "bfloat16" in str(out.dtype)
    ref, _ = reference_forward(batch, fw.host(query) * q_scale, fw.host(cache), oracle_args(layer), 64)
    assert rel_err(fw.host(out), ref) <= FP8_TOLERANCE
    # Without an fp8 cache the query must be in the layer dtype.
    plain = make_layer(fw, "bfloat16", 8, 64, backend=backend, num_kv_heads=2)
    assert not plain.supports_quant_query_input
    with pytest.raises(pagedattn.Error, match="query"):
        plain.forward(query, key, value, prepare_cache(fw, plain, batch, 64),
                      plain.metadata_builder().build(batch.common()))


def test_kv_sharing_layer_reads_the_target_cache(fw, rng):
    model = pagedattn.StaticForwardContext()
    first = make_layer(fw, "float32", 4, 32, num_kv_heads=2, prefix="layers.0.attn",
                       static_forward_context=model)
    second = make_layer(fw, "float32", 4, 32, num_kv_heads=2, prefix="layers.1.attn",
                        kv_sharing_target_layer_name="layers.0.attn",
                        static_forward_context=model)
    assert second.kv_sharing_target_layer_name == "layers.0.attn"
    assert model.layer_names == ["layers.0.attn", "layers.1.attn"]
    batch = make_batch(rng, [1, 5], [12, 0], 16, 2, 32)
    cache = prepare_cache(fw, first, batch, 32)
    md = first.metadata_builder().build(batch.common())
    k, v = batch.new_kv()
    first.forward(fw.array(rng.standard_normal((6, 4, 32)), "float32"), fw.array(k, "float32"),
                  fw.array(v, "float32"), cache, md)
    before = fw.host(cache).copy()
    query = fw.array(rng.standard_normal((6, 4, 32)), "float32")
    out = second.forward(query, None, None, cache, md)
    np.testing.assert_array_equal(fw.host(cache), before)  # the sharing layer wrote nothing
    ref, _ = reference_forward(batch, fw.host(query), before, oracle_args(second), 32)
    assert rel_err(fw.host(out), ref) <= TOLERANCE["float32"]


@pytest.mark.parametrize("window", [None, 3])
def test_encoder_only_attends_non_causally_without_cache(fw, rng, window):
    layer = make_layer(fw, "float32", 4, 32, num_kv_heads=2, attn_type=pagedattn.AttentionType.ENCODER_ONLY,
                       sliding_window=window)
    assert layer.attn_type == "encoder_only"
    lens = [5, 1, 8]
    t = sum(lens)
    qsl = np.concatenate([[0], np.cumsum(lens)])
    common = pagedattn.CommonAttentionMetadata(qsl, lens, np.zeros((3, 1), np.int32),
                                               -np.ones(t, np.int64), causal=False)
    q = fw.array(rng.standard_normal((t, 4, 32)), "float32")
    k = fw.array(rng.standard_normal((t, 2, 32)), "float32")
    v = fw.array(rng.standard_normal((t, 2, 32)), "float32")
    out, lse = layer.forward(q, k, v, None, layer.metadata_builder().build(common), return_lse=True)
    ref_out, ref_lse = [], []
    for r, n in enumerate(lens):
        s = slice(int(qsl[r]), int(qsl[r + 1]))
        pos = np.arange(n)
        o, l = attend(fw.host(q)[s], fw.host(k)[s], fw.host(v)[s], pos, pos, layer.scale,
                      causal=False, window=window, two_sided_window=True)
        ref_out.append(o)
        ref_lse.append(l)
    assert rel_err(fw.host(out), np.concatenate(ref_out)) <= TOLERANCE["float32"]
    assert rel_err(fw.host(lse), np.concatenate(ref_lse, axis=1)) <= 1e-5


def test_cross_attention_over_cached_encoder_kv(fw, rng):
    """encoder_decoder: decoder queries attend to every cached encoder token (no mask)."""
    layer = make_layer(fw, "float32", 4, 32, num_kv_heads=2,
                       attn_type=pagedattn.AttentionType.ENCODER_DECODER)
    enc_lens, dec_lens = [7, 20], [1, 3]
    batch = make_batch(rng, [0, 0], enc_lens, 16, 2, 32)  # the encoder K/V as "context"
    cache = prepare_cache(fw, layer, batch, 32)
    qsl = np.concatenate([[0], np.cumsum(dec_lens)])
    common = pagedattn.CommonAttentionMetadata(qsl, enc_lens, batch.block_table,
                                               -np.ones(sum(dec_lens), np.int64), causal=False)
    query = fw.array(rng.standard_normal((sum(dec_lens), 4, 32)), "float32")
    out = layer.forward(query, None, None, cache, layer.metadata_builder().build(common))
    ref = []
    for r in range(2):
        k, v = cached_kv(batch, fw.host(cache), r, 32, 32)
        s = slice(int(qsl[r]), int(qsl[r + 1]))
        o, _ = attend(fw.host(query)[s], k, v, np.zeros(dec_lens[r]), np.arange(enc_lens[r]),
                      layer.scale, causal=False)
        ref.append(o)
    assert rel_err(fw.host(out), np.concatenate(ref)) <= TOLERANCE["float32"]


def test_query_key_value_as_views_of_a_fused_qkv(rng):
    """query/key/value sliced out of one (T, (Hq + 2 Hkv) * D) projection: strided token rows,
    no copy, same result as contiguous inputs."""
    hq, hkv, d = 4, 2, 32
    layer = pagedattn.Attention(hq, d, d ** -0.5, num_kv_heads=hkv, dtype="float32")
    batch = make_batch(rng, [1, 6], [9, 0], 16, hkv, d)
    t = batch.num_tokens
    k, v = batch.new_kv()
    qkv = np.concatenate([rng.standard_normal((t, hq * d)).astype(np.float32),
                          k.reshape(t, -1), v.reshape(t, -1)], axis=1)
    q_view = qkv[:, :hq * d].reshape(t, hq, d)
    k_view = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    v_view = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    assert not q_view.flags.c_contiguous and np.shares_memory(q_view, qkv)
    cache = layer.allocate_kv_cache(batch.num_blocks)
    fill_context(batch, cache, d, d)
    out = layer.forward(q_view, k_view, v_view, cache, layer.metadata_builder().build(batch.common()))
    ref, _ = reference_forward(batch, q_view, cache, oracle_args(layer), d)
    assert rel_err(out, ref) <= TOLERANCE["float32"]


def test_head_size_v_differs(rng):
    d, dv = 64, 32
    try:
        layer = pagedattn.Attention(4, d, d ** -0.5, num_kv_heads=2, dtype="float32",
                                    head_size_v=dv)
    except pagedattn.Error as exc:
        pytest.skip(f"no backend supports head_size_v != head_size here: {exc}")
    assert layer.head_size_v == dv and layer.kv_cache_spec.head_size_v == dv
    batch = make_batch(rng, [1, 4], [10, 2], 16, 2, d, head_size_v=dv)
    cache = layer.allocate_kv_cache(batch.num_blocks)
    assert cache.shape[-1] == max(d, dv)
    cache[...] = np.nan
    fill_context(batch, cache, d, dv)
    k, v = batch.new_kv()
    query = rng.standard_normal((batch.num_tokens, 4, d)).astype(np.float32)
    out = layer.forward(query, k, v, cache, layer.metadata_builder().build(batch.common()))
    assert out.shape == (batch.num_tokens, 4, dv)
    ref, _ = reference_forward(batch, query, cache, oracle_args(layer), d, head_size_v=dv)
    assert rel_err(out, ref) <= TOLERANCE["float32"]


def test_scale_defaults_to_inverse_sqrt_head_size():
    layer = pagedattn.Attention(2, 64, None, dtype="float32")
    assert math.isclose(layer.scale, 64 ** -0.5, rel_tol=1e-7)
    layer = pagedattn.Attention(2, 64, 0.3, dtype="float32")
    assert math.isclose(layer.scale, 0.3, rel_tol=1e-7)


def test_metadata_built_once_serves_every_layer_of_the_group(rng):
    layers = [pagedattn.Attention(4, 32, 32 ** -0.5, num_kv_heads=2, dtype="bfloat16",
                                  prefix=f"layers.{i}.attn") for i in range(3)]
    batch = make_batch(rng, [1, 1, 3], [4, 17, 0], 16, 2, 32)
    md = layers[0].metadata_builder().build(batch.common())
    for layer in layers:
        cache = layer.allocate_kv_cache(batch.num_blocks)
        fill_context(batch, cache, 32, 32)
        query = random_array(rng, (batch.num_tokens, 4, 32), "bfloat16")
        k, v = batch.new_kv()
        out = layer.forward(query, k.astype(query.dtype), v.astype(query.dtype), cache, md)
        ref, _ = reference_forward(batch, query, cache, oracle_args(layer), 32)
        assert rel_err(out, ref) <= TOLERANCE["bfloat16"]



@pytest.mark.parametrize("backend", ["CPU", "REFERENCE"])
def test_build_for_drafting_and_fast_build_match_build(rng, backend):
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="float32", backend=backend)
    batch = make_batch(rng, [1, 2, 1], [700, 300, 40], 16, 2, 32)
    cache = layer.allocate_kv_cache(batch.num_blocks)
    fill_context(batch, cache, 32, 32)
    builder = layer.metadata_builder()
    k, v = batch.new_kv()
    query = rng.standard_normal((4, 4, 32), dtype=np.float32)
    plans = [builder.build(batch.common()), builder.build(batch.common(), fast_build=True),
             builder.build_for_drafting(batch.common(), draft_index=2)]
    outs = [layer.forward(query, k, v, cache, md) for md in plans]
    for out in outs[1:]:
        assert rel_err(out, outs[0]) <= TOLERANCE["float32"]
    ref, _ = reference_forward(batch, query, cache, oracle_args(layer), 32)
    assert rel_err(outs[0], ref) <= TOLERANCE["float32"]
    with pytest.raises(pagedattn.Error, match="draft_index = -1") as e:
        builder.build_for_drafting(batch.common(), -1)
    assert e.value.argument == "draft_index"


@pytest.mark.parametrize("backend", ["CPU", "REFERENCE"])
def test_speculative_decodes_match_the_oracle(rng, backend):
    # num_speculative_tokens = 3: requests of up to 4 tokens are decodes (reorder threshold 4);
    # their rows attend causally to the cache and the earlier rows of the request.
    layer = pagedattn.Attention(8, 32, None, num_kv_heads=2, dtype="float32", backend=backend)
    builder = layer.metadata_builder(num_speculative_tokens=3)
    assert builder.reorder_batch_threshold == 4
    assert layer.metadata_builder().reorder_batch_threshold == 0
    query_lens, context_lens = [4, 30, 1, 2, 4], [700, 0, 300, 40, 90]
    order, modified = builder.reorder_batch(query_lens)
    assert modified and [query_lens[i] <= 4 for i in order] == [True] * 4 + [False]
    batch = make_batch(rng, [query_lens[i] for i in order], [context_lens[i] for i in order],
                       16, 2, 32)
    cache = layer.allocate_kv_cache(batch.num_blocks)
    fill_context(batch, cache, 32, 32)
    k, v = batch.new_kv()
    query = rng.standard_normal((batch.num_tokens, 8, 32), dtype=np.float32)
    out = layer.forward(query, k, v, cache, builder.build(batch.common()))
    ref, _ = reference_forward(batch, query, cache, oracle_args(layer), 32)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    with pytest.raises(pagedattn.Error, match="num_speculative_tokens = -1") as e:
        layer.metadata_builder(num_speculative_tokens=-1)
    assert e.value.argument == "config.num_speculative_tokens"


def test_forward_context_runs_each_layer_with_its_plan_and_cache(rng):
    model = pagedattn.StaticForwardContext()
    owner = pagedattn.Attention(4, 32, None, num_kv_heads=2, prefix="layers.0.attn",
                                dtype="float32", static_forward_context=model)
    sharer = pagedattn.Attention(4, 32, None, num_kv_heads=2, prefix="layers.1.attn",
                                 dtype="float32", kv_sharing_target_layer_name="layers.0.attn",
                                 static_forward_context=model)
    batch = make_batch(rng, [1, 3], [20, 5], 16, 2, 32)
    cache = owner.allocate_kv_cache(batch.num_blocks)
    fill_context(batch, cache, 32, 32)
    md = owner.metadata_builder().build(batch.common())
    ctx = pagedattn.ForwardContext()
    with pytest.raises(pagedattn.Error, match="layers.0.attn") as e:
        ctx.metadata_for(owner)
    assert e.value.argument == "attn_metadata"
    ctx.attn_metadata = {"layers.0.attn": md, "layers.1.attn": md}
    with pytest.raises(pagedattn.Error) as e:
        ctx.kv_cache_for(sharer)  # names both layers
    assert e.value.argument == "kv_caches"
    assert "layers.0.attn" in str(e.value) and "layers.1.attn" in str(e.value)
    ctx.kv_caches["layers.0.attn"] = cache
    assert ctx.metadata_for(sharer) is md and ctx.kv_cache_for(sharer) is cache
    k, v = batch.new_kv()
    query = rng.standard_normal((4, 4, 32), dtype=np.float32)
    out = ctx.forward(owner, query, k, v)
    before = cache.copy()
    shared_out, lse = ctx.forward(sharer, query, None, None, return_lse=True)
    np.testing.assert_array_equal(cache, before)  # the sharing layer wrote nothing
    np.testing.assert_allclose(shared_out, out, rtol=0, atol=0)
    assert lse.shape == (4, 4)
