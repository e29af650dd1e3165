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

With --moefuse-lib PATH (libmoefuse_bench_capi.so, from `cargo xtask device-pack`), moefuse
(through ctypes, on the same tensors and stream) and dense cuBLAS (torch.mm on one expert's
weights, the same FLOPs) are timed in the same loop, interleaved sample by sample in a
rotating order, all samples queued back to back between CUDA events (no per-sample host
synchronisation, so launch overhead is not timed); rows for all three backends are written.
moefuse's output is checked against torch's on the same inputs before timing.
"""
import argparse, ctypes, datetime, json, os, statistics
import torch


class Moefuse:
    """moefuse's grouped GEMM through crates/bench-capi (pass 0 fwd, 1 dgrad, 2 wgrad)."""

    PASS = {"fwd": 0, "dgrad": 1, "wgrad": 2}

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        i64, u64 = ctypes.c_int64, ctypes.c_uint64
        self.lib.moefuse_capi_grouped_plan.argtypes = [ctypes.c_int32, i64, i64, i64, i64]
        self.lib.moefuse_capi_grouped_plan.restype = i64
        self.lib.moefuse_capi_grouped_run.argtypes = [ctypes.c_int32, i64, i64, i64, i64] + [u64] * 7
        self.lib.moefuse_capi_grouped_run.restype = ctypes.c_int32
        self.lib.moefuse_capi_last_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.lib.moefuse_capi_last_error.restype = ctypes.c_size_t

    def message(self):
        buf = ctypes.create_string_buffer(1024)
        self.lib.moefuse_capi_last_error(buf, 1024)
        return buf.value.decode()

    def plan(self, pas, e, m, n, k):
        """Returns (workspace tensor, variant name)."""
        ws = self.lib.moefuse_capi_grouped_plan(self.PASS[pas], e, m, n, k)
        if ws < 0:
            raise RuntimeError("moefuse plan: " + self.message())
        return torch.empty(max(ws, 256), dtype=torch.uint8, device="cuda"), self.message()

    def run(self, pas, e, m, n, k, ends, a, b, d, ws):
        rc = self.lib.moefuse_capi_grouped_run(
            self.PASS[pas], e, m, n, k, ends.data_ptr(), a.data_ptr(), b.data_ptr(), d.data_ptr(),
            ws.data_ptr(), ws.numel(), torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError("moefuse run: " + self.message())
        return d


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
    ap.add_argument("--moefuse-lib", default=None,
                    help="libmoefuse_bench_capi.so: also time moefuse and dense cuBLAS, interleaved")
    args = ap.parse_args()
    mf = Moefuse(args.moefuse_lib) if args.moefuse_lib else None
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
        pas = c["pass"]
        if pas == "fwd":
            a_shape, call = (m, k), lambda a: torch._grouped_mm(a, w.transpose(-2, -1), offs=ends)
            dense, out_shape, b_op = (lambda a: torch.mm(a, w[0].t())), (m, n), w
        elif pas == "dgrad":
            a_shape, call = (m, n), lambda a: torch._grouped_mm(a, w, offs=ends)
            dense, out_shape, b_op = (lambda a: torch.mm(a, w[0])), (m, k), w
        else:
            x = rnd(m, k)
            a_shape, call = (m, n), lambda a: torch._grouped_mm(a.t(), x, offs=ends)
            dense, out_shape, b_op = (lambda a: torch.mm(a.t(), x)), (e, n, k), x
        bytes_per_set = 2 * (a_shape[0] * a_shape[1]) + 2 * w.numel()
        sets = max(1, min(64, -(-3 * l2 // bytes_per_set)))
        inputs = [rnd(*a_shape) for _ in range(sets)]
        out = call(inputs[0])
        torch.cuda.synchronize()
        # Check against float64 on samples (the same samples for every backend).
        g = torch.Generator().manual_seed(11)
        if c["pass"] in ("fwd", "dgrad"):
            rows = torch.randint(0, m, (32,), generator=g).tolist()
            want = []
            for r in rows:
                ex = next(i for i in range(e) if starts[i] <= r < starts[i] + sizes[i])
                wt = w[ex].double().t() if c["pass"] == "fwd" else w[ex].double()
                want.append(inputs[0][r].double() @ wt)
            want = torch.stack(want)
            sample_err = lambda o: rel_err(torch.stack([o[r] for r in rows]), want)
        else:
            live = [i for i in range(e) if sizes[i] > 0]
            picks, want = [], []
            for _ in range(min(4, len(live))):
                ex = live[torch.randint(0, len(live), (1,), generator=g).item()]
                s, t = starts[ex], starts[ex] + sizes[ex]
                ps = torch.randint(0, n, (8,), generator=g).tolist()
                want.append(inputs[0][s:t].double().t()[ps] @ x[s:t].double())
                picks.append((ex, ps))
            want = torch.cat(want)
            sample_err = lambda o: rel_err(torch.cat([o[ex][ps] for ex, ps in picks]), want)
        err = sample_err(out)
        backends = {"torch_grouped_mm": (call, err)}
        if mf is not None:
            ws, variant = mf.plan(pas, e, m, n, k)
            d = torch.empty(out_shape, dtype=torch.bfloat16, device=dev)
            if pas == "wgrad":
                d.fill_(float("nan"))  # empty experts must come back zeroed
            moe = lambda a: mf.run(pas, e, m, n, k, ends, a, b_op, d, ws)
            got = moe(inputs[0]).clone()
            torch.cuda.synchronize()
            vs_torch = rel_err(got, out.double())
            if not vs_torch < 1e-2:
                raise RuntimeError(f"{c['name']}: moefuse differs from torch by {vs_torch:.2e}")
            backends["moefuse"] = (moe, sample_err(got))
            # The dense product reads expert 0's weights for every row: its own check.
            dout = dense(inputs[0])
            if pas == "wgrad":
                ps = picks[0][1]
                d_err = rel_err(dout[ps], inputs[0].double().t()[ps] @ x.double())
            else:
                w0 = w[0].double().t() if pas == "fwd" else w[0].double()
                d_err = rel_err(torch.stack([dout[r] for r in rows]),
                                torch.stack([inputs[0][r].double() @ w0 for r in rows]))
            del dout
            backends["cublas_dense"] = (dense, d_err)
            print(f"{c['name']:<48} moefuse variant {variant}, rel err vs torch {vs_torch:.2e}", flush=True)
        names = list(backends)
        for i in range(3):
            for b in names:
                backends[b][0](inputs[i % sets])
        torch.cuda.synchronize()
        events = {b: [] for b in names}
        for i in range(args.samples):
            order = names[i % len(names):] + names[:i % len(names)]
            for b in order:
                s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s0.record(); backends[b][0](inputs[(3 + i) % sets]); s1.record()
                events[b].append((s0, s1))
        torch.cuda.synchronize()
        for b in names:
            times = [s0.elapsed_time(s1) * 1e3 for s0, s1 in events[b]]
            med, iqr = quartiles(times)
            tflops = 2.0 * m * n * k / med / 1e6
            print(f"{c['name']:<48} {b:<16} {med:9.1f} us [IQR {iqr:6.1f}] {tflops:6.1f} TFLOP/s  rel err {backends[b][1]:.2e}", flush=True)
            record = dict(suite="grouped_gemm", case=c["name"], backend=b, gpu=gpu,
                          median_us=med, iqr_us=iqr, tflops=tflops, rel_err=backends[b][1],
                          date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                          commit=os.environ.get("MOEFUSE_COMMIT", "unknown"))
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "grouped_gemm.jsonl"), "a") as f:  # per case
                f.write(json.dumps(record) + "\n")
        del inputs, out, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
