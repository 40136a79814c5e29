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
