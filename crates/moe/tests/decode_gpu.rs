//! GPU tests of the decode path (`moefuse::gpu::decode_forward`, the layer's forward for
//! `T ≤ 64`) against the CPU reference: every activation and gate/up layout, the softmax,
//! raw-softmax and grouped-sigmoid routers and external routing (zero-token experts), top-1
//! to top-16, 1 to 64 tokens, sizes that are not multiples of 128, an expert with more
//! slots than one pass holds (several passes), few touched experts (the down kernel's K
//! splits); the Training layer's backward on the rows the decode kernels saved; a graph
//! replay with new routing equal to eager; ids outside `0..E` dropped and flagged; bad
//! input refused before any launch; the gate_up's units from a shared counter equal bit for
//! bit to fixed shares, the counter zero again after each call. Outputs are poisoned before
//! each run; relative error < 2e-2 (bf16 storage).

#![forbid(unsafe_code)]

mod layer_common;

use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;
use layer_common::{bits, check_case, e, graph_replay_case, same_bits, Case, Route};
use moefuse::gpu::{
    decode_applies, decode_forward, ActivationBackwardPath, DecodeInputs, DeviceErrors, GateUpPath,
};
use moefuse::{Activation, GateUpLayout, MoeConfig, MoeError, RouterKind};
use moefuse_testkit::{GpuSuite, Rng, POISON_BF16};
use std::sync::Arc;

fn decode_cases() -> Vec<Case> {
    let grouped = RouterKind::SigmoidGrouped {
        n_group: 4,
        topk_group: 2,
        routed_scaling_factor: 2.5,
        renormalize: true,
    };
    let c = |name, cfg, tokens, route| Case {
        name,
        cfg,
        tokens,
        route,
    };
    vec![
        c(
            "swiglu_t1_top8",
            MoeConfig::new(256, 192, 32, 8),
            1,
            Route::Ours,
        ),
        c(
            "swiglu_odd_sizes_t7",
            MoeConfig::new(320, 448, 16, 4),
            7,
            Route::Ours,
        ),
        c(
            "geglu_interleaved_external_zero_experts_t33",
            MoeConfig::new(128, 192, 8, 2)
                .with_activation(Activation::GeGlu)
                .with_gate_up_layout(GateUpLayout::Interleaved)
                .with_router(RouterKind::External),
            33,
            Route::ExternalLowerHalf,
        ),
        c(
            "swiglu_oai_interleaved_raw_softmax_t64",
            MoeConfig::new(192, 128, 16, 4)
                .with_activation(Activation::swiglu_oai())
                .with_gate_up_layout(GateUpLayout::Interleaved)
                .with_router(RouterKind::SoftmaxTopK { renormalize: false }),
            64,
            Route::Ours,
        ),
        c(
            "bounded_swiglu_grouped_sigmoid_t17",
            MoeConfig::new(192, 128, 16, 4)
                .with_activation(Activation::BoundedSwiGlu { limit: 3.0 })
                .with_router(grouped),
            17,
            Route::Ours,
        ),
        // ~8 rows per expert, up to ~20: several 8-column blocks in one pass.
        c(
            "relu2_top1_t64",
            MoeConfig::new(128, 128, 8, 1).with_activation(Activation::Relu2),
            64,
            Route::Ours,
        ),
        // Every expert gets all 64 tokens: two passes of 32 rows per expert.
        c(
            "swiglu_top16_every_expert_t64",
            MoeConfig::new(64, 64, 16, 16),
            64,
            Route::Ours,
        ),
        // Two of eight experts touched, long K: the down kernel splits K across warps.
        c(
            "swiglu_few_experts_t1",
            MoeConfig::new(256, 1024, 8, 2),
            1,
            Route::Ours,
        ),
        // Every expert gets 8 slots: one full column block of the MMAs.
        c(
            "swiglu_every_expert_twice_over_t8",
            MoeConfig::new(128, 192, 8, 8),
            8,
            Route::Ours,
        ),
        // The other activations and the interleaved layout's row pairs.
        c(
            "geglu_interleaved_external_zero_experts_t3",
            MoeConfig::new(128, 192, 8, 2)
                .with_activation(Activation::GeGlu)
                .with_gate_up_layout(GateUpLayout::Interleaved)
                .with_router(RouterKind::External),
            3,
            Route::ExternalLowerHalf,
        ),
        c(
            "swiglu_oai_interleaved_raw_softmax_t2",
            MoeConfig::new(192, 128, 16, 4)
                .with_activation(Activation::swiglu_oai())
                .with_gate_up_layout(GateUpLayout::Interleaved)
                .with_router(RouterKind::SoftmaxTopK { renormalize: false }),
            2,
            Route::Ours,
        ),
        c(
            "bounded_swiglu_grouped_sigmoid_t4",
            MoeConfig::new(192, 128, 16, 4)
                .with_activation(Activation::BoundedSwiGlu { limit: 3.0 })
                .with_router(grouped),
            4,
            Route::Ours,
        ),
        // ~10 slots per expert: experts with more than 8 take two column blocks per pass.
        c(
            "swiglu_two_column_blocks_t40",
            MoeConfig::new(512, 128, 16, 4),
            40,
            Route::Ours,
        ),
        // Hidden 2048: the largest the pipelined gate_up takes (8 chunks per warp; it
        // serves up to 32 tokens), top-8 at 3 tokens, and ~10 slots per expert (two 8-slot
        // groups there, one 16-column pass in the general kernel).
        c(
            "swiglu_hidden2048_t3_top8",
            MoeConfig::new(2048, 128, 32, 8),
            3,
            Route::Ours,
        ),
        c(
            "relu2_hidden2048_two_groups_t20",
            MoeConfig::new(2048, 128, 2, 1).with_activation(Activation::Relu2),
            20,
            Route::Ours,
        ),
        c(
            "swiglu_all_on_one_expert_t3",
            MoeConfig::new(128, 256, 2, 1).with_router(RouterKind::External),
            3,
            Route::ExternalLowerHalf,
        ),
    ]
}

/// Forward, backward and accumulation of every case on the decode path.
fn decode_layer_matches_reference(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.new_stream().map_err(e)?;
    let seed = Rng::fresh_seed();
    for (n, case) in decode_cases().iter().enumerate() {
        if !decode_applies(&case.cfg, case.tokens) {
            return Err(format!("{}: not a decode case", case.name));
        }
        check_case(
            &stream,
            case,
            seed.wrapping_add(n as u64),
            true,
            GateUpPath::Auto,
            ActivationBackwardPath::Auto,
            None,
        )?;
        println!("{} ok", case.name);
    }
    Ok(())
}

/// Forward + backward captured on the decode path, replayed with new inputs, routing and
/// weights: equal to eager bit for bit (one token, top-8; seven tokens, top-4).
fn decode_graph_replay(ctx: &Arc<CudaContext>) -> Result<(), String> {
    for case in &decode_cases()[..2] {
        graph_replay_case(ctx, case, true)?;
        println!("{} ok", case.name);
    }
    Ok(())
}

/// `decode_forward` of a config and inputs, into a poisoned `y`: `(y bits, errors)`.
fn run_free(
    stream: &Arc<CudaStream>,
    cfg: &MoeConfig,
    t: usize,
    ids: &[i32],
    weights: &[f32],
    seed: u64,
) -> Result<(Vec<u16>, Result<(), MoeError>), String> {
    let (d, i, ex, k) = (cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k);
    let mut rng = Rng::new(seed);
    // At least one element per buffer (cudarc allocates no empty buffer), so that a bad
    // token count reaches the layer's check.
    let n = |len: usize| len.max(1);
    let x = stream.clone_htod(&rng.bf16_vec(n(t * d))).map_err(e)?;
    let gate_up = stream
        .clone_htod(&rng.bf16_vec(ex * cfg.gate_up_width() * d))
        .map_err(e)?;
    let down = stream.clone_htod(&rng.bf16_vec(ex * d * i)).map_err(e)?;
    let (ids_d, w_d) = (
        stream.clone_htod(ids).map_err(e)?,
        stream.clone_htod(weights).map_err(e)?,
    );
    let mut h = stream.alloc_zeros::<bf16>(n(t * k * i)).map_err(e)?;
    let mut y = stream.clone_htod(&vec![POISON_BF16; n(t * d)]).map_err(e)?;
    let mut errors = DeviceErrors::new(stream).map_err(e)?;
    let inputs = DecodeInputs {
        tokens: t,
        topk_ids: &ids_d,
        topk_weights: &w_d,
        x: &x,
        gate_up: &gate_up,
        down: &down,
    };
    decode_forward(cfg, stream, inputs, &mut h, &mut y, None, &mut errors).map_err(e)?;
    let y = bits(&stream.clone_dtoh(&y).map_err(e)?);
    Ok((y, errors.take()))
}

/// An id outside `0..E` drops its slot (the other slots' sum is what a zero weight on a
/// valid id gives, bit for bit) and raises the out-of-range bit.
fn decode_drops_and_flags_bad_ids(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.new_stream().map_err(e)?;
    let cfg = MoeConfig::new(128, 128, 8, 2);
    let seed = Rng::fresh_seed();
    let t = 3;
    let bad = [1, 99, -1, 4, 2, 5];
    let good = [1, 0, 0, 4, 2, 5];
    let w = [0.7f32, 0.3, 0.4, 0.6, 0.5, 0.5];
    let zeroed = [0.7f32, 0.0, 0.0, 0.6, 0.5, 0.5];
    let (y_bad, err_bad) = run_free(&stream, &cfg, t, &bad, &w, seed)?;
    let (y_good, err_good) = run_free(&stream, &cfg, t, &good, &zeroed, seed)?;
    err_good.map_err(|x| format!("valid ids flagged: {x}"))?;
    match err_bad {
        Err(MoeError::InvalidDeviceRouting {
            out_of_range: true, ..
        }) => {}
        other => return Err(format!("bad ids: {other:?}")),
    }
    same_bits(
        &format!("y with dropped slots (seed {seed})"),
        &y_bad,
        &y_good,
    )
}

/// Sizes, token counts and buffers the kernels cannot take are typed errors before any
/// launch (the poisoned output stays untouched).
fn decode_rejects_bad_input(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.new_stream().map_err(e)?;
    let cfg = MoeConfig::new(128, 128, 8, 2);
    let ids: Vec<i32> = (0..130).map(|i| i % 8).collect();
    let w = vec![0.5f32; 130];
    for (what, t) in [("65 tokens", 65usize), ("0 tokens", 0)] {
        match run_free(&stream, &cfg, t, &ids, &w, 1) {
            Err(msg) if msg.contains("tokens") => {}
            other => return Err(format!("{what}: {other:?}")),
        }
    }
    // h one row short.
    let (d, i) = (cfg.hidden, cfg.intermediate);
    let x = stream.alloc_zeros::<bf16>(2 * d).map_err(e)?;
    let gate_up = stream.alloc_zeros::<bf16>(8 * 2 * i * d).map_err(e)?;
    let down = stream.alloc_zeros::<bf16>(8 * d * i).map_err(e)?;
    let ids_d = stream.clone_htod(&ids[..4]).map_err(e)?;
    let w_d = stream.clone_htod(&w[..4]).map_err(e)?;
    let mut h = stream.alloc_zeros::<bf16>(3 * i).map_err(e)?;
    let mut y = stream.clone_htod(&vec![POISON_BF16; 2 * d]).map_err(e)?;
    let mut errors = DeviceErrors::new(&stream).map_err(e)?;
    let inputs = DecodeInputs {
        tokens: 2,
        topk_ids: &ids_d,
        topk_weights: &w_d,
        x: &x,
        gate_up: &gate_up,
        down: &down,
    };
    match decode_forward(&cfg, &stream, inputs, &mut h, &mut y, None, &mut errors) {
        Err(MoeError::Kernel(_)) => {}
        other => return Err(format!("short h: {other:?}")),
    }
    let y = stream.clone_dtoh(&y).map_err(e)?;
    if bits(&y).iter().any(|&b| b != POISON_BF16.to_bits()) {
        return Err("a refused call wrote y".into());
    }
    Ok(())
}

/// The gate_up's units taken from a shared counter against fixed shares: the same
/// `DecodeForward` launched with a unit counter and without writes the same bits of `y`,
/// `h` and the expert-major copies, at a Qwen3-30B-A3B layer's sizes (16 of its 128 experts
/// kept: the kernels read only the touched ones) and at odd ones, top-1 to top-16, with an
/// id outside `0..E`; the counter is zero again after every call. That the kernels take
/// their units from it is shown by a counter set past the last unit: no row of `h` written.
fn decode_unit_counter_equals_fixed_shares(ctx: &Arc<CudaContext>) -> Result<(), String> {
    use moefuse_kernels::{ActivationKind as K, DecodeForward, GateUpLayout as L, Kernels};
    let stream = ctx.new_stream().map_err(e)?;
    let kernels = Kernels::new(ctx).map_err(e)?;
    let seed = Rng::fresh_seed();
    let mut rng = Rng::new(seed);
    // (name, tokens, top_k, hidden, intermediate, experts, activation, layout, a bad id)
    let swiglu_oai = K::SwiGluOai {
        alpha: 1.702,
        limit: 7.0,
    };
    let cases = [
        ("qwen3_t1", 1, 8, 2048, 768, 16, K::SwiGlu, L::Split, false),
        ("qwen3_t8", 8, 8, 2048, 768, 16, K::SwiGlu, L::Split, false),
        (
            "odd_t7_top4",
            7,
            4,
            320,
            448,
            16,
            K::GeGlu,
            L::Interleaved,
            true,
        ),
        (
            "oai_t64_top16",
            64,
            16,
            192,
            96,
            64,
            swiglu_oai,
            L::Interleaved,
            false,
        ),
        ("relu2_t3_top1", 3, 1, 96, 160, 4, K::Relu2, L::Split, true),
    ];
    const NONE_LEFT: u32 = 1 << 30; // past any unit count
    for (name, t, k, d, i, ex, kind, layout, bad_id) in cases {
        let w = if kind.is_gated() { 2 * i } else { i };
        let x = stream.clone_htod(&rng.bf16_vec(t * d)).map_err(e)?;
        let gate_up = stream.clone_htod(&rng.bf16_vec(ex * w * d)).map_err(e)?;
        let down = stream.clone_htod(&rng.bf16_vec(ex * d * i)).map_err(e)?;
        let mut ids: Vec<i32> = (0..t).flat_map(|_| rng.distinct(ex, k)).collect();
        if bad_id {
            ids[1 % (t * k)] = ex as i32 + 3;
        }
        let weights: Vec<f32> = (0..t * k).map(|_| rng.uniform() + 0.05).collect();
        let row_of: Vec<i32> = (0..(t * k) as i32).rev().collect();
        let (ids, weights, row_of) = (
            stream.clone_htod(&ids).map_err(e)?,
            stream.clone_htod(&weights).map_err(e)?,
            stream.clone_htod(&row_of).map_err(e)?,
        );
        let mut outs = Vec::new();
        for counter_start in [Some(0u32), None, Some(NONE_LEFT)] {
            let poisoned = |n: usize| stream.clone_htod(&vec![POISON_BF16; n]);
            let (mut h, mut y) = (poisoned(t * k * i).map_err(e)?, poisoned(t * d).map_err(e)?);
            let (mut h_pre_rows, mut h_rows, mut y_e_rows) = (
                poisoned(t * k * w).map_err(e)?,
                poisoned(t * k * i).map_err(e)?,
                poisoned(t * k * d).map_err(e)?,
            );
            let mut errors = stream.alloc_zeros::<u32>(1).map_err(e)?;
            let mut counter = stream
                .clone_htod(&[counter_start.unwrap_or(0)])
                .map_err(e)?;
            kernels
                .launch(
                    &stream,
                    DecodeForward {
                        tokens: t,
                        top_k: k,
                        hidden: d,
                        intermediate: i,
                        experts: ex,
                        kind,
                        layout,
                        topk_ids: &ids,
                        topk_weights: &weights,
                        x: &x,
                        w_gate_up: &gate_up,
                        w_down: &down,
                        h: &mut h,
                        y: &mut y,
                        row_of: Some(&row_of),
                        h_pre_rows: Some(&mut h_pre_rows),
                        h_rows: Some(&mut h_rows),
                        y_e_rows: Some(&mut y_e_rows),
                        errors: Some(&mut errors),
                        unit_counter: counter_start.map(|_| &mut counter as _),
                    },
                )
                .map_err(e)?;
            let got = |b: &cudarc::driver::CudaSlice<bf16>| stream.clone_dtoh(b).map(|v| bits(&v));
            let error_bits = stream.clone_dtoh(&errors).map_err(e)?[0];
            let want_bits = if bad_id { 1 } else { 0 }; // MOEFUSE_MOE_ERROR_EXPERT_ID
            if error_bits != want_bits {
                return Err(format!("{name}: error bits {error_bits}, want {want_bits}"));
            }
            let left = stream.clone_dtoh(&counter).map_err(e)?[0];
            if counter_start.is_some() && left != 0 {
                return Err(format!(
                    "{name}: unit counter {left} after the call, want 0"
                ));
            }
            outs.push([
                got(&y).map_err(e)?,
                got(&h).map_err(e)?,
                got(&h_pre_rows).map_err(e)?,
                got(&h_rows).map_err(e)?,
                got(&y_e_rows).map_err(e)?,
            ]);
        }
        if outs[0][0].iter().any(|&b| b == POISON_BF16.to_bits()) {
            return Err(format!("{name}: y left poisoned"));
        }
        for (what, (shared, fixed)) in ["y", "h", "h_pre_rows", "h_rows", "y_e_rows"]
            .iter()
            .zip(outs[0].iter().zip(outs[1].iter()))
        {
            same_bits(&format!("{name}: {what} (seed {seed})"), shared, fixed)?;
        }
        if outs[2][1].iter().any(|&b| b != POISON_BF16.to_bits()) {
            return Err(format!(
                "{name}: a counter past the last unit still had h written: the kernels do not take their units from it"
            ));
        }
        println!("{name} ok");
    }
    Ok(())
}

fn main() {
    GpuSuite::new()
        .test(
            "decode_layer_matches_reference",
            decode_layer_matches_reference,
        )
        .test("decode_graph_replay", decode_graph_replay)
        .test(
            "decode_drops_and_flags_bad_ids",
            decode_drops_and_flags_bad_ids,
        )
        .test("decode_rejects_bad_input", decode_rejects_bad_input)
        .test(
            "decode_unit_counter_equals_fixed_shares",
            decode_unit_counter_equals_fixed_shares,
        )
        .run();
}
