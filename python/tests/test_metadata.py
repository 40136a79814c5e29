"""CommonAttentionMetadata and the batch utilities of vLLM's backends/utils.py."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from frameworks import torch_or_skip


def test_derived_fields():
    common = pagedattn.CommonAttentionMetadata(
        query_start_loc=[0, 1, 2, 7], seq_lens=[9, 33, 5], block_table=[[0, 1, 2], [3, 4, 5], [6, 7, 8]],
        slot_mapping=[8, 32 + 16, 96, 97, 98, 99, 100, -1, -1])
    assert common.num_reqs == 3
    assert common.num_actual_tokens == 7
    assert common.max_query_len == 5
    assert common.max_seq_len == 33
    assert common.causal
    np.testing.assert_array_equal(common.num_computed_tokens_cpu, [8, 32, 0])
    np.testing.assert_array_equal(common.query_start_loc_cpu, [0, 1, 2, 7])
    np.testing.assert_array_equal(common.seq_lens_cpu, [9, 33, 5])
    np.testing.assert_array_equal(common.block_table_tensor, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    np.testing.assert_array_equal(common.slot_mapping[:7], [8, 48, 96, 97, 98, 99, 100])
    assert common.slot_mapping.dtype == np.int64 and common.seq_lens.dtype == np.int32
    # The arrays are read-only views of the metadata's own memory.
    assert not common.seq_lens_cpu.flags.writeable
    with pytest.raises(ValueError):
        common.seq_lens_cpu[0] = 1
    assert np.shares_memory(common.seq_lens_cpu, common.seq_lens_cpu)
    assert "num_reqs=3" in repr(common)


def test_explicit_fields_that_agree_are_accepted():
    common = pagedattn.CommonAttentionMetadata(
        [0, 3, 4], [10, 6], [[0], [1]], [7, 8, 9, 21], num_computed_tokens=[7, 5],
        max_query_len=3, max_seq_len=10, num_actual_tokens=4)
    assert (common.max_query_len, common.max_seq_len, common.num_actual_tokens) == (3, 10, 4)
    common.validate()


def test_inputs_as_numpy_of_any_int_type_and_as_tuples():
    common = pagedattn.CommonAttentionMetadata(
        np.array([0, 2, 3], np.int64), (4, 1), np.array([[1], [2]], np.int16),
        np.array([18, 19, 32], np.int32))
    assert common.num_actual_tokens == 3
    np.testing.assert_array_equal(common.num_computed_tokens_cpu, [2, 0])


def test_inputs_as_torch_tensors():
    torch = torch_or_skip()
    common = pagedattn.CommonAttentionMetadata(
        torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([4, 1]),
        torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([18, 19, 32]))
    assert common.num_reqs == 2 and common.max_seq_len == 4


def test_empty_batch():
    common = pagedattn.CommonAttentionMetadata([0], [], np.zeros((0, 4), np.int32), [])
    assert (common.num_reqs, common.num_actual_tokens) == (0, 0)


def reordered_common(query_lens, seq_extra=3):
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    seq_lens = np.asarray(query_lens) + seq_extra
    return pagedattn.CommonAttentionMetadata(qsl, seq_lens, np.zeros((len(query_lens), 1), np.int32),
                                             -np.ones(int(qsl[-1]), np.int64))


@pytest.mark.parametrize("query_lens, threshold, uniform, expected", [
    ([1, 1, 1], 1, False, (3, 0, 3, 0)),
    ([1, 1, 4, 7], 1, False, (2, 2, 2, 11)),
    ([5, 6], 1, False, (0, 2, 0, 11)),
    ([2, 2, 3, 5], 4, False, (3, 1, 7, 5)),
    ([2, 2, 3, 5], 4, True, (2, 2, 4, 8)),
    ([2, 2, 2], 2, True, (3, 0, 6, 0)),
])
def test_split_decodes_and_prefills(query_lens, threshold, uniform, expected):
    common = reordered_common(query_lens)
    got = pagedattn.split_decodes_and_prefills(common, decode_threshold=threshold,
                                               require_uniform=uniform)
    assert tuple(got) == expected


def reorder_oracle(tokens, threshold):
    """The swaps described in vLLM's reorder_batch_to_split_decodes_and_prefills: decodes from
    the back (descending) trade places with prefills from the front (ascending) while the
    decode sits past where the last decode belongs."""
    decodes = [i for i, n in enumerate(tokens) if n <= threshold]
    prefills = [i for i, n in enumerate(tokens) if n > threshold]
    order = list(range(len(tokens)))
    modified = False
    for i in range(1, min(len(decodes), len(prefills)) + 1):
        d = decodes[len(decodes) - i]
        if d < len(decodes):
            break
        p = prefills[i - 1]
        order[p], order[d] = order[d], order[p]
        modified = True
    return order, modified


def test_reorder_batch_worked_example():
    order, modified = pagedattn.reorder_batch_to_split_decodes_and_prefills([5, 1, 3, 1, 1])
    assert (list(order), modified) == ([4, 1, 3, 2, 0], True)
    order, modified = pagedattn.reorder_batch_to_split_decodes_and_prefills([1, 1, 7])
    assert (list(order), modified) == ([0, 1, 2], False)


def test_reorder_batch_random(rng):
    for _ in range(50):
        tokens = rng.integers(1, 6, size=int(rng.integers(0, 12))).tolist()
        threshold = int(rng.integers(1, 4))
        order, modified = pagedattn.reorder_batch_to_split_decodes_and_prefills(
            np.asarray(tokens, np.int32), decode_threshold=threshold)
        assert (list(order), modified) == reorder_oracle(tokens, threshold)
        reordered = [tokens[i] for i in order]
        num_decodes = sum(n <= threshold for n in tokens)
        assert all(n <= threshold for n in reordered[:num_decodes])
        assert sorted(order) == list(range(len(tokens)))


def test_local_attention_virtual_batches_documented_example():
    # The example in vLLM's make_local_attention_virtual_batches comments.
    block_table = np.arange(30, dtype=np.int32).reshape(3, 10)
    q_lens, k_lens = [4, 10, 5], [6, 17, 9]
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    sq, cu, sk, table = pagedattn.make_local_attention_virtual_batches(4, qsl, k_lens,
                                                                       block_table, 2)
    np.testing.assert_array_equal(sq, [2, 2, 1, 4, 4, 1, 4, 1])
    np.testing.assert_array_equal(cu, [0, 2, 4, 5, 9, 13, 14, 18, 19])
    np.testing.assert_array_equal(sk, [4, 2, 4, 4, 4, 1, 4, 1])
    np.testing.assert_array_equal(table, [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17],
                                          [18, 19], [22, 23], [24, 25]])
    assert all(isinstance(a, np.ndarray) and a.dtype == np.int32 for a in (sq, cu, sk, table))


def local_batches_oracle(chunk, qsl, seq_lens, table, block_size):
    """Each request's query positions grouped by the attention chunk they fall in."""
    sq, sk, rows = [], [], []
    pages = chunk // block_size
    for r, s in enumerate(seq_lens):
        ql = qsl[r + 1] - qsl[r]
        ctx = s - ql
        for c in range(ctx // chunk, (s - 1) // chunk + 1):
            lo, hi = c * chunk, (c + 1) * chunk
            sq.append(min(hi, s) - max(lo, ctx))
            sk.append(min(hi, s) - lo)
            first_page = lo // block_size
            rows.append([table[r, min(first_page + j, table.shape[1] - 1)] for j in range(pages)])
    cu = np.concatenate([[0], np.cumsum(sq)])
    return np.array(sq), cu, np.array(sk), np.array(rows).reshape(len(sq), pages)


def test_local_attention_virtual_batches_random(rng):
    for _ in range(30):
        block_size = int(rng.choice([1, 2, 4, 8]))
        chunk = block_size * int(rng.integers(1, 5))
        n = int(rng.integers(1, 6))
        q_lens = rng.integers(1, 20, size=n)
        seq_lens = q_lens + rng.integers(0, 40, size=n)
        cols = int(-(-seq_lens.max() // block_size))
        table = rng.integers(0, 1000, size=(n, cols)).astype(np.int32)
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        got = pagedattn.make_local_attention_virtual_batches(chunk, qsl, seq_lens, table, block_size)
        want = local_batches_oracle(chunk, qsl, seq_lens, table, block_size)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_local_attention_chunk_must_be_a_multiple_of_the_block_size():
    with pytest.raises(pagedattn.Error):
        pagedattn.make_local_attention_virtual_batches(6, [0, 2], [5], [[0, 1]], 4)


@pytest.mark.parametrize("args, expected", [
    # prefill requests with a long shared prefix: cascade
    (dict(common_prefix_len=1024, query_lens=[16] * 8, num_query_heads=32, num_kv_heads=8), True),
    # gates: short prefix, few requests, ALiBi, window, local attention, context parallelism
    (dict(common_prefix_len=255, query_lens=[16] * 8, num_query_heads=32, num_kv_heads=8), False),
    (dict(common_prefix_len=1024, query_lens=[16] * 7, num_query_heads=32, num_kv_heads=8), False),
    (dict(common_prefix_len=1024, query_lens=[16] * 8, num_query_heads=32, num_kv_heads=8,
          use_alibi=True), False),
    (dict(common_prefix_len=1024, query_lens=[16] * 8, num_query_heads=32, num_kv_heads=8,
          use_sliding_window=True), False),
    (dict(common_prefix_len=1024, query_lens=[16] * 8, num_query_heads=32, num_kv_heads=8,
          use_local_attention=True), False),
    (dict(common_prefix_len=1024, query_lens=[16] * 8, num_query_heads=32, num_kv_heads=8,
          dcp_world_size=2), False),
    # GQA decodes: the CTA model. 64 requests x 8 KV heads over 32 prefix tiles is many waves
    # of flash-decoding against one wave of cascade: cascade.
    (dict(common_prefix_len=4096, query_lens=[1] * 64, num_query_heads=32, num_kv_heads=8), True),
    # 8 MQA decodes over 2 prefix tiles: flash-decoding fits in one wave, cascade takes 2.
    (dict(common_prefix_len=256, query_lens=[1] * 8, num_query_heads=8, num_kv_heads=1), False),
])
def test_use_cascade_attention(args, expected):
    full = dict(use_alibi=False, use_sliding_window=False, use_local_attention=False, num_sms=132)
    full.update(args)
    assert pagedattn.use_cascade_attention(**full) is expected


def test_common_prefix_len():
    table = [[5, 6, 7, 1], [5, 6, 9, 2], [5, 6, 7, 3]]
    common = pagedattn.CommonAttentionMetadata([0, 1, 2, 3], [60, 50, 55], table, [0, 1, 2])
    assert pagedattn.common_prefix_len(common, 16) == 32
    # capped by the smallest num_computed_tokens (20), rounded down to a block
    common = pagedattn.CommonAttentionMetadata([0, 1, 31, 32], [60, 50, 55], table,
                                               np.arange(32))
    assert pagedattn.common_prefix_len(common, 16) == 16


def test_builder_plans_and_reorders(rng):
    layer = pagedattn.Attention(4, 32, None, num_kv_heads=2, dtype="float32")
    builder = layer.metadata_builder(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    assert builder.kv_cache_spec == layer.kv_cache_spec
    assert builder.cudagraph_support in {"never", "uniform_single_token_decode", "uniform_batch",
                                         "always"}
    assert builder.device == "cpu" and builder.workspace_bytes >= 0
    threshold = builder.reorder_batch_threshold
    reorder = builder.reorder_batch([5, 1, 3, 1, 1])
    if threshold == 0:
        assert reorder is None
    else:
        want = pagedattn.reorder_batch_to_split_decodes_and_prefills([5, 1, 3, 1, 1], threshold)
        assert (list(reorder[0]), reorder[1]) == (list(want[0]), want[1])
    common = pagedattn.CommonAttentionMetadata([0, 1, 4], [9, 3], [[0, 1], [2, 3]], [8, 32, 33, 34])
    md = builder.build(common, common_prefix_len=0, fast_build=True)
    assert (md.num_reqs, md.num_actual_tokens, md.use_cascade, md.common_prefix_len) == (2, 4, False, 0)
    assert isinstance(builder.can_run_in_cudagraph(
        pagedattn.CommonAttentionMetadata([0, 1], [4], [[0]], [3])), bool)
