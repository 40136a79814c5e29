#!/usr/bin/env python3
"""Markdown summary of bench/cuda_attention_bench (+ bench/cuda_peers.py) results.

Usage: cuda_report.py BENCH.json [PEERS.json] > summary.md
Targets (issue 5, H200, bf16, 32q/8kv, d128, page 16) are marked met / MISSED.
"""
import json
import sys

TARGETS = {  # (grid, name, head_size, kv) -> (metric, value)
    ("decode", "decode b128x4k", 128, "auto"): ("tbps", 3.6),
    ("decode", "decode b64x2k", 128, "auto"): ("tbps", 3.3),
    ("decode", "decode b1x8k", 128, "auto"): ("tbps", 1.2),
    ("decode", "decode b32x16k", 128, "auto"): ("tbps", 3.6),
    ("prefill", "prefill 4x4k causal", 128, "auto"): ("tflops", 330.0),
}
MIXED_TARGET_MS = 0.2


def fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def main():
    bench = json.load(open(sys.argv[1]))
    peers = {}
    if len(sys.argv) > 2:
        for r in json.load(open(sys.argv[2]))["rows"]:
            peers[(r["grid"], r["name"], r["head_size"], r["kv_cache_dtype"])] = r
    print(f"Device: {bench['device']} ({bench['sms']} SMs); measured copy {bench['copy_tbps']:.2f} TB/s "
          f"(read + write), cuBLAS bf16 GEMM {bench['gemm_bf16_tflops']:.0f} TFLOP/s.\n")
    print("| grid | case | d | KV | ms | KV TB/s | TFLOP/s | % of floor | SDPA flash ms | SDPA cuDNN ms | flex ms | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in bench["rows"]:
        key = (r["grid"], r["name"], r["head_size"], r["kv_cache_dtype"])
        p = peers.get(key, {})
        def peer(k):
            v = p.get(k)
            if not v:
                return "-"
            return "n/a" if "error" in v else f"{v['ms']:.4f}"
        target = ""
        t = TARGETS.get((key[0], key[1].replace(" HND", ""), key[2], key[3]))
        if t:
            metric, value = t
            got = r[metric]
            target = f"{'met' if got >= value else 'MISSED'} (>= {value} {'TB/s' if metric == 'tbps' else 'TFLOP/s'})"
        if r["grid"] == "mixed" and r["head_size"] == 128 and r["kv_cache_dtype"] == "auto":
            target = f"{'met' if r['ms'] <= MIXED_TARGET_MS else 'MISSED'} (<= {MIXED_TARGET_MS} ms)"
        print(f"| {r['grid']} | {r['name']} | {r['head_size']} | {'bf16' if r['kv_cache_dtype'] == 'auto' else r['kv_cache_dtype']} "
              f"| {r['ms']:.4f} | {r['tbps']:.2f} | {r['tflops']:.1f} | {100 * r['fraction_of_floor']:.0f}% "
              f"| {peer('sdpa_flash')} | {peer('sdpa_cudnn')} | {peer('flex')} | {target} |")


if __name__ == "__main__":
    main()
