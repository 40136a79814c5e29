"""Decode context parallelism from Python (pagedattn.dcp_forward and its parts), mirroring
tests/dcp/test_dcp.cpp: the layout functions against a brute-force count; N = 2 and 3 ranks as
Python threads of an in-memory group (standard CPU and CPU_MLA layers, float32) running a context
fill then a decode or a mixed step, where every rank's output has the same bits and equals the
unsharded layer's own forward; the planned API (dcp_plan, dcp_attend, dcp_combine); Python
subclasses of DcpCommunicator driving the same step (the trampoline and the GIL); errors naming
the argument; TorchDcpCommunicator over gloo (2 processes, host tensors) and over NCCL (2 GPUs),
skipped without PyTorch / without 2 GPUs."""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading
import time

import numpy as np
import pytest

import pagedattn

BLOCK = 16
DECODES = [(200, 1), (47, 1), (1, 1), (333, 1), (90, 1)]
# Decodes; then prefill chunks (one without context), decodes and a 16-token speculative decode.
MIXED = [(200, 1), (0, 40), (100, 25), (333, 1), (20, 3), (64, 16)]
BATCHES = {"decode": DECODES, "mixed": MIXED}
GROUPS = [(2, 1), (2, 16), (3, 1), (3, 16)]  # (N, interleave)

STD = dict(num_heads=8, num_kv_heads=2, head_size=64)
MLA = dict(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)

# CUDA (the GPU tests of tests/gpu_dcp): CUDA and CUDA_MLA layers in bfloat16.
GPU_STD = dict(num_heads=16, num_kv_heads=4, head_size=128)
GPU_MLA = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128)
GPU_MLA_BLOCK = 64
GPU_DECODES = [(1200, 1), (477, 1), (1, 1), (2100, 1), (900, 1), (64, 1)]
GPU_MIXED = [(1200, 1), (0, 40), (1000, 25), (2100, 1), (20, 3), (640, 16)]
GPU_MLA_DECODES = [(1200, 1), (477, 1), (3, 1), (2100, 1), (900, 1)]


# ---- steps ---------------------------------------------------------------------------------------

def step_arrays(reqs, n, fill, block=BLOCK):
    """The global step of `reqs` (fill: the contexts as new tokens from position 0, requests
    without one left out) over a table of virtual blocks of block * n tokens, distinct ids per
    request (tests/dcp/dcp_steps.h). Returns (query_start_loc, seq_lens, block_table,
    num_blocks): num_blocks is what a rank's cache needs."""
    span = block * n
    cols = max(1, max(-(-(c + q) // span) for c, q in reqs))
    qsl, seq, table, nxt = [0], [], [], 0
    for c, q in reqs:
        used = -(-(c + q) // span)
        first, nxt = nxt, nxt + used
        if fill and c == 0:
            continue
        qsl.append(qsl[-1] + (c if fill else q))
        seq.append(c if fill else c + q)
        table.append([first + i if i < used else 0 for i in range(cols)])
    return (np.array(qsl, np.int32), np.array(seq, np.int32),
            np.array(table, np.int32).reshape(len(seq), cols), nxt + 1)


def global_common(reqs, n, fill, block=BLOCK):
    """The global step as DCP takes it: a CommonAttentionMetadata (slot_mapping -1: not read)."""
    qsl, seq, table, _ = step_arrays(reqs, n, fill, block)
    return pagedattn.CommonAttentionMetadata(qsl, seq, table, np.full(int(qsl[-1]), -1, np.int64))


def num_blocks_of(reqs, n, block=BLOCK):
    return step_arrays(reqs, n, False, block)[3]


def step_tokens(reqs, fill):
    return sum(c if fill else q for c, q in reqs)


def make_inputs(kind, reqs, seed, dims=None):
    """float32 activations of the fill and the main step (a pair of 3-tuples), and an MLA layer's
    kv_b_proj weight, from `seed` (the same in every rank, thread or process)."""
    rng = np.random.default_rng(seed)
    d = dims or (STD if kind == "standard" else MLA)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    steps = []
    for fill in (True, False):
        t = step_tokens(reqs, fill)
        if kind == "standard":
            steps.append((normal(t, d["num_heads"], d["head_size"]),
                          normal(t, d["num_kv_heads"], d["head_size"]),
                          normal(t, d["num_kv_heads"], d["head_size"])))
        else:
            steps.append((normal(t, d["num_heads"], d["qk_nope_head_dim"] + d["qk_rope_head_dim"]),
                          normal(t, d["kv_lora_rank"]), normal(t, d["qk_rope_head_dim"])))
    weight = None
    if kind == "mla":
        rows = d["num_heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"])
        weight = (normal(rows, d["kv_lora_rank"]) / np.sqrt(d["kv_lora_rank"])).astype(np.float32)
    return steps, weight


def make_layer(kind, n=1, rank=0, interleave=1, weight=None, **extra):
    """A float32 CPU layer (CPU / CPU_MLA, block 16) of DCP rank `rank` of `n`."""
    dcp = dict(dcp_world_size=n, dcp_rank=rank, cp_kv_cache_interleave_size=interleave)
    if kind == "standard":
        args = dict(num_kv_heads=STD["num_kv_heads"], logits_soft_cap=20.0, block_size=BLOCK,
                    dtype="float32", backend="CPU")
        args.update(extra)
        return pagedattn.Attention(STD["num_heads"], STD["head_size"], None, **args, **dcp)
    args = dict(kv_b_proj=weight, block_size=BLOCK, dtype="float32", backend="CPU_MLA")
    args.update(extra)
    return pagedattn.MLAAttention(MLA["num_heads"], None, MLA["qk_nope_head_dim"],
                                  MLA["qk_rope_head_dim"], MLA["v_head_dim"], None,
                                  MLA["kv_lora_rank"], **args, **dcp)


def _take(x, rows):
    if isinstance(x, np.ndarray):
        return x[rows]
    import torch

    return x[torch.as_tensor(rows, device=x.device)]


def _put(dst, rows, src, axis=0):
    if isinstance(dst, np.ndarray):
        if axis == 0:
            dst[rows] = src
        else:
            dst[:, rows] = src
        return
    import torch

    index = torch.as_tensor(rows, device=dst.device)
    if axis == 0:
        dst[index] = src
    else:
        dst[:, index] = src


def plain_step(layer, builder, cache, reqs, fill, inputs, block=BLOCK):
    """One step of the unsharded layer through its own forward (requests reordered as the builder
    asks, the rows put back): (out, lse) in the global row order."""
    qsl, seq, table, _ = step_arrays(reqs, 1, fill, block)
    qlens = np.diff(qsl)
    reorder = builder.reorder_batch(qlens.tolist())
    order = list(range(len(seq))) if reorder is None else list(reorder[0])
    rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in order]).astype(np.int64)
    pqsl = np.concatenate([[0], np.cumsum(qlens[order])]).astype(np.int32)
    pseq, ptable = seq[order], table[order]
    slots = []
    for i in range(len(order)):
        q = int(pqsl[i + 1] - pqsl[i])
        for j in range(q):
            pos = int(pseq[i]) - q + j
            slots.append(int(ptable[i, pos // block]) * block + pos % block)
    common = pagedattn.CommonAttentionMetadata(pqsl, pseq, ptable, np.array(slots, np.int64))
    md = builder.build(common)
    out_p, lse_p = layer.forward(*(_take(x, rows) for x in inputs), cache, md, return_lse=True)
    out = out_p.clone() if hasattr(out_p, "clone") else out_p.copy()
    lse = lse_p.clone() if hasattr(lse_p, "clone") else lse_p.copy()
    _put(out, rows, out_p)
    _put(lse, rows, lse_p, axis=1)
    return out, lse


def unsharded(kind, reqs, steps, weight):
    """The main step's (out, lse) of the unsharded float32 layer (one cache, plain forward)."""
    layer = make_layer(kind, weight=weight)
    cache = layer.allocate_kv_cache(num_blocks_of(reqs, 1))
    cache[...] = np.nan
    builder = layer.metadata_builder(64, 2048, 2048)
    plain_step(layer, builder, cache, reqs, True, steps[0])
    return plain_step(layer, builder, cache, reqs, False, steps[1])


def rank_steps(kind, n, rank, interleave, reqs, steps, weight, comm, framework=None):
    """One rank's fill and main step through dcp_forward; returns the main step's (out, lse)."""
    layer = make_layer(kind, n, rank, interleave, weight)
    assert layer.need_to_return_lse_for_decode == (n > 1)
    cache = layer.allocate_kv_cache(num_blocks_of(reqs, n), framework)
    cache[...] = float("nan")  # a key read from a slot this rank never wrote would show
    # A fill step's runs of rows held elsewhere are one local request each: max_num_seqs holds them.
    builder = layer.metadata_builder(2048, 2048, 2048)
    pagedattn.dcp_forward(layer, builder, comm, None, global_common(reqs, n, True), *steps[0], cache)
    return pagedattn.dcp_forward(layer, builder, comm, pagedattn.DcpConfig(n, rank, interleave),
                                 global_common(reqs, n, False), *steps[1], cache, return_lse=True)


def sharded(kind, n, interleave, reqs, steps, weight, comms=None):
    """Every rank's main-step (out, lse), the ranks as threads over `comms` (default: an
    in-memory group)."""
    comms = comms if comms is not None else pagedattn.make_in_memory_dcp_group(n)
    return pagedattn.run_dcp_ranks(
        n, lambda r: rank_steps(kind, n, r, interleave, reqs, steps, weight, comms[r]), timeout=600)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def check_group(results, reference):
    """Every rank has rank 0's bits (output and LSE), finite, within 1e-5 (output) / 1e-6 (LSE)
    of the unsharded layer."""
    out0, lse0 = results[0]
    assert np.isfinite(out0).all() and np.isfinite(lse0).all()
    for r, (out, lse) in enumerate(results[1:], start=1):
        assert np.array_equal(bits(out), bits(out0)), f"rank {r} combined other output bits"
        assert np.array_equal(bits(lse), bits(lse0)), f"rank {r} combined other LSE bits"
    ref_out, ref_lse = reference
    assert np.abs(ref_out).max() > 0.1  # a real result, not zeros
    assert rel_err(out0, ref_out) <= 1e-5, rel_err(out0, ref_out)
    assert rel_err(lse0, ref_lse) <= 1e-6, rel_err(lse0, ref_lse)


@contextlib.contextmanager
def raises_naming(argument: str, *words: str):
    """Expects a pagedattn.Error (a ValueError) whose .argument is `argument` and whose message
    names it (and contains `words`)."""
    with pytest.raises(pagedattn.Error) as info:
        yield info
    err = info.value
    assert err.argument == argument, (err.argument, str(err))
    assert argument in str(err), str(err)
    for w in words:
        assert w in str(err), str(err)


# ---- layout ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("interleave", [1, 2, 16])
def test_layout_matches_a_brute_force_count(n, interleave):
    nxt = [0] * n  # next local position of each rank
    lens = list(range(0, 401))
    local = pagedattn.get_dcp_local_seq_lens(lens, n, None, interleave)
    assert local.shape == (len(lens), n) and local.dtype == np.int32
    for t in range(400):
        owner = pagedattn.dcp_owner(t, n, interleave)
        assert owner == (t // interleave) % n  # vLLM's layout
        assert pagedattn.dcp_local_position(t, n, interleave) == nxt[owner], (t, owner)
        nxt[owner] += 1
        assert list(local[t + 1]) == nxt, (t + 1, list(local[t + 1]), nxt)
    for r in range(n):
        one = pagedattn.get_dcp_local_seq_lens(np.array(lens), dcp_size=n, dcp_rank=r,
                                               cp_kv_cache_interleave_size=interleave)
        assert one.shape == (len(lens),) and np.array_equal(one, local[:, r])
    assert local[400].sum() == 400  # every token on exactly one rank


def test_get_dcp_local_seq_lens_defaults_and_torch_input():
    assert pagedattn.get_dcp_local_seq_lens([5, 0]).tolist() == [[5], [0]]  # dcp_size 1, every rank
    assert pagedattn.get_dcp_local_seq_lens([5, 7], 2, 1).tolist() == [2, 3]
    try:
        import torch
    except ImportError:
        return
    got = pagedattn.get_dcp_local_seq_lens(torch.tensor([17, 4]), 3, 2, 2)
    assert isinstance(got, torch.Tensor) and got.tolist() == [5, 0]


def test_bad_layout_arguments_are_errors():
    with raises_naming("dcp_size"):
        pagedattn.dcp_owner(3, 0)
    with raises_naming("cp_kv_cache_interleave_size"):
        pagedattn.dcp_local_position(3, 2, 0)
    with raises_naming("token"):
        pagedattn.dcp_owner(-1, 2)
    with raises_naming("dcp_rank"):
        pagedattn.get_dcp_local_seq_lens([3], 2, 2)
    with raises_naming("dcp_size"):
        pagedattn.get_dcp_local_seq_lens([3], 0)
    with raises_naming("seq_lens"):
        pagedattn.get_dcp_local_seq_lens([3, -1], 2, 0)


# ---- layers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["standard", "mla"])
def test_layer_dcp_properties(kind, rng):
    weight = make_inputs("mla", DECODES, 1)[1] if kind == "mla" else None
    layer = make_layer(kind, 2, 1, 16, weight)
    assert layer.dcp == pagedattn.DcpConfig(2, 1, 16) and layer.dcp != pagedattn.DcpConfig(2, 0, 16)
    assert (layer.dcp_world_size, layer.dcp_rank, layer.cp_kv_cache_interleave_size) == (2, 1, 16)
    assert layer.can_return_lse_for_decode and layer.need_to_return_lse_for_decode
    single = make_layer(kind, weight=weight)
    assert single.dcp == pagedattn.DcpConfig() and not single.need_to_return_lse_for_decode
    config = pagedattn.DcpConfig(world_size=3, rank=2, interleave=4)
    assert repr(config) == "DcpConfig(world_size=3, rank=2, interleave=4)"
    config.validate(16)
    with raises_naming("dcp.interleave"):
        config.validate(6)


@pytest.mark.parametrize("kind", ["standard", "mla"])
@pytest.mark.parametrize("extra, argument", [
    (dict(n=2, rank=2), "dcp_rank"), (dict(n=2, rank=-1), "dcp_rank"),
    (dict(n=0, rank=0), "dcp_world_size"),
    (dict(n=2, rank=0, interleave=5), "cp_kv_cache_interleave_size"),
    (dict(n=2, rank=1, interleave=32), "cp_kv_cache_interleave_size"),
])
def test_bad_layer_groups_are_errors(kind, extra, argument):
    weight = make_inputs("mla", DECODES, 1)[1] if kind == "mla" else None
    with raises_naming(argument):
        make_layer(kind, extra["n"], extra["rank"], extra.get("interleave", 1), weight)


# ---- the N-rank emulation (in-memory group, Python threads) ------------------------------------------

@pytest.mark.parametrize("kind", ["standard", "mla"])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("n, interleave", GROUPS)
def test_in_memory_group_matches_the_unsharded_layer(kind, batch, n, interleave, rng):
    reqs = BATCHES[batch]
    steps, weight = make_inputs(kind, reqs, int(rng.integers(2**31)))
    check_group(sharded(kind, n, interleave, reqs, steps, weight), unsharded(kind, reqs, steps, weight))


@pytest.mark.parametrize("kind", ["standard", "mla"])
def test_planned_step_matches_dcp_forward_and_replays(kind, rng):
    """dcp_plan + dcp_attend + dcp_combine give dcp_forward's bits; a plan runs twice to the same
    bits (it holds every buffer of its step)."""
    n, interleave, reqs = 2, 16, DECODES
    steps, weight = make_inputs(kind, reqs, int(rng.integers(2**31)))
    expected = sharded(kind, n, interleave, reqs, steps, weight)
    group = pagedattn.make_in_memory_dcp_group(n)

    def body(r):
        layer = make_layer(kind, n, r, interleave, weight)
        cache = layer.allocate_kv_cache(num_blocks_of(reqs, n))
        cache[...] = np.nan
        builder = layer.metadata_builder(2048, 2048, 2048)
        pagedattn.dcp_forward(layer, builder, group[r], None, global_common(reqs, n, True), *steps[0],
                              cache)
        plan = pagedattn.dcp_plan(layer, builder, None, global_common(reqs, n, False))
        assert isinstance(plan, pagedattn.DcpPlan) and plan.config == layer.dcp
        assert plan.num_tokens == len(reqs) and plan.device == "cpu" and plan.dtype == "float32"
        # Request (1, 1): both tokens on rank 0 at interleave 16, so rank 1 holds no key of its row.
        assert plan.identity == (r == 0)
        assert plan.num_local_rows == len(reqs) - r and sorted(plan.rows.tolist()) == plan.rows.tolist()
        assert len(plan.seq_lens) == len(plan.query_start_loc) - 1 == plan.num_local_rows
        runs = []
        for _ in range(2):
            pagedattn.dcp_attend(layer, plan, *steps[1], cache)
            runs.append(pagedattn.dcp_combine(plan, group[r], return_lse=True))
        return runs

    for r, runs in enumerate(pagedattn.run_dcp_ranks(n, body, timeout=600)):
        for out, lse in runs:
            assert np.array_equal(bits(out), bits(expected[r][0])), f"rank {r}"
            assert np.array_equal(bits(lse), bits(expected[r][1])), f"rank {r}"


# ---- Python communicators (the trampoline) ---------------------------------------------------------

class WrappedComm(pagedattn.DcpCommunicator):
    """A Python communicator delegating to an in-memory one (Python -> C++ -> Python -> C++)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def world_size(self):
        return self.inner.world_size()

    def rank(self):
        return self.inner.rank()

    def all_gather(self, send, recv):
        assert isinstance(send, np.ndarray) and isinstance(recv, np.ndarray)
        assert recv.shape == (self.world_size(),) + send.shape and recv.dtype == send.dtype
        self.calls += 1
        self.inner.all_gather(send, recv)


class BarrierGroup:
    """A pure-Python group: a threading barrier and a table of the ranks' send buffers."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=300)
        self.sends = [None] * n

    def comm(self, rank):
        group = self

        class BarrierComm(pagedattn.DcpCommunicator):
            def world_size(self):
                return group.n

            def rank(self):
                return rank

            def device(self):
                return "cpu"

            def all_gather(self, send, recv):
                group.sends[rank] = send  # valid until every rank has copied (second barrier)
                group.barrier.wait()
                for r, s in enumerate(group.sends):
                    recv[r] = s
                group.barrier.wait()

        return BarrierComm()


@pytest.mark.parametrize("kind, batch, n, interleave", [
    ("standard", "mixed", 3, 16), ("mla", "decode", 2, 1), ("mla", "mixed", 3, 1)])
@pytest.mark.parametrize("comm_kind", ["wrapped", "pure_python"])
def test_python_communicators_drive_the_step(kind, batch, n, interleave, comm_kind, rng):
    reqs = BATCHES[batch]
    steps, weight = make_inputs(kind, reqs, int(rng.integers(2**31)))
    if comm_kind == "wrapped":
        comms = [WrappedComm(c) for c in pagedattn.make_in_memory_dcp_group(n)]
    else:
        group = BarrierGroup(n)
        comms = [group.comm(r) for r in range(n)]
    assert [c.rank() for c in comms] == list(range(n)) and comms[0].device() == "cpu"
    results = sharded(kind, n, interleave, reqs, steps, weight, comms)
    if comm_kind == "wrapped":
        assert all(c.calls == 2 for c in comms)  # the fill and the main step: one all-gather each
    check_group(results, unsharded(kind, reqs, steps, weight))
    in_memory = sharded(kind, n, interleave, reqs, steps, weight)
    assert np.array_equal(bits(results[0][0]), bits(in_memory[0][0])), "same gathered states, same bits"


def test_python_communicator_errors_propagate():
    class Failing(pagedattn.DcpCommunicator):
        def world_size(self):
            return 1

        def rank(self):
            return 0

        def all_gather(self, send, recv):
            raise RuntimeError("all_gather failed in Python")

    class Incomplete(pagedattn.DcpCommunicator):  # no all_gather
        def world_size(self):
            return 1

        def rank(self):
            return 0

    class NotAnInt(Failing):
        def world_size(self):
            return "one"

    steps, _ = make_inputs("standard", DECODES, 3)
    layer = make_layer("standard")
    builder = layer.metadata_builder(64, 2048, 2048)
    for comm, error, match in ((Failing(), RuntimeError, "all_gather failed in Python"),
                               (Incomplete(), RuntimeError, "all_gather.*pure virtual"),
                               (NotAnInt(), pagedattn.Error, "world_size\\(\\) returned 'one'")):
        cache = layer.allocate_kv_cache(num_blocks_of(DECODES, 1))
        with pytest.raises(error, match=match):
            pagedattn.dcp_forward(layer, builder, comm, None, global_common(DECODES, 1, True),
                                  *steps[0], cache)
    assert "rank 0 of 1" in repr(pagedattn.make_in_memory_dcp_group(1)[0])


# ---- errors ----------------------------------------------------------------------------------------

def test_step_errors_name_the_argument():
    steps, weight = make_inputs("mla", DECODES, 5)
    std_steps, _ = make_inputs("standard", DECODES, 5)
    layer = make_layer("standard", 2, 1)
    builder = layer.metadata_builder(2048, 2048, 2048)
    cache = layer.allocate_kv_cache(num_blocks_of(DECODES, 2))
    common = global_common(DECODES, 2, True)
    group = pagedattn.make_in_memory_dcp_group(2)
    q, k, v = std_steps[0]
    # Every check below fails before any collective (rank 0 of the group never arrives).
    with raises_naming("config", "communicator"):  # the layer is rank 1, the communicator rank 0
        pagedattn.dcp_forward(layer, builder, group[0], None, common, q, k, v, cache)
    with raises_naming("config", "layer's dcp"):
        pagedattn.dcp_plan(layer, builder, pagedattn.DcpConfig(2, 0, 1), common)
    with raises_naming("config.rank"):
        pagedattn.dcp_plan(layer, builder, pagedattn.DcpConfig(2, 5, 1), common)
    with raises_naming("config"):
        pagedattn.dcp_plan(layer, builder, (2, 1, 1), common)
    with raises_naming("layer"):
        pagedattn.dcp_forward("layer", builder, group[1], None, common, q, k, v, cache)
    with raises_naming("builder"):
        pagedattn.dcp_forward(layer, "builder", group[1], None, common, q, k, v, cache)
    with raises_naming("comm"):
        pagedattn.dcp_forward(layer, builder, object(), None, common, q, k, v, cache)
    with raises_naming("common"):
        pagedattn.dcp_forward(layer, builder, group[1], None, {"seq_lens": [1]}, q, k, v, cache)
    with raises_naming("query"):
        pagedattn.dcp_forward(layer, builder, group[1], None, common, q[:, :4], k, v, cache)
    plan = pagedattn.dcp_plan(layer, builder, None, common)
    with raises_naming("comm"):  # the plan is rank 1's
        pagedattn.dcp_combine(plan, group[0])
    with raises_naming("out"):
        pagedattn.dcp_combine(plan, group[1], np.empty((plan.num_tokens, 8, 32), np.float32))
    with raises_naming("plan"):
        pagedattn.dcp_attend(layer, "plan", q, k, v, cache)
    mla = make_layer("mla", 2, 1, 1, weight)
    mla_builder = mla.metadata_builder(2048, 2048, 2048)
    mla_cache = mla.allocate_kv_cache(num_blocks_of(DECODES, 2))
    with raises_naming("kv_c_normed"):
        pagedattn.dcp_forward(mla, mla_builder, group[1], None, common, steps[0][0], steps[0][1][:, :8],
                              steps[0][2], mla_cache)


@pytest.mark.parametrize("extra, words", [
    (dict(alibi_slopes=[0.5 ** (i + 1) for i in range(8)]), ["ALiBi"]),
    (dict(sliding_window=64), ["sliding window"]),
    (dict(sinks=[0.5] * 8), ["sinks"]),
])
@pytest.mark.parametrize("n", [1, 2])
def test_layers_dcp_cannot_run_are_errors(extra, words, n):
    steps, _ = make_inputs("standard", DECODES, 7)
    layer = make_layer("standard", n, n - 1, **extra)
    builder = layer.metadata_builder(2048, 2048, 2048)
    cache = layer.allocate_kv_cache(num_blocks_of(DECODES, n))
    group = pagedattn.make_in_memory_dcp_group(n)
    with raises_naming("layer", *words):
        pagedattn.dcp_forward(layer, builder, group[n - 1], None, global_common(DECODES, n, True),
                              *steps[0], cache)


def test_nccl_names_follow_the_build():
    assert pagedattn.built_with_nccl() == hasattr(pagedattn, "NcclDcpCommunicator")
    if not pagedattn.built_with_cuda():
        assert not pagedattn.built_with_nccl()
    for name in ("nccl_unique_id", "nccl_version", "wrap_nccl_dcp_communicator"):
        assert hasattr(pagedattn, name) == pagedattn.built_with_nccl()


# ---- torch.distributed (2 processes) -----------------------------------------------------------------

def _spawn(fn, args, nprocs=2, timeout=600.0):
    """torch.multiprocessing.spawn with a deadline; a rank's exception fails the test."""
    import torch.multiprocessing as mp

    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {nprocs} ranks did not finish within {timeout} s")


GLOO_CASES = [("standard", "mixed", 1), ("mla", "decode", 16)]


def _gloo_rank(rank, init_file, out_dir, seed):
    """One process of the gloo test: torch CPU tensors, TorchDcpCommunicator on the default group."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        comm = pagedattn.TorchDcpCommunicator()
        assert (comm.world_size(), comm.rank(), comm.device()) == (2, rank, "cpu")
        results = {}
        for kind, batch, interleave in GLOO_CASES:
            reqs = BATCHES[batch]
            steps, weight = make_inputs(kind, reqs, seed)
            torch_steps = [tuple(torch.from_numpy(x) for x in s) for s in steps]
            out, lse = rank_steps(kind, 2, rank, interleave, reqs, torch_steps, weight, comm, "torch")
            assert isinstance(out, torch.Tensor)
            results[f"{kind}_out"], results[f"{kind}_lse"] = out.numpy(), lse.numpy()
        np.savez(pathlib.Path(out_dir) / f"rank{rank}.npz", **results)
    finally:
        dist.destroy_process_group()


def test_torch_communicator_over_gloo(tmp_path, rng):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    seed = int(rng.integers(2**31))
    _spawn(_gloo_rank, (str(tmp_path / "store"), str(tmp_path), seed))
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for kind, batch, interleave in GLOO_CASES:
        reqs = BATCHES[batch]
        steps, weight = make_inputs(kind, reqs, seed)
        got = [(z[f"{kind}_out"], z[f"{kind}_lse"]) for z in ranks]
        check_group(got, unsharded(kind, reqs, steps, weight))
        in_memory = sharded(kind, 2, interleave, reqs, steps, weight)
        assert np.array_equal(bits(got[0][0]), bits(in_memory[0][0])), kind


def _nccl_rank(rank, init_file, out_dir, seed, communicator):
    """One process of the 2-GPU tests: GPU `rank`, CUDA / CUDA_MLA bf16 layers, a torch NCCL group
    (communicator "torch") or the library's NCCL communicator ("nccl"). Checks this rank against
    the unsharded layer on its GPU and leaves its output bits in out_dir."""
    import torch
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    pagedattn.set_current_cuda_device(rank)
    if communicator == "torch":
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
        comm = pagedattn.TorchDcpCommunicator()
    else:
        id_file = pathlib.Path(init_file + ".id")
        if rank == 0:
            tmp = id_file.with_suffix(".tmp")
            tmp.write_bytes(pagedattn.nccl_unique_id())
            tmp.rename(id_file)
        while not id_file.exists():
            time.sleep(0.05)
        comm = pagedattn.NcclDcpCommunicator(id_file.read_bytes(), 2, rank)
    assert (comm.world_size(), comm.rank(), comm.device()) == (2, rank, "cuda")
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, lo=-1.0, hi=1.0):
        return torch.empty(shape).uniform_(lo, hi, generator=gen).to(torch.bfloat16).cuda()

    def std_layer(n=1, r=0, interleave=1):
        return pagedattn.Attention(GPU_STD["num_heads"], GPU_STD["head_size"], None,
                                   num_kv_heads=GPU_STD["num_kv_heads"], block_size=BLOCK,
                                   dtype="bfloat16", device="cuda", backend="CUDA",
                                   dcp_world_size=n, dcp_rank=r, cp_kv_cache_interleave_size=interleave)

    def mla_layer(weight, n=1, r=0, interleave=1):
        d = GPU_MLA
        return pagedattn.MLAAttention(d["num_heads"], None, d["qk_nope_head_dim"],
                                      d["qk_rope_head_dim"], d["v_head_dim"], None,
                                      d["kv_lora_rank"], kv_b_proj=weight,
                                      block_size=GPU_MLA_BLOCK, dtype="bfloat16", device="cuda",
                                      backend="CUDA_MLA", dcp_world_size=n, dcp_rank=r,
                                      cp_kv_cache_interleave_size=interleave)

    cases = [("standard", "decode", GPU_DECODES, 1), ("standard", "mixed", GPU_MIXED, 16),
             ("standard", "decode16", GPU_DECODES, 16), ("mla", "decode", GPU_MLA_DECODES, 1),
             ("mla", "decode16", GPU_MLA_DECODES, 16)]
    results = {}
    try:
        for kind, name, reqs, interleave in cases:
            block = BLOCK if kind == "standard" else GPU_MLA_BLOCK
            steps, weight = [], None
            for fill in (True, False):
                t = step_tokens(reqs, fill)
                if kind == "standard":
                    d = GPU_STD
                    steps.append((rand(t, d["num_heads"], d["head_size"]),
                                  rand(t, d["num_kv_heads"], d["head_size"]),
                                  rand(t, d["num_kv_heads"], d["head_size"])))
                else:
                    d = GPU_MLA
                    qk = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
                    steps.append((rand(t, d["num_heads"], qk),
                                  rand(t, d["kv_lora_rank"]), rand(t, d["qk_rope_head_dim"])))
            if kind == "mla":
                d = GPU_MLA
                rows = d["num_heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"])
                weight = rand(rows, d["kv_lora_rank"], lo=-0.08, hi=0.08)
            make = std_layer if kind == "standard" else (lambda *a: mla_layer(weight, *a))
            # Unsharded on this GPU: the layer's own forward.
            ref_layer = make()
            ref_cache = ref_layer.allocate_kv_cache(num_blocks_of(reqs, 1, block))
            ref_cache[...] = float("nan")
            ref_builder = ref_layer.metadata_builder(64, 8192, 8192)
            plain_step(ref_layer, ref_builder, ref_cache, reqs, True, steps[0], block)
            ref_out, ref_lse = plain_step(ref_layer, ref_builder, ref_cache, reqs, False, steps[1],
                                          block)
            # This rank of the group.
            layer = make(2, rank, interleave)
            assert layer.need_to_return_lse_for_decode
            cache = layer.allocate_kv_cache(num_blocks_of(reqs, 2, block))
            cache[...] = float("nan")
            builder = layer.metadata_builder(8192, 8192, 8192)
            pagedattn.dcp_forward(layer, builder, comm, None, global_common(reqs, 2, True, block),
                                  *steps[0], cache)
            out, lse = pagedattn.dcp_forward(layer, builder, comm, None,
                                             global_common(reqs, 2, False, block), *steps[1], cache,
                                             return_lse=True)
            torch.cuda.synchronize()
            assert out.is_cuda and out.dtype == torch.bfloat16
            got, want = out.float().cpu().numpy(), ref_out.float().cpu().numpy()
            assert np.isfinite(got).all(), (name, "an output element was left unwritten")
            assert rel_err(got, want) <= 8e-3, (kind, name, rel_err(got, want))
            lse_tol = 1e-3 if kind == "standard" else 5e-3  # MLA prefill LSEs move with the chunking
            assert np.abs(lse.cpu().numpy() - ref_lse.cpu().numpy()).max() <= lse_tol, (kind, name)
            results[f"{kind}_{name}"] = out.view(torch.int16).cpu().numpy()
        np.savez(pathlib.Path(out_dir) / f"rank{rank}.npz", **results)
    finally:
        if communicator == "torch":
            dist.destroy_process_group()


def _two_gpus_or_skip(need_nccl_build=False):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not pagedattn.built_with_cuda():
        pytest.skip("pagedattn was built without CUDA")
    if need_nccl_build and not pagedattn.built_with_nccl():
        pytest.skip("pagedattn was built without NCCL")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one per DCP rank)")
    import torch.distributed as dist

    if not need_nccl_build and (not dist.is_available() or not dist.is_nccl_available()):
        pytest.skip("torch.distributed has no NCCL backend")


@pytest.mark.parametrize("communicator", ["torch", "nccl"])
def test_two_gpus_over_nccl(communicator, tmp_path, rng, monkeypatch):
    _two_gpus_or_skip(need_nccl_build=communicator == "nccl")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # before the ranks start: no NVLink multicast
    seed = int(rng.integers(2**31))
    _spawn(_nccl_rank, (str(tmp_path / "store"), str(tmp_path), seed, communicator))
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    assert set(ranks[0].files) == set(ranks[1].files) and len(ranks[0].files) == 5
    for name in ranks[0].files:
        assert np.array_equal(ranks[0][name], ranks[1][name]), f"{name}: the ranks combined other bits"


def test_a_failing_rank_aborts_the_group():
    """A rank that raises before its all-gather aborts the group given to run_dcp_ranks: the
    others leave the collective with an Error naming comm, and the first failure is re-raised."""
    group = pagedattn.make_in_memory_dcp_group(3)
    seen = [None] * 3

    def body(rank):
        if rank == 1:
            raise ValueError("rank 1 failed first")
        send, recv = np.ones(4, np.float32), np.zeros((3, 4), np.float32)
        try:
            group[rank].all_gather(send, recv)
        except pagedattn.Error as e:
            seen[rank] = e.argument
            raise

    with pytest.raises(ValueError, match="rank 1 failed first"):
        pagedattn.run_dcp_ranks(3, body, timeout=60, group=group)
    assert seen == ["comm", None, "comm"]
