"""Bad input raises pagedattn.Error (a ValueError) naming the argument, before anything is
written."""

from __future__ import annotations

import contextlib
import numpy as np
import pytest

import pagedattn
from attention_oracle import fill_context, make_batch


@pytest.fixture
def setup(rng):
    layer = pagedattn.Attention(4, 32, 32 ** -0.5, num_kv_heads=2, dtype="float32", prefix="l0")
    batch = make_batch(rng, [1, 5], [7, 0], 16, 2, 32)
    cache = layer.allocate_kv_cache(batch.num_blocks)
    fill_context(batch, cache, 32, 32)
    k, v = batch.new_kv()
    q = rng.standard_normal((batch.num_tokens, 4, 32)).astype(np.float32)
    md = layer.metadata_builder().build(batch.common())
    return layer, batch, cache, q, k, v, md


@contextlib.contextmanager
def raises_naming(argument: str):
    """Expects a pagedattn.Error (a ValueError) whose message and .argument name `argument`."""
    with pytest.raises(ValueError) as info:
        yield info
    err = info.value
    assert isinstance(err, pagedattn.Error), type(err)
    assert argument in str(err), str(err)
    assert err.argument == argument, (err.argument, str(err))


def test_error_is_a_value_error():
    assert issubclass(pagedattn.Error, ValueError)


@pytest.mark.parametrize("bad, argument", [
    ("query_f64", "query"), ("query_f16", "query"), ("query_shape", "query"),
    ("query_list", "query"), ("query_fortran", "query"), ("key_shape", "key"),
    ("value_shape", "value"), ("cache_dtype", "kv_cache"), ("cache_shape", "kv_cache"),
    ("output_shape", "output"), ("output_dtype", "output"), ("output_readonly", "output"),
    ("output_strided", "output"),
])
def test_forward_rejects_bad_tensors_and_leaves_the_cache_untouched(setup, bad, argument):
    layer, batch, cache, q, k, v, md = setup
    t = batch.num_tokens
    args = dict(query=q, key=k, value=v, kv_cache=cache, attn_metadata=md, output=None)
    if bad == "query_f64":
        args["query"] = q.astype(np.float64)
    elif bad == "query_f16":
        args["query"] = q.astype(np.float16)
    elif bad == "query_shape":
        args["query"] = q[:, :3]
    elif bad == "query_list":
        args["query"] = q.tolist()
    elif bad == "query_fortran":
        args["query"] = np.asfortranarray(q)
    elif bad == "key_shape":
        args["key"] = np.ascontiguousarray(k[:, :1])
    elif bad == "value_shape":
        args["value"] = np.concatenate([v, v], axis=2)
    elif bad == "cache_dtype":
        args["kv_cache"] = cache.astype(np.float16)
    elif bad == "cache_shape":
        args["kv_cache"] = np.ascontiguousarray(cache[:, :, :8])
    elif bad == "output_shape":
        args["output"] = np.empty((t, 4, 16), np.float32)
    elif bad == "output_dtype":
        args["output"] = np.empty((t, 4, 32), np.float16)
    elif bad == "output_readonly":
        out = np.empty((t, 4, 32), np.float32)
        out.flags.writeable = False
        args["output"] = out
    elif bad == "output_strided":
        args["output"] = np.empty((t, 4, 64), np.float32)[:, :, ::2]
    before = cache.copy()
    with raises_naming(argument):
        layer.forward(**args)
    np.testing.assert_array_equal(cache, before)


def test_forward_requires_metadata(setup):
    layer, _, cache, q, k, v, _ = setup
    with raises_naming("attn_metadata"):
        layer.forward(q, k, v, cache, None)


def test_query_with_fewer_rows_than_the_metadata(setup):
    layer, _, cache, q, k, v, md = setup
    with raises_naming("query"):
        layer.forward(q[:2], k[:2], v[:2], cache, md)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
    (dict(attn_type="sideways"), "attn_type"),
    (dict(dtype="float64"), "dtype"),
    (dict(dtype="complex"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(alibi_slopes=[0.5, 0.25]), "alibi_slopes"),
    (dict(sinks=[0.1]), "sinks"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(block_size=0), "block_size"),
])
def test_attention_rejects_bad_parameters(kwargs, argument):
    with raises_naming(argument):
        pagedattn.Attention(4, 32, 32 ** -0.5, **{"dtype": "float32", **kwargs})


def test_unknown_backend_names_it():
    with pytest.raises(pagedattn.Error) as info:
        pagedattn.Attention(4, 32, None, backend="NO_SUCH_BACKEND")
    assert "NO_SUCH_BACKEND" in str(info.value)


def test_selector_lists_every_backend_when_nothing_fits():
    with pytest.raises(pagedattn.Error) as info:
        pagedattn.get_attn_backend(64, "bfloat16", "auto", 16, use_sparse=True)
    for backend in pagedattn.list_backends():
        assert backend.name in str(info.value)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(seq_lens=[2, 1]), "seq_lens"),                 # seq_len < query_len
    (dict(query_start_loc=[0, 2.5, 4]), "query_start_loc"),
    (dict(query_start_loc=[1, 2, 4]), "query_start_loc"),  # [0] != 0
    (dict(block_table=[1, 2]), "block_table"),
    (dict(num_actual_tokens=5), "num_actual_tokens"),
    (dict(max_query_len=9), "max_query_len"),
    (dict(max_seq_len=3), "max_seq_len"),
    (dict(num_computed_tokens=[0, 0]), "num_computed_tokens"),
    (dict(slot_mapping=[[0, 1, 2, 3]]), "slot_mapping"),
    (dict(seq_lens=None), "seq_lens"),
])
def test_common_attention_metadata_rejects_inconsistencies(kwargs, argument):
    args = dict(query_start_loc=[0, 3, 4], seq_lens=[10, 6], block_table=[[0], [1]],
                slot_mapping=[7, 8, 9, 21])
    args.update(kwargs)
    with raises_naming(argument):
        pagedattn.CommonAttentionMetadata(**args)


def test_validate_checks_blocks_and_slots_against_the_cache():
    common = pagedattn.CommonAttentionMetadata([0, 2], [2], [[3]], [48, 49])
    common.validate()
    common.validate(num_blocks=4, block_size=16)
    with raises_naming("slot_mapping"):
        pagedattn.CommonAttentionMetadata([0, 2], [2], [[3]], [48, 64]).validate(4, 16)
    with raises_naming("block_table"):
        common.validate(num_blocks=3, block_size=16)


def test_reshape_and_cache_flash_checks_before_writing(rng):
    key = rng.standard_normal((4, 2, 32)).astype(np.float32)
    value = rng.standard_normal((4, 2, 32)).astype(np.float32)
    cache = np.zeros((2, 3, 16, 2, 32), np.float32)
    before = cache.copy()
    with raises_naming("slot_mapping"):  # the last slot is out of range: nothing is written
        pagedattn.reshape_and_cache_flash(key, value, cache[0], cache[1],
                                          np.array([0, 1, 2, 48], np.int64))
    with raises_naming("slot_mapping"):
        pagedattn.reshape_and_cache_flash(key, value, cache[0], cache[1],
                                          np.array([0, 1, 2, 3], np.int32))
    with raises_naming("value"):
        pagedattn.reshape_and_cache_flash(key, value[:, :1], cache[0], cache[1], [0, 1, 2, 3])
    with raises_naming("key_cache"):
        ro = cache[0].copy()
        ro.flags.writeable = False
        pagedattn.reshape_and_cache_flash(key, value, ro, cache[1], [0, 1, 2, 3])
    with raises_naming("kv_cache_dtype"):
        pagedattn.reshape_and_cache_flash(key, value, cache[0], cache[1], [0, 1, 2, 3], "int8")
    np.testing.assert_array_equal(cache, before)


def test_merge_attn_states_names_bad_lse(rng):
    out = np.empty((3, 2, 16), np.float32)
    o = rng.standard_normal((3, 2, 16)).astype(np.float32)
    lse = rng.standard_normal((2, 3)).astype(np.float32)
    with raises_naming("suffix_lse"):
        pagedattn.merge_attn_states(out, o, lse, o, lse.T.copy())
    with raises_naming("prefix_lse"):
        pagedattn.merge_attn_states(out, o, lse.astype(np.float16), o, lse)


def test_dtype_arguments_name_themselves():
    with raises_naming("dtype"):
        pagedattn.get_attn_backend(64, "float128", "auto", 16)
    with raises_naming("device"):
        pagedattn.get_attn_backend(64, "bfloat16", "auto", 16, device="npu")


# scale / num_kv_heads: None means the default (head_size ** -0.5, num_heads); an explicit 0 used
# to mean the same silently and is now an error naming the argument (as MLAAttention's scale).
@pytest.mark.parametrize("kwargs, argument", [
    (dict(scale=0.0), "scale"),
    (dict(scale=-0.0), "scale"),
    (dict(num_kv_heads=0), "num_kv_heads"),
])
def test_zero_is_not_unset(kwargs, argument):
    args = dict(num_heads=4, head_size=32, scale=None, dtype="float32")
    args.update(kwargs)
    with raises_naming(argument):
        pagedattn.Attention(**args)
    layer = pagedattn.Attention(4, 32, None, dtype="float32")
    assert layer.num_kv_heads == 4
    assert layer.scale == pytest.approx(32 ** -0.5)


def test_mla_scale_zero_names_it():
    with raises_naming("scale"):
        pagedattn.MLAAttention(4, 0.0, 32, 16, 32, None, 64, None, dtype="float32")


# 32-bit fields given 2**31 (or more): pagedattn.Error naming the field, not nanobind's TypeError.
@pytest.mark.parametrize("field", ["num_heads", "block_size", "sliding_window", "num_kv_heads",
                                   "head_size"])
def test_attention_ints_beyond_32_bits_name_the_field(field):
    args = dict(num_heads=4, head_size=32, scale=None, dtype="float32")
    for value in (2**31, -(2**31) - 1, 2**40):
        args[field] = value
        with raises_naming(field):
            pagedattn.Attention(**args)


@pytest.mark.parametrize("field", ["max_query_len", "max_seq_len", "num_actual_tokens"])
def test_metadata_ints_beyond_32_bits_name_the_field(field):
    args = dict(query_start_loc=[0, 3, 4], seq_lens=[10, 6], block_table=[[0], [1]],
                slot_mapping=[7, 8, 9, 21])
    args[field] = 2**31
    with raises_naming(field):
        pagedattn.CommonAttentionMetadata(**args)


def test_mla_ints_beyond_32_bits_name_the_field():
    with raises_naming("num_heads"):
        pagedattn.MLAAttention(2**31, None, 32, 16, 32, None, 64, None, dtype="float32")
    with raises_naming("block_size"):
        pagedattn.MLAAttention(4, None, 32, 16, 32, None, 64, None, block_size=2**31,
                               dtype="float32")


# An empty batch (no request, or requests with no new token) is a no-op, whatever strides the
# (0, H, D) arrays carry (NumPy 2 exports zeros through DLPack).
@pytest.mark.parametrize("requests", [[], [0, 0]])
def test_empty_batch_is_a_no_op(rng, requests):
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="float32")
    cache = layer.allocate_kv_cache(4)
    cache[...] = rng.standard_normal(cache.shape).astype(np.float32)
    before = cache.copy()
    n = len(requests)
    common = pagedattn.CommonAttentionMetadata([0] * (n + 1), [3] * n,
                                               np.zeros((n, 1), np.int32), [])
    md = layer.metadata_builder().build(common)
    q = np.empty((0, 4, 32), np.float32)
    k = np.empty((0, 2, 32), np.float32)
    v = np.empty((0, 2, 32), np.float32)
    zero_strides = np.lib.stride_tricks.as_strided(q, strides=(0, 0, 0))
    for query in (q, zero_strides):
        out, lse = layer.forward(query, k, v, cache, md, return_lse=True)
        assert out.shape == (0, 4, 32) and lse.shape == (4, 0)
    out = np.empty((0, 4, 32), np.float32)
    assert layer.forward(q, k, v, cache, md, output=np.lib.stride_tricks.as_strided(
        out, strides=(0, 0, 0), writeable=True)).shape == (0, 4, 32)
    np.testing.assert_array_equal(cache, before)
