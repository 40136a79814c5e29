"""pagedattn.Attention(calculate_kv_scales=True): the first batch written into the fp8 cache sets
k_scale / v_scale = amax / fp8 max, later batches keep them, and the layer computes the same bits
as a layer given those scales; a kv-sharing layer with the option is an error."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn

FP8_MAX = {"fp8": 448.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def step(layer, query_start_loc, seq_lens, slot_mapping, rng, k_amp, v_amp):
    """One step's (q, k, v, plan): request r uses block 2 r."""
    t = query_start_loc[-1]
    common = pagedattn.CommonAttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=[[0], [2]],
        slot_mapping=slot_mapping)
    q = rng.uniform(-1, 1, (t, 4, 32)).astype(np.float32)
    k = rng.uniform(-k_amp, k_amp, (t, 2, 32)).astype(np.float32)
    v = rng.uniform(-v_amp, v_amp, (t, 2, 32)).astype(np.float32)
    return q, k, v, layer.metadata_builder().build(common)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_first_batch_sets_scales(rng, kv_cache_dtype):
    kwargs = dict(num_heads=4, head_size=32, scale=None, num_kv_heads=2, dtype="float32",
                  kv_cache_dtype=kv_cache_dtype, backend="CPU")
    layer = pagedattn.Attention(**kwargs, calculate_kv_scales=True)
    given = pagedattn.Attention(**kwargs)
    assert layer.kv_scales_pending and (layer.k_scale, layer.v_scale) == (1.0, 1.0)
    cache, given_cache = layer.allocate_kv_cache(4), given.allocate_kv_cache(4)

    # Prefill 3 + 2 tokens: the scales come from this batch.
    q, k, v, md = step(layer, [0, 3, 5], [3, 2], [0, 1, 2, 32, 33], rng, 3.0, 0.7)
    out = layer.forward(q, k, v, cache, md)
    want_k = np.float32(np.abs(k).max()) / np.float32(FP8_MAX[kv_cache_dtype])
    want_v = np.float32(np.abs(v).max()) / np.float32(FP8_MAX[kv_cache_dtype])
    assert (layer.k_scale, layer.v_scale) == (float(want_k), float(want_v))
    assert not layer.kv_scales_pending

    given.k_scale, given.v_scale = layer.k_scale, layer.v_scale
    np.testing.assert_array_equal(given.forward(q, k, v, given_cache, md), out)
    np.testing.assert_array_equal(given_cache.view(np.uint8), cache.view(np.uint8))

    # A decode with 10x larger keys / values changes nothing.
    q, k, v, md = step(layer, [0, 1, 2], [4, 3], [3, 34], rng, 30.0, 7.0)
    out = layer.forward(q, k, v, cache, md)
    assert (layer.k_scale, layer.v_scale) == (float(want_k), float(want_v))
    np.testing.assert_array_equal(given.forward(q, k, v, given_cache, md), out)


def test_kv_sharing_layer_rejects_calculate_kv_scales():
    ctx = pagedattn.StaticForwardContext()
    pagedattn.Attention(4, 32, None, 2, kv_cache_dtype="fp8", prefix="l0", dtype="float32",
                        static_forward_context=ctx)
    with pytest.raises(pagedattn.Error, match="calculate_kv_scales = true but "
                       "kv_sharing_target_layer_name = 'l0'"):
        pagedattn.Attention(4, 32, None, 2, kv_cache_dtype="fp8", prefix="l1", dtype="float32",
                            kv_sharing_target_layer_name="l0", static_forward_context=ctx,
                            calculate_kv_scales=True)


@pytest.mark.parametrize("backend", ["CPU_MLA", "REFERENCE_MLA"])
def test_mla_first_batch_sets_k_scale(rng, backend):
    # MLAAttention(calculate_kv_scales=True): k_scale = amax(|kv_c_normed|, |k_pe|) / 448 over the
    # rows the first batch stores (the latent cache's one scale); later batches keep it.
    heads, nope, rope, v_dim, lora = 4, 32, 16, 32, 64
    layer = pagedattn.MLAAttention(heads, None, nope, rope, v_dim, None, lora, kv_cache_dtype="fp8",
                                   block_size=16, dtype="float32", backend=backend,
                                   calculate_kv_scales=True)
    layer.process_weights_after_loading(
        rng.uniform(-0.1, 0.1, (heads * (nope + v_dim), lora)).astype(np.float32))
    assert layer.kv_scales_pending and layer.k_scale == 1.0
    cache = layer.allocate_kv_cache(4)
    common = pagedattn.CommonAttentionMetadata(
        query_start_loc=[0, 3, 5], seq_lens=[3, 2], block_table=[[0], [2]], slot_mapping=[0, 1, 2, 32, 33])
    md = layer.metadata_builder().build(common)
    q = rng.uniform(-1, 1, (5, heads, nope + rope)).astype(np.float32)
    kv_c = rng.uniform(-2, 2, (5, lora)).astype(np.float32)
    k_pe = rng.uniform(-3, 3, (5, rope)).astype(np.float32)
    layer.forward(q, kv_c, k_pe, cache, md)
    want = np.float32(max(np.abs(kv_c).max(), np.abs(k_pe).max())) / np.float32(448.0)
    assert layer.k_scale == float(want) and not layer.kv_scales_pending
    layer.forward(q, kv_c * 10, k_pe, cache, md)
    assert layer.k_scale == float(want)
