"""Batch metadata (vLLM's CommonAttentionMetadata) and the utilities that take array-likes."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _C
from . import _tensors


class CommonAttentionMetadata(_C.CommonAttentionMetadata):
    """Per-step batch metadata shared by every layer and backend (vLLM's
    ``CommonAttentionMetadata``).

    Request ``r`` owns query tokens ``[query_start_loc[r], query_start_loc[r + 1])`` of the
    flat token axis and attends to ``seq_lens[r]`` keys (its context after this step); its
    query ``i`` sits at position ``seq_lens[r] - query_len + i``.

    Arguments (lists, NumPy arrays or tensors on any device; copied to host int arrays):
        query_start_loc: ``(num_reqs + 1,)`` non-decreasing, starting at 0.
        seq_lens: ``(num_reqs,)``.
        block_table: ``(num_reqs, max_num_blocks_per_req)`` block ids of each request.
        slot_mapping: ``(>= num_actual_tokens,)`` cache slot of each new token
            (``block_id * block_size + offset``), -1 = do not write; entries past
            num_actual_tokens are padding.
        num_computed_tokens: ``(num_reqs,)``; None = ``seq_lens - query_lens``.
        max_query_len, max_seq_len, num_actual_tokens: None = derived from the arrays.
        causal: False for encoder batches.

    Values given explicitly must agree with the arrays: ``validate()`` runs at construction
    and raises pagedattn.Error (a ValueError) naming the field and the request. The metadata
    is copied to a backend's device the first time a builder on that device uses it.

    Attributes: ``query_start_loc``, ``seq_lens``, ``block_table_tensor``, ``slot_mapping``,
    ``query_start_loc_cpu``, ``seq_lens_cpu``, ``num_computed_tokens_cpu`` (read-only NumPy
    views), ``num_reqs``, ``num_actual_tokens``, ``max_query_len``, ``max_seq_len``, ``causal``.
    """

    def __init__(
        self,
        query_start_loc: Any,
        seq_lens: Any,
        block_table: Any,
        slot_mapping: Any,
        num_computed_tokens: Any = None,
        max_query_len: Optional[int] = None,
        max_seq_len: Optional[int] = None,
        num_actual_tokens: Optional[int] = None,
        causal: bool = True,
    ) -> None:
        super().__init__(
            _tensors.host_ints(query_start_loc, np.int32, "query_start_loc", 1),
            _tensors.host_ints(seq_lens, np.int32, "seq_lens", 1),
            _tensors.host_ints(block_table, np.int32, "block_table", 2),
            _tensors.host_ints(slot_mapping, np.int64, "slot_mapping", 1),
            None if num_computed_tokens is None
            else _tensors.host_ints(num_computed_tokens, np.int32, "num_computed_tokens", 1),
            -1 if max_query_len is None else _nonneg(max_query_len, "max_query_len"),
            -1 if max_seq_len is None else _nonneg(max_seq_len, "max_seq_len"),
            -1 if num_actual_tokens is None else _nonneg(num_actual_tokens, "num_actual_tokens"),
            bool(causal),
        )


def _nonneg(value: Any, argument: str) -> int:
    v = _tensors.int32_arg(value, argument)
    if v < 0:
        raise _tensors.error(argument, f"{argument} = {v}: expected >= 0")
    return v


def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    query_start_loc: Any,
    seq_lens: Any,
    block_table: Any,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Splits each request into virtual requests of at most ``attn_chunk_size`` keys (chunked
    local attention, llama4), exactly as vLLM.

    query_start_loc ``(num_reqs + 1,)``, seq_lens ``(num_reqs,)``, block_table
    ``(num_reqs, max_num_blocks_per_req)``; ``attn_chunk_size`` must be a multiple of
    ``block_size``. Returns NumPy int32 arrays ``(seqlens_q_local (V,), cu_seqlens_q_local
    (V + 1,), seqlens_k_local (V,), block_table_local (V, attn_chunk_size // block_size))``.
    """
    return _C._make_local_attention_virtual_batches(
        _tensors.int32_arg(attn_chunk_size, "attn_chunk_size"),
        _tensors.host_ints(query_start_loc, np.int32, "query_start_loc", 1),
        _tensors.host_ints(seq_lens, np.int32, "seq_lens", 1),
        _tensors.host_ints(block_table, np.int32, "block_table", 2),
        _tensors.int32_arg(block_size, "block_size"),
    )
