#!/usr/bin/env python3
"""LigerMoE baseline for the MoE-layer suite (`moe`): LinkedIn's fused expert-parallel MoE
(liger-cute-kernels 0.8.5 native core, liger-kernel 0.8.5 autograd front end) at EP=1.

    benches/ligermoe/setup.sh                       # once per GPU machine (unpacks .ligermoe/)
    python3 benches/ligermoe_moe.py --out DIR [--models qwen3-30b-a3b,...] [--tokens ...]
        [--passes fwd,bwd,fwdbwd] [--routing-seed 0] [--seed 0] [--samples 30]

Same cases, inputs, routing, float64 check, timing and JSON lines as benches/torch_moe.py
(imported from it; read its docstring), backend "ligermoe", appended to DIR/moe.jsonl.
The script re-executes itself once through `source $LIGERMOE_ROOT/env.sh` (default
/tmp/ligermoe, written by setup.sh): PYTHONPATH, LD_LIBRARY_PATH (libcudart.so.12),
LD_PRELOAD of NVSHMEM 3.6.5's libnvshmem_host.so.3 + nvshmem_bootstrap_uid.so.3 (so that they,
not torch's NVSHMEM 3.4.5, own the libnvshmem_host.so.3 soname), NVSHMEM_REMOTE_TRANSPORT=none,
NVSHMEM_DISABLE_NVLS=1.  With several --models it runs one child process per model (a sticky
CUDA error or an NVSHMEM abort then costs one model, and each process configures LigerMoE for
its own model only).

The LigerMoE call (read from the 0.8.5 wheels' Python sources):
  torch.distributed.init_process_group("nccl", world_size=1)          # bootstrap for NVSHMEM
  liger_cute_kernels.configure(device=cuda:0, moe=MoEConfig(max_tokens=max T,
      hidden_size=D, num_experts=E, top_k=k, num_hosts=1, gpus_per_host=1))  # once
  y = liger_kernel.ops.cute.ops.moe.moe_fused(X [T,D] bf16, topk_ids [T,k] int32,
      topk_weights [T,k] bf16, gate [E,I,D] bf16, up [E,I,D] bf16, down [E,D,I] bf16,
      E, k, pg=None)
  - autograd: LigerExpertParallelFusedMoEFunction; backward returns dX, d topk_weights (bf16),
    d gate, d up, d down (none for the ids); forward with grad keeps its buffers on a symmetric
    stack (max_inflight=1) until backward pops it.  Under torch.no_grad() (our fwd cases) it
    runs the same forward kernel and pops immediately.
  - activation: SwiGLU silu(gate)*up only (no activation argument, no bias, no clamp), so
    gpt-oss-120b (SwiGLU-OAI, interleaved gate/up) is skipped with a printed reason.
  - gate/up come from the same gate_up [E,2I,D] as torch_moe (rows [0,I) and [I,2I), copied
    contiguous: the grad path rejects strided gate/up); topk weights are the fp32 softmax
    weights rounded to bf16 (the only dtype it accepts), the reference keeps fp32.
"""
import os, subprocess, sys, traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("LIGERMOE_ROOT", "/tmp/ligermoe")
PRELOAD = [f"{ROOT}/lib/libnvshmem_host.so.3", f"{ROOT}/lib/nvshmem_bootstrap_uid.so.3"]


def ensure_env():
    """Re-exec through `source $LIGERMOE_ROOT/env.sh` unless that environment is in place."""
    if os.environ.get("LIGERMOE_ENV_OK") == "1":
        return
    env_sh = f"{ROOT}/env.sh"
    if not os.path.isfile(env_sh) or not all(os.path.isfile(p) for p in PRELOAD):
        print(f"SKIP ligermoe: {ROOT} is not set up (run benches/ligermoe/setup.sh; it needs the "
              f".ligermoe/ carry folder made by benches/ligermoe/fetch.sh)", flush=True)
        sys.exit(3)
    os.execvp("bash", ["bash", "-c", 'source "$0" && exec "$@"', env_sh,
                       sys.executable, os.path.abspath(__file__)] + sys.argv[1:])


def main():
    sys.path.insert(0, HERE)
    import torch_moe as tm  # noqa: E402  (argument parsing needs no GPU)

    ap = tm.parser("LigerMoE (liger-cute-kernels 0.8.5) baseline for the moe suite")
    ap.add_argument("--single", action="store_true", help=__import__("argparse").SUPPRESS)
    args = tm.parse(ap)

    if len(args.models) > 1 and not args.single:
        # One process per model; the children inherit this (already set up) environment.
        rc = 0
        argv = sys.argv[1:]
        for model in args.models:
            child = [sys.executable, os.path.abspath(__file__)] + strip_models(argv) + ["--models", model, "--single"]
            r = subprocess.run(child).returncode
            if r not in (0, 3):
                print(f"FAIL ligermoe {model}: child exited with {r}", flush=True)
                rc = 1
        sys.exit(rc)

    import torch
    import torch.distributed as dist

    supported = [m for m in args.models if tm.MODELS[m]["act"] == "swiglu"]
    for m in args.models:
        if m not in supported:
            print(f"SKIP {m} (ligermoe): LigerMoE 0.8.5 computes SwiGLU silu(gate)*up only (no "
                  f"activation choice, clamp, alpha or interleaved gate/up); {m} uses "
                  f"{tm.MODELS[m]['act']}", flush=True)
    if not supported:
        sys.exit(0)
    args.models = supported
    if not torch.cuda.is_available():
        raise SystemExit("ligermoe_moe.py needs a CUDA GPU")

    torch.cuda.set_device(0)
    import liger_cute_kernels
    from liger_cute_kernels import MoEConfig
    from liger_cute_kernels import tvm_ffi as lck_ffi
    try:
        from liger_kernel.ops.cute.ops.moe import moe_fused
    except ImportError as exc:
        # liger_kernel/__init__ imports its Triton ops; fall back to the op module alone.
        print(f"# liger_kernel import failed ({exc}); loading ops/cute/ops/moe.py directly", flush=True)
        moe_fused = load_moe_module_directly(lck_ffi)

    port = free_port()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    sel = [tm.MODELS[m] for m in supported]
    cfg = MoEConfig(max_tokens=max(args.tokens), hidden_size=max(m["D"] for m in sel),
                    num_experts=max(m["E"] for m in sel), top_k=max(m["k"] for m in sel),
                    num_hosts=1, gpus_per_host=1)
    try:
        liger_cute_kernels.configure(device=torch.device("cuda", 0), moe=cfg)
    except Exception:
        print("# liger_cute_kernels.configure failed; if the message mentions nvshmem_malloc, raise "
              "the NVSHMEM heap, e.g. NVSHMEM_SYMMETRIC_SIZE=16G (current: "
              f"{os.environ.get('NVSHMEM_SYMMETRIC_SIZE', 'unset')})", flush=True)
        raise
    team = lck_ffi.team_world()
    print(f"# liger_cute_kernels configured: {cfg}; NVSHMEM team {team}", flush=True)

    class LigerMoE(tm.TorchMoE):
        name = "ligermoe"

        def supports(self, model, m):
            return model in supported, "not SwiGLU"

        def load(self, model, m, gate_up, down):
            I = m["I"]
            self.m = m
            with torch.no_grad():
                self.gate = gate_up[:, :I].contiguous().requires_grad_()
                self.up = gate_up[:, I:].contiguous().requires_grad_()
                self.dn = down.contiguous().requires_grad_()

        def routing(self, ids, w):
            wl = w.to(torch.bfloat16).requires_grad_()
            return (ids.to(torch.int32).contiguous(), wl), wl

        def forward(self, x, r):
            ids32, wl = r
            return moe_fused(x, ids32, wl, self.gate, self.up, self.dn, self.m["E"], self.m["k"], None)

        def params(self):
            return [self.gate, self.up, self.dn]

        def unpack(self, grads, e0):
            dx, dw, dg, du, dd = grads
            return dict(dx=dx, dw=dw, dgate_up=torch.cat([dg[e0], du[e0]], 0), ddown=dd[e0])

        def after_failure(self):
            # A failed forward-with-grad or backward may leave its buffers on the symmetric
            # stack (max_inflight=1); pop so that the next case can run.
            try:
                lck_ffi.moe_pop_fwd(team)
            except Exception as exc:  # noqa: BLE001
                print(f"# moe_pop_fwd after failure: {exc}", flush=True)

        def unload(self):
            self.gate = self.up = self.dn = None

    failures = tm.run(LigerMoE(), args)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    # NVSHMEM finalize is left to process exit (liger_cute_kernels.nvshmem.finalize() tears
    # down all configured contexts; nothing else runs after this point).
    sys.exit(1 if failures else 0)


def strip_models(argv):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--models":
            skip = True
            continue
        if a.startswith("--models="):
            continue
        out.append(a)
    return out


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_moe_module_directly(lck_ffi):
    import importlib.util, types
    spec = importlib.util.find_spec("liger_kernel")
    base = os.path.dirname(spec.origin) if spec and spec.origin else None
    if base is None:
        for p in sys.path:
            if os.path.isdir(os.path.join(p, "liger_kernel")):
                base = os.path.join(p, "liger_kernel")
                break
    path = os.path.join(base, "ops", "cute", "ops", "moe.py")
    for name in ("liger_kernel", "liger_kernel.ops", "liger_kernel.ops.cute"):
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod
    sys.modules["liger_kernel.ops.cute"]._load_tvm_ffi = lambda: lck_ffi
    spec = importlib.util.spec_from_file_location("liger_kernel.ops.cute.ops.moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.moe_fused


if __name__ == "__main__":
    if "-h" not in sys.argv and "--help" not in sys.argv:
        ensure_env()
    try:
        main()
    except SystemExit:
        raise
    except Exception:
        traceback.print_exc()
        sys.exit(1)
