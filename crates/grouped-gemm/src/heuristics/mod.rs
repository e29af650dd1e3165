//! Variant choice, apart from the kernels: a problem in, a compiled variant out, through an
//! [`ArchSpec`] per architecture. Only compiled variants are candidates. Each new choice is
//! logged once with `tracing::debug!`; `MOEFUSE_GEMM_VARIANT=<name>` pins a variant (benches).

mod sm100;
mod sm90;

use crate::GemmError;
use moefuse_kernels::{compiled, CompiledVariant, Kernels, Op, VariantArch};
use std::collections::HashSet;
use std::sync::Mutex;

pub(crate) use sm100::Sm100;
pub(crate) use sm90::Sm90;

/// What a heuristic knows about the device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Device {
    pub(crate) sms: usize,
}

/// The heuristic for `ctx`'s device and its kernel handle ([`Kernels::new`] checks the ABI,
/// that moefuse has kernels for the device's architecture and that this build compiled
/// them, and reads the SM count).
pub(crate) fn for_device(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> Result<(Box<dyn ArchSpec + Send + Sync>, Device, Kernels), GemmError> {
    let kernels = Kernels::new(ctx)?;
    let spec: Box<dyn ArchSpec + Send + Sync> = match kernels.arch() {
        VariantArch::Sm90a => Box::new(Sm90),
        VariantArch::Sm100a => Box::new(Sm100),
    };
    let device = Device { sms: kernels.sms() };
    Ok((spec, device, kernels))
}

/// What a heuristic sees of a problem: `groups` GEMMs of `m × n` outputs (dense: one group;
/// grouped: the expected rows per group) reducing over `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Problem {
    pub(crate) op: Op,
    pub(crate) groups: usize,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
}

/// A tile choice: the name fields a heuristic ranks.
pub(crate) trait ArchSpec {
    /// The architecture the spec is for.
    fn arch(&self) -> VariantArch;
    /// Scores a candidate for `p` on `device`: lower is better; `None` rules it out.
    fn score(&self, v: &CompiledVariant, p: &Problem, device: Device) -> Option<f64>;
}

/// Picks the variant for `p`: the override if given (or `MOEFUSE_GEMM_VARIANT`), else the
/// best-scoring compiled candidate of `spec`'s arch and `p`'s op.
pub(crate) fn choose(
    spec: &dyn ArchSpec,
    p: &Problem,
    device: Device,
    override_name: Option<&str>,
) -> Result<&'static CompiledVariant, GemmError> {
    let op = p.op;
    let candidates = compiled()
        .iter()
        .filter(|v| v.spec.arch == spec.arch() && v.spec.op == op);
    let env = std::env::var("MOEFUSE_GEMM_VARIANT")
        .ok()
        .filter(|n| n.contains(op.name()));
    if let Some(name) = override_name.or(env.as_deref()) {
        return candidates
            .clone()
            .find(|v| v.name() == name)
            .ok_or_else(|| GemmError::NoVariant {
                what: format!("override `{name}` ({} {:?})", spec.arch().name(), op),
            });
    }
    let best = candidates
        .filter_map(|v| spec.score(v, p, device).map(|s| (s, v)))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, v)| v)
        .ok_or_else(|| GemmError::NoVariant {
            what: format!("{} {:?}", spec.arch().name(), op),
        })?;
    log_once(p, best);
    Ok(best)
}

fn log_once(p: &Problem, v: &'static CompiledVariant) {
    static SEEN: Mutex<Option<HashSet<(Problem, &'static str)>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen
        .get_or_insert_with(HashSet::new)
        .insert((*p, v.spec.op.name()))
    {
        tracing::debug!(op = p.op.name(), groups = p.groups, m = p.m, n = p.n, k = p.k, variant = %v.name(), "moefuse variant chosen");
    }
}

/// Predicted time of a tile shape, in units of one full wave of `tile` tiles: waves
/// rounded up (the tail wave costs a whole wave), each wave scaled by the tile's work.
pub(crate) fn wave_cost(
    p: &Problem,
    tile_m: usize,
    tile_n: usize,
    sms: usize,
    efficiency: f64,
) -> f64 {
    let tiles = p.groups * p.m.max(1).div_ceil(tile_m) * p.n.div_ceil(tile_n);
    let waves = tiles.div_ceil(sms.max(1));
    waves as f64 * (tile_m * tile_n) as f64 / efficiency
}

/// [`wave_cost`] for M-grouped problems whose group sizes vary around the hint `p.m` (routed
/// tokens): each group's last M-tile is partial and, with a cluster of `cluster_m` CTAs
/// along M, the scheduler counts a group's tiles in whole clusters. Expected M-tiles per
/// group: `m / tile_m + 1/2` (the partial tile), plus `(cluster_m - 1) / 5` for the
/// incomplete cluster: its idle CTA only drains the stages its partner's multicast fills,
/// which measured at ~2/5 of a tile, not the half a tile of lockstep (H200, 2026-12-03,
/// routed Qwen3 groups of ~512 rows: the 2x1 contiguous twin 2% faster on gate_up and 3%
/// slower on down than 1x1; balanced, 2-4% faster on both). The group sizes are not known
/// here, so neither is the tail: it costs its expected half wave, not a rounding of the
/// expected tile count (which flipped Mixtral down to 1x1, measured 3.5% slower than 2x1:
/// 2513 vs 2426 us). Dense or single-group problems fall back to [`wave_cost`].
pub(crate) fn ragged_wave_cost(
    p: &Problem,
    tile_m: usize,
    tile_n: usize,
    cluster_m: usize,
    sms: usize,
    efficiency: f64,
) -> f64 {
    let grouped_m = matches!(p.op, Op::GroupedFwdBnk | Op::GroupedFwdBkn) && p.groups > 1;
    if !grouped_m {
        return wave_cost(p, tile_m, tile_n, sms, efficiency);
    }
    let m_tiles = p.m as f64 / tile_m as f64 + 0.5 + (cluster_m.max(1) - 1) as f64 / 5.0;
    let tiles = p.groups as f64 * m_tiles * p.n.div_ceil(tile_n) as f64;
    (tiles / sms.max(1) as f64 + 0.5) * (tile_m * tile_n) as f64 / efficiency
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_waves_cost_a_whole_wave() {
        let p = |n| Problem {
            op: Op::GemmBnk,
            groups: 1,
            m: 128,
            n,
            k: 64,
        };
        let one = wave_cost(&p(256 * 132), 128, 256, 132, 1.0);
        let two = wave_cost(&p(256 * 133), 128, 256, 132, 1.0);
        assert_eq!(two, 2.0 * one);
    }

    #[test]
    fn groups_multiply_tiles() {
        let p = Problem {
            op: Op::GroupedFwdBnk,
            groups: 8,
            m: 128,
            n: 256,
            k: 64,
        };
        assert_eq!(wave_cost(&p, 128, 256, 4, 1.0), 2.0 * 128.0 * 256.0);
    }
}
