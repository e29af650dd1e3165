//! GPU tests of the pulled exchange on its own (`EpConfig::pull_rows`): the metadata-only
//! dispatch's tables against the host model (`SendPlan` / `ReceiveLayout`: received rows,
//! offsets, origins, weights, and each row's source `rank · max_tokens + token`), then the
//! scattered down GEMM (`DownScatter`) storing every received row's expert output into its
//! token's slot at home, and the slot combine, against a host sum. The experts are scaled
//! identities (`W_e = s_e · I`, `s_e` in {0.25, 0.5, 0.75, 1}), so each expert output is
//! `bf16(s_e · x[token])` exactly and the test needs no GEMM reference; the rows the GEMM
//! reads are the model's received rows, built on the host. At 1 PE in this process and at
//! 2 and 4 PEs on one GPU through the launcher, for uniform, skewed, last-rank-sends-
//! nothing, upper-ranks-receive-nothing, top-1, top-16 and single-token routing, twice each
//! (epochs and buffer reuse).
//! Without a GPU (or on a device without the sm_90a MoE kernels) every test says SKIPPED.

#![forbid(unsafe_code)]

mod common;

use common::e;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use half::bf16;
use moefuse_comm::{EpConfig, ExpertParallel, ReceiveLayout, Runtime, SendPlan};
use moefuse_kernels::{DownScatter, Kernels, ScatterWeights};
use moefuse_testkit::{check_close, GpuSuite, Rng, BF16_REL_ERR, POISON_BF16};
use std::sync::Arc;

const EXPERTS: usize = 16;
const HIDDEN: usize = 1024;
const MAX_TOKENS: usize = 1024;

#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    top_k: usize,
    skewed: bool,
    /// Experts drawn from the lower half only: the upper ranks receive nothing.
    lower_half: bool,
    /// Tokens of rank r: `tokens + 29 r`, or 0 for the last of several ranks when set.
    tokens: usize,
    last_rank_empty: bool,
}

fn cases() -> Vec<Case> {
    let c = |name, top_k, skewed, tokens, last_rank_empty| Case {
        name,
        top_k,
        skewed,
        lower_half: false,
        tokens,
        last_rank_empty,
    };
    vec![
        c("uniform", 4, false, 700, false),
        c("skewed", 4, true, 900, false),
        c("last_rank_sends_nothing", 4, false, 500, true),
        Case {
            lower_half: true,
            ..c("upper_ranks_receive_nothing", 2, false, 600, false)
        },
        c("top1", 1, false, 800, false),
        c("top16_every_expert", 16, false, 200, false),
        c("single_token", 4, true, 1, false),
    ]
}

fn tokens_of(case: &Case, rank: usize, ranks: usize) -> usize {
    if case.last_rank_empty && ranks > 1 && rank == ranks - 1 {
        0
    } else {
        (case.tokens + 29 * rank).min(MAX_TOKENS)
    }
}

/// Rank `rank`'s tokens, distinct experts per token (skewed: low ids far likelier) and
/// positive weights summing to one, all from `seed`.
fn inputs(case: &Case, seed: u64, rank: usize, t: usize) -> (Vec<bf16>, Vec<i32>, Vec<f32>) {
    let mut rng = Rng::new(seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let x = rng.bf16_vec(t * HIDDEN);
    let k = case.top_k;
    let (mut ids, mut ws) = (Vec::with_capacity(t * k), Vec::with_capacity(t * k));
    for _ in 0..t {
        let mut chosen: Vec<i32> = Vec::with_capacity(k);
        let pool = if case.lower_half {
            EXPERTS / 2
        } else {
            EXPERTS
        };
        while chosen.len() < k {
            let u = (rng.uniform() + 1.0) / 2.0;
            let id = if case.skewed {
                ((pool as f32).powf(u * u * u) - 1.0) as usize % pool
            } else {
                rng.below(pool)
            } as i32;
            if !chosen.contains(&id) {
                chosen.push(id);
            }
        }
        let raw: Vec<f32> = (0..k).map(|_| 0.05 + (rng.uniform() + 1.0) / 2.0).collect();
        let sum: f32 = raw.iter().sum();
        ids.extend(chosen);
        ws.extend(raw.iter().map(|w| w / sum));
    }
    (x, ids, ws)
}

/// Expert `e`'s scale: its weight matrix is `scale(e) · I`.
fn scale(e: usize) -> f32 {
    (e % 4 + 1) as f32 * 0.25
}

fn upload<T: DeviceRepr + Clone + Default>(
    s: &Arc<CudaStream>,
    v: &[T],
) -> Result<CudaSlice<T>, String> {
    if v.is_empty() {
        return s.clone_htod(&[T::default()]).map_err(e);
    }
    s.clone_htod(v).map_err(e)
}

/// One pulled dispatch → scattered down GEMM → slot combine of `case`, checked on this rank.
fn round_trip(
    ep: &mut ExpertParallel,
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    case: &Case,
    seed: u64,
) -> Result<(), String> {
    let (me, ranks, place) = (ep.rank(), ep.placement().ranks(), ep.placement());
    let (k, local) = (case.top_k, place.per_rank());
    let what = |msg: String| format!("{} (rank {me}/{ranks}, seed {seed}): {msg}", case.name);
    let all: Vec<_> = (0..ranks)
        .map(|r| inputs(case, seed, r, tokens_of(case, r, ranks)))
        .collect();
    let plans = all
        .iter()
        .enumerate()
        .map(|(r, (_, ids, _))| {
            let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
            SendPlan::build(&place, r, &ids, k)
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(e)?;
    let layout = ReceiveLayout::build(&place, me, &plans).map_err(e)?;
    let t = tokens_of(case, me, ranks);
    let (x, ids, ws) = &all[me];
    let (x_d, ids_d, ws_d) = (
        upload(stream, x)?,
        upload(stream, ids)?,
        upload(stream, ws)?,
    );

    // The experts: scaled identities [local, D, D]; the rows the GEMM reads: the model's.
    let cap = ep.recv_rows_capacity();
    let mut w = vec![bf16::ZERO; local * HIDDEN * HIDDEN];
    for l in 0..local {
        let s = bf16::from_f32(scale(me * local + l));
        for i in 0..HIDDEN {
            w[(l * HIDDEN + i) * HIDDEN + i] = s;
        }
    }
    let mut h = vec![bf16::ZERO; cap * HIDDEN];
    for (r, row) in layout.rows.iter().enumerate() {
        let src = &all[row.src].0[row.token * HIDDEN..(row.token + 1) * HIDDEN];
        h[r * HIDDEN..(r + 1) * HIDDEN].copy_from_slice(src);
    }
    let (w_d, h_d) = (upload(stream, &w)?, upload(stream, &h)?);
    let mut out_d = upload(stream, &vec![POISON_BF16; t * HIDDEN])?;

    let d = ep
        .dispatch_pull(&x_d, &ids_d, &ws_d, t)
        .map_err(|x| what(format!("dispatch_pull: {x}")))?;
    let rows = layout.rows.len();
    let got_rows = d.received_rows().map_err(e)?;
    if got_rows != rows {
        return Err(what(format!("received {got_rows} rows, model {rows}")));
    }
    let offsets = stream.clone_dtoh(d.offsets()).map_err(e)?;
    if offsets != layout.offsets {
        return Err(what(format!(
            "offsets {offsets:?}, model {:?}",
            layout.offsets
        )));
    }
    let origin = stream.clone_dtoh(d.origin()).map_err(e)?;
    let weights = stream.clone_dtoh(d.weights()).map_err(e)?;
    let sources = stream.clone_dtoh(d.row_sources()).map_err(e)?;
    for (r, row) in layout.rows.iter().enumerate() {
        let o = &origin[3 * r..3 * r + 3];
        if o != [row.src as i32, row.token as i32, row.slot as i32] {
            return Err(what(format!("row {r}: origin {o:?}, model {row:?}")));
        }
        let want_w = all[row.src].2[row.token * k + row.slot];
        if weights[r] != want_w {
            return Err(what(format!(
                "row {r}: weight {}, model {want_w}",
                weights[r]
            )));
        }
        let want_src = (row.src * MAX_TOKENS + row.token) as i32;
        if sources[r] != want_src {
            return Err(what(format!(
                "row {r}: source {}, model {want_src}",
                sources[r]
            )));
        }
    }
    let dst = d.row_destinations();
    let down = DownScatter {
        rows: cap,
        experts: local,
        hidden: HIDDEN,
        intermediate: HIDDEN,
        weights: ScatterWeights::OutByIn,
        offsets: d.offsets(),
        h: &h_d,
        w: &w_d,
        dst: &dst,
    };
    kernels
        .launch(stream, down)
        .map_err(|x| what(format!("down_scatter: {x}")))?;
    drop(dst);
    d.combine_slots(&ids_d, &ws_d, &mut out_d)
        .map_err(|x| what(format!("combine_slots: {x}")))?;
    ep.synchronize().map_err(|x| what(x.to_string()))?;

    let got: Vec<f32> = stream.clone_dtoh(&out_d).map_err(e)?[..t * HIDDEN]
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let mut want = vec![0f32; t * HIDDEN];
    for tok in 0..t {
        for j in 0..k {
            let (id, wj) = (ids[tok * k + j] as usize, ws[tok * k + j]);
            for c in 0..HIDDEN {
                let y = bf16::from_f32(x[tok * HIDDEN + c].to_f32() * scale(id)).to_f32();
                want[tok * HIDDEN + c] += wj * y;
            }
        }
    }
    check_close(&got, &want, BF16_REL_ERR, &what("combined output".into()))?;
    let flags = ep.take_flags().map_err(e)?;
    if flags != Default::default() {
        return Err(what(format!("kernels raised {flags:?} on valid routing")));
    }
    Ok(())
}

/// Every case on this rank's runtime, two seeds each.
fn all_cases(rt: &Arc<Runtime>, stream: &Arc<CudaStream>, seed: u64) -> Result<(), String> {
    if !moefuse::gpu::gate_up_fused_auto(stream).map_err(e)? {
        println!("SKIPPED pulled exchange: this device does not run the sm_90a MoE kernels");
        return Ok(());
    }
    let kernels = Kernels::new(stream.context()).map_err(e)?;
    for case in cases() {
        let cfg = EpConfig::new(EXPERTS, case.top_k, HIDDEN, MAX_TOKENS).pulled();
        let mut ep = ExpertParallel::new(rt, stream, cfg).map_err(e)?;
        for i in 0..2 {
            round_trip(&mut ep, &kernels, stream, &case, seed.wrapping_add(i))?;
        }
        println!("rank {}/{}: {} ok", rt.rank(), rt.ranks(), case.name);
    }
    Ok(())
}

fn one_pe(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let (rt, stream) = common::one_pe(ctx)?;
    all_cases(&rt, &stream, Rng::fresh_seed())
}

fn rank_main() -> Result<(), String> {
    let (rt, stream, seed) = common::join()?;
    all_cases(&rt, &stream, seed)
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
        .test("pulled_exchange_one_pe", one_pe)
        .test("pulled_exchange_2_pes_one_gpu", |_| common::n_pes(2, 180))
        .test("pulled_exchange_4_pes_one_gpu", |_| common::n_pes(4, 180))
        .run()
}
