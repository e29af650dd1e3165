#!/usr/bin/env python3
"""PyTorch baseline for the MoE-layer suite (`moe`): the MoE layer a PyTorch user assembles
from stock ops, forward and backward, on one GPU (EP=1).

    python3 benches/torch_moe.py --out DIR [--models qwen3-30b-a3b,deepseek-v3]
        [--tokens 1,32,128,8192,16384] [--passes fwd,bwd,fwdbwd] [--routing-seed 0]
        [--seed 0] [--samples 30] [--warmup 3]

Appends one JSON line per case to DIR/moe.jsonl:
  {"suite":"moe","case":"<model>-t<T>-<pass>","backend":"torch_moe","gpu":...,
   "median_us":...,"iqr_us":...,"tflops":...,"rel_err":...,"date":"YYYY-MM-DD",
   "commit":$MOEFUSE_COMMIT or "unknown"}

Models (bf16 weights, gate_up [E, 2I, D], down [E, D, I], nn.Linear "N x K" layout, init
N(0, std=1/sqrt(fan_in)) from --seed):
  qwen3-30b-a3b  D=2048 I=768   E=128 top-8  SwiGLU       silu(g)*u, g = rows [0,I), u = [I,2I)
  mixtral-8x7b   D=4096 I=14336 E=8   top-2  SwiGLU
  gpt-oss-120b   D=2880 I=2880  E=128 top-4  SwiGLU-OAI   g,u interleaved (even rows g, odd u),
                 g = min(g, 7), u = clamp(u, -7, 7), h = g*sigmoid(1.702 g)*(u+1)  (no biases)
  deepseek-v3    D=7168 I=2048  E=256 top-8  SwiGLU
Tokens T in {1, 32, 128} (decode) and {8192, 16384}.

Routing (identical for every backend; `routing()` below is the definition, importable):
balanced random -- a CPU torch.Generator seeded with routing_seed*1000003 + set_index draws
logits = torch.rand(T, E), (vals, ids) = logits.topk(k), weights = softmax(vals) in fp32
(softmax over the k chosen logits, i.e. renormalised top-k). Inputs x and dy ~ N(0,1) bf16.

The torch_moe layer (forward):
  order   = argsort(topk_ids.flatten(), stable=True); offs = cumsum(bincount(ids, E)) int32
  x_perm  = x.index_select(0, order // k)
  h       = torch._grouped_mm(x_perm, gate_up.transpose(-2,-1), offs=offs)   # [T*k, 2I]
  a       = act(h)                                                           # [T*k, I]
  o       = torch._grouped_mm(a, down.transpose(-2,-1), offs=offs)           # [T*k, D]
  y       = bmm(weights.bf16[T,1,k], o.un-permuted[T,k,D])   (fp32 accumulation, bf16 out)
Backward is autograd (torch.autograd.grad of y with dy w.r.t. x, the routing weights,
gate_up and down; autograd.grad instead of y.backward so no .grad accumulation is timed).

What is timed (CUDA events on the current stream, --warmup 3 untimed calls, --samples >= 20
timed, median and IQR in microseconds):
  fwd     the forward under torch.no_grad()
  bwd     the backward only: each sample runs the forward (with autograd) untimed,
          synchronizes, then times torch.autograd.grad
  fwdbwd  forward (with autograd) + backward in one timed region
Input sets (x, routing, dy) rotate through ceil(3*L2 / bytes(x)) copies (3..64) when x is
smaller than 3x the L2 cache (torch.cuda.get_device_properties(0).L2_cache_size); weights are
not copied (they are far larger than L2 except in decode, where the rotating routing touches
other experts each sample).
TFLOP/s counts useful FLOPs: fwd 6*T*k*D*I, bwd 12*T*k*D*I, fwdbwd 18*T*k*D*I.

Correctness, once per (model, T) before timing, on input set 0: one forward+backward is
compared with a float64 per-expert loop (on the GPU) over the first min(T, 64) tokens (y, dx,
d weights) and over every token routed to expert ids[0,0] (d gate_up[e], d down[e]).
rel_err = ||got - want|| / ||want||; fwd cases record the y error, bwd/fwdbwd the largest of
the five. The errors are printed; a case whose rel_err exceeds 5e-2 is still recorded.

benches/ligermoe_moe.py imports this module (models, routing, inputs, reference, timing,
records) and only swaps the backend.
"""
import argparse, datetime, json, math, os, statistics, sys, time, traceback

import torch
import torch.nn.functional as F

MODELS = {
    "qwen3-30b-a3b": dict(D=2048, I=768, E=128, k=8, act="swiglu"),
    "mixtral-8x7b": dict(D=4096, I=14336, E=8, k=2, act="swiglu"),
    "gpt-oss-120b": dict(D=2880, I=2880, E=128, k=4, act="swiglu_oai"),
    "deepseek-v3": dict(D=7168, I=2048, E=256, k=8, act="swiglu"),
}
TOKENS = [1, 32, 128, 8192, 16384]
PASSES = ["fwd", "bwd", "fwdbwd"]
FLOP_MULT = {"fwd": 6, "bwd": 12, "fwdbwd": 18}
REF_TOKENS = 64


# ----------------------------------------------------------------------------- inputs

def routing(T, E, k, routing_seed, set_index=0, device="cuda"):
    """Balanced random routing: (topk_ids int64 [T,k], topk_weights fp32 [T,k]).

    Drawn on the CPU so that it is the same on every machine and for every backend."""
    g = torch.Generator(device="cpu").manual_seed(routing_seed * 1000003 + set_index)
    logits = torch.rand(T, E, generator=g, dtype=torch.float32)
    vals, ids = logits.topk(k, dim=1)
    w = torch.softmax(vals, dim=1)
    return ids.to(device), w.to(device)


def make_weights(m, seed, device="cuda"):
    """gate_up [E, 2I, D], down [E, D, I], bf16, N(0, 1/sqrt(fan_in)); per expert on the GPU."""
    E, D, I = m["E"], m["D"], m["I"]
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.empty(E, 2 * I, D, dtype=torch.bfloat16, device=device)
    down = torch.empty(E, D, I, dtype=torch.bfloat16, device=device)
    for e in range(E):
        gate_up[e] = torch.randn(2 * I, D, generator=g, device=device).mul_(1.0 / math.sqrt(D))
    for e in range(E):
        down[e] = torch.randn(D, I, generator=g, device=device).mul_(1.0 / math.sqrt(I))
    return gate_up, down


def make_activations(m, T, seed, set_index, device="cuda"):
    """x, dy [T, D] bf16 ~ N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed * 7919 + 104729 * T + set_index + 1)
    x = torch.randn(T, m["D"], generator=g, device=device).to(torch.bfloat16)
    dy = torch.randn(T, m["D"], generator=g, device=device).to(torch.bfloat16)
    return x, dy


def num_sets(T, D, l2):
    nbytes = T * D * 2
    if nbytes >= 3 * l2:
        return 1
    return max(3, min(64, -(-3 * l2 // nbytes)))


# ----------------------------------------------------------------------------- math

def act(h, kind):
    """h [M, 2I] -> [M, I] for the model's activation (any dtype)."""
    I = h.shape[-1] // 2
    if kind == "swiglu":
        return F.silu(h[..., :I]) * h[..., I:]
    if kind == "swiglu_oai":
        g = h[..., 0::2].clamp(max=7.0)
        u = h[..., 1::2].clamp(min=-7.0, max=7.0)
        return g * torch.sigmoid(1.702 * g) * (u + 1)
    raise ValueError(kind)


def torch_moe(x, ids, w, gate_up, down, kind):
    """The PyTorch MoE layer (see the module docstring)."""
    T, k = ids.shape
    E, D = gate_up.shape[0], x.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    x_perm = x.index_select(0, order // k)
    h = torch._grouped_mm(x_perm, gate_up.transpose(-2, -1), offs=offs)
    a = act(h, kind)
    o = torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    ok = o.index_select(0, inv).view(T, k, D)
    return torch.bmm(w.to(x.dtype).unsqueeze(1), ok).squeeze(1)


def reference(m, x, ids, w, gate_up, down, dy, e0):
    """float64 per-expert loop: y, dx, dw on the first REF_TOKENS tokens; d gate_up[e0],
    d down[e0] over all tokens routed to e0."""
    kind = m["act"]
    S = min(x.shape[0], REF_TOKENS)
    xs = x[:S].double().requires_grad_()
    ws = w[:S].double().requires_grad_()
    y = torch.zeros(S, x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids[:S]).tolist():
        rows, slots = (ids[:S] == e).nonzero(as_tuple=True)
        gu, dn = gate_up[e].double(), down[e].double()
        o = act(xs[rows] @ gu.t(), kind) @ dn.t()
        y = y.index_add(0, rows, o * ws[rows, slots].unsqueeze(1))
    dx, dw = torch.autograd.grad(y, [xs, ws], dy[:S].double())
    rows, slots = (ids == e0).nonzero(as_tuple=True)
    gu = gate_up[e0].double().requires_grad_()
    dn = down[e0].double().requires_grad_()
    o = (act(x[rows].double() @ gu.t(), kind) @ dn.t()) * w[rows, slots].double().unsqueeze(1)
    dgu, ddn = torch.autograd.grad(o, [gu, dn], dy[rows].double())
    return dict(y=y.detach(), dx=dx, dw=dw, dgate_up=dgu, ddown=ddn)


def rel_err(got, want):
    want = want.double()
    den = torch.linalg.vector_norm(want).item()
    num = torch.linalg.vector_norm(got.double() - want).item()
    return num / den if den > 0 else num


# ----------------------------------------------------------------------------- backends

class TorchMoE:
    """Backend interface used by run(): supports(), load(), routing(), forward(),
    grad_inputs(), unpack(), after_failure()."""

    name = "torch_moe"

    def supports(self, model, m):
        return True, ""

    def load(self, model, m, gate_up, down):
        self.m = m
        self.gate_up = gate_up.requires_grad_()
        self.down = down.requires_grad_()

    def routing(self, ids, w):
        """Backend form of the routing: (tuple of forward args, routing-weight leaf)."""
        wl = w.clone().requires_grad_()
        return (ids, wl), wl

    def forward(self, x, r):
        ids, wl = r
        return torch_moe(x, ids, wl, self.gate_up, self.down, self.m["act"])

    def params(self):
        return [self.gate_up, self.down]

    def unpack(self, grads, e0):
        dx, dw, dgu, ddn = grads
        return dict(dx=dx, dw=dw, dgate_up=dgu[e0], ddown=ddn[e0])

    def after_failure(self):
        pass

    def unload(self):
        self.gate_up = self.down = None


# ----------------------------------------------------------------------------- timing

def quartiles(xs):
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[2] - q[0]


def time_it(step, prepare, n_sets, warmup, samples):
    """step(set_index, prepared) is timed; prepare(set_index) runs untimed before it."""
    for i in range(warmup):
        s = i % n_sets
        step(s, prepare(s) if prepare else None)
    torch.cuda.synchronize()
    times = []
    for i in range(samples):
        s = (warmup + i) % n_sets
        p = None
        if prepare:
            p = prepare(s)
            torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        step(s, p)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
        del p
    return quartiles(times)


# ----------------------------------------------------------------------------- driver

def csv_list(s, allowed, conv=str):
    out = [conv(v) for v in s.split(",") if v.strip()]
    bad = [v for v in out if v not in allowed]
    if bad:
        raise SystemExit(f"unknown value(s) {bad}; choose from {allowed}")
    return out


def parser(desc=None):
    ap = argparse.ArgumentParser(description=desc or __doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for moe.jsonl (appended)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma list (default: all)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                    help="comma list of token counts (default: 1,32,128,8192,16384)")
    ap.add_argument("--passes", default=",".join(PASSES), help="comma list of fwd,bwd,fwdbwd")
    ap.add_argument("--routing-seed", type=int, default=0, help="seed of the routing draw")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights and activations")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="skip the float64 check (rel_err null)")
    return ap


def parse(ap, argv=None):
    args = ap.parse_args(argv)
    args.models = csv_list(args.models, list(MODELS))
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    if any(t < 1 for t in args.tokens):
        raise SystemExit("--tokens must be positive")
    args.passes = csv_list(args.passes, PASSES)
    if args.samples < 20:
        raise SystemExit("--samples must be >= 20")
    return args


def write_record(args, case, backend, gpu, med, iqr, tflops, err):
    rec = dict(suite="moe", case=case, backend=backend, gpu=gpu, median_us=med, iqr_us=iqr,
               tflops=tflops, rel_err=err,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
               commit=os.environ.get("MOEFUSE_COMMIT") or "unknown")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def run(backend, args):
    """Run every selected case for one backend. Returns the number of failed cases."""
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    failures = 0
    print(f"# backend {backend.name} on {gpu}, L2 {l2 >> 20} MiB, torch {torch.__version__}, "
          f"routing seed {args.routing_seed}, seed {args.seed}", flush=True)
    for model in args.models:
        m = MODELS[model]
        ok, why = backend.supports(model, m)
        if not ok:
            print(f"SKIP {model} ({backend.name}): {why}", flush=True)
            continue
        E, D, I, k = m["E"], m["D"], m["I"], m["k"]
        t0 = time.time()
        gate_up, down = make_weights(m, args.seed)
        backend.load(model, m, gate_up, down)
        print(f"# {model}: weights ready in {time.time() - t0:.1f} s", flush=True)
        for T in args.tokens:
            base = f"{model}-t{T}"
            try:
                n = num_sets(T, D, l2)
                sets = []
                for s in range(n):
                    ids, w = routing(T, E, k, args.routing_seed, s)
                    x, dy = make_activations(m, T, args.seed, s)
                    r, wl = backend.routing(ids, w)
                    sets.append(dict(ids=ids, w=w, x=x.requires_grad_(), dy=dy, r=r, wl=wl))
                errs = {"fwd": None, "bwd": None}
                if not args.no_check:
                    st = sets[0]
                    e0 = int(st["ids"][0, 0])
                    y = backend.forward(st["x"], st["r"])
                    grads = torch.autograd.grad(y, [st["x"], st["wl"]] + backend.params(), st["dy"])
                    got = dict(y=y.detach()[:REF_TOKENS], **backend.unpack(grads, e0))
                    got["dx"], got["dw"] = got["dx"][:REF_TOKENS], got["dw"][:REF_TOKENS]
                    del y, grads
                    want = reference(m, st["x"].detach(), st["ids"], st["w"], gate_up.detach(),
                                     down.detach(), st["dy"], e0)
                    each = {key: rel_err(got[key], want[key]) for key in want}
                    errs = {"fwd": each["y"], "bwd": max(each.values())}
                    print(f"# {base} check vs float64 (first {min(T, REF_TOKENS)} tokens; expert "
                          f"{e0} grads): " + " ".join(f"{kk} {v:.2e}" for kk, v in each.items()),
                          flush=True)
                    del got, want
            except Exception as exc:  # noqa: BLE001 -- report and go on with the next case
                failures += 1
                print(f"FAIL {base} ({backend.name}) setup/check: {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc()
                backend.after_failure()
                sets = None
                torch.cuda.empty_cache()
                continue

            def fwd(s, _):
                with torch.no_grad():
                    backend.forward(sets[s]["x"], sets[s]["r"])

            def fwd_graph(s):
                return backend.forward(sets[s]["x"], sets[s]["r"])

            def bwd(s, y):
                st = sets[s]
                torch.autograd.grad(y, [st["x"], st["wl"]] + backend.params(), st["dy"])

            def fwdbwd(s, _):
                bwd(s, fwd_graph(s))

            for p in args.passes:
                case = f"{base}-{p}"
                try:
                    step, prep = {"fwd": (fwd, None), "bwd": (bwd, fwd_graph),
                                  "fwdbwd": (fwdbwd, None)}[p]
                    med, iqr = time_it(step, prep, n, args.warmup, args.samples)
                except Exception as exc:  # noqa: BLE001
                    failures += 1
                    print(f"FAIL {case} ({backend.name}): {type(exc).__name__}: {exc}", flush=True)
                    traceback.print_exc()
                    backend.after_failure()
                    torch.cuda.empty_cache()
                    continue
                tflops = FLOP_MULT[p] * T * k * D * I / med / 1e6
                err = errs["fwd" if p == "fwd" else "bwd"]
                print(f"{case:<32} {backend.name:<10} {med:10.1f} us [IQR {iqr:7.1f}] "
                      f"{tflops:7.1f} TFLOP/s  rel err {err if err is None else f'{err:.2e}'}  "
                      f"({n} input sets)", flush=True)
                write_record(args, case, backend.name, gpu, med, iqr, tflops, err)
            del sets
            torch.cuda.empty_cache()
        backend.unload()
        del gate_up, down
        torch.cuda.empty_cache()
    return failures


def main():
    args = parse(parser())
    if not torch.cuda.is_available():
        raise SystemExit("torch_moe.py needs a CUDA GPU")
    failures = run(TorchMoE(), args)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
