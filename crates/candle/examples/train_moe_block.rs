//! Trains a small Qwen3-MoE-shaped block through moefuse's candle op.
//!
//! ```text
//! cargo run -p moefuse-candle --example train_moe_block                    # CPU (reference op, f32)
//! CUDA_COMPUTE_CAP=90 cargo run --release -p moefuse-candle --features cuda --example train_moe_block   # GPU (bf16)
//! ```
//!
//! 1. Writes a safetensors file with Hugging Face Qwen3-MoE names and random weights
//!    (`model.layers.0.mlp.gate.weight`, `….mlp.experts.{e}.{gate,up,down}_proj.weight`).
//! 2. Loads it with `load_qwen3_moe` through candle-nn's `VarBuilder` (router f32 Var,
//!    experts one flat Var: bf16 on the GPU, f32 on the CPU).
//! 3. Verifies one forward against the same block written with candle ops.
//! 4. Trains `STEPS` AdamW steps towards a fixed linear target and prints the loss (and time)
//!    of each; exits non-zero if the loss did not fall.
//!
//! Runs on the GPU when built with `--features cuda` and a GPU is present, else on the CPU,
//! and says which.

use candle::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder};
use moefuse_candle::{candle_ops, load_qwen3_moe, qwen3_moe_config, HfNaming};
use std::collections::HashMap;
use std::time::Instant;

// Config: a Qwen3-MoE block scaled down (Qwen3-30B-A3B: 2048, 768, 128, 8).
const HIDDEN: usize = 256;
const MOE_INTERMEDIATE: usize = 128;
const EXPERTS: usize = 16;
const TOP_K: usize = 4;
/// Tokens per step on the GPU, and on the CPU (the f32 reference is slow).
const TOKENS_GPU: usize = 4096;
const TOKENS_CPU: usize = 128;
const STEPS: usize = 8;
const LAYER: &str = "model.layers.0";

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The GPU when a device answers, else the CPU; and a sentence saying which and why.
#[cfg(feature = "cuda")]
fn pick_device() -> (Device, String) {
    // NOTES: a missing driver may panic inside cudarc; treat it as "no GPU".
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let dev = std::panic::catch_unwind(|| Device::new_cuda(0));
    std::panic::set_hook(hook);
    match dev {
        Ok(Ok(dev)) => (dev, "GPU 0 (moefuse's fused layer, bf16)".into()),
        Ok(Err(err)) => (Device::Cpu, format!("CPU (no CUDA device: {err})")),
        Err(_) => (Device::Cpu, "CPU (no CUDA driver could be loaded)".into()),
    }
}

/// The CPU: this build has no GPU path.
#[cfg(not(feature = "cuda"))]
fn pick_device() -> (Device, String) {
    let why = "CPU (built without `--features cuda`: moefuse's f32 reference op)";
    (Device::Cpu, why.into())
}

/// Random Hugging Face Qwen3-MoE tensors for one layer, written to `path`.
fn write_checkpoint(path: &std::path::Path) -> Res<()> {
    let (d, i, cpu) = (HIDDEN, MOE_INTERMEDIATE, Device::Cpu);
    let mut map = HashMap::new();
    let naming = HfNaming::Qwen3Moe;
    map.insert(
        naming.router(LAYER),
        Tensor::randn(0f32, 0.1, (EXPERTS, d), &cpu)?,
    );
    let scale = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    for e in 0..EXPERTS {
        let [gate, up, down] = naming.expert(LAYER, e);
        map.insert(gate, Tensor::randn(0f32, scale(d), (i, d), &cpu)?);
        map.insert(up, Tensor::randn(0f32, scale(d), (i, d), &cpu)?);
        map.insert(down, Tensor::randn(0f32, scale(i), (d, i), &cpu)?);
    }
    candle::safetensors::save(&map, path)?;
    Ok(())
}

fn main() -> Res<()> {
    let (dev, which) = pick_device();
    let (dtype, tokens) = match dev.is_cuda() {
        true => (DType::BF16, TOKENS_GPU),
        false => (DType::F32, TOKENS_CPU),
    };
    println!("train_moe_block: running on {which}");
    println!(
        "config: hidden {HIDDEN}, moe_intermediate {MOE_INTERMEDIATE}, experts {EXPERTS}, \
         top_k {TOP_K} (norm_topk_prob), tokens {tokens}, experts dtype {dtype:?}"
    );

    // 1-2. Write a checkpoint with HF names, load it into the flat layout.
    let path = std::env::temp_dir().join(format!(
        "moefuse-qwen3-moe-{}.safetensors",
        std::process::id()
    ));
    write_checkpoint(&path)?;
    let vb = VarBuilder::from_tensors(candle::safetensors::load(&path, &dev)?, dtype, &dev);
    let cfg = qwen3_moe_config(HIDDEN, MOE_INTERMEDIATE, EXPERTS, TOP_K, true)?;
    let block = load_qwen3_moe(&vb, &cfg, LAYER)?;
    std::fs::remove_file(&path)?;
    println!("loaded {} from {}", LAYER, path.display());

    // 3. Verify once against the candle-ops block.
    let x = Tensor::randn(0f32, 1.0, (tokens, HIDDEN), &dev)?.to_dtype(dtype)?;
    let y = block.forward(&x)?;
    let logits = block.router_logits(&x)?;
    let y_ref = candle_ops::forward(&cfg, &x, &logits, block.experts().as_tensor())?;
    let diff = (y.to_dtype(DType::F32)? - y_ref.to_dtype(DType::F32)?)?
        .sqr()?
        .sum_all()?;
    let norm = y_ref.to_dtype(DType::F32)?.sqr()?.sum_all()?;
    let rel = (diff.to_scalar::<f32>()? / norm.to_scalar::<f32>()?).sqrt();
    let bound = if dtype == DType::BF16 { 2e-2 } else { 1e-4 };
    println!("verify: op vs candle-ops block, rel err {rel:.2e} (bound {bound:e})");
    if rel.partial_cmp(&bound) != Some(std::cmp::Ordering::Less) {
        return Err(format!("verification failed: rel err {rel:e}").into());
    }

    // 4. Train towards a fixed linear map of x.
    let map = (Tensor::randn(0f32, 1.0, (HIDDEN, HIDDEN), &dev)? / (HIDDEN as f64).sqrt())?;
    let target = (x.to_dtype(DType::F32)?.matmul(&map)? * 0.1)?;
    let params = ParamsAdamW {
        lr: 2e-3,
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut opt = AdamW::new(block.vars(), params)?;
    let mut losses = Vec::with_capacity(STEPS);
    for step in 0..STEPS {
        let start = Instant::now();
        let y = block.forward(&x)?.to_dtype(DType::F32)?;
        let loss = (y - &target)?.sqr()?.mean_all()?;
        opt.backward_step(&loss)?;
        let value = loss.to_scalar::<f32>()?; // synchronises
        println!(
            "step {step}: loss {value:.6} ({:.1} ms)",
            start.elapsed().as_secs_f64() * 1e3
        );
        losses.push(value);
    }
    let (first, last) = (losses[0], losses[STEPS - 1]);
    if last.partial_cmp(&first) != Some(std::cmp::Ordering::Less) {
        return Err(format!("the loss did not fall: {losses:?}").into());
    }
    println!("loss fell from {first:.6} to {last:.6} in {STEPS} steps on {which}");
    Ok(())
}
