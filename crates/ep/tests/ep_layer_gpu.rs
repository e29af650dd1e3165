//! GPU tests of the expert-parallel layer's forward and backward (dx, d_topk_weights and the
//! local experts' weight gradients) against the CPU reference of the whole (single-GPU)
//! layer: at 1 PE in this process, and at 2 and 4 PEs on one GPU through the
//! launcher (this binary relaunched once per rank). Every rank builds the same global
//! problem from one seed (tokens of every rank, all experts' weights), runs its own tokens
//! with its own experts' weights, and compares its output rows with the reference's rows of
//! the same tokens. Ragged token counts per rank, one rank that sends nothing, odd routing
//! (every token of one rank on one owner's experts). From two ranks on, an Inference layer
//! with rows pulled in place is checked against the reference and, bit for bit, against the
//! same layer with rows copied. Without a GPU every test prints SKIPPED.

#![forbid(unsafe_code)]

mod common;

use common::e;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use moefuse::gpu::Mode;
use moefuse::model::MoeWeights;
use moefuse::reference::{backward, forward, RoutingInput};
use moefuse::{MoeConfig, RouterKind};
use moefuse_comm::Runtime;
use moefuse_ep::{EpMoeLayer, EpRouting, LocalWeights, RowDelivery};
use moefuse_testkit::{check_close, GpuSuite, Rng, POISON_BF16};
use std::sync::Arc;

/// The layer every test runs: 16 experts of D 256, I 128, top-4 (E divisible by 1, 2, 4).
fn config() -> MoeConfig {
    MoeConfig::new(256, 128, 16, 4).with_router(RouterKind::External)
}

/// Tokens of each rank in a world of `ranks` (rank 1 sends nothing when there are 2+).
fn tokens_of(ranks: usize) -> Vec<usize> {
    [37, 0, 64, 5]
        .iter()
        .copied()
        .take(ranks)
        .map(|t| if ranks == 1 { 53 } else { t })
        .collect()
}

/// The global problem of one seed: bf16-exact weights and inputs (f32 copies for the
/// reference), and each token's routing. Rank 2's tokens all pick the experts of rank 0.
struct Problem {
    weights: MoeWeights,
    x: Vec<f32>,
    ids: Vec<i32>,
    topk_w: Vec<f32>,
}

fn problem(cfg: &MoeConfig, tokens: &[usize], seed: u64) -> Problem {
    let mut rng = Rng::new(seed);
    let round = |v: f32| bf16::from_f32(v).to_f32();
    let mut weights = MoeWeights::zeros(cfg, false);
    for v in weights.gate_up.iter_mut() {
        *v = round(0.2 * rng.uniform());
    }
    for v in weights.down.iter_mut() {
        *v = round(0.2 * rng.uniform());
    }
    let total: usize = tokens.iter().sum();
    let x = (0..total * cfg.hidden)
        .map(|_| round(rng.uniform()))
        .collect();
    let (e, k) = (cfg.experts, cfg.top_k);
    let (mut ids, mut topk_w) = (Vec::new(), Vec::new());
    let per_rank = e / tokens.len();
    for (r, &t) in tokens.iter().enumerate() {
        for _ in 0..t {
            let chosen = if r == 2 && per_rank >= k {
                rng.distinct(per_rank, k) // rank 0's experts only
            } else {
                rng.distinct(e, k)
            };
            let raw: Vec<f32> = (0..k).map(|_| 0.1 + rng.uniform().abs()).collect();
            let sum: f32 = raw.iter().sum();
            ids.extend(chosen);
            topk_w.extend(raw.iter().map(|w| w / sum));
        }
    }
    Problem {
        weights,
        x,
        ids,
        topk_w,
    }
}

/// This rank's Training forward and backward against the reference's rows of its tokens,
/// with the rows delivered by `delivery` (from two ranks on).
fn check_rank(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    seed: u64,
    delivery: RowDelivery,
) -> Result<f64, String> {
    let cfg = config();
    let (ranks, rank) = (rt.ranks(), rt.rank());
    let tokens = tokens_of(ranks);
    let p = problem(&cfg, &tokens, seed);
    let (d, i, w, k) = (cfg.hidden, cfg.intermediate, cfg.gate_up_width(), cfg.top_k);
    let total: usize = tokens.iter().sum();
    let want = forward(
        &cfg,
        &p.weights,
        &p.x,
        RoutingInput::External {
            topk_ids: &p.ids,
            topk_weights: &p.topk_w,
        },
    )
    .map_err(e)?;
    let first: usize = tokens[..rank].iter().sum();
    let t = tokens[rank];
    let max_tokens = *tokens.iter().max().unwrap_or(&1);
    let mut layer =
        EpMoeLayer::with_delivery(rt, stream, cfg, max_tokens.max(1), Mode::Training, delivery)
            .map_err(e)?;
    let (local, e0) = (layer.local_experts(), layer.first_expert());
    // What the layer holds: no exchange at one rank; from two ranks the forward's and the
    // backward's two, the forward's sized for every rank's max_tokens tokens (no capacity
    // factor) and its staging rows on the symmetric heap.
    let mem = layer.memory();
    let ranks = rt.ranks();
    let staged = ranks * max_tokens.max(1);
    let sized = if ranks == 1 {
        mem.exchanges == 0 && mem.symmetric == 0 && mem.layer > 0
    } else if layer.rows_pulled() {
        // One exchange carries both passes: this rank's rows and slots on the symmetric
        // heap (x, dy, k slots per token), no received row copies.
        mem.exchanges == 1
            && mem.staging_rows == staged
            && mem.recv_rows == staged * k.min(local)
            && mem.symmetric >= max_tokens.max(1) * d * 2 * (k + 2)
            && mem.exchange_local < mem.recv_rows * d * 2
            && mem.layer > 0
    } else {
        mem.exchanges == 3
            && mem.staging_rows == staged
            && mem.recv_rows == staged * k.min(local)
            && mem.symmetric >= staged * d * 2
            && mem.exchange_local >= mem.recv_rows * d * 2
            && mem.layer > 0
    };
    if !sized {
        return Err(format!("rank {rank} of {ranks}: memory() {mem:?}"));
    }
    let bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let gate_up = stream
        .clone_htod(&bf(&p.weights.gate_up[e0 * w * d..(e0 + local) * w * d]))
        .map_err(e)?;
    let down = stream
        .clone_htod(&bf(&p.weights.down[e0 * d * i..(e0 + local) * d * i]))
        .map_err(e)?;
    // Every buffer holds at least one row, so a rank with no tokens still has valid ones.
    let rows = t.max(1);
    let mut x_host = bf(&p.x[first * d..(first + t) * d]);
    x_host.resize(rows * d, bf16::ZERO);
    let x = stream.clone_htod(&x_host).map_err(e)?;
    let mut ids_host = p.ids[first * k..(first + t) * k].to_vec();
    ids_host.resize(rows * k, 0);
    let mut wts_host = p.topk_w[first * k..(first + t) * k].to_vec();
    wts_host.resize(rows * k, 0.0);
    let ids = stream.clone_htod(&ids_host).map_err(e)?;
    let wts = stream.clone_htod(&wts_host).map_err(e)?;
    let mut y = stream.clone_htod(&vec![POISON_BF16; rows * d]).map_err(e)?;
    let weights = LocalWeights {
        gate_up: gate_up.as_view(),
        down: down.as_view(),
    };
    let routing = || EpRouting::External {
        topk_ids: &ids,
        topk_weights: &wts,
    };
    // dy of every token (the same seed on every rank), the reference's gradients of all.
    let mut rng = Rng::new(seed ^ 0xd1);
    let dy_all: Vec<f32> = (0..total * d)
        .map(|_| bf16::from_f32(rng.uniform()).to_f32())
        .collect();
    let grads = backward(&cfg, &p.weights, &p.x, &want, &dy_all).map_err(e)?;
    let mut dy_host = bf(&dy_all[first * d..(first + t) * d]);
    dy_host.resize(rows * d, bf16::ZERO);
    let dy = stream.clone_htod(&dy_host).map_err(e)?;
    let mut dx = stream.clone_htod(&vec![POISON_BF16; rows * d]).map_err(e)?;
    let mut g = layer.gradients().map_err(e)?;
    let mut err = 0.0;
    for call in 0..2 {
        // Twice: the second call reuses every buffer (and the exchange's next epoch).
        layer
            .forward(&weights, &x, t, routing(), &mut y)
            .map_err(|x| format!("rank {rank} call {call}: {x}"))?;
        let got: Vec<f32> = stream.clone_dtoh(&y).map_err(e)?[..t * d]
            .iter()
            .map(|v| v.to_f32())
            .collect();
        if t > 0 {
            err = check_close(
                &got,
                &want.y[first * d..(first + t) * d],
                2e-2,
                &format!("rank {rank} of {ranks}, call {call}, seed {seed}: y"),
            )?;
        }
    }
    layer
        .backward(&weights, &dy, &mut dx, &mut g, false)
        .map_err(|x| format!("rank {rank} backward: {x}"))?;
    let what = |n: &str| format!("rank {rank} of {ranks}, seed {seed}: {n}");
    let f32s = |v: Vec<bf16>| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
    if t > 0 {
        let got = f32s(stream.clone_dtoh(&dx).map_err(e)?);
        check_close(
            &got[..t * d],
            &grads.dx[first * d..(first + t) * d],
            2e-2,
            &what("dx"),
        )?;
        let got = stream.clone_dtoh(&g.d_topk_weights).map_err(e)?;
        let want_dw = &grads.d_topk_weights[first * k..(first + t) * k];
        check_close(&got[..t * k], want_dw, 2e-2, &what("d_topk_weights"))?;
    }
    let got = f32s(stream.clone_dtoh(&g.d_gate_up).map_err(e)?);
    let want_gu = &grads.d_gate_up[e0 * w * d..(e0 + local) * w * d];
    check_close(&got, want_gu, 2e-2, &what("d_gate_up"))?;
    let got = f32s(stream.clone_dtoh(&g.d_down).map_err(e)?);
    let want_dn = &grads.d_down[e0 * d * i..(e0 + local) * d * i];
    check_close(&got, want_dn, 2e-2, &what("d_down"))?;
    println!(
        "rank {rank} of {ranks} ({delivery:?} rows, pulled: {}): {t} tokens, experts {e0}..{}, y rel err {err:.2e}, backward ok (of {total} tokens)",
        layer.rows_pulled(),
        e0 + local
    );
    Ok(err)
}

/// The Inference forward of a fine-grained layer (32 experts: the fused gate_up's shapes)
/// with rows pulled in place (`RowDelivery::Pull`: metadata-only dispatch, the fused
/// gate_up reading each row at its home rank, the down GEMM storing each output row into
/// its token's slot at home, the slot combine) against the reference and against the same
/// layer with rows copied (`RowDelivery::Copy`); two calls each (buffer and epoch reuse),
/// and the pulled calls must give the same bits (deterministic). From two ranks on; on a
/// device without the fused gate_up it says so and passes.
fn check_pulled(rt: &Arc<Runtime>, stream: &Arc<CudaStream>, seed: u64) -> Result<(), String> {
    let cfg = MoeConfig::new(256, 128, 32, 4).with_router(RouterKind::External);
    let (ranks, rank) = (rt.ranks(), rt.rank());
    if ranks < 2 {
        return Ok(()); // one rank exchanges nothing
    }
    if !moefuse::gpu::gate_up_fused_auto(stream).map_err(e)? {
        println!(
            "rank {rank}: pulled rows SKIPPED: this device does not run the sm_90a fused kernels"
        );
        return Ok(());
    }
    let tokens = tokens_of(ranks);
    let p = problem(&cfg, &tokens, seed);
    let (d, i, w, k) = (cfg.hidden, cfg.intermediate, cfg.gate_up_width(), cfg.top_k);
    let routing_in = RoutingInput::External {
        topk_ids: &p.ids,
        topk_weights: &p.topk_w,
    };
    let want = forward(&cfg, &p.weights, &p.x, routing_in).map_err(e)?;
    let first: usize = tokens[..rank].iter().sum();
    let t = tokens[rank];
    let max_tokens = (*tokens.iter().max().unwrap_or(&1)).max(1);
    let build = |delivery| {
        EpMoeLayer::with_delivery(rt, stream, cfg, max_tokens, Mode::Inference, delivery)
            .map_err(|x| format!("rank {rank}: {delivery:?} layer: {x}"))
    };
    let mut pulled = build(RowDelivery::Pull)?;
    let mut copied = build(RowDelivery::Copy)?;
    if !pulled.rows_pulled() || copied.rows_pulled() {
        return Err(format!(
            "rank {rank}: rows_pulled() does not follow the delivery asked"
        ));
    }
    // Pulling allocates no staged, received or expert-output rows (its own rows and their
    // slots on the symmetric heap instead, more of it than the copies' staging at 2 ranks
    // and top-4): less memory in all, and less local memory.
    let (mp, mc) = (pulled.memory(), copied.memory());
    if mp.total() >= mc.total() || mp.exchange_local >= mc.exchange_local {
        return Err(format!(
            "rank {rank}: pulled {mp:?} is not smaller than copied {mc:?}"
        ));
    }
    let (local, e0) = (pulled.local_experts(), pulled.first_expert());
    let bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let gate_up = stream
        .clone_htod(&bf(&p.weights.gate_up[e0 * w * d..(e0 + local) * w * d]))
        .map_err(e)?;
    let down = stream
        .clone_htod(&bf(&p.weights.down[e0 * d * i..(e0 + local) * d * i]))
        .map_err(e)?;
    let rows = t.max(1);
    let mut x_host = bf(&p.x[first * d..(first + t) * d]);
    x_host.resize(rows * d, bf16::ZERO);
    let x = stream.clone_htod(&x_host).map_err(e)?;
    let mut ids_host = p.ids[first * k..(first + t) * k].to_vec();
    ids_host.resize(rows * k, 0);
    let mut wts_host = p.topk_w[first * k..(first + t) * k].to_vec();
    wts_host.resize(rows * k, 0.0);
    let mut ids = stream.clone_htod(&ids_host).map_err(e)?;
    let mut wts = stream.clone_htod(&wts_host).map_err(e)?;
    let weights = LocalWeights {
        gate_up: gate_up.as_view(),
        down: down.as_view(),
    };
    let mut outputs = Vec::new();
    for (name, layer) in [("pulled", &mut pulled), ("copied", &mut copied)] {
        let mut y = stream.clone_htod(&vec![POISON_BF16; rows * d]).map_err(e)?;
        for call in 0..2 {
            let routing = EpRouting::External {
                topk_ids: &ids,
                topk_weights: &wts,
            };
            layer
                .forward(&weights, &x, t, routing, &mut y)
                .map_err(|x| format!("rank {rank} {name} call {call}: {x}"))?;
            let got: Vec<f32> = stream.clone_dtoh(&y).map_err(e)?[..t * d]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            if t > 0 {
                let what = format!("rank {rank} of {ranks}, {name} call {call}, seed {seed}: y");
                check_close(&got, &want.y[first * d..(first + t) * d], 2e-2, &what)?;
            }
            outputs.push(got);
        }
    }
    // outputs: pulled call 0, pulled call 1, copied call 0, copied call 1.
    let differing = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
    };
    let repeat = differing(&outputs[0], &outputs[1]);
    if repeat > 0 {
        return Err(format!(
            "rank {rank} of {ranks}, seed {seed}: two pulled calls differ in {repeat} y values (not deterministic)"
        ));
    }
    if t > 0 {
        let what = format!("rank {rank} of {ranks}, seed {seed}: pulled against copied y");
        check_close(&outputs[0], &outputs[2], 2e-2, &what)?;
    }
    replay_pulled(&mut pulled, &weights, t, seed, (&mut ids, &mut wts), &cfg)?;
    let same = outputs[0].len() - differing(&outputs[0], &outputs[2]);
    println!(
        "rank {rank} of {ranks}: pulled rows ok, deterministic ({t} tokens; {same} of {} values equal to the copied path's bits), memory {mp} vs {mc}",
        outputs[0].len()
    );
    Ok(())
}

/// The pulled forward captured once in a CUDA graph (every rank its own), then replayed
/// with new tokens and routing written into the captured buffers: each replay equals an
/// eager forward on the same inputs bit for bit. Replays and eager calls are collective:
/// every rank runs the same sequence.
fn replay_pulled(
    layer: &mut EpMoeLayer,
    weights: &LocalWeights<'_>,
    t: usize,
    seed: u64,
    (ids, wts): (&mut CudaSlice<i32>, &mut CudaSlice<f32>),
    cfg: &MoeConfig,
) -> Result<(), String> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let stream = layer.stream().clone();
    let (d, k, rows) = (cfg.hidden, cfg.top_k, t.max(1));
    let mut rng = Rng::new(seed ^ 0x6a);
    let mut x = stream.clone_htod(&rng.bf16_vec(rows * d)).map_err(e)?;
    let mut y = stream.clone_htod(&vec![POISON_BF16; rows * d]).map_err(e)?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e)?;
    let routing = EpRouting::External {
        topk_ids: &*ids,
        topk_weights: &*wts,
    };
    let captured = layer.forward(weights, &x, t, routing, &mut y);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
    captured.map_err(|x| format!("pulled forward under capture: {x}"))?;
    let graph = graph.ok_or("capture produced no graph")?;
    for replay in 0..3 {
        let what = format!("graph replay {replay}, seed {seed}");
        let mut new_ids = Vec::with_capacity(rows * k);
        let mut new_w = Vec::with_capacity(rows * k);
        for _ in 0..rows {
            new_ids.extend(rng.distinct(cfg.experts, k));
            new_w.extend((0..k).map(|_| 0.1 + rng.uniform().abs()));
        }
        stream.memcpy_htod(&new_ids, ids).map_err(e)?;
        stream.memcpy_htod(&new_w, wts).map_err(e)?;
        stream
            .memcpy_htod(&rng.bf16_vec(rows * d), &mut x)
            .map_err(e)?;
        stream
            .memcpy_htod(&vec![POISON_BF16; rows * d], &mut y)
            .map_err(e)?;
        graph.launch().map_err(|x| format!("{what}: {x}"))?;
        let replayed = stream.clone_dtoh(&y).map_err(e)?;
        stream
            .memcpy_htod(&vec![POISON_BF16; rows * d], &mut y)
            .map_err(e)?;
        let routing = EpRouting::External {
            topk_ids: &*ids,
            topk_weights: &*wts,
        };
        layer
            .forward(weights, &x, t, routing, &mut y)
            .map_err(|x| format!("{what}: eager: {x}"))?;
        let eager = stream.clone_dtoh(&y).map_err(e)?;
        let n = t * d;
        let same =
            |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
        if !same(&replayed[..n], &eager[..n]) {
            return Err(format!("{what}: replayed and eager outputs differ"));
        }
        if t > 0
            && replayed[..n]
                .iter()
                .any(|v| v.to_bits() == POISON_BF16.to_bits())
        {
            return Err(format!("{what}: a poisoned value survived the replay"));
        }
    }
    Ok(())
}

fn one_pe_layer(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let (rt, stream) = common::one_pe(ctx)?;
    check_rank(&rt, &stream, Rng::fresh_seed(), RowDelivery::Auto).map(|_| ())
}

/// A child of `common::n_pes`: the Training checks with copied and pulled rows, then the
/// pulled Inference forward.
fn rank_main() -> Result<(), String> {
    let (rt, stream, seed) = common::join()?;
    check_rank(&rt, &stream, seed, RowDelivery::Copy)?;
    if moefuse::gpu::gate_up_fused_auto(&stream).map_err(e)? {
        check_rank(&rt, &stream, seed ^ 0x70, RowDelivery::Pull)?;
    } else {
        println!(
            "rank {}: pulled Training SKIPPED: no sm_90a fused kernels on this device",
            rt.rank()
        );
    }
    check_pulled(&rt, &stream, seed ^ 0x9011)
}

fn main() {
    if std::env::var_os("MOEFUSE_RANK").is_some() {
        std::process::exit(match rank_main() {
            Ok(()) => 0,
            Err(msg) => {
                eprintln!("{msg}");
                1
            }
        });
    }
    GpuSuite::new()
        .test("ep_layer_one_pe", one_pe_layer)
        .test("ep_layer_2_pes_one_gpu", |_| common::n_pes(2, 120))
        .test("ep_layer_4_pes_one_gpu", |_| common::n_pes(4, 120))
        .run()
}
