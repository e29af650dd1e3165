//! Variant choice, apart from the kernels: a problem in, a compiled variant out, through an
//! [`ArchSpec`] per architecture. Only compiled variants are candidates. Each new choice is
//! logged once with `tracing::debug!`; `MOEFUSE_GEMM_VARIANT=<name>` pins a variant (benches).

mod sm100;
mod sm90;

use crate::{BLayout, GemmDesc, GemmError};
use moefuse_kernels::{compiled, CompiledVariant, Op, VariantArch};
use std::collections::HashSet;
use std::sync::Mutex;

pub(crate) use sm100::Sm100;
pub(crate) use sm90::Sm90;

/// What a heuristic knows about the device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Device {
    pub(crate) sms: usize,
}

/// A tile choice: the name fields a heuristic ranks.
pub(crate) trait ArchSpec {
    /// The architecture the spec is for.
    fn arch(&self) -> VariantArch;
    /// Scores a candidate for `desc` on `device`: lower is better; `None` rules it out.
    fn score(&self, v: &CompiledVariant, desc: &GemmDesc, device: Device) -> Option<f64>;
}

pub(crate) fn op_for(layout: BLayout) -> Op {
    match layout {
        BLayout::Nk => Op::GemmBnk,
        BLayout::Kn => Op::GemmBkn,
    }
}

/// Picks the variant for `desc`: the override if given (or `MOEFUSE_GEMM_VARIANT`), else the
/// best-scoring compiled candidate of `spec`'s arch and the desc's op.
pub(crate) fn choose(
    spec: &dyn ArchSpec,
    desc: &GemmDesc,
    device: Device,
    override_name: Option<&str>,
) -> Result<&'static CompiledVariant, GemmError> {
    let op = op_for(desc.b_layout);
    let candidates = compiled().iter().filter(|v| v.spec.arch == spec.arch() && v.spec.op == op);
    let env = std::env::var("MOEFUSE_GEMM_VARIANT").ok();
    if let Some(name) = override_name.or(env.as_deref()) {
        return candidates
            .clone()
            .find(|v| v.name() == name)
            .ok_or_else(|| GemmError::NoVariant { what: format!("override `{name}` ({} {:?})", spec.arch().name(), op) });
    }
    let best = candidates
        .filter_map(|v| spec.score(v, desc, device).map(|s| (s, v)))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, v)| v)
        .ok_or_else(|| GemmError::NoVariant { what: format!("{} {:?}", spec.arch().name(), op) })?;
    log_once(desc, best);
    Ok(best)
}

fn log_once(desc: &GemmDesc, v: &CompiledVariant) {
    static SEEN: Mutex<Option<HashSet<(usize, usize, usize, String)>>> = Mutex::new(None);
    let key = (desc.m, desc.n, desc.k, v.name());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(key) {
        tracing::debug!(m = desc.m, n = desc.n, k = desc.k, variant = %v.name(), "moefuse gemm variant chosen");
    }
}

/// Predicted time of a tile shape, in units of one full wave of `tile` tiles: waves
/// rounded up (the tail wave costs a whole wave), each wave scaled by the tile's work.
pub(crate) fn wave_cost(m: usize, n: usize, tile_m: usize, tile_n: usize, sms: usize, efficiency: f64) -> f64 {
    let tiles = m.div_ceil(tile_m) * n.div_ceil(tile_n);
    let waves = tiles.div_ceil(sms.max(1));
    waves as f64 * (tile_m * tile_n) as f64 / efficiency
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_waves_cost_a_whole_wave() {
        let one = wave_cost(128, 256 * 132, 128, 256, 132, 1.0);
        let two = wave_cost(128, 256 * 133, 128, 256, 132, 1.0);
        assert_eq!(two, 2.0 * one);
    }
}
