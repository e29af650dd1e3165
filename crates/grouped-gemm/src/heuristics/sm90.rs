//! Hopper: the cooperative 128x256 tile is the fastest per tile when there are enough
//! tiles to fill the 132 SMs; smaller M or N move to 128x128, and decode-sized M (≤ 64
//! rows) to the 64x128 ping-pong tile, whose M wastes least on few rows.

use super::{ragged_wave_cost, ArchSpec, Device, Problem};
use moefuse_kernels::{CompiledVariant, Schedule, VariantArch};
use moefuse_spec::CONTIGUOUS_MAX_GROUPS;

pub(crate) struct Sm90;

/// Rows per group (the routed average) over which the forward's M-grouped contiguous GEMM
/// runs CTA pairs that share each W_e tile (see [`Sm90::score`]): more than one M-tile, and
/// fewer rows than Qwen3-30B-A3B's ~512, where the single-CTA kernel measured as fast.
const WEIGHT_BOUND_ROWS: std::ops::Range<usize> = 129..384;

impl ArchSpec for Sm90 {
    fn arch(&self) -> VariantArch {
        VariantArch::Sm90a
    }

    fn score(&self, v: &CompiledVariant, p: &Problem, device: Device) -> Option<f64> {
        let [tm, tn, _] = v.spec.tile.map(|x| x as usize);
        // Relative per-tile throughput measured on the H200 (2026-12-02): grouped sweep
        // on Qwen3 EP1 gate_up/down, 128x128 at 0.94/0.87 of 128x256 and 64x128 ping-pong
        // at 0.63/0.73 (suite grouped_gemm_sweep); dense 8192³ 0.89 and 0.40
        // (docs/perf-notes.md). Ping-pong wins only when M is too small to fill 128 rows.
        // The 1x1-cluster twin of 128x256 gives up the multicast of B yet measured 2-3%
        // faster even on balanced groups (Qwen3 gate_up 607 vs 624 us, down 350 vs 358:
        // grouped_gemm_sweep), and on routed (ragged) groups it does not round each group's
        // M-tiles up to whole clusters (the MoE layer's gate_up 763 -> 699 us).
        // The contiguous kernel (moefuse's own, M-grouped only) keeps its group table in
        // shared memory: at most CONTIGUOUS_MAX_GROUPS groups. Measured on the H200
        // (2026-12-03, grouped_gemm_sweep, Qwen3 EP1 balanced): 1x1 at parity with the
        // CUTLASS 1x1 twin on gate_up (605 vs 601 us) and 4-8% faster on down (337 vs
        // 351-367); its 2x1 twin (W_e tiles multicast) 3% faster again on gate_up (583) and
        // 1% on down, but a group's M-tiles then count in pairs: it wins on large groups.
        // Second sweep (same day): 2x1 contig 584 / 327 us on Qwen3 (CUTLASS 1x1: 606 / 352),
        // GPT-OSS down 754 (CUTLASS 773-785), Mixtral down 2460-2540 and DeepSeek-V3 down
        // 2580-2680 against CUTLASS's best 2425 and 2524: within those shapes' ~3% noise.
        // Third sweep (2026-12-03, commit 1815730): groups of 2048 rows, 2x1 against 1x1 contig
        // on GPT-OSS down 748-763 vs 890 us, GPT-OSS gate_up 1417-1435 vs 1487-1496,
        // DeepSeek-V3 down 2547-2639 vs 2635-2670: the multicast twin is worth ~1.10 of the
        // CUTLASS 2x1 tile, not 1.085 (that value left the wave rounding to pick 1x1 there).
        // The contiguous wgrad's 2x1 twin (B's strips multicast) scores the same 1.10: in one
        // sweep (2026-12-04, bench_grouped --sweep --filter wgrad, 12 tile orders x 2 calls)
        // it ran Qwen3 gate_up 682-692 us against 696-711 for 1x1, down 352-361 vs 358-368,
        // DeepSeek-V3 down 2501-2643 vs 2569-2784, gate_up best 5150 vs 5273.
        if v.spec.schedule == Schedule::Contiguous && p.groups > CONTIGUOUS_MAX_GROUPS {
            return None;
        }
        // The contiguous kernel with B read transposed (`[k, n]`: the MoE layer's dgrads)
        // is another matter: one H100 device call (2026-12-06, session 20, `bench_moe
        // --profile`, the 2x1 twin forced against the 1x1) ran GPT-OSS-120B's gate_up dgrad
        // 2421-2470 us against 4531-4562 and its down dgrad 1168-1182 against 2089-2113,
        // DeepSeek-V3's gate_up dgrad 8695-8911 against 14341 (groups of ~256 rows);
        // Qwen3-30B-A3B's (~512 rows) 725-731 against 778, Mixtral-8x7B's 5680 against 6599.
        // The 1x1 kernel ran at down to half the 2x1's rate (why is open: docs/perf-notes.md),
        // so for B read transposed 2x1 scores far above 1x1 and above the ptr-array tiles.
        // The forward's M-grouped GEMM (B `[n, k]`) shows the same at groups of two or
        // three M-tiles (`WEIGHT_BOUND_ROWS`): one H100 call (2026-12-07, session 21,
        // `bench_moe --profile`, T = 8192, two rounds, the 2x1 twin forced against the
        // heuristic's 1x1) ran DeepSeek-V3's down GEMM 4164-4252 us against 6513-6573 and
        // its unfused gate_up GEMM 9062-9133 against 15347-15351, GPT-OSS-120B's down GEMM
        // 1190-1260 against 1893-1986 and its gate_up GEMM 2259-2341 against 3508-3522
        // (~256-row groups). At ~256 rows an expert's weights carry ~256 FLOP per byte,
        // below the H100's and near the H200's balance, so a second read of W_e per n-block
        // (1x1: one per M-tile) costs what the multicast saves; at ~512 rows (Qwen3) 1x1
        // stayed within 3% of 2x1 on down.
        let cluster_m = v.spec.cluster[0] as usize;
        let transposed_b = p.op == moefuse_kernels::Op::GroupedFwdBkn;
        let weight_bound = p.op == moefuse_kernels::Op::GroupedFwdBnk
            && WEIGHT_BOUND_ROWS.contains(&p.m)
            && p.groups > 1;
        let efficiency = match (v.spec.schedule, tm, tn, cluster_m) {
            (Schedule::Contiguous, 128, 256, 1) if transposed_b || weight_bound => 0.7,
            (Schedule::Contiguous, 128, 256, _) if transposed_b || weight_bound => 1.25,
            (Schedule::Contiguous, 128, 256, 1) => 1.05,
            (Schedule::Contiguous, 128, 256, _) => 1.10,
            (Schedule::Cooperative, 128, 256, 1) => 1.02,
            (Schedule::Cooperative, 128, 256, _) => 1.0,
            (Schedule::Cooperative, 128, 128, _) => 0.9,
            (Schedule::Pingpong, 64, 128, _) => 0.6,
            _ => 0.5,
        };
        Some(ragged_wave_cost(
            p, tm, tn, cluster_m, device.sms, efficiency,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heuristics::choose;
    use moefuse_kernels::Op;

    #[test]
    fn picks_the_measured_best_tile_for_moe_shapes_and_pingpong_for_decode() {
        if !moefuse_kernels::built_archs().contains(&VariantArch::Sm90a.name()) {
            println!("SKIPPED picks_the_measured_best_tile: sm90a not built (MOEFUSE_CUDA_ARCHS)");
            return;
        }
        let device = Device { sms: 132 };
        let qwen = Problem {
            op: Op::GroupedFwdBnk,
            groups: 128,
            m: 512,
            n: 1536,
            k: 2048,
        };
        // Routed ~512-row groups: the 2x1 twin measured 2% faster than 1x1 on routed
        // gate_up (672 vs 685 us) and 2-4% on balanced; a near tie, as the model says.
        let v = choose(&Sm90, &qwen, device, None).unwrap();
        assert_eq!(
            (v.spec.tile, v.spec.schedule),
            ([128, 256, 64], Schedule::Contiguous),
            "routed groups: the contiguous kernel"
        );
        let many = Problem {
            groups: CONTIGUOUS_MAX_GROUPS + 1,
            ..qwen
        };
        let v = choose(&Sm90, &many, device, None).unwrap();
        assert_eq!(
            (v.spec.tile, v.spec.cluster, v.spec.schedule),
            ([128, 256, 64], [1, 1], Schedule::Cooperative),
            "more groups than the contiguous kernel's table: the 1x1 ptr-array twin"
        );
        let large = Problem { m: 2048, ..qwen };
        let big = choose(&Sm90, &large, device, None).unwrap();
        assert_eq!(
            (big.spec.cluster, big.spec.schedule),
            ([2, 1], Schedule::Contiguous),
            "large groups: the multicast twin"
        );
        // 2048-row groups (GPT-OSS EP8, DeepSeek-V3 EP8, Mixtral EP1): the multicast twin
        // measured 3-16% faster than 1x1 on each swept one.
        for (groups, n, k) in [
            (16, 5760, 2880),
            (16, 2880, 2880),
            (32, 4096, 7168),
            (32, 7168, 2048),
            (8, 4096, 14336),
        ] {
            let p = Problem {
                groups,
                m: 2048,
                n,
                k,
                ..qwen
            };
            let v = choose(&Sm90, &p, device, None).unwrap();
            assert_eq!(
                (v.spec.cluster, v.spec.schedule),
                ([2, 1], Schedule::Contiguous),
                "{p:?}"
            );
        }
        let dense = Problem {
            op: Op::GemmBnk,
            groups: 1,
            m: 8192,
            n: 8192,
            k: 8192,
        };
        let v = choose(&Sm90, &dense, device, None).unwrap();
        assert_eq!(v.spec.cluster, [2, 1], "dense: the multicast cluster");
        // The dgrads (B read transposed): the multicast twin at every routed group size
        // measured (GPT-OSS-120B and DeepSeek-V3 ~256 rows, Qwen3 ~512, Mixtral ~8192).
        for (groups, m, n, k) in [
            (128, 256, 2880, 5760),
            (128, 256, 5760, 2880),
            (256, 256, 7168, 4096),
            (128, 512, 2048, 1536),
            (8, 8192, 4096, 28672),
        ] {
            let p = Problem {
                op: Op::GroupedFwdBkn,
                groups,
                m,
                n,
                k,
            };
            let v = choose(&Sm90, &p, device, None).unwrap();
            assert_eq!(
                (v.spec.tile, v.spec.cluster, v.spec.schedule),
                ([128, 256, 64], [2, 1], Schedule::Contiguous),
                "{p:?}"
            );
        }
        // ~256-row groups (DeepSeek-V3 and GPT-OSS-120B at T = 8192, both projections):
        // the multicast twin, measured 35-40% faster than 1x1 on each.
        for (groups, n, k) in [
            (256, 4096, 7168),
            (256, 7168, 2048),
            (128, 5760, 2880),
            (128, 2880, 2880),
        ] {
            let p = Problem {
                groups,
                m: 256,
                n,
                k,
                ..qwen
            };
            let v = choose(&Sm90, &p, device, None).unwrap();
            assert_eq!(
                (v.spec.tile, v.spec.cluster, v.spec.schedule),
                ([128, 256, 64], [2, 1], Schedule::Contiguous),
                "{p:?}"
            );
        }
        // One M-tile per group: nothing to share, no pairs.
        let small = Problem { m: 96, ..qwen };
        let v = choose(&Sm90, &small, device, None).unwrap();
        assert_ne!(v.spec.cluster, [2, 1], "{small:?}");
        let decode = Problem { m: 1, ..qwen };
        let v = choose(&Sm90, &decode, device, None).unwrap();
        assert_eq!(
            (v.spec.tile, v.spec.schedule),
            ([64, 128, 64], Schedule::Pingpong)
        );
    }

    #[test]
    fn wgrad_takes_the_contiguous_kernel() {
        if !moefuse_kernels::built_archs().contains(&VariantArch::Sm90a.name()) {
            println!(
                "SKIPPED wgrad_takes_the_contiguous_kernel: sm90a not built (MOEFUSE_CUDA_ARCHS)"
            );
            return;
        }
        // Measured on the H200 (2026-12-03, bench_grouped --filter wgrad): Qwen3 gate_up
        // wgrad 680.7 us against CUTLASS's ptr-array 2x1 kernel's 887-931 us in the layer.
        let device = Device { sms: 132 };
        for (groups, m, n, k) in [
            (128, 512, 1536, 2048),
            (128, 512, 2048, 768),
            (32, 2048, 4096, 7168),
        ] {
            let p = Problem {
                op: Op::GroupedWgrad,
                groups,
                m,
                n,
                k,
            };
            let v = choose(&Sm90, &p, device, None).unwrap();
            assert_eq!(
                (v.spec.schedule, v.spec.cluster),
                (Schedule::Contiguous, [2, 1]),
                "{p:?}"
            );
        }
    }
}
