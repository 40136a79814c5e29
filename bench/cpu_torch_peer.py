#!/usr/bin/env python3
"""PyTorch CPU peer of bench/cpu_bench.cpp: torch.nn.functional.scaled_dot_product_attention on
the CPU for the same shapes (Llama-3-8B attention: Hq 32, Hkv 8, D 128, bf16 unless noted).

What differs from cpu_bench, on purpose and stated in the output:
  * K/V are CONTIGUOUS per request ((batch, Hkv, keys, D)), not paged: SDPA has no block table,
    so PyTorch reads sequential memory where the CPU backend follows shuffled 16-token pages.
  * GQA through enable_gqa=True (no K/V copy); decode rows pass is_causal=False (one query sees
    every key), prefill rows is_causal=True. Ragged batches are not expressible: every request of
    a row has the same length, as in cpu_bench's rows.
Counters follow cpu_bench: FLOPs = 4 * visible keys * D * Hq per query token; bytes = K/V once
per (request, kv head) + Q + O.

Threads: --threads N, else PAGEDATTN_NUM_THREADS, else torch's default (set it to compare with
cpu_bench at the same count). Times: median (and min) of --reps timed calls after warm-ups.

Run: python3 bench/cpu_torch_peer.py --threads 2 --json out.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128

# name, batch, keys per request, queries per request, causal, dtype
CASES = [
    ("Prefill/1x2048", 1, 2048, 2048, True, torch.bfloat16),
    ("Prefill/4x1024", 4, 1024, 1024, True, torch.bfloat16),
    ("Prefill/1x2048_f16", 1, 2048, 2048, True, torch.float16),
    ("Decode/1x4k", 1, 4096, 1, False, torch.bfloat16),
    ("Decode/16x1k", 16, 1024, 1, False, torch.bfloat16),
    ("Decode/16x4k", 16, 4096, 1, False, torch.bfloat16),
    ("Decode/64x4k", 64, 4096, 1, False, torch.bfloat16),
]


def counters(batch, keys, queries, causal, elem_bytes):
    flops = 0.0
    for i in range(queries):
        visible = (keys - queries + i + 1) if causal else keys
        flops += 4.0 * visible * D * HQ
    flops *= batch
    kv_bytes = 2.0 * batch * keys * HKV * D * elem_bytes
    qo_bytes = 2.0 * batch * queries * HQ * D * elem_bytes
    return flops, kv_bytes + qo_bytes


def time_case(batch, keys, queries, causal, dtype, reps, min_seconds):
    gen = torch.Generator().manual_seed(1)
    q = torch.rand(batch, HQ, queries, D, generator=gen).mul_(2).sub_(1).to(dtype)
    k = torch.rand(batch, HKV, keys, D, generator=gen).mul_(2).sub_(1).to(dtype)
    v = torch.rand(batch, HKV, keys, D, generator=gen).mul_(2).sub_(1).to(dtype)
    scale = D ** -0.5

    def call():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=True)

    with torch.inference_mode():
        out = call()
        if not torch.isfinite(out.float()).all():
            raise RuntimeError("SDPA returned non-finite values")
        call()
        times = []
        start_all = time.perf_counter()
        while len(times) < reps or time.perf_counter() - start_all < min_seconds:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
            if len(times) >= 10 * reps:
                break
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.5)
    parser.add_argument("--filter", default="", help="substring of the case names to run")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args()

    threads = args.threads or int(os.environ.get("PAGEDATTN_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    info = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "layout": "contiguous K/V per request (not paged), enable_gqa=True",
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    print(json.dumps(info), flush=True)

    results = []
    for name, batch, keys, queries, causal, dtype in CASES:
        if args.filter and args.filter not in name:
            continue
        elem = torch.tensor([], dtype=dtype).element_size()
        flops, nbytes = counters(batch, keys, queries, causal, elem)
        times = time_case(batch, keys, queries, causal, dtype, args.reps, args.min_seconds)
        med = statistics.median(times)
        row = {
            "name": "Torch/" + name,
            "median_ms": med * 1e3,
            "min_ms": min(times) * 1e3,
            "calls": len(times),
            "GFLOP/s": flops / med / 1e9,
            "GB/s": nbytes / med / 1e9,
        }
        results.append(row)
        print(f"{row['name']:<26} {row['median_ms']:10.3f} ms (min {row['min_ms']:.3f}, "
              f"{row['calls']} calls)  {row['GFLOP/s']:8.1f} GFLOP/s  {row['GB/s']:7.1f} GB/s",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
