"""Batch-invariant mode from Python (docs/batch_invariance.md): metadata_builder(batch_invariant=True)
plans say so, and a decode request's output is bitwise the same alone and in any batch of the others,
on the standard and the MLA layer; cascade is off in the mode."""
import numpy as np
import pagedattn
import pytest

BLOCK = 16


def blocks_for(start, tokens):
    return list(range(start, start + -(-tokens // BLOCK)))


def run_decodes(layer, builder, cache, order, contexts, tables, q_all, k_all, v_all):
    """One decode step of the requests `order`; returns each request's output row."""
    qsl, seq_lens, table, slots = [0], [], [], []
    cols = max(len(t) for t in tables)
    for r in order:
        qsl.append(qsl[-1] + 1)
        seq_lens.append(contexts[r] + 1)
        table.append(tables[r] + [0] * (cols - len(tables[r])))
        pos = contexts[r]
        slots.append(tables[r][pos // BLOCK] * BLOCK + pos % BLOCK)
    common = pagedattn.CommonAttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens,
                                               block_table=table, slot_mapping=slots)
    plan = builder.build(common)
    assert plan.batch_invariant
    idx = list(order)
    out = layer.forward(q_all[idx], k_all[idx], v_all[idx], cache, plan)
    return {r: np.array(out[i]) for i, r in enumerate(order)}


def test_standard_layer_decodes_are_bitwise_the_same_in_any_batch():
    rng = np.random.default_rng(21)
    hq, hkv, d = 8, 2, 64
    layer = pagedattn.Attention(num_heads=hq, head_size=d, scale=0.125, num_kv_heads=hkv,
                                dtype="float32")
    contexts = [2500, 1200, 300, 40]
    tables, next_block = [], 0
    for c in contexts:
        tables.append(blocks_for(next_block, c + 1))
        next_block += len(tables[-1])
    cache = layer.allocate_kv_cache(num_blocks=next_block + 1)
    # The contexts: one prefill step of every request (writes their keys and values).
    qsl = np.cumsum([0] + contexts).tolist()
    slots = [tables[r][p // BLOCK] * BLOCK + p % BLOCK for r, c in enumerate(contexts) for p in range(c)]
    cols = max(len(t) for t in tables)
    fill = pagedattn.CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=contexts,
        block_table=[t + [0] * (cols - len(t)) for t in tables], slot_mapping=slots)
    t = sum(contexts)
    k, v = rng.standard_normal((2, t, hkv, d), dtype=np.float32)
    layer.forward(rng.standard_normal((t, hq, d), dtype=np.float32), k, v, cache,
                  layer.metadata_builder().build(fill))

    builder = layer.metadata_builder(max_num_seqs=8, batch_invariant=True)
    n = len(contexts)
    q_all = rng.standard_normal((n, hq, d), dtype=np.float32)
    k_all, v_all = rng.standard_normal((2, n, hkv, d), dtype=np.float32)
    alone = {r: run_decodes(layer, builder, cache, [r], contexts, tables, q_all, k_all, v_all)[r]
             for r in range(n)}
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0], [1, 3, 0], [0, 3]):
        rows = run_decodes(layer, builder, cache, order, contexts, tables, q_all, k_all, v_all)
        for r in order:
            assert np.array_equal(rows[r].view(np.uint32), alone[r].view(np.uint32)), (r, order)


def test_cascade_is_off_in_the_mode():
    layer = pagedattn.Attention(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, dtype="float32")
    common = pagedattn.CommonAttentionMetadata(query_start_loc=[0, 1, 2], seq_lens=[40, 50],
                                               block_table=[[0, 1, 2, 3], [0, 1, 4, 5]],
                                               slot_mapping=[3 * 16 + 7, 5 * 16 + 1])
    assert layer.metadata_builder().build(common, common_prefix_len=32).use_cascade
    plan = layer.metadata_builder(batch_invariant=True).build(common, common_prefix_len=32)
    assert plan.batch_invariant and not plan.use_cascade
    assert not layer.metadata_builder(batch_invariant=True).supports_cascade


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_mla_builder_flag(batch_invariant):
    w = np.random.default_rng(3).standard_normal((4 * (32 + 32), 64), dtype=np.float32)
    layer = pagedattn.MLAAttention(num_heads=4, scale=0.1, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                   v_head_dim=32, q_lora_rank=None, kv_lora_rank=64, kv_b_proj=w,
                                   dtype="float32", block_size=16)
    common = pagedattn.CommonAttentionMetadata(query_start_loc=[0, 1], seq_lens=[20],
                                               block_table=[[0, 1]], slot_mapping=[19])
    plan = layer.metadata_builder(batch_invariant=batch_invariant).build(common)
    assert plan.batch_invariant == batch_invariant
