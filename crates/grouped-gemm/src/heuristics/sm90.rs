//! Hopper: the cooperative 128x256 tile is the fastest per tile when there are enough
//! tiles to fill the 132 SMs; smaller M or N move to 128x128, and decode-sized M (≤ 64
//! rows) to the 64x128 ping-pong tile, whose M wastes least on few rows.

use super::{wave_cost, ArchSpec, Device, Problem};
use moefuse_kernels::{CompiledVariant, Schedule, VariantArch};

pub(crate) struct Sm90;

impl ArchSpec for Sm90 {
    fn arch(&self) -> VariantArch {
        VariantArch::Sm90a
    }

    fn score(&self, v: &CompiledVariant, p: &Problem, device: Device) -> Option<f64> {
        let [tm, tn, _] = v.spec.tile.map(|x| x as usize);
        // Relative per-tile throughput: starting guesses (larger tiles reuse operands
        // better); `bench_gemm --all-variants` times each variant, docs/perf-notes.md.
        let efficiency = match (v.spec.schedule, tm, tn) {
            (Schedule::Cooperative, 128, 256) => 1.0,
            (Schedule::Cooperative, 128, 128) => 0.85,
            (Schedule::Pingpong, 64, 128) => 0.7,
            _ => 0.6,
        };
        Some(wave_cost(p, tm, tn, device.sms, efficiency))
    }
}
