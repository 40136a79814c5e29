#!/usr/bin/env python3
"""Markdown summary of bench/cuda_attention_bench (+ bench/cuda_peers.py, + bench/cuda_mla_bench) results.

Usage: cuda_report.py BENCH.json [PEERS.json [MLA_BENCH.json]] > summary.md
Targets (issue 5, H200, bf16, 32q/8kv, d128, page 16) are marked met / MISSED. Peer cells: ms; FA3 and
FlashInfer also "(ours/peer)", the ratio of our time to theirs (< 1: we are faster); "*" = timed
eagerly (its CUDA graph capture failed), "wrong" = failed the correctness check, "n/a" = the peer
raised, "-" = not run.
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
PEER_NOTE = ("SDPA (flash, cuDNN) and flex: PyTorch {torch}, contiguous bf16 KV (fp8 rows show the bf16 peer). "
             "FA3: fa3-fwd {fa3_fwd} flash_attn_varlen_func, contiguous KV (fp8 rows: fp8 Q/K/V with descales). "
             "FlashInfer {flashinfer}: paged, page 16 (MLA: 64), random block tables, bf16 Q, bf16/fp8 cache.")


def cell(p, ours_ms=None):
    """A peer's table cell; with ours_ms, also our time over theirs."""
    if not p:
        return "-"
    if "wrong" in p:
        return f"wrong ({p['wrong']:.2g})"
    if "error" in p:
        return "n/a"
    text = f"{p['ms']:.4f}" + ("" if p.get("graph", True) else "*")
    return text if ours_ms is None else f"{text} ({ours_ms / p['ms']:.2f})"


def kv_name(kv):
    return "bf16" if kv == "auto" else kv


def main():
    bench = json.load(open(sys.argv[1]))
    peers_doc = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {}
    mla = json.load(open(sys.argv[3])) if len(sys.argv) > 3 else None
    peers = {(r["grid"], r["name"], r["head_size"], r["kv_cache_dtype"]): r for r in peers_doc.get("rows", [])}
    title = f"## pagedattn CUDA benchmark on {bench['device']}"
    if peers_doc:
        title += " with peers in the same run"
        if peers_doc.get("device") != bench["device"]:
            title += f" (peers measured on {peers_doc.get('device')}!)"
    print(title + "\n")
    print(f"Device: {bench['device']} ({bench['sms']} SMs); measured copy {bench['copy_tbps']:.2f} TB/s "
          f"(read + write), cuBLAS bf16 GEMM {bench['gemm_bf16_tflops']:.0f} TFLOP/s.")
    if peers_doc:
        v = {"torch": peers_doc.get("torch", "?"), "fa3_fwd": "?", "flashinfer": "?", **peers_doc.get("versions", {})}
        print("Peers: " + PEER_NOTE.format(**v) + f" Peer seconds: {peers_doc.get('seconds', {})}.")
    print()
    print("| grid | case | d | KV | ms | KV TB/s | TFLOP/s | % of floor | SDPA flash ms | SDPA cuDNN ms | flex ms "
          "| FA3 ms (ours/FA3) | FlashInfer ms (ours/FI) | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in bench["rows"]:
        key = (r["grid"], r["name"], r["head_size"], r["kv_cache_dtype"])
        p = peers.get(key, {})
        target = ""
        t = TARGETS.get((key[0], key[1].replace(" HND", ""), key[2], key[3]))
        if t:
            metric, value = t
            got = r[metric]
            target = f"{'met' if got >= value else 'MISSED'} (>= {value} {'TB/s' if metric == 'tbps' else 'TFLOP/s'})"
        if r["grid"] == "mixed" and r["head_size"] == 128 and r["kv_cache_dtype"] == "auto":
            target = f"{'met' if r['ms'] <= MIXED_TARGET_MS else 'MISSED'} (<= {MIXED_TARGET_MS} ms)"
        print(f"| {r['grid']} | {r['name']} | {r['head_size']} | {kv_name(r['kv_cache_dtype'])} "
              f"| {r['ms']:.4f} | {r['tbps']:.2f} | {r['tflops']:.1f} | {100 * r['fraction_of_floor']:.0f}% "
              f"| {cell(p.get('sdpa_flash'))} | {cell(p.get('sdpa_cudnn'))} | {cell(p.get('flex'))} "
              f"| {cell(p.get('fa3'), r['ms'])} | {cell(p.get('flashinfer'), r['ms'])} | {target} |")
    if mla:
        mp = {(r["grid"], r["name"]): r for r in peers_doc.get("mla_rows", [])}
        print(f"\n### MLA (bench/cuda_mla_bench) beside the peers, {mla['device']}\n")
        print("FlashInfer: BatchMLAPagedAttentionWrapper on the decode rows (bf16 latent cache, page 64). "
              "FA3: flash_attn_varlen_func (Dqk 192, Dv 128, causal after the context) on the prefill "
              "attention rows; \"layer\" rows have no peer.\n")
        print("| grid | case | ms | TFLOP/s | FlashInfer ms (ours/FI) | FA3 ms (ours/FA3) |")
        print("|---|---|---|---|---|---|")
        for r in mla["rows"]:
            p = mp.get((r["grid"], r["name"]), {})
            print(f"| {r['grid']} | {r['name']} | {r['ms']:.4f} | {r['flops'] / (r['ms'] * 1e-3) / 1e12:.0f} "
                  f"| {cell(p.get('flashinfer'), r['ms'])} | {cell(p.get('fa3'), r['ms'])} |")


if __name__ == "__main__":
    main()
