#!/usr/bin/env python3
"""PyTorch baseline for the grouped-GEMM suite: torch._grouped_mm on the cases that
`bench_grouped --list-cases` prints (identical shapes and per-expert rows).

    bench_grouped --list-cases > cases.json
    python3 torch_grouped_mm.py --cases cases.json --out DIR

Weights are [E, N, K] (as nn.Linear stores them); offsets are int32 prefix-sum ends.
fwd:   Y  = grouped_mm(X [M,K], W.transpose(-2,-1) [E,K,N])
dgrad: dX = grouped_mm(dY [M,N], W [E,N,K])
wgrad: dW = grouped_mm(dY.t() [N,M], X [M,K])  -> [E,N,K]
Each case is checked once (32 sampled rows, or 4 experts x 8 rows for wgrad, against
float64), then timed with CUDA events (3 warm-ups, 20 samples, median and IQR), input
copies rotated past 3x L2. Appends JSON lines (backend torch_grouped_mm) to
DIR/grouped_gemm.jsonl.
"""
import argparse, datetime, json, os, statistics
import torch


def rel_err(got, want):
    return (torch.linalg.vector_norm(got.double() - want) / torch.linalg.vector_norm(want)).item()


def quartiles(xs):
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[2] - q[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()
    cases = json.load(open(args.cases))
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    for c in cases:
        sizes = c["sizes"]; n, k, e = c["n"], c["k"], len(c["sizes"])
        m = sum(sizes)
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
        starts = [sum(sizes[:i]) for i in range(e)]
        rnd = lambda *shape: (torch.rand(*shape, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)
        w = rnd(e, n, k)
        if c["pass"] == "fwd":
            a_shape, call = (m, k), lambda a: torch._grouped_mm(a, w.transpose(-2, -1), offs=ends)
        elif c["pass"] == "dgrad":
            a_shape, call = (m, n), lambda a: torch._grouped_mm(a, w, offs=ends)
        else:
            x = rnd(m, k)
            a_shape, call = (m, n), lambda a: torch._grouped_mm(a.t(), x, offs=ends)
        bytes_per_set = 2 * (a_shape[0] * a_shape[1]) + 2 * w.numel()
        sets = max(1, min(64, -(-3 * l2 // bytes_per_set)))
        inputs = [rnd(*a_shape) for _ in range(sets)]
        out = call(inputs[0])
        torch.cuda.synchronize()
        # Check against float64 on samples.
        g = torch.Generator().manual_seed(11)
        if c["pass"] in ("fwd", "dgrad"):
            rows = torch.randint(0, m, (32,), generator=g).tolist()
            got, want = [], []
            for r in rows:
                ex = next(i for i in range(e) if starts[i] <= r < starts[i] + sizes[i])
                wt = w[ex].double().t() if c["pass"] == "fwd" else w[ex].double()
                want.append(inputs[0][r].double() @ wt)
                got.append(out[r])
            err = rel_err(torch.stack(got), torch.stack(want))
        else:
            live = [i for i in range(e) if sizes[i] > 0]
            got, want = [], []
            for _ in range(min(4, len(live))):
                ex = live[torch.randint(0, len(live), (1,), generator=g).item()]
                s, t = starts[ex], starts[ex] + sizes[ex]
                ps = torch.randint(0, n, (8,), generator=g).tolist()
                ref = inputs[0][s:t].double().t()[ps] @ x[s:t].double()
                want.append(ref); got.append(out[ex][ps])
            err = rel_err(torch.cat(got), torch.cat(want))
        for i in range(3):
            call(inputs[i % sets])
        times = []
        for i in range(args.samples):
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record(); call(inputs[(3 + i) % sets]); s1.record(); s1.synchronize()
            times.append(s0.elapsed_time(s1) * 1e3)
        med, iqr = quartiles(times)
        tflops = 2.0 * m * n * k / med / 1e6
        print(f"{c['name']:<48} torch_grouped_mm {med:9.1f} us [IQR {iqr:6.1f}] {tflops:6.1f} TFLOP/s  rel err {err:.2e}", flush=True)
        record = (dict(suite="grouped_gemm", case=c["name"], backend="torch_grouped_mm", gpu=gpu,
                             median_us=med, iqr_us=iqr, tflops=tflops, rel_err=err,
                             date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                             commit=os.environ.get("MOEFUSE_COMMIT", "unknown")))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "grouped_gemm.jsonl"), "a") as f:  # per case
            f.write(json.dumps(record) + "\n")
        del inputs, out, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
