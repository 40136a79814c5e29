#!/usr/bin/env python3
"""Peers for bench/cuda_attention_bench: PyTorch scaled_dot_product_attention (flash and cuDNN
backends) on CONTIGUOUS KV (no paging) for the same decode / prefill shapes, timed the same way
(CUDA events, median of 5 repeats, inputs rotated so the KV does not sit in L2), and
flex_attention (torch.compile'd, causal block mask; contiguous KV too) for the issue's target
shapes at head size 128 (FLEX_ROWS: each shape compiles once, ~10-20 s).

Usage: cuda_peers.py BENCH.json OUT.json   (reads the rows to mirror from BENCH.json)
fp8-KV rows are compared with the bf16 peer (SDPA has no fp8 KV); mixed rows have no peer.
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FLEX = "flex"
FLEX_ROWS = {"decode b128x4k", "decode b64x2k", "decode b1x8k", "decode b32x16k", "prefill 4x4k causal",
             "prefill 1x16k causal", "prefill 16x1k causal"}
_flex_fn = []      # flex_attention compiled once per process
_flex_masks = {}   # causal block mask per (q_len, kv_len)


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


def peer_row(row, backend):
    d, hq, hkv = row["head_size"], row["num_heads"], row["num_kv_heads"]
    name = row["name"]
    if row["grid"] == "decode":
        b = row["batch"]
        ctx = int(name.split("x")[1].split()[0].rstrip("k")) * 1024
        q_len, kv_len, causal = 1, ctx, False
    elif row["grid"] == "prefill":
        n, rest = name.split(" ")[1].split("x")
        b, q_len = int(n), int(rest.rstrip("k")) * 1024
        kv_len, causal = q_len, True
    else:
        return None
    kv_bytes = b * kv_len * hkv * 2 * d * 2
    rot = max(1, min(8, math.ceil(256e6 / kv_bytes)))
    dev = "cuda"
    qs = [torch.randn(b, hq, q_len, d, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
    ks = [torch.randn(b, hkv, kv_len, d, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
    vs = [torch.randn(b, hkv, kv_len, d, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
    state = {"i": 0}

    def fn():
        i = state["i"] % rot
        state["i"] += 1
        if backend == FLEX:
            flex_call(qs[i], ks[i], vs[i], causal)
            return
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=causal, enable_gqa=True)

    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # backend not available for this shape
        return {"error": str(e).splitlines()[0][:160]}
    ms = time_ms(fn, max(10, min(2000, int(20.0 / max(row["ms"], 1e-3)))))
    return {"ms": ms, "tbps": kv_bytes / (ms * 1e-3) / 1e12, "tflops": row["flops"] / (ms * 1e-3) / 1e12}


def main():
    bench = json.load(open(sys.argv[1]))
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "rows": []}
    cache = {}
    for row in bench["rows"]:
        key = (row["grid"], row["name"].replace(" HND", ""), row["head_size"])
        if key not in cache:
            cache[key] = {
                "sdpa_flash": peer_row(row, SDPBackend.FLASH_ATTENTION),
                "sdpa_cudnn": peer_row(row, SDPBackend.CUDNN_ATTENTION),
            }
            if key[1] in FLEX_ROWS and key[2] == 128:
                cache[key]["flex"] = peer_row(row, FLEX)
            torch.cuda.empty_cache()
            print(key, cache[key], file=sys.stderr, flush=True)
        out["rows"].append({"grid": row["grid"], "name": row["name"], "head_size": row["head_size"],
                            "kv_cache_dtype": row["kv_cache_dtype"], **cache[key]})
    json.dump(out, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
