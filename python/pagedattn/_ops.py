"""Standalone ops (vLLM's _custom_ops): cache writes and merging of partial attention."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _C
from . import _tensors


def _slots(slot_mapping: Any) -> Any:
    # Lists become int64 arrays; tensors pass through untouched (the extension checks them).
    if isinstance(slot_mapping, (list, tuple)):
        return np.asarray(slot_mapping, dtype=np.int64)
    return slot_mapping


def reshape_and_cache_flash(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    kv_cache_dtype: str = "auto",
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
) -> None:
    """Writes ``key`` ``(N, Hkv, D)`` and ``value`` ``(N, Hkv, Dv)`` into ``key_cache`` /
    ``value_cache`` ``(num_blocks, block_size, Hkv, D[v])`` (any strides, e.g.
    ``kv_cache[0]`` and ``kv_cache[1]`` of an NHD or HND cache) at ``slot_mapping`` (int64,
    ``N' <= N`` entries: tokens ``[0, N')`` are written, slot -1 skipped).

    kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2" stores ``saturate(x / scale)``; k_scale and
    v_scale are floats, 1-element tensors, or float32 ``(Hkv,)`` tensors (per-head scales).
    Every argument is checked before anything is written: a bad one raises pagedattn.Error
    (ValueError) naming it and the caches are untouched. In place; returns None.
    """
    ks, ks_per_head = _tensors.scale_arg(k_scale, "k_scale")
    vs, vs_per_head = _tensors.scale_arg(v_scale, "v_scale")
    _tensors.use_stream_of(key)
    _C._reshape_and_cache_flash(key, value, key_cache, value_cache, _slots(slot_mapping),
                                str(kv_cache_dtype), ks, vs, ks_per_head, vs_per_head)


def reshape_and_cache(
    key: Any,
    value: Any,
    kv_cache: Any,
    slot_mapping: Any,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Same as ``reshape_and_cache_flash`` on the standard 5-D cache
    ``(2, num_blocks, block_size, Hkv, D)`` of ``Attention.allocate_kv_cache``. In place."""
    ks, ks_per_head = _tensors.scale_arg(k_scale, "k_scale")
    vs, vs_per_head = _tensors.scale_arg(v_scale, "v_scale")
    if ks_per_head is not None or vs_per_head is not None:
        raise _tensors.error("k_scale" if ks_per_head is not None else "v_scale",
                             "reshape_and_cache takes per-tensor scales: use "
                             "reshape_and_cache_flash for per-head scales")
    _tensors.use_stream_of(key)
    _C._reshape_and_cache(key, value, kv_cache, _slots(slot_mapping), str(kv_cache_dtype), ks, vs)


def merge_attn_states(
    output: Any,
    prefix_output: Any,
    prefix_lse: Any,
    suffix_output: Any,
    suffix_lse: Any,
    output_lse: Any = None,
    prefill_tokens_with_context: Optional[int] = None,
) -> None:
    """Merges two partial attention results by their log-sum-exps (natural log):

    ``out = (e^(lp-m) * prefix_output + e^(ls-m) * suffix_output) / (e^(lp-m) + e^(ls-m))``

    output, prefix_output, suffix_output: ``(T, H, D)``; prefix_lse, suffix_lse, output_lse:
    ``(H, T)`` float32. An LSE of +inf counts as -inf; when both are -inf the prefix output is
    copied. Tokens ``t >= prefill_tokens_with_context`` copy the suffix (and its LSE); None =
    every token is merged. Writes ``output`` (and ``output_lse`` when given) in place; returns
    None.
    """
    _tensors.use_stream_of(output)
    _C._merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                          output_lse,
                          -1 if prefill_tokens_with_context is None else int(prefill_tokens_with_context))


def _scalar_scale(x: Any, argument: str) -> float:
    # A float or a 1-element tensor (vLLM passes layer._k_scale, a (1,) tensor).
    value, per_head = _tensors.scale_arg(x, argument)
    if per_head is not None:
        raise _tensors.error(argument, f"{argument} has {_numel(per_head)} elements: the MLA "
                             "cache takes one per-tensor scale (a float or a 1-element tensor)")
    return value


def _numel(x: Any) -> int:
    return int(np.prod(getattr(x, "shape", (1,))))


def _host_or_tensor_i32(x: Any, argument: str, ndim: int) -> Any:
    # Lists become int32 arrays; tensors pass through untouched (the extension checks them).
    if isinstance(x, (list, tuple)):
        return _tensors.host_ints(x, np.int32, argument, ndim)
    return x


def concat_and_cache_mla(
    kv_c: Any,
    k_pe: Any,
    kv_cache: Any,
    slot_mapping: Any,
    kv_cache_dtype: str = "auto",
    scale: Any = 1.0,
) -> None:
    """Writes MLA latents into the cache (vLLM's ``concat_and_cache_mla``): ``kv_c`` ``(N, L)``
    and ``k_pe`` ``(N, R)`` (or ``(N, 1, R)``) into ``kv_cache`` ``(num_blocks, block_size,
    L + R)`` at ``slot_mapping`` (int64, ``N' <= N`` entries, slot -1 skipped): elements
    ``[0, L)`` = kv_c, ``[L, L + R)`` = k_pe.

    kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2" stores ``saturate(x / scale)``; scale is a
    float or a 1-element tensor. Every argument is checked before anything is written: a bad
    one raises pagedattn.Error naming it and the cache is untouched. In place; returns None.
    """
    s = _scalar_scale(scale, "scale")
    _tensors.use_stream_of(kv_c)
    _C._concat_and_cache_mla(kv_c, k_pe, kv_cache, _slots(slot_mapping), str(kv_cache_dtype), s)


def gather_and_maybe_dequant_cache(
    src_cache: Any,
    dst: Any,
    block_table: Any,
    cu_seq_lens: Any,
    batch_size: int,
    kv_cache_dtype: str = "auto",
    scale: Any = 1.0,
    seq_starts: Any = None,
) -> None:
    """Gathers cached latent rows into a dense buffer (vLLM's ``gather_and_maybe_dequant_cache``):
    for request ``r < batch_size``, the cache rows of token positions ``[seq_starts[r],
    seq_starts[r] + cu_seq_lens[r+1] - cu_seq_lens[r])``, read through ``block_table`` row
    ``r``, are dequantized (fp8 * scale) and written to ``dst`` rows ``[cu_seq_lens[r],
    cu_seq_lens[r+1])``.

    src_cache ``(num_blocks, block_size, L + R)``; dst ``(>= cu_seq_lens[batch_size], L + R)``
    float32/float16/bfloat16; block_table ``(>= batch_size, max_blocks)`` int32; cu_seq_lens
    ``(batch_size + 1,)`` int32; seq_starts ``(batch_size,)`` int32 or None (= 0). Index
    arrays live on the cache's device (lists are accepted for a CPU cache). In place.
    """
    s = _scalar_scale(scale, "scale")
    _tensors.use_stream_of(src_cache)
    _C._gather_and_maybe_dequant_cache(
        src_cache, dst, _host_or_tensor_i32(block_table, "block_table", 2),
        _host_or_tensor_i32(cu_seq_lens, "cu_seq_lens", 1), int(batch_size), str(kv_cache_dtype),
        s, None if seq_starts is None else _host_or_tensor_i32(seq_starts, "seq_starts", 1))
