#!/usr/bin/env python3
"""Roofline plot of a `pagedattn bench` result (optional: needs matplotlib, which pagedattn
itself does not depend on).

Usage: python3 bench/cli_roofline.py OUT_DIR/cli_bench.json OUT_DIR/cli_roofline.png

x: arithmetic intensity (FLOPs / bytes that must move, DESIGN.md section 7), y: achieved FLOP/s.
The roof is min(peak FLOP/s, peak bandwidth x intensity) from the calibrated peaks stored in
the JSON. One marker per grid point, coloured by backend, shaped by grid (decode / prefill /
mixed).
"""
import json
import sys


def main(argv):
    if len(argv) != 3:
        print("usage: cli_roofline.py BENCH_JSON OUT_PNG", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(argv[1]) as f:
        doc = json.load(f)
    points = doc["points"]
    if not points:
        print("cli_roofline.py: no points in " + argv[1], file=sys.stderr)
        return 1
    peak_bw = doc.get("peak_bandwidth_bytes_per_second")
    peak_flops = doc.get("peak_flop_per_second")

    fig, ax = plt.subplots(figsize=(8, 5.5))
    intensities = [p["arithmetic_intensity"] for p in points]
    lo, hi = min(intensities) / 4, max(intensities) * 4
    if peak_bw and peak_flops:
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(peak_flops, peak_bw * x) for x in xs], color="black", linewidth=1.5,
                label="roof: %.3g GB/s, %.3g GFLOP/s" % (peak_bw / 1e9, peak_flops / 1e9))
    markers = {"decode": "o", "prefill": "s", "mixed": "^"}
    backends = sorted({p["backend"] for p in points})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for bi, backend in enumerate(backends):
        for grid, marker in markers.items():
            sel = [p for p in points if p["backend"] == backend and p["grid"] == grid]
            if not sel:
                continue
            ax.scatter([p["arithmetic_intensity"] for p in sel], [p["flop_per_second"] for p in sel],
                       marker=marker, color=colors[bi % len(colors)], label="%s %s" % (backend, grid))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(doc.get("header", "pagedattn bench"), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
