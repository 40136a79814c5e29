"""Property tests (hypothesis) of pagedattn.Attention on the CPU backends (CPU, REFERENCE).

test_random_valid_batch_matches_the_oracle: random layers (GQA, head sizes, dtypes, fp8 caches,
block sizes, NHD/HND, sliding window, soft cap, ALiBi, sinks) and random batches (empty queries,
decodes, chunked prefills with context) against the float64 NumPy oracle (attention_oracle.py);
the new keys/values land exactly at slot_mapping.

test_invalid_batch_raises_and_leaves_the_cache_untouched[kind]: a random valid step with ONE
defect of the named kind must raise pagedattn.Error (when the metadata, the plan or the forward
is made) and leave every byte of the KV cache as it was (DESIGN.md §1: every value is validated
before the first write), including a forward rejected for an out-of-range block id, for a
cache smaller than the plan's blocks, or for a bad output_scale (these wrote the new
keys/values before the plan's KV-cache footprint was checked ahead of the write).

Hypothesis runs a bounded number of examples (no deadline; no example database written; no
shrinking for the invalid steps), prints the falsifying example on failure, and can replay one
with @reproduce_failure.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import pagedattn
from attention_oracle import FP8_TOLERANCE, TOLERANCE, fill_context, make_batch, oracle_args
from attention_oracle import reference_forward, rel_err
from pagedattn._tensors import numpy_dtype

SETTINGS = dict(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
K_SCALE, V_SCALE = 0.5, 2.0  # fp8 caches: powers of two, x / scale is exact before rounding


@st.composite
def layer_configs(draw, kv_cache_dtypes=("auto", "auto", "fp8", "fp8_e5m2")):
    kv_heads = draw(st.integers(1, 2))
    return dict(
        backend=draw(st.sampled_from(["CPU", "REFERENCE"])),
        num_kv_heads=kv_heads,
        num_heads=kv_heads * draw(st.integers(1, 3)),
        head_size=draw(st.sampled_from([16, 32, 64])),
        dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])),
        block_size=draw(st.sampled_from([1, 2, 8, 16])),
        kv_cache_dtype=draw(st.sampled_from(kv_cache_dtypes)),
        sliding_window=draw(st.none() | st.integers(1, 24)),
        logits_soft_cap=draw(st.none() | st.sampled_from([5.0, 30.0])),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        layout=draw(st.sampled_from(["NHD", "HND"])),
    )


# (query_len, context_len) per request: empty queries, decodes, prefill chunks with context.
requests = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 30)), min_size=1, max_size=5)
seeds = st.integers(0, 2 ** 32 - 1)


class Step:
    """One layer, one batch, a cache holding the batch's context (NaN everywhere else), and the
    step's query/key/value: everything a forward needs, valid as built."""

    def __init__(self, cfg: dict, query_lens, context_lens, seed: int):
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        h, d = cfg["num_heads"], cfg["head_size"]
        self.slopes = [2.0 ** (-8.0 * (i + 1) / h) for i in range(h)] if cfg["alibi"] else None
        self.sinks = [float(x) for x in self.rng.standard_normal(h)] if cfg["sinks"] else None
        pagedattn.set_kv_cache_layout(cfg["layout"])
        try:
            self.layer = pagedattn.Attention(
                h, d, d ** -0.5, num_kv_heads=cfg["num_kv_heads"], alibi_slopes=self.slopes,
                sliding_window=cfg["sliding_window"], logits_soft_cap=cfg["logits_soft_cap"],
                kv_cache_dtype=cfg["kv_cache_dtype"], block_size=cfg["block_size"],
                sinks=self.sinks, dtype=cfg["dtype"], backend=cfg["backend"])
            self.fp8 = cfg["kv_cache_dtype"] != "auto"
            self.k_scale, self.v_scale = (K_SCALE, V_SCALE) if self.fp8 else (1.0, 1.0)
            self.layer.k_scale, self.layer.v_scale = self.k_scale, self.v_scale
            self.batch = make_batch(self.rng, query_lens, context_lens, cfg["block_size"],
                                    cfg["num_kv_heads"], d)
            self.cache = self.layer.allocate_kv_cache(self.batch.num_blocks)
        finally:
            pagedattn.set_kv_cache_layout(None)
        self.query = self.array(self.rng.standard_normal((self.batch.num_tokens, h, d)))
        k, v = self.batch.new_kv()
        self.key, self.value = self.array(k), self.array(v)

    def array(self, values) -> np.ndarray:
        return np.asarray(values, np.float32).astype(numpy_dtype(self.cfg["dtype"]))

    def fill_cache(self) -> None:
        """NaN poison everywhere, then the batch's context (quantized by the scales)."""
        d = self.cfg["head_size"]
        host = np.full(self.cache.shape, np.nan, np.float32)
        fill_context(self.batch, host, d, d, self.k_scale, self.v_scale)
        self.cache[...] = host.astype(self.cache.dtype)

    def common(self, **overrides) -> pagedattn.CommonAttentionMetadata:
        args = dict(query_start_loc=self.batch.query_start_loc, seq_lens=self.batch.seq_lens,
                    block_table=self.batch.block_table, slot_mapping=self.batch.slot_mapping)
        args.update(overrides)
        return pagedattn.CommonAttentionMetadata(**args)

    def oracle_features(self) -> dict:
        return dict(window=self.cfg["sliding_window"], soft_cap=self.cfg["logits_soft_cap"],
                    alibi=self.slopes, sinks=self.sinks)

    def swap_blocks(self, a: int, b: int) -> None:
        """Relabels blocks a and b in the block table and the slot mapping (same batch)."""
        bs = self.batch.block_size
        table = self.batch.block_table
        ta, tb = table == a, table == b
        table[ta], table[tb] = b, a
        blocks, offsets = np.divmod(self.batch.slot_mapping, bs)
        blocks = np.where(blocks == a, b, np.where(blocks == b, a, blocks))
        self.batch.slot_mapping = blocks * bs + offsets


@settings(max_examples=150, **SETTINGS)
@given(cfg=layer_configs(), reqs=requests, seed=seeds)
def test_random_valid_batch_matches_the_oracle(cfg, reqs, seed):
    step = Step(cfg, [q for q, _ in reqs], [c for _, c in reqs], seed)
    step.fill_cache()
    layer, batch, d = step.layer, step.batch, cfg["head_size"]
    md = layer.metadata_builder().build(step.common())
    out, lse = layer.forward(step.query, step.key, step.value, step.cache, md, return_lse=True)

    cache = np.asarray(step.cache).astype(np.float64)
    for i, slot in enumerate(batch.slot_mapping):
        b, o = divmod(int(slot), batch.block_size)
        want_k = (step.key[i].astype(np.float32) / step.k_scale).astype(step.cache.dtype)
        want_v = (step.value[i].astype(np.float32) / step.v_scale).astype(step.cache.dtype)
        np.testing.assert_array_equal(cache[0, b, o], want_k.astype(np.float64))
        np.testing.assert_array_equal(cache[1, b, o], want_v.astype(np.float64))
    if batch.num_tokens == 0:
        return
    ref_out, ref_lse = reference_forward(batch, step.query, step.cache,
                                         oracle_args(layer, **step.oracle_features()), d,
                                         k_scale=step.k_scale, v_scale=step.v_scale)
    tol = FP8_TOLERANCE if step.fp8 else TOLERANCE[cfg["dtype"]]
    assert rel_err(out, ref_out) <= tol
    assert rel_err(lse, ref_lse) <= max(tol, 1e-5)


# ---- invalid steps ---------------------------------------------------------------------------
INVALID_KINDS = [
    "query_start_loc_decreasing",      # CommonAttentionMetadata rejects it
    "seq_len_below_query_len",         # CommonAttentionMetadata rejects it
    "num_actual_tokens_mismatch",      # CommonAttentionMetadata rejects it
    "slot_out_of_range",               # reshape_and_cache checks every slot before writing
    "query_wrong_dtype",               # Attention.forward checks the activations first
    "query_too_few_rows",
    "value_rows_differ_from_key",
    "output_wrong_head_size",
    "k_scale_invalid",                 # fp8 cache: the scales are checked before the write
    "metadata_not_for_this_layer",     # CPU: another shape's plan; REFERENCE: a CPU plan
    "block_id_out_of_range",           # the plan's KV-cache footprint, checked before the write
    "cache_smaller_than_plan",
    "output_scale_invalid",            # check_forward runs before the write
]
BAD_SCALES = [0.0, -1.0, math.nan, math.inf, -math.inf]


# No shrinking: a failing example has one defect already, and shrinking costs ~15 s an example.
@pytest.mark.parametrize("kind", INVALID_KINDS)
@settings(max_examples=25, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
          **SETTINGS)
@given(cfg=layer_configs(), reqs=requests, seed=seeds, data=st.data())
def test_invalid_batch_raises_and_leaves_the_cache_untouched(kind, cfg, reqs, seed, data):
    if kind == "k_scale_invalid":
        cfg = dict(cfg, kv_cache_dtype=data.draw(st.sampled_from(["fp8", "fp8_e5m2"])))
    # A witness request first: one new token, and a context of at least two whole blocks, so the
    # step always writes the cache and always has a block that only its context uses.
    bs = cfg["block_size"]
    witness = (1, 2 * bs + data.draw(st.integers(0, bs)))
    step = Step(cfg, [witness[0]] + [q for q, _ in reqs], [witness[1]] + [c for _, c in reqs], seed)
    batch, layer = step.batch, step.layer
    context_block = int(batch.block_table[0, 0])  # block 0 of the witness: context only
    if kind == "cache_smaller_than_plan":
        step.swap_blocks(context_block, batch.num_blocks - 1)  # ... is now the highest id
    step.fill_cache()
    t = batch.num_tokens
    common_args: dict = {}
    query, key, value = step.query, step.key, step.value
    output, output_scale, kv_cache = None, None, step.cache
    builder = layer.metadata_builder()

    if kind == "query_start_loc_decreasing":
        qsl = batch.query_start_loc.copy()
        i = data.draw(st.integers(1, len(qsl) - 1))
        qsl[i] = qsl[i - 1] - data.draw(st.integers(1, 5))
        common_args["query_start_loc"] = qsl
    elif kind == "seq_len_below_query_len":
        seq = batch.seq_lens.copy()
        qlens = np.diff(batch.query_start_loc)
        r = data.draw(st.sampled_from([r for r in range(len(seq)) if qlens[r] > 0]))
        seq[r] = qlens[r] - data.draw(st.integers(1, int(qlens[r])))
        common_args["seq_lens"] = seq
    elif kind == "num_actual_tokens_mismatch":
        common_args["num_actual_tokens"] = t + data.draw(st.sampled_from([-1, 1, 7]))
    elif kind == "slot_out_of_range":
        slots = batch.slot_mapping.copy()
        i = data.draw(st.integers(0, t - 1))
        slots[i] = data.draw(st.sampled_from([-2, -100, batch.num_blocks * bs,
                                              batch.num_blocks * bs + 5, 2 ** 40]))
        common_args["slot_mapping"] = slots
    elif kind == "query_wrong_dtype":
        query = query.astype(np.float64)
    elif kind == "query_too_few_rows":
        query = query[: t - 1]
    elif kind == "value_rows_differ_from_key":
        value = value[: t - 1]
    elif kind == "output_wrong_head_size":
        output = np.empty((t, cfg["num_heads"], cfg["head_size"] * 2), query.dtype)
    elif kind == "k_scale_invalid":
        bad = data.draw(st.sampled_from(BAD_SCALES))
        if data.draw(st.booleans()):
            layer.k_scale = bad
        else:
            layer.v_scale = bad
    elif kind == "metadata_not_for_this_layer":
        # The CPU plan carries workspace sized for its builder's layer shapes, so a plan of a
        # layer with twice the heads is refused; a REFERENCE plan is shape-free (as vLLM's, one
        # per KV-cache group), so a REFERENCE layer gets a plan of another backend instead.
        other = pagedattn.Attention(
            cfg["num_heads"] * (2 if cfg["backend"] == "CPU" else 1), cfg["head_size"], None,
            num_kv_heads=cfg["num_kv_heads"], block_size=bs, kv_cache_dtype=cfg["kv_cache_dtype"],
            dtype=cfg["dtype"], backend="CPU")
        builder = other.metadata_builder()
    elif kind == "block_id_out_of_range":
        table = batch.block_table.copy()
        table[0, 0] = data.draw(st.sampled_from([batch.num_blocks, batch.num_blocks + 3, -1, -7]))
        common_args["block_table"] = table
    elif kind == "cache_smaller_than_plan":
        # The plan is built for num_blocks blocks; the cache passed lacks the last one, which only
        # the witness's context uses (every slot written this step lies below it).
        kv_cache = step.cache[:, : batch.num_blocks - 1]
    elif kind == "output_scale_invalid":
        output_scale = np.array([data.draw(st.sampled_from(BAD_SCALES))], np.float32)
    else:
        raise AssertionError(kind)

    before = np.ascontiguousarray(step.cache).tobytes()
    with pytest.raises(pagedattn.Error):
        md = builder.build(step.common(**common_args))
        layer.forward(query, key, value, kv_cache, md, output=output, output_scale=output_scale)
    after = np.ascontiguousarray(step.cache).tobytes()
    assert after == before, f"{kind}: the rejected step changed the KV cache"
