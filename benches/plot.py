#!/usr/bin/env python3
"""Plots a benchmark suite's JSON lines as TFLOP/s per case and backend (horizontal bars).

    python3 benches/plot.py benches/results/grouped_gemm.jsonl docs/grouped_gemm.png

Needs matplotlib (`pip install matplotlib`); takes the latest row of each (case, backend).
"""
import json, sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src, dst):
    rows = [json.loads(l) for l in open(src) if l.strip()]
    latest, cases, backends = {}, [], []
    for r in rows:
        latest[(r["case"], r["backend"])] = r
        if r["case"] not in cases:
            cases.append(r["case"])
        if r["backend"] not in backends:
            backends.append(r["backend"])
    cases = [c for c in cases if not any(d in c for d in ("decode",))]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(cases) + 1.5))
    h = 0.8 / len(backends)
    for i, b in enumerate(backends):
        ys = [j + i * h for j in range(len(cases))]
        xs = [latest.get((c, b), {}).get("tflops") or 0 for c in cases]
        ax.barh(ys, xs, height=h, label=b)
    ax.set_yticks([j + 0.4 - h / 2 for j in range(len(cases))])
    ax.set_yticklabels(cases, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s (useful FLOPs, bf16)")
    gpu = rows[-1]["gpu"] if rows else ""
    ax.set_title(f"{src.split('/')[-1]} on {gpu} (decode cases omitted: see the table)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
