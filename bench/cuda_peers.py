#!/usr/bin/env python3
"""Peers for bench/cuda_attention_bench (and bench/cuda_mla_bench), measured in the same run on the
same card. Each peer is optional (--peers); a missing wheel or a peer that raises skips that peer or
row with one printed line.

  sdpa, cudnn  PyTorch scaled_dot_product_attention, flash / cuDNN backend, CONTIGUOUS bf16 KV (fp8
               rows show the bf16 peer: SDPA has no fp8 KV), eager calls; not on mixed and spec rows
               (its is_causal aligns the mask top-left, not to the end of each request's keys).
  flex         flex_attention (torch.compile'd, causal block mask, contiguous KV) on FLEX_ROWS (d 128).
  fa3          FlashAttention-3 forward (PyPI fa3-fwd): flash_attn_varlen_func on CONTIGUOUS KV (the wheel
               is built without paged KV), num_splits=0 (its split-KV heuristic); bf16, or on the fp8 rows
               fp8 e4m3 Q, K, V with descale factors (vLLM's FA3 call on an fp8 cache; Q is quantized
               outside the timed region); decode, prefill (causal), mixed and speculative-decode
               ("spec": q new tokens per request, causal among them) rows; MLA prefill attention
               rows (Dqk 192, Dv 128, new tokens after the context, causal).
  flashinfer   FlashInfer, PAGED like ours (page 16, random block tables from a shuffled page pool):
               BatchDecodeWithPagedKVCacheWrapper on decode rows (NHD, and HND on the HND rows; its
               CUDA-core kernel, or with --fi-decode-tensor-cores its tensor-core "fa2" kernels),
               BatchPrefillWithPagedKVCacheWrapper (causal) on prefill, mixed and spec rows at
               --fi-prefill-head-sizes (default 128: each prefill module is a long nvcc build),
               BatchMLAPagedAttentionWrapper on MLA decode rows (kv_lora_rank 512, rope 64, page 64;
               bf16 and "decode-fp8" e4m3 latent caches, scale 1 as ours) and on the MLA "spec" rows
               (q tokens a request, causal among them); bf16 Q on a bf16 or fp8 e4m3 cache
               (GQA rows: k_scale / v_scale given to run(), as vLLM does).
               plan() outside the timed region, run() inside. Every module the rows need is JIT-built
               first in one parallel ninja run, into $FLASHINFER_WORKSPACE_BASE (default /tmp/...).
The fp8out rows (fused fp8 output against bf16 output + a separate quantize) and the fp8q rows (an e4m3
query against a bf16 one over an e4m3 cache) are ours only; the fp8 prefill rows have FA3 on fp8 Q, K, V.
fa3 and flashinfer calls are timed as CUDA graphs, one per rotation, as bench/cuda_attention_bench
times ours (eagerly if capture fails: "graph": false). Times: CUDA events, median of 5 repeats, the
inputs rotated over up to 8 copies so the KV does not sit in L2; random inputs, never zeros.
Before timing, each peer (flex excepted: one compile per shape) runs a small version of the row (its
first 3 requests and its last, <= 160 new tokens, <= ~480 context, uneven lengths) and is compared with
fp32 SDPA on the same (dequantized) inputs; a relative L2 error over 2e-2 (bf16) or 1e-1 (fp8) marks
the row "wrong" and it is not timed.

Usage: cuda_peers.py BENCH.json OUT.json [MLA_BENCH.json] [--peers sdpa,cudnn,flex,fa3,flashinfer]
                     [--fi-prefill-head-sizes 64,128,256] [--fi-decode-tensor-cores] [--update]
                     [--deadline-s S]
--update keeps OUT.json's results of the peers not run now; --deadline-s starts no row after S s.
"""
import argparse
import functools
import gc
import json
import math
import os
import re
import sys
import time

os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-jit")  # JIT cache under /tmp
os.environ.setdefault("TVM_FFI_CACHE_DIR", "/tmp/tvm-ffi-cache")

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ALL_PEERS = ("sdpa", "cudnn", "flex", "fa3", "flashinfer")
FLEX = "flex"
FLEX_ROWS = {"decode b128x4k", "decode b64x2k", "decode b1x8k", "decode b32x16k", "prefill 4x4k causal",
             "prefill 1x16k causal", "prefill 16x1k causal"}
_flex_fn = []      # flex_attention compiled once per process
_flex_masks = {}   # causal block mask per (q_len, kv_len)
DEV = "cuda"
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
K_SCALE, V_SCALE, Q_SCALE = 0.5, 0.25, 1.0  # the bench's k / v scales (real = stored * scale); FA3's Q
PAGE, MLA_PAGE = 16, 64
MLA_LATENT, MLA_ROPE, MLA_SCALE, MLA_DQK, MLA_DV = 512, 64, 0.0722, 192, 128  # bench/cuda_mla_bench
TOL = {False: 2e-2, True: 1e-1}  # relative L2 error allowed: bf16, fp8


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def short(e):
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (type(e).__name__ + ": " + (lines[0] if lines else ""))[:200]


def cleanup():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def rand(shape, dtype, scale=1.0):
    """N(0, 1) values x stored as x / scale in dtype (fp8 converted in chunks)."""
    if dtype != FP8:
        return torch.randn(shape, device=DEV, dtype=dtype)
    t = torch.empty(shape, device=DEV, dtype=dtype)
    flat, step = t.view(-1), 1 << 26
    for i in range(0, flat.numel(), step):
        n = min(step, flat.numel() - i)
        flat[i:i + n].copy_(torch.randn(n, device=DEV) / scale)
    return t


def deq(t, scale):
    return t.float() * scale if t.dtype == FP8 else t.float()


def cumsum0(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def rotations(kv_bytes, budget=256e6):
    return max(1, min(8, math.ceil(budget / max(kv_bytes, 1.0))))


def iters_for(ms):
    return max(10, min(2000, int(20.0 / max(ms, 1e-3))))


# ---- shapes -----------------------------------------------------------------------------------

def row_requests(row):
    """[(new tokens, keys)] per request of a cuda_attention_bench row (keys include the new tokens)."""
    name = row["name"].replace(" HND", "")
    m = re.fullmatch(r"decode b(\d+)x(\d+)k", name)
    if m:
        return [(1, int(m[2]) * 1024)] * int(m[1])
    m = re.fullmatch(r"spec decode b(\d+)x(\d+)k q(\d+)", name)
    if m:
        return [(int(m[3]), int(m[2]) * 1024)] * int(m[1])
    m = re.fullmatch(r"prefill (\d+)x(\d+)k causal", name)
    if m:
        return [(int(m[2]) * 1024, int(m[2]) * 1024)] * int(m[1])
    m = re.fullmatch(r"mixed (\d+) decodes@(\d+)k \+ (\d+) chunks of (\d+) \(context (\d+)\)", name)
    if m:
        return [(1, int(m[2]) * 1024)] * int(m[1]) + [(int(m[4]), int(m[4]) + int(m[5]))] * int(m[3])
    raise ValueError(f"unknown row {row['name']!r}")


def mla_shape(row):
    """(heads, [(new tokens, keys)]) of a cuda_mla_bench decode row (bf16 or fp8 cache), speculative
    decode row or prefill attention row, else None."""
    m = re.fullmatch(r"H(\d+) B(\d+) ctx(\d+)k( fp8)?", row["name"])
    if m and row["grid"] in ("decode", "decode-fp8"):
        return int(m[1]), [(1, int(m[3]) * 1024)] * int(m[2])
    m = re.fullmatch(r"H(\d+) B(\d+) ctx(\d+)k q(\d+)", row["name"])
    if m and row["grid"] == "spec":
        return int(m[1]), [(int(m[4]), int(m[3]) * 1024)] * int(m[2])
    m = re.fullmatch(r"H(\d+) (\d+)x(\d+)k(?: \+(\d+)k ctx)? attention", row["name"])
    if m and row["grid"] == "prefill":
        new, ctx = int(m[3]) * 1024, int(m[4] or 0) * 1024
        return int(m[1]), [(new, new + ctx)] * int(m[2])
    return None


def small_reqs(reqs):
    """The correctness check's small batch: first 3 requests and the last (mixed batches end with their
    chunks), <= 160 new tokens and <= ~480 context each, uneven lengths."""
    pick = reqs[:3] + ([reqs[-1]] if len(reqs) > 3 else [])
    out = []
    for i, (q, kv) in enumerate(pick):
        qs = q if q == 1 else min(q, 160 - 7 * i)
        out.append((qs, min(kv - q, 480 - 23 * i) + qs))
    return out


def reference(qs, ks, vs, scale):
    """fp32 SDPA per request: q (lq, hq, d), k (lk, hkv, d), v (lk, hkv, dv); the causal mask aligned to
    the last key (new tokens follow the context); kv head h // (hq / hkv) for query head h."""
    outs = []
    for q, k, v in zip(qs, ks, vs):
        g = q.shape[1] // k.shape[1]
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.arange(lk, device=DEV)[None, :] <= torch.arange(lq, device=DEV)[:, None] + (lk - lq)
        o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().repeat_interleave(g, 1).transpose(0, 1),
                                           v.float().repeat_interleave(g, 1).transpose(0, 1), attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def bad(err, fp8):
    return not err <= TOL[fp8]  # NaN counts as wrong


# ---- timing -----------------------------------------------------------------------------------

def time_ms(fn, iters):
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / iters)
    samples.sort()
    return samples[2]


def timed(calls, iters):
    """(ms of one call, graph?): one CUDA graph per rotation's call, launched in turn; eager if capture fails."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    state = {"i": 0}
    try:
        graphs = []
        for c in calls:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                c()
            graphs.append(g)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any capture failure: time the same calls eagerly
        torch.cuda.set_stream(torch.cuda.default_stream())
        torch.cuda.synchronize()
        log(f"  graph capture failed ({short(e)}); timing eagerly")

        def eager():
            calls[state["i"] % len(calls)]()
            state["i"] += 1
        return time_ms(eager, iters), False

    def replay():
        graphs[state["i"] % len(graphs)].replay()
        state["i"] += 1
    return time_ms(replay, iters), True


def result(ms, graph, kv_bytes, flops, err):
    return {"ms": ms, "tbps": kv_bytes / (ms * 1e-3) / 1e12, "tflops": flops / (ms * 1e-3) / 1e12,
            "graph": graph, "check_rel_err": err}


# ---- PyTorch SDPA / flex (contiguous bf16 KV, eager) -----------------------------------------

def flex_call(q, k, v, causal):
    """flex_attention compiled once per process; the causal block mask cached per shape."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if not _flex_fn:
        _flex_fn.append(torch.compile(flex_attention, dynamic=False))
    mask = None
    if causal:
        key = (q.shape[2], k.shape[2])
        if key not in _flex_masks:
            _flex_masks[key] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, key[0], key[1],
                                                 device="cuda")
        mask = _flex_masks[key]
    return _flex_fn[0](q, k, v, block_mask=mask, enable_gqa=True)


def sdpa_check(row, backend):
    """Small uniform batch (SDPA's layout) vs fp32 SDPA with an explicit mask."""
    d, hq, hkv = row["head_size"], row["num_heads"], row["num_kv_heads"]
    q_len, kv_len = small_reqs(row_requests(row))[0]
    q = torch.randn(2, hq, q_len, d, device=DEV, dtype=BF16)
    k = torch.randn(2, hkv, kv_len, d, device=DEV, dtype=BF16)
    v = torch.randn(2, hkv, kv_len, d, device=DEV, dtype=BF16)
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, enable_gqa=True)
    ref = reference([x.transpose(0, 1) for x in q], [x.transpose(0, 1) for x in k], [x.transpose(0, 1) for x in v],
                    1.0 / math.sqrt(d))
    return rel_err(out.transpose(1, 2).reshape(-1, hq, d), ref)


def peer_row(row, backend):
    d, hq, hkv = row["head_size"], row["num_heads"], row["num_kv_heads"]
    reqs = row_requests(row)
    b, (q_len, kv_len) = len(reqs), reqs[0]
    causal = q_len > 1
    err = None
    if backend != FLEX:
        try:
            err = sdpa_check(row, backend)
        except Exception as e:  # noqa: BLE001 - the small shape unsupported: time the row unchecked
            log(f"  check skipped ({short(e)})")
        if err is not None and bad(err, False):
            return {"wrong": err}
    kv_bytes = b * kv_len * hkv * 2 * d * 2
    rot = rotations(kv_bytes)
    qs = [torch.randn(b, hq, q_len, d, device=DEV, dtype=BF16) for _ in range(rot)]
    ks = [torch.randn(b, hkv, kv_len, d, device=DEV, dtype=BF16) for _ in range(rot)]
    vs = [torch.randn(b, hkv, kv_len, d, device=DEV, dtype=BF16) for _ in range(rot)]
    state = {"i": 0}

    def fn():
        i = state["i"] % rot
        state["i"] += 1
        if backend == FLEX:
            flex_call(qs[i], ks[i], vs[i], causal)
            return
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=causal, enable_gqa=True)

    fn()
    torch.cuda.synchronize()
    ms = time_ms(fn, iters_for(row["ms"]))
    return {"ms": ms, "tbps": kv_bytes / (ms * 1e-3) / 1e12, "tflops": row["flops"] / (ms * 1e-3) / 1e12,
            "check_rel_err": err}


# ---- FlashAttention-3 (fa3-fwd wheel), contiguous KV, varlen ---------------------------------

class FA3:
    def __init__(self):
        import importlib.metadata
        import fa3_fwd_interface
        self.mod = fa3_fwd_interface
        self.version = importlib.metadata.version("fa3_fwd")

    @staticmethod
    def inputs(reqs, hq, hkv, d, dv, fp8):
        dt = FP8 if fp8 else BF16
        cu_q, cu_k = cumsum0([q for q, _ in reqs]), cumsum0([k for _, k in reqs])
        return {"q": rand((cu_q[-1], hq, d), dt, Q_SCALE), "k": rand((cu_k[-1], hkv, d), dt, K_SCALE),
                "v": rand((cu_k[-1], hkv, dv), dt, V_SCALE), "cu_q_host": cu_q, "cu_k_host": cu_k,
                "cu_q": torch.tensor(cu_q, dtype=torch.int32, device=DEV),
                "cu_k": torch.tensor(cu_k, dtype=torch.int32, device=DEV),
                "max_q": max(q for q, _ in reqs), "max_k": max(k for _, k in reqs)}

    def call(self, x, hkv, fp8, scale):
        kw = {}
        if fp8:  # (batch, kv heads) descale factors: real = stored * descale
            b = len(x["cu_q_host"]) - 1
            kw = {name: torch.full((1, 1), s, dtype=torch.float32, device=DEV).expand(b, hkv)
                  for name, s in (("q_descale", Q_SCALE), ("k_descale", K_SCALE), ("v_descale", V_SCALE))}
        return functools.partial(self.mod.flash_attn_varlen_func, x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"],
                                 x["max_q"], x["max_k"], softmax_scale=scale, causal=True, num_splits=0, **kw)

    def run(self, reqs, hq, hkv, d, dv, fp8, scale, kv_bytes, flops, ours_ms):
        x = self.inputs(small_reqs(reqs), hq, hkv, d, dv, fp8)
        out = self.call(x, hkv, fp8, scale)()
        cq, ck = x["cu_q_host"], x["cu_k_host"]
        n = len(cq) - 1
        ref = reference([deq(x["q"][cq[i]:cq[i + 1]], Q_SCALE) for i in range(n)],
                        [deq(x["k"][ck[i]:ck[i + 1]], K_SCALE) for i in range(n)],
                        [deq(x["v"][ck[i]:ck[i + 1]], V_SCALE) for i in range(n)], scale)
        err = rel_err(out, ref)
        del x, out, ref
        if bad(err, fp8):
            return {"wrong": err}
        xs = [self.inputs(reqs, hq, hkv, d, dv, fp8) for _ in range(rotations(kv_bytes))]
        ms, graph = timed([self.call(x, hkv, fp8, scale) for x in xs], iters_for(ours_ms))
        return result(ms, graph, kv_bytes, flops, err)


# ---- FlashInfer, paged -----------------------------------------------------------------------

class FlashInfer:
    def __init__(self, decode_tensor_cores=False):
        import flashinfer
        import flashinfer.jit
        from flashinfer.utils import determine_attention_backend, determine_mla_backend
        self.fi, self.jit = flashinfer, flashinfer.jit
        self.version = flashinfer.__version__
        dev = torch.device(DEV, torch.cuda.current_device())
        self.prefill_backend = lambda kvdt, d: determine_attention_backend(dev, 0, False, False, BF16, kvdt,
                                                                           head_dim_qk=d, head_dim_vo=d)
        self.mla_backend = determine_mla_backend(dev)
        self.ws = torch.zeros(512 << 20, dtype=torch.uint8, device=DEV)  # float workspace, zeroed once
        self.decode_tc = decode_tensor_cores  # decode on its prefill ("fa2") kernels instead
        self.pool = {}     # (kind, layout, backend) -> wrappers, reused across rows
        self.failed = {}   # JIT module name -> error

    def spec(self, kind, kvdt, d):
        if kind == "decode" and self.decode_tc:  # what plan() builds: the fa2 prefill module
            return self.jit.gen_batch_prefill_module("fa2", BF16, kvdt, BF16, torch.int32, d, d, 0, False, False, False)
        if kind == "decode":
            return self.jit.gen_batch_decode_module(BF16, kvdt, BF16, torch.int32, d, d, 0, False, False)
        if kind == "prefill":
            return self.jit.gen_batch_prefill_module(self.prefill_backend(kvdt, d), BF16, kvdt, BF16, torch.int32,
                                                     d, d, 0, False, False, False)
        return self.jit.gen_batch_mla_module(self.mla_backend, BF16, kvdt, BF16, torch.int32, MLA_LATENT, MLA_ROPE,
                                             False)

    def prebuild(self, configs, late):
        """Builds every module the rows need in one ninja run (their sources compile in parallel)."""
        specs = {}
        for cfg in configs:
            try:
                s = self.spec(*cfg)
                specs[s.name] = s
            except Exception as e:  # noqa: BLE001
                log(f"flashinfer: no module for {cfg}: {short(e)}")
        start = time.time()
        try:
            self.jit.build_jit_specs(list(specs.values()), verbose=False)
        except Exception as e:  # noqa: BLE001 - find which modules failed, one by one
            log(f"flashinfer: JIT build failed ({short(e)}); building the modules one by one")
            log("\n".join(str(e).splitlines()[-30:]))
            for name, s in specs.items():
                if not s.is_compiled and late():
                    self.failed[name] = "not built (deadline)"
                elif not s.is_compiled:
                    try:
                        s.build()
                    except Exception as e2:  # noqa: BLE001
                        self.failed[name] = short(e2)
        log(f"flashinfer: {len(specs)} JIT modules ready in {time.time() - start:.0f} s "
            f"({len(self.failed)} failed)")

    def wrappers(self, kind, layout, backend, n):
        lst = self.pool.setdefault((kind, layout, backend), [])
        while len(lst) < n:
            if kind == "decode":
                lst.append(self.fi.BatchDecodeWithPagedKVCacheWrapper(self.ws, layout,
                                                                      use_tensor_cores=self.decode_tc))
            elif kind == "prefill":
                lst.append(self.fi.BatchPrefillWithPagedKVCacheWrapper(self.ws, layout, backend=backend))
            else:
                lst.append(self.fi.BatchMLAPagedAttentionWrapper(self.ws, backend=backend))
        return lst[:n]

    @staticmethod
    def tables(reqs, page, rot):
        """rot disjoint random page sets (block ids shuffled over the pool, page 0 unused): per rotation
        (indptr, indices on the GPU, last page lengths, keys per request)."""
        pages = [-(-kv // page) for _, kv in reqs]
        per = sum(pages)
        perm = torch.randperm(per * rot, dtype=torch.int64) + 1
        indptr = torch.tensor(cumsum0(pages), dtype=torch.int32)
        last = torch.tensor([kv - page * (p - 1) for (_, kv), p in zip(reqs, pages)], dtype=torch.int32)
        kv_lens = torch.tensor([kv for _, kv in reqs], dtype=torch.int32)
        return per * rot + 1, [(indptr, perm[r * per:(r + 1) * per].to(torch.int32).to(DEV), last, kv_lens)
                               for r in range(rot)]

    def gqa(self, kind, reqs, hq, hkv, d, kvdt, layout, rot):
        """(calls, check inputs) for `rot` wrappers planned on disjoint pages of one paged cache."""
        backend = self.prefill_backend(kvdt, d) if kind == "prefill" else "auto"
        n_pages, plans = self.tables(reqs, PAGE, rot)
        shape = (n_pages, 2, PAGE, hkv, d) if layout == "NHD" else (n_pages, 2, hkv, PAGE, d)
        cache = rand(shape, kvdt, K_SCALE)  # real K = stored * K_SCALE, real V = stored * V_SCALE
        qo = torch.tensor(cumsum0([q for q, _ in reqs]), dtype=torch.int32)
        wr = self.wrappers(kind, layout, backend, rot)
        for w, (indptr, indices, last, _) in zip(wr, plans):
            if kind == "decode":
                w.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=BF16, kv_data_type=kvdt)
            else:
                w.plan(qo, indptr, indices, last, hq, hkv, d, PAGE, causal=True, q_data_type=BF16, kv_data_type=kvdt)
        scales = {"k_scale": K_SCALE, "v_scale": V_SCALE} if kvdt == FP8 else {}
        qs = [rand((int(qo[-1]), hq, d), BF16) for _ in range(rot)]
        outs = [torch.empty((int(qo[-1]), hq, d), dtype=BF16, device=DEV) for _ in range(rot)]
        calls = [functools.partial(w.run, q, cache, out=o, **scales) for w, q, o in zip(wr, qs, outs)]
        return calls, (cache, plans[0], qs[0], qo)

    @staticmethod
    def gather(cache_kv, indptr, indices, i, kv, layout):
        """Request i's keys (or values) from one half of the paged cache, as (kv, heads, d)."""
        t = cache_kv[indices[int(indptr[i]):int(indptr[i + 1])].long()]
        if layout == "HND":
            t = t.transpose(1, 2)
        return t.reshape(-1, t.shape[-2], t.shape[-1])[:kv]

    def run_gqa(self, kind, reqs, hq, hkv, d, kvdt, layout, kv_bytes, flops, ours_ms):
        name = self.spec("decode" if kind == "decode" else "prefill", kvdt, d).name
        if name in self.failed:
            return {"error": "JIT build failed: " + self.failed[name]}
        small = small_reqs(reqs)
        calls, (cache, (indptr, indices, _, _), q, qo) = self.gqa(kind, small, hq, hkv, d, kvdt, layout, 1)
        out = calls[0]()
        n = len(small)
        ref = reference([q[int(qo[i]):int(qo[i + 1])] for i in range(n)],
                        [deq(self.gather(cache[:, 0], indptr, indices, i, kv, layout), K_SCALE)
                         for i, (_, kv) in enumerate(small)],
                        [deq(self.gather(cache[:, 1], indptr, indices, i, kv, layout), V_SCALE)
                         for i, (_, kv) in enumerate(small)], 1.0 / math.sqrt(d))
        err = rel_err(out, ref)
        del calls, cache, q, out, ref
        if bad(err, kvdt == FP8):
            return {"wrong": err}
        calls, _ = self.gqa(kind, reqs, hq, hkv, d, kvdt, layout, rotations(kv_bytes))
        ms, graph = timed(calls, iters_for(ours_ms))
        return result(ms, graph, kv_bytes, flops, err)

    def mla(self, reqs, heads, rot, kvdt):
        n_pages, plans = self.tables(reqs, MLA_PAGE, rot)
        cache = rand((n_pages, MLA_PAGE, MLA_LATENT + MLA_ROPE), kvdt)  # fp8: N(0, 1) codes, scale 1
        qo = torch.tensor(cumsum0([q for q, _ in reqs]), dtype=torch.int32)
        tokens = int(qo[-1])
        causal = any(q > 1 for q, _ in reqs)  # speculative decodes: causal among a request's tokens
        wr = self.wrappers("mla", "NHD", self.mla_backend, rot)
        for w, (indptr, indices, _, kv_lens) in zip(wr, plans):
            w.plan(qo, indptr, indices, kv_lens, heads, MLA_LATENT, MLA_ROPE, MLA_PAGE, causal, MLA_SCALE, BF16, kvdt)
        qs = [rand((tokens, heads, MLA_LATENT + MLA_ROPE), BF16) for _ in range(rot)]
        outs = [torch.empty((tokens, heads, MLA_LATENT), dtype=BF16, device=DEV) for _ in range(rot)]
        scales = {"ckv_scale": 1.0, "kpe_scale": 1.0} if kvdt == FP8 else {}  # FlashInfer >= 0.6.18 asks for both
        calls = [functools.partial(w.run, q[..., :MLA_LATENT], q[..., MLA_LATENT:], cache[..., :MLA_LATENT],
                                   cache[..., MLA_LATENT:], out=o, **scales) for w, q, o in zip(wr, qs, outs)]
        return calls, (cache, plans[0], qs[0], qo)

    def run_mla(self, reqs, heads, kvdt, kv_bytes, flops, ours_ms):
        name = self.spec("mla", kvdt, 0).name
        if name in self.failed:
            return {"error": "JIT build failed: " + self.failed[name]}
        small = small_reqs(reqs)
        calls, (cache, (indptr, indices, _, _), q, qo) = self.mla(small, heads, 1, kvdt)
        out = calls[0]()
        rows = [deq(self.gather(cache[:, :, None], indptr, indices, i, kv, "NHD"), 1.0)
                for i, (_, kv) in enumerate(small)]
        ref = reference([q[int(qo[i]):int(qo[i + 1])] for i in range(len(small))], rows,
                        [r[..., :MLA_LATENT] for r in rows], MLA_SCALE)
        err = rel_err(out, ref)
        del calls, cache, q, out, ref, rows
        if bad(err, kvdt == FP8):
            return {"wrong": err}
        calls, _ = self.mla(reqs, heads, rotations(kv_bytes, 512e6), kvdt)
        ms, graph = timed(calls, iters_for(ours_ms))
        return result(ms, graph, kv_bytes, flops, err)


# ---- driver -----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench")
    ap.add_argument("out")
    ap.add_argument("mla", nargs="?")
    ap.add_argument("--peers", default=",".join(ALL_PEERS))
    ap.add_argument("--fi-prefill-head-sizes", default="128")
    ap.add_argument("--fi-decode-tensor-cores", action="store_true")
    ap.add_argument("--update", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=0.0)
    args = ap.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(ALL_PEERS)
    if unknown:
        sys.exit(f"cuda_peers.py: unknown peers {sorted(unknown)} (known: {','.join(ALL_PEERS)})")
    fi_prefill_ds = {int(x) for x in args.fi_prefill_head_sizes.split(",") if x}
    t0 = time.time()
    torch.manual_seed(0)
    bench = json.load(open(args.bench))
    mla_bench = json.load(open(args.mla)) if args.mla else {"rows": []}
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "versions": {}, "seconds": {},
           "rows": [{k: r[k] for k in ("grid", "name", "head_size", "kv_cache_dtype")} for r in bench["rows"]],
           "mla_rows": [{k: r[k] for k in ("grid", "name")} for r in mla_bench["rows"]]}
    if args.update and os.path.exists(args.out):
        old = json.load(open(args.out))
        out["versions"].update(old.get("versions", {}))
        out["seconds"].update(old.get("seconds", {}))
        for part, key in (("rows", ("grid", "name", "head_size", "kv_cache_dtype")), ("mla_rows", ("grid", "name"))):
            prev = {tuple(r[k] for k in key): r for r in old.get(part, [])}
            for r in out[part]:
                r.update({k: v for k, v in prev.get(tuple(r[k] for k in key), {}).items() if k not in key})
    out["versions"]["torch"] = torch.__version__

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    def late():
        return args.deadline_s > 0 and time.time() - t0 > args.deadline_s

    def each(rows, field, key_fn, fn):
        """fn(row) for each row (results shared between rows of one key); errors recorded per row."""
        cache = {}
        for _, o in rows:
            o.pop(field, None)  # --update: this run's result or none
        for r, o in rows:
            key = key_fn(r)
            if key is None:
                continue
            if key not in cache:
                if late():
                    log(f"{field}: deadline reached, remaining rows skipped")
                    break
                try:
                    cache[key] = fn(r)
                except Exception as e:  # noqa: BLE001 - one row's failure must not stop the peer
                    cache[key] = {"error": short(e)}
                try:
                    cleanup()
                except Exception as e:  # noqa: BLE001
                    log(f"{field}: cleanup after {key}: {short(e)}")
                log(field, key, cache[key])
                save()
            o[field] = cache[key]
        save()

    main_rows = list(zip(bench["rows"], out["rows"]))
    mla_rows = list(zip(mla_bench["rows"], out["mla_rows"]))
    no_hnd = lambda r: r["name"].replace(" HND", "")  # noqa: E731
    for peer in [p for p in ALL_PEERS if p in peers]:
        if late():
            log(f"{peer}: skipped (deadline reached)")
            continue
        start = time.time()
        if peer in ("sdpa", "cudnn"):
            backend = SDPBackend.FLASH_ATTENTION if peer == "sdpa" else SDPBackend.CUDNN_ATTENTION
            each(main_rows, "sdpa_flash" if peer == "sdpa" else "sdpa_cudnn",
                 lambda r: None if r["grid"] in ("mixed", "spec", "fp8out", "fp8q") else (r["grid"], no_hnd(r), r["head_size"]),
                 lambda r, b=backend: peer_row(r, b))
        elif peer == "flex":
            each(main_rows, "flex",
                 lambda r: (r["grid"], no_hnd(r), 128) if no_hnd(r) in FLEX_ROWS and r["head_size"] == 128 else None,
                 lambda r: peer_row(r, FLEX))
        elif peer == "fa3":
            try:
                fa3 = FA3()
            except Exception as e:  # noqa: BLE001 - missing wheel or incompatible torch: skip the peer
                log(f"fa3: skipped ({short(e)})")
                continue
            out["versions"]["fa3_fwd"] = fa3.version
            each(main_rows, "fa3", lambda r: None if r["grid"] in ("fp8out", "fp8q") else
                 (r["grid"], no_hnd(r), r["head_size"], r["kv_cache_dtype"]),
                 lambda r: fa3.run(row_requests(r), r["num_heads"], r["num_kv_heads"], r["head_size"], r["head_size"],
                                   r["kv_cache_dtype"] != "auto", 1.0 / math.sqrt(r["head_size"]), r["kv_bytes"],
                                   r["flops"], r["ms"]))

            def fa3_mla(r):
                heads, reqs = mla_shape(r)
                kv_bytes = sum(kv for _, kv in reqs) * heads * (MLA_DQK + MLA_DV) * 2
                return fa3.run(reqs, heads, heads, MLA_DQK, MLA_DV, False, 1.0 / math.sqrt(MLA_DQK), kv_bytes,
                               r["flops"], r["ms"])
            each(mla_rows, "fa3", lambda r: r["name"] if r["grid"] == "prefill" and mla_shape(r) else None, fa3_mla)
        elif peer == "flashinfer":
            try:
                fi = FlashInfer(args.fi_decode_tensor_cores)
            except Exception as e:  # noqa: BLE001
                log(f"flashinfer: skipped ({short(e)})")
                continue
            out["versions"]["flashinfer"] = fi.version + (" (decode: tensor cores)" if fi.decode_tc else "")
            kvdt = lambda r: FP8 if r["kv_cache_dtype"] != "auto" else BF16  # noqa: E731
            kind = lambda r: "decode" if r["grid"] == "decode" else "prefill"  # noqa: E731
            use = lambda r: r["grid"] not in ("fp8out", "fp8q") and (r["grid"] == "decode" or r["head_size"] in fi_prefill_ds)  # noqa: E731
            configs = {(kind(r), kvdt(r), r["head_size"]) for r, _ in main_rows if use(r)}
            mla_kvdt = lambda r: FP8 if r["grid"] == "decode-fp8" else BF16  # noqa: E731
            mla_use = lambda r: r["grid"] in ("decode", "decode-fp8", "spec") and mla_shape(r)  # noqa: E731
            configs |= {("mla", mla_kvdt(r), 0) for r, _ in mla_rows if mla_use(r)}
            fi.prebuild(sorted(configs, key=str), late)
            each(main_rows, "flashinfer",
                 lambda r: (r["grid"], r["name"], r["head_size"], r["kv_cache_dtype"]) if use(r) else None,
                 lambda r: fi.run_gqa(kind(r), row_requests(r), r["num_heads"], r["num_kv_heads"], r["head_size"],
                                      kvdt(r), "HND" if r["name"].endswith(" HND") else "NHD", r["kv_bytes"],
                                      r["flops"], r["ms"]))

            def fi_mla(r):
                heads, reqs = mla_shape(r)
                return fi.run_mla(reqs, heads, mla_kvdt(r), r["bytes"], r["flops"], r["ms"])
            each(mla_rows, "flashinfer", lambda r: r["name"] if mla_use(r) else None, fi_mla)
        out["seconds"][peer] = round(time.time() - start, 1)
        log(f"{peer}: {out['seconds'][peer]} s")
        save()
    log(f"peers: {time.time() - t0:.0f} s in all ({out['seconds']})")


if __name__ == "__main__":
    with torch.no_grad():
        main()
