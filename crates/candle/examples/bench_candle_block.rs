//! Benchmarks moefuse's candle op against the same MoE block written with candle's ops, on
//! the GPU (feature `cuda`): Qwen3-30B-A3B's block (hidden 2048, moe intermediate 768, 128
//! experts, top-8, renormalised), bf16 activations and experts, one set of block weights.
//!
//! ```text
//! CUDA_COMPUTE_CAP=90 cargo run --release -p moefuse-candle --features cuda \
//!     --example bench_candle_block -- [--tokens 8192[,4096...]] [--iters 20] [--warmup 5] [--out candle.jsonl]
//! # from the candle pack (`cargo xtask candle-pack`) on the H200, with python's nvidia/*/lib on
//! # LD_LIBRARY_PATH (as run.sh sets it):
//! tar -xJf .device-pack-candle/candle.tar.xz -C /tmp && /tmp/bench_candle_block --out "$OUT"
//! ```
//!
//! 1. Config: [`qwen3_moe_config`]`(2048, 768, 128, 8, true)`; `T` from `--tokens` (8192).
//! 2. Weights: a random [`MoeBlock`] (router f32 Var, experts one flat bf16 Var), shared by
//!    both backends: `moefuse` (`block.forward(x)`, the op) and `candle_ops`
//!    ([`candle_ops::forward`] on the block's router logits and flat Var).
//! 3. Inputs: `INPUTS` random bf16 `x [T, 2048]` Vars (and one f32 target), cycled per
//!    iteration so no two consecutive calls read the same activations.
//! 4. Verify: forward `y` of moefuse against candle_ops on the first input; ‖Δ‖₂/‖y_ref‖₂
//!    (the tests' `rel_err`) is the moefuse rows' `rel_err` (the max-abs ratio is printed
//!    too); above `REL` the run still times and writes its rows, then exits 1.
//! 5. Time: cases `fwd` (forward) and `fwd_bwd` (forward, then `backward()` of
//!    `sum(f32(y) ⊙ target)`), the two backends interleaved sample by sample, each call
//!    between two CUDA events recorded on candle's stream (the host synchronisations inside
//!    candle_ops' routing count as its time); `--warmup` calls of each first, untimed;
//!    median and IQR (p75 − p25) of `--iters` samples.
//! 6. Report: a table, the moefuse/candle_ops speedup per case, and one JSON line per
//!    backend × case appended to `--out` (a file, or a folder that gets `candle.jsonl`):
//!    `suite, case, backend, gpu, median_us, iqr_us, tflops, rel_err, date, commit`.
//!    TFLOP/s count the experts' three GEMMs: `6·T·k·H·I` forward, 3× that for fwd_bwd.
//!
//! Exits 0 with `SKIPPED bench_candle_block: <reason>` without a usable GPU. `gpu` is the
//! driver's device name (else `MOEFUSE_GPU_NAME`, else `unknown`); `commit` is
//! `MOEFUSE_COMMIT` (else `unknown`).
//!
//! NOTES: `block.forward` on Vars records the op for candle's backward, so the moefuse
//! `fwd` case runs the layer in Training mode (it keeps the state its backward reads), as
//! in a training step's forward; an inference-only forward would be somewhat cheaper.

use candle::{DType, Device, Module, Tensor, Var};
use moefuse::cudarc::driver::sys::CUevent_flags;
use moefuse::cudarc::driver::CudaStream;
use moefuse_candle::{candle_ops, qwen3_moe_config, FlatLayout, MoeBlock};
use moefuse_testkit::{rel_err, within, Stats};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

// Config: Qwen3-30B-A3B's MoE block.
const HIDDEN: usize = 2048;
const MOE_INTERMEDIATE: usize = 768;
const EXPERTS: usize = 128;
const TOP_K: usize = 8;
const DEFAULT_TOKENS: usize = 8192;
/// Random inputs cycled through per iteration.
const INPUTS: usize = 4;
/// Verification bound on the forward's relative error (bf16), as in the GPU tests.
const REL: f64 = 2e-2;
const SEED: u64 = 20_261_203;
const NAME: &str = "bench_candle_block";
const USAGE: &str =
    "usage: bench_candle_block [--tokens T[,T...]] [--iters N] [--warmup N] [--out PATH]";

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Command-line flags.
struct Args {
    tokens: Vec<usize>,
    iters: usize,
    warmup: usize,
    out: PathBuf,
}

/// The flags (`--flag value` or `--flag=value`); `None` for `--help`.
fn parse_args(args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut a = Args {
        tokens: Vec::new(),
        iters: 20,
        warmup: 5,
        out: PathBuf::from("candle.jsonl"),
    };
    let mut it = args;
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (arg, None),
        };
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        let value = match inline {
            Some(v) => v,
            None => it.next().ok_or(format!("{flag} needs a value"))?,
        };
        let count = |v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("{flag}: `{v}` is not a count"))
        };
        match flag.as_str() {
            "--tokens" => {
                for t in value.split(',').filter(|t| !t.trim().is_empty()) {
                    a.tokens.push(count(t)?);
                }
            }
            "--iters" => a.iters = count(&value)?,
            "--warmup" => a.warmup = count(&value)?,
            "--out" => a.out = PathBuf::from(value),
            other => return Err(format!("unknown flag `{other}`")),
        }
    }
    if a.tokens.is_empty() {
        a.tokens.push(DEFAULT_TOKENS);
    }
    if a.iters == 0 || a.tokens.contains(&0) {
        return Err("--iters and every --tokens value must be at least 1".into());
    }
    if a.out.is_dir() {
        a.out.push("candle.jsonl");
    }
    Ok(Some(a))
}

/// GPU 0, or why there is none usable.
fn open_gpu() -> Result<Device, String> {
    // NOTES: a missing driver may panic inside cudarc; treat it as "no GPU".
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let dev = std::panic::catch_unwind(|| Device::new_cuda(0));
    std::panic::set_hook(hook);
    let dev = match dev {
        Ok(Ok(dev)) => dev,
        Ok(Err(err)) => return Err(format!("no CUDA device ({err})")),
        Err(_) => return Err("no CUDA driver could be loaded".into()),
    };
    let cap = stream(&dev)
        .and_then(|s| Ok(s.context().compute_capability()?))
        .map_err(|err| format!("compute capability unknown ({err})"))?;
    match cap.0 {
        9 | 10 => Ok(dev),
        _ => Err(format!(
            "compute capability {}.{}: moefuse's kernels need 9.0 (Hopper) or 10.0 (Blackwell)",
            cap.0, cap.1
        )),
    }
}

/// candle's CUDA stream of `dev` (the one the op and candle's kernels run on).
fn stream(dev: &Device) -> Res<Arc<CudaStream>> {
    Ok(dev.as_cuda_device()?.cuda_stream())
}

/// The two timed cases.
#[derive(Clone, Copy, PartialEq)]
enum Case {
    Fwd,
    FwdBwd,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Fwd => "fwd",
            Case::FwdBwd => "fwd_bwd",
        }
    }

    /// Useful FLOPs: the experts' gate, up and down GEMMs (`2·T·k·H·I` each) forward,
    /// three times that with the backward (dgrad and wgrad).
    fn flops(self, tokens: usize) -> f64 {
        let fwd = 6.0 * (tokens * TOP_K) as f64 * (HIDDEN * MOE_INTERMEDIATE) as f64;
        match self {
            Case::Fwd => fwd,
            Case::FwdBwd => 3.0 * fwd,
        }
    }
}

/// A backend: `y` of `x` on the block.
type Forward<'a> = &'a dyn Fn(&Tensor) -> Res<Tensor>;

/// One call of `case`: the forward, and for `FwdBwd` the backward of `sum(f32(y) ⊙ target)`.
fn step(case: Case, f: Forward<'_>, x: &Tensor, target: &Tensor) -> Res<()> {
    let y = f(x)?;
    if case == Case::FwdBwd {
        let loss = (y.to_dtype(DType::F32)? * target)?.sum_all()?;
        let grads = loss.backward()?;
        drop(grads);
    }
    Ok(())
}

/// `warmup` calls of each backend, then `iters` samples of each, interleaved (one call of
/// each in turn), each between two events on `stream`; inputs rotate per call.
fn time_interleaved(
    stream: &Arc<CudaStream>,
    case: Case,
    backends: &[Forward<'_>],
    inputs: &[Var],
    target: &Tensor,
    warmup: usize,
    iters: usize,
) -> Res<Vec<Stats>> {
    for f in backends {
        for i in 0..warmup {
            step(case, *f, inputs[i % inputs.len()].as_tensor(), target)?;
        }
    }
    stream.synchronize()?;
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut us = vec![Vec::with_capacity(iters); backends.len()];
    for s in 0..iters {
        let x = inputs[(warmup + s) % inputs.len()].as_tensor();
        for (f, times) in backends.iter().zip(us.iter_mut()) {
            let start = stream.record_event(timing)?;
            step(case, *f, x, target)?;
            let end = stream.record_event(timing)?;
            end.synchronize()?;
            times.push(f64::from(start.elapsed_ms(&end)?) * 1e3);
        }
    }
    Ok(us.into_iter().map(Stats::from_samples).collect())
}

/// A random block of Qwen3-30B-A3B's shape on `dev`: router f32 in ±0.2, experts bf16
/// in ±0.05 (the GPU tests' scales).
fn random_block(dev: &Device) -> Res<MoeBlock> {
    let cfg = qwen3_moe_config(HIDDEN, MOE_INTERMEDIATE, EXPERTS, TOP_K, true)?;
    let router = Tensor::rand(-0.2f32, 0.2, (EXPERTS, HIDDEN), dev)?;
    let experts = Tensor::rand(-0.05f32, 0.05, FlatLayout::new(&cfg).len(), dev)?;
    let experts = experts.to_dtype(DType::BF16)?;
    Ok(MoeBlock::new(
        cfg,
        Var::from_tensor(&router)?,
        Var::from_tensor(&experts)?,
    )?)
}

/// The candle-ops block on the same Vars.
fn reference(block: &MoeBlock, x: &Tensor) -> Res<Tensor> {
    let logits = block.router_logits(x)?;
    Ok(candle_ops::forward(
        block.config(),
        x,
        &logits,
        block.experts().as_tensor(),
    )?)
}

/// `(‖got − want‖₂ / ‖want‖₂, max|got − want| / max|want|)` on the host, in f32.
fn errors(got: &Tensor, want: &Tensor) -> Res<(f64, f64)> {
    let host = |t: &Tensor| -> Res<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (g, w) = (host(got)?, host(want)?);
    let max_diff = g
        .iter()
        .zip(&w)
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, |m: f64, d| {
            if m.is_nan() || d.is_nan() {
                f64::NAN
            } else {
                m.max(d)
            }
        });
    let max_ref = w.iter().map(|v| f64::from(v.abs())).fold(0.0, f64::max);
    Ok((rel_err(&g, &w), max_diff / max_ref))
}

/// One result row (one JSON line).
struct Row {
    case: String,
    backend: &'static str,
    stats: Stats,
    tflops: f64,
    rel_err: Option<f64>,
}

fn main() {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return;
        }
        Err(why) => {
            eprintln!("{NAME}: {why}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let dev = match open_gpu() {
        Ok(dev) => dev,
        Err(why) => {
            println!("SKIPPED {NAME}: {why}");
            return;
        }
    };
    match run(&args, &dev) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(err) => {
            eprintln!("{NAME}: {err}");
            std::process::exit(1);
        }
    }
}

/// The whole benchmark; `Ok(false)` when a verification failed (rows are still written).
fn run(args: &Args, dev: &Device) -> Res<bool> {
    let stream = stream(dev)?;
    let gpu = stream
        .context()
        .name()
        .ok()
        .or_else(|| std::env::var("MOEFUSE_GPU_NAME").ok())
        .unwrap_or_else(|| "unknown".into());
    println!(
        "{NAME}: {gpu}; Qwen3-30B-A3B block (hidden {HIDDEN}, moe intermediate \
         {MOE_INTERMEDIATE}, {EXPERTS} experts, top-{TOP_K}, renormalised), bf16; tokens \
         {:?}; {} warm-up + {} timed calls per backend and case (CUDA events on candle's \
         stream), {INPUTS} rotating inputs",
        args.tokens, args.warmup, args.iters
    );
    dev.set_seed(SEED)?;
    let block = random_block(dev)?;
    let ours = |x: &Tensor| -> Res<Tensor> { Ok(block.forward(x)?) };
    let theirs = |x: &Tensor| reference(&block, x);
    let backends: [(&'static str, Forward<'_>); 2] = [("moefuse", &ours), ("candle_ops", &theirs)];
    let forwards: Vec<Forward<'_>> = backends.iter().map(|(_, f)| *f).collect();

    let mut rows = Vec::new();
    let mut ok = true;
    for &t in &args.tokens {
        let inputs = (0..INPUTS)
            .map(|_| {
                let x = Tensor::rand(-1f32, 1.0, (t, HIDDEN), dev)?.to_dtype(DType::BF16)?;
                Ok(Var::from_tensor(&x)?)
            })
            .collect::<Res<Vec<Var>>>()?;
        let target = Tensor::rand(-1f32, 1.0, (t, HIDDEN), dev)?;

        // Verify once, before timing.
        let x0 = inputs[0].as_tensor();
        let (rel, max_rel) = errors(&ours(x0)?, &theirs(x0)?)?;
        let verdict = if within(rel, REL) { "ok" } else { "FAILED" };
        println!(
            "T={t}: verify moefuse vs candle_ops forward y: rel err {rel:.3e} (bound {REL:e}) \
             {verdict}; max-abs ratio {max_rel:.3e}"
        );
        ok &= within(rel, REL);

        for case in [Case::Fwd, Case::FwdBwd] {
            let stats = time_interleaved(
                &stream,
                case,
                &forwards,
                &inputs,
                &target,
                args.warmup,
                args.iters,
            )?;
            for (&(backend, _), stats) in backends.iter().zip(stats) {
                rows.push(Row {
                    case: format!("qwen3-30b-a3b-T{t}-{}", case.name()),
                    backend,
                    tflops: case.flops(t) / (stats.median_us * 1e-6) / 1e12,
                    stats,
                    rel_err: (backend == "moefuse").then_some(rel),
                });
            }
        }
    }

    print_table(&rows);
    write_jsonl(args, &rows, &gpu)?;
    Ok(ok)
}

/// The table and the speedups.
fn print_table(rows: &[Row]) {
    println!(
        "\n{:<30} {:<11} {:>12} {:>10} {:>9} {:>10}",
        "case", "backend", "median_us", "iqr_us", "TFLOP/s", "rel_err"
    );
    for r in rows {
        let rel = r.rel_err.map_or("-".into(), |e| format!("{e:.2e}"));
        println!(
            "{:<30} {:<11} {:>12.1} {:>10.1} {:>9.1} {:>10}",
            r.case, r.backend, r.stats.median_us, r.stats.iqr_us, r.tflops, rel
        );
    }
    println!();
    for r in rows.iter().filter(|r| r.backend == "moefuse") {
        let base = rows
            .iter()
            .find(|b| b.case == r.case && b.backend == "candle_ops");
        if let Some(b) = base {
            println!(
                "speedup moefuse vs candle_ops, {}: {:.2}x",
                r.case,
                b.stats.median_us / r.stats.median_us
            );
        }
    }
}

/// Appends one JSON line per row to `args.out`.
fn write_jsonl(args: &Args, rows: &[Row], gpu: &str) -> Res<()> {
    let (date, commit) = (
        moefuse_testkit::today(),
        std::env::var("MOEFUSE_COMMIT").unwrap_or_else(|_| "unknown".into()),
    );
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.out)
        .map_err(|e| format!("{}: {e}", args.out.display()))?;
    for r in rows {
        writeln!(
            f,
            "{{\"suite\":\"candle\",\"case\":{},\"backend\":{},\"gpu\":{},\"median_us\":{},\
             \"iqr_us\":{},\"tflops\":{},\"rel_err\":{},\"date\":{},\"commit\":{}}}",
            json_str(&r.case),
            json_str(r.backend),
            json_str(gpu),
            json_num(Some(r.stats.median_us)),
            json_num(Some(r.stats.iqr_us)),
            json_num(Some(r.tflops)),
            json_num(r.rel_err),
            json_str(&date),
            json_str(&commit),
        )?;
    }
    println!(
        "{NAME}: {} rows appended to {}",
        rows.len(),
        args.out.display()
    );
    Ok(())
}

/// A JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON number, `null` for none or a non-finite value (JSON has no NaN).
fn json_num(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v}"),
        _ => "null".into(),
    }
}
