"""reshape_and_cache_flash, reshape_and_cache and merge_attn_states against NumPy, in place."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from attention_oracle import TOLERANCE, attend, rel_err
from frameworks import attention_or_skip
from pagedattn._tensors import numpy_dtype

DTYPES = ["float32", "float16", "bfloat16"]


def make_cache(fw, num_blocks, block_size, heads, head_size, dtype, layout):
    """A NaN-poisoned (2, num_blocks, block_size, heads, head_size) cache in logical order,
    stored NHD or HND."""
    if layout == "NHD":
        cache = fw.empty((2, num_blocks, block_size, heads, head_size), dtype)
    else:
        physical = fw.empty((2, num_blocks, heads, block_size, head_size), dtype)
        cache = (physical.transpose(0, 1, 3, 2, 4) if isinstance(physical, np.ndarray)
                 else physical.permute(0, 1, 3, 2, 4))
    fw.fill(cache, float("nan"))
    return cache


def random_slots(rng, n_written, n_tokens, num_slots, num_skipped):
    """slot_mapping of n_written (<= n_tokens) distinct slots, num_skipped of them -1."""
    slots = rng.choice(num_slots, size=n_written, replace=False).astype(np.int64)
    slots[rng.choice(n_written, size=num_skipped, replace=False)] = -1
    return slots


def check_written(fw, cache, key, value, slots, block_size, expect_k=None, expect_v=None):
    host = fw.host(cache)
    written = np.zeros(host.shape[1:3], dtype=bool)
    k = fw.host(key) if expect_k is None else expect_k
    v = fw.host(value) if expect_v is None else expect_v
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        written[b, o] = True
        np.testing.assert_array_equal(host[0, b, o], k[i])
        np.testing.assert_array_equal(host[1, b, o], v[i])
    # Everything else is still the NaN poison.
    assert np.all(np.isnan(host[:, ~written]))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_flash_writes_each_slot(fw, rng, dtype, layout):
    nb, bs, h, d, n = 5, 16, 2, 32, 12
    cache = make_cache(fw, nb, bs, h, d, dtype, layout)
    key = fw.array(rng.standard_normal((n, h, d)), dtype)
    value = fw.array(rng.standard_normal((n, h, d)), dtype)
    slots = random_slots(rng, 9, n, nb * bs, 2)  # tokens 9..11 are not written
    result = pagedattn.reshape_and_cache_flash(key, value, cache[0], cache[1], fw.ints(slots),
                                               "auto", 1.0, 1.0)
    assert result is None
    check_written(fw, cache, key, value, slots, bs)


def quantize(x, scale, name):
    """saturate(x / scale) in fp8 `name` (round to nearest even), as float64."""
    limit = 448.0 if name == "float8_e4m3fn" else 57344.0
    q = np.clip(np.asarray(x, np.float32) / np.asarray(scale, np.float32), -limit, limit)
    return q.astype(numpy_dtype(name)).astype(np.float64)


@pytest.mark.parametrize("kv_cache_dtype, name", [("fp8", "float8_e4m3fn"),
                                                   ("fp8_e4m3", "float8_e4m3fn"),
                                                   ("fp8_e5m2", "float8_e5m2")])
@pytest.mark.parametrize("per_head", [False, True])
def test_reshape_and_cache_flash_fp8(fw, rng, kv_cache_dtype, name, per_head):
    nb, bs, h, d, n = 4, 16, 2, 32, 10
    cache = make_cache(fw, nb, bs, h, d, name, "NHD")
    k = rng.standard_normal((n, h, d)) * 3
    k[0, 0, :4] = [1e5, -1e5, 500.0, -500.0]  # saturate instead of overflowing
    key = fw.array(k, "bfloat16")
    value = fw.array(rng.standard_normal((n, h, d)), "bfloat16")
    slots = random_slots(rng, n, n, nb * bs, 1)
    if per_head:
        k_scale = np.array([0.5, 2.0], np.float32)
        v_scale = np.array([0.25, 1.0], np.float32)
        k_arg, v_arg = fw.array(k_scale, "float32"), fw.array(v_scale, "float32")
        k_div, v_div = k_scale[None, :, None], v_scale[None, :, None]
    else:
        k_arg, v_arg = 0.5, fw.array([4.0], "float32")  # a float and a 1-element tensor
        k_div, v_div = 0.5, 4.0
    pagedattn.reshape_and_cache_flash(key, value, cache[0], cache[1], fw.ints(slots),
                                      kv_cache_dtype, k_arg, v_arg)
    check_written(fw, cache, key, value, slots, bs,
                  expect_k=quantize(fw.host(key), k_div, name),
                  expect_v=quantize(fw.host(value), v_div, name))


def test_reshape_and_cache_into_a_layer_cache(fw, rng, hnd_layout):
    layer = attention_or_skip(fw.device, 4, 32, None, num_kv_heads=2, dtype="float16")
    cache = layer.allocate_kv_cache(3, framework=fw.cache_framework())
    assert np.all(fw.host(cache) == 0)  # allocated zeroed
    fw.fill(cache, float("nan"))
    key = fw.array(rng.standard_normal((6, 2, 32)), "float16")
    value = fw.array(rng.standard_normal((6, 2, 32)), "float16")
    slots = random_slots(rng, 6, 6, 48, 1)
    pagedattn.reshape_and_cache(key, value, cache, fw.ints(slots), "auto")
    check_written(fw, cache, key, value, slots, 16)


def merge_oracle(p_out, p_lse, s_out, s_lse, prefill_tokens_with_context=None):
    p_lse = np.where(p_lse == np.inf, -np.inf, p_lse)
    s_lse = np.where(s_lse == np.inf, -np.inf, s_lse)
    t = p_out.shape[0]
    out = np.empty_like(p_out)
    lse = np.empty_like(p_lse)
    for i in range(t):
        for h in range(p_out.shape[1]):
            lp, ls = p_lse[h, i], s_lse[h, i]
            if prefill_tokens_with_context is not None and i >= prefill_tokens_with_context:
                out[i, h], lse[h, i] = s_out[i, h], ls
            elif lp == -np.inf and ls == -np.inf:
                out[i, h], lse[h, i] = p_out[i, h], -np.inf
            else:
                m = max(lp, ls)
                wp, ws = np.exp(lp - m), np.exp(ls - m)
                out[i, h] = (wp * p_out[i, h] + ws * s_out[i, h]) / (wp + ws)
                lse[h, i] = m + np.log(wp + ws)
    return out, lse


@pytest.mark.parametrize("prefill_tokens_with_context", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_attn_states(fw, rng, dtype, prefill_tokens_with_context):
    t, h, d = 9, 3, 32
    p_lse = rng.standard_normal((h, t)).astype(np.float32) * 2
    s_lse = rng.standard_normal((h, t)).astype(np.float32) * 2
    p_lse[0, 1] = np.inf          # +inf counts as -inf: the suffix wins
    p_lse[1, 2] = s_lse[1, 2] = -np.inf  # both empty: the prefix output is copied
    s_lse[2, 3] = -np.inf         # empty suffix: the prefix wins
    prefix = fw.array(rng.standard_normal((t, h, d)), dtype)
    suffix = fw.array(rng.standard_normal((t, h, d)), dtype)
    output = fw.empty((t, h, d), dtype)
    output_lse = fw.empty((h, t), "float32")
    fw.fill(output, float("nan"))
    fw.fill(output_lse, float("nan"))
    result = pagedattn.merge_attn_states(output, prefix, fw.array(p_lse, "float32"), suffix,
                                         fw.array(s_lse, "float32"), output_lse=output_lse,
                                         prefill_tokens_with_context=prefill_tokens_with_context)
    assert result is None
    ref_out, ref_lse = merge_oracle(fw.host(prefix), p_lse.astype(np.float64), fw.host(suffix),
                                    s_lse.astype(np.float64), prefill_tokens_with_context)
    assert rel_err(fw.host(output), ref_out) <= TOLERANCE[dtype]
    got_lse = fw.host(output_lse)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    if prefill_tokens_with_context is None:
        # the both-empty entry copies the prefix exactly
        np.testing.assert_array_equal(fw.host(output)[2, 1], fw.host(prefix)[2, 1])


def test_merge_attn_states_without_output_lse(rng):
    t, h, d = 4, 2, 16
    p = rng.standard_normal((t, h, d)).astype(np.float32)
    s = rng.standard_normal((t, h, d)).astype(np.float32)
    lp = rng.standard_normal((h, t)).astype(np.float32)
    ls = rng.standard_normal((h, t)).astype(np.float32)
    out = np.full((t, h, d), np.nan, np.float32)
    pagedattn.merge_attn_states(out, p, lp, s, ls)
    ref, _ = merge_oracle(p.astype(np.float64), lp.astype(np.float64), s.astype(np.float64),
                          ls.astype(np.float64))
    assert rel_err(out, ref) <= TOLERANCE["float32"]


def test_merged_halves_equal_attention_over_the_whole(rng):
    """Attention over keys [0, n) equals the LSE-merge of attention over [0, m) and [m, n)
    (natural-log LSEs, canonical ALiBi)."""
    scale = 32 ** -0.5
    n, m = 12, 5
    q = rng.standard_normal((1, 2, 32)).astype(np.float32)
    k = rng.standard_normal((n, 1, 32)).astype(np.float32)
    v = rng.standard_normal((n, 1, 32)).astype(np.float32)
    whole, whole_lse = attend(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                              np.array([n - 1]), np.arange(n), scale, causal=False,
                              alibi=[0.5, 0.125])
    parts = []
    for lo, hi in [(0, m), (m, n)]:
        o, lse = attend(q.astype(np.float64), k[lo:hi].astype(np.float64),
                        v[lo:hi].astype(np.float64), np.array([n - 1]), np.arange(lo, hi),
                        scale, causal=False, alibi=[0.5, 0.125])
        parts.append((o.astype(np.float32), lse.astype(np.float32)))
    out = np.empty((1, 2, 32), np.float32)
    out_lse = np.empty((2, 1), np.float32)
    pagedattn.merge_attn_states(out, parts[0][0], parts[0][1], parts[1][0], parts[1][1], out_lse)
    assert rel_err(out, whole) <= 1e-5
    np.testing.assert_allclose(out_lse, whole_lse, rtol=1e-5)
