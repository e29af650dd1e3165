#!/usr/bin/env python3
"""PyTorch baseline for the dispatch_combine suite at one PE: what a user assembles from
PyTorch pieces for the single-GPU equivalent of dispatch and combine.

    python3 torch_dispatch_combine.py --out DIR [--tokens 4096] [--samples 30]

dispatch: stable sort of the flattened topk_ids, per-expert counts and prefix-sum offsets,
          and the expert-major rows gathered with index_select (the same output as
          moefuse's dispatch: rows grouped by expert, in token order within an expert);
combine:  out[t] = sum_slot w[t, slot] * y[row(t, slot)]: rows un-permuted with
          index_select, the slot sum in fp32, then bf16 (index_add_ with float atomics was
          3-5x slower).
Same models, routing law (k distinct uniform experts, weights 1/k), rotation past 3x L2,
CUDA-event timing of dispatch then combine per sample, and the same byte count for GB/s
(each token once, hidden * 2 bytes) as bench_ep. Identity experts: combine(dispatch(x))
must equal x. Appends JSON lines (backend torch) to DIR/dispatch_combine.jsonl.
"""
import argparse, datetime, json, os, statistics
import torch

MODELS = [("qwen3-30b-a3b", 128, 8, 2048), ("deepseek-v3", 256, 8, 7168)]


def quartiles(xs):
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[2] - q[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    t = args.tokens
    out_path = os.path.join(args.out, "dispatch_combine.jsonl")
    for model, experts, k, d in MODELS:
        ids = torch.rand(t, experts, device=dev, generator=gen).topk(k, dim=1).indices
        w = torch.full((t, k), 1.0 / k, device=dev, dtype=torch.float32)
        sets = max(1, min(64, -(-3 * l2 // (t * d * 2))))
        xs = [torch.randn(t, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(sets)]

        def dispatch(x):
            flat = ids.reshape(-1)
            order = torch.sort(flat, stable=True).indices
            offsets = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
            return x.index_select(0, order // k), order, offsets

        def combine(y, order):
            # Un-permute to (token, slot) order, then the weighted slot sum in fp32 (faster
            # than index_add_'s float atomics, and deterministic).
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), device=dev)
            yk = y.index_select(0, inv).view(t, k, d)
            return (yk.float() * w[:, :, None]).sum(1).to(torch.bfloat16)

        recv, order, _ = dispatch(xs[0])
        got = combine(recv, order)
        err = (torch.linalg.vector_norm(got.double() - xs[0].double()) / torch.linalg.vector_norm(xs[0].double())).item()
        assert err < 1e-2, f"{model}: torch combine(dispatch(x)) != x ({err})"
        disp, comb = [], []
        for i in range(5 + args.samples):
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            a.record()
            recv, order, _ = dispatch(xs[i % sets])
            b.record()
            combine(recv, order)
            c.record()
            c.synchronize()
            if i >= 5:
                disp.append(a.elapsed_time(b) * 1e3)
                comb.append(b.elapsed_time(c) * 1e3)
        with open(out_path, "a") as f:
            for phase, us in (("dispatch", disp), ("combine", comb)):
                med, iqr = quartiles(us)
                rec = {
                    "suite": "dispatch_combine", "case": f"{model}-t{t}-pe1-{phase}", "backend": "torch",
                    "gpu": gpu, "median_us": med, "iqr_us": iqr, "gbps": t * d * 2 / (med * 1e-6) / 1e9,
                    "rel_err": err, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                    "commit": os.environ.get("MOEFUSE_COMMIT", "unknown"),
                }
                f.write(json.dumps(rec) + "\n")
                print(f"{rec['case']:<40} torch {med:9.1f} us [IQR {iqr:6.1f}] {rec['gbps']:7.1f} GB/s")


if __name__ == "__main__":
    main()
