"""Zero-copy: inputs are read in place, outputs are written in place, returned tensors share
memory and export DLPack; NumPy (ml_dtypes for bf16/fp8), PyTorch CPU and CUDA."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import pagedattn
from attention_oracle import TOLERANCE, fill_context, make_batch, oracle_args, reference_forward, rel_err
from frameworks import attention_or_skip, cuda_or_skip, torch_or_skip


def step(layer, rng, dtype_np=np.float32):
    batch = make_batch(rng, [1, 4], [6, 0], layer.block_size, layer.num_kv_heads, layer.head_size)
    cache = layer.allocate_kv_cache(batch.num_blocks)
    fill_context(batch, cache, layer.head_size, layer.head_size)
    q = rng.standard_normal((batch.num_tokens, layer.num_heads, layer.head_size)).astype(dtype_np)
    k, v = batch.new_kv()
    return batch, cache, q, k.astype(dtype_np), v.astype(dtype_np)


def test_output_buffer_is_written_in_place(rng):
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="float32")
    batch, cache, q, k, v = step(layer, rng)
    storage = np.full((batch.num_tokens + 2, 4, 32), np.nan, np.float32)
    output = storage[1:-1]  # a view into a larger buffer
    md = layer.metadata_builder().build(batch.common())
    result = layer.forward(q, k, v, cache, md, output=output)
    assert result is output and np.shares_memory(result, storage)
    assert np.all(np.isnan(storage[0])) and np.all(np.isnan(storage[-1]))
    ref, _ = reference_forward(batch, q, cache, oracle_args(layer), 32)
    assert rel_err(storage[1:-1], ref) <= TOLERANCE["float32"]
    # The new keys/values landed in the caller's cache array itself.
    b, o = batch.slot(1, 0)
    np.testing.assert_array_equal(cache[0, b, o], k[1])


def test_empty_arrays_with_zero_strides_are_accepted(rng):
    """Found by test_properties.py: a step whose requests all have empty queries has (0, H, D)
    query/key/value arrays, which NumPy 2 exports with strides (0, 0, 0); they were rejected as
    'last dimension not contiguous'. An empty array is now taken as contiguous."""
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="float32")
    batch = make_batch(rng, [0, 0], [6, 17], 16, 2, 32)
    cache = layer.allocate_kv_cache(batch.num_blocks)
    fill_context(batch, cache, 32, 32)
    before = cache.copy()
    q = np.empty((0, 4, 32), np.float32)
    k, v = np.empty((0, 2, 32), np.float32), np.empty((0, 2, 32), np.float32)
    out, lse = layer.forward(q, k, v, cache, layer.metadata_builder().build(batch.common()),
                             return_lse=True)
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0)
    np.testing.assert_array_equal(cache, before)


def test_returned_arrays_export_dlpack_and_share_memory(rng):
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="float32")
    batch, cache, q, k, v = step(layer, rng)
    out, lse = layer.forward(q, k, v, cache, layer.metadata_builder().build(batch.common()),
                             return_lse=True)
    for array in (out, lse, cache):
        assert hasattr(array, "__dlpack__")
        alias = np.from_dlpack(array)
        assert np.shares_memory(alias, array) and alias.shape == array.shape
    # The cache owns its memory: it outlives the layer.
    del layer
    gc.collect()
    cache[...] = 1.0
    assert float(cache.sum()) == cache.size


def test_bfloat16_and_fp8_numpy_through_ml_dtypes(rng):
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="bfloat16", kv_cache_dtype="fp8")
    batch, cache, q, k, v = step(layer, rng, ml_dtypes.bfloat16)
    assert cache.dtype == ml_dtypes.float8_e4m3fn and q.dtype == ml_dtypes.bfloat16
    out = layer.forward(q, k, v, cache, layer.metadata_builder().build(batch.common()))
    assert out.dtype == ml_dtypes.bfloat16
    out_again = np.empty_like(out)
    assert layer.forward(q, k, v, cache, layer.metadata_builder().build(batch.common()),
                         output=out_again) is out_again
    np.testing.assert_array_equal(out_again.astype(np.float32), out.astype(np.float32))


def test_read_only_inputs_are_accepted(rng):
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="float32")
    batch, cache, q, k, v = step(layer, rng)
    for a in (q, k, v):
        a.flags.writeable = False
    out = layer.forward(q, k, v, cache, layer.metadata_builder().build(batch.common()))
    ref, _ = reference_forward(batch, q, cache, oracle_args(layer), 32)
    assert rel_err(out, ref) <= TOLERANCE["float32"]


def test_plan_keeps_its_inputs_alive(rng):
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="float32")
    batch, cache, q, k, v = step(layer, rng)
    md = layer.metadata_builder().build(batch.common())  # builder and common are temporaries
    gc.collect()
    out = layer.forward(q, k, v, cache, md)
    ref, _ = reference_forward(batch, q, cache, oracle_args(layer), 32)
    assert rel_err(out, ref) <= TOLERANCE["float32"]


def torch_step(torch, device, rng, dtype="bfloat16", kv_cache_dtype="auto"):
    layer = attention_or_skip(device, 4, 64, None, num_kv_heads=2, dtype=getattr(torch, dtype),
                              kv_cache_dtype=kv_cache_dtype)
    batch = make_batch(rng, [1, 5], [9, 2], 16, 2, 64)
    cache = layer.allocate_kv_cache(batch.num_blocks, framework="torch")
    host = np.zeros(tuple(cache.shape), np.float32)
    fill_context(batch, host, 64, 64)
    cache.copy_(torch.from_numpy(host))
    t = batch.num_tokens
    q = torch.randn(t, 4, 64, dtype=getattr(torch, dtype), device=device)
    k, v = batch.new_kv()
    key = torch.from_numpy(k).to(device=device, dtype=getattr(torch, dtype))
    value = torch.from_numpy(v).to(device=device, dtype=getattr(torch, dtype))
    return layer, batch, cache, q, key, value


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_tensors_in_and_out(rng, device):
    torch = cuda_or_skip() if device == "cuda" else torch_or_skip()
    layer, batch, cache, q, key, value = torch_step(torch, device, rng)
    assert isinstance(cache, torch.Tensor) and cache.dtype == torch.bfloat16
    assert cache.device.type == device
    md = layer.metadata_builder().build(batch.common())
    output = torch.full((batch.num_tokens, 4, 64), float("nan"), dtype=torch.bfloat16, device=device)
    result, lse = layer.forward(q, key, value, cache, md, output=output, return_lse=True)
    assert result is output and isinstance(lse, torch.Tensor) and lse.device.type == device
    # Returned / written tensors share memory with what DLPack exports.
    assert torch.from_dlpack(result).data_ptr() == output.data_ptr()
    assert torch.from_dlpack(cache).data_ptr() == cache.data_ptr()
    allocated = layer.forward(q, key, value, cache, md)
    assert isinstance(allocated, torch.Tensor) and allocated.device.type == device
    ref, ref_lse = reference_forward(batch, q, cache, oracle_args(layer), 64)
    assert rel_err(output, ref) <= TOLERANCE["bfloat16"]
    assert rel_err(allocated, ref) <= TOLERANCE["bfloat16"]
    assert rel_err(lse, ref_lse) <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_fp8_cache(rng, device):
    torch = cuda_or_skip() if device == "cuda" else torch_or_skip()
    layer, batch, cache, q, key, value = torch_step(torch, device, rng, kv_cache_dtype="fp8")
    assert cache.dtype == torch.float8_e4m3fn
    out = layer.forward(q, key, value, cache, layer.metadata_builder().build(batch.common()))
    ref, _ = reference_forward(batch, q, cache, oracle_args(layer), 64)
    assert rel_err(out, ref) <= 6e-2


def test_torch_numpy_cache_shares_memory_on_cpu(rng):
    torch_or_skip()
    layer = pagedattn.Attention(2, 32, None, dtype="float16")
    cache = layer.allocate_kv_cache(2, framework="torch")
    alias = np.from_dlpack(cache)  # float16 exports to NumPy directly
    cache[0, 0, 0, 0, 0] = 3.0
    assert alias[0, 0, 0, 0, 0] == 3.0


def test_cuda_tensor_on_a_cpu_layer_is_rejected(rng):
    torch = cuda_or_skip()
    layer = pagedattn.Attention(4, 64, None, num_kv_heads=2, dtype="bfloat16")
    batch = make_batch(rng, [2], [0], 16, 2, 64)
    cache = layer.allocate_kv_cache(batch.num_blocks)
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16, device="cuda")
    k = np.zeros((2, 2, 64), ml_dtypes.bfloat16)
    with pytest.raises(pagedattn.Error) as info:
        layer.forward(q, k, k, cache, layer.metadata_builder().build(batch.common()))
    assert info.value.argument == "query"


def test_cuda_layer_with_torch_stream(rng):
    torch = cuda_or_skip()
    layer, batch, cache, q, key, value = torch_step(torch, "cuda", rng)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    md = layer.metadata_builder().build(batch.common())
    with torch.cuda.stream(stream):
        out = layer.forward(q, key, value, cache, md)
        assert pagedattn.current_cuda_stream() == stream.cuda_stream
    stream.synchronize()
    ref, _ = reference_forward(batch, q, cache, oracle_args(layer), 64)
    assert rel_err(out, ref) <= TOLERANCE["bfloat16"]
