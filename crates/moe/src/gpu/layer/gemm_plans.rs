//! The grouped GEMM plans of a layer: the forward's per band of routed rows per expert, the
//! backward's (Training) with the gather choices its variants allow.

use super::plan::{Mode, MoePlan};
use crate::{MoeConfig, MoeError};
use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedGemm, GroupedPlan};

/// The grouped GEMM plans: the forward's always, the backward's in Training.
pub(super) struct GemmPlans {
    pub(super) forward: ForwardPlans,
    pub(super) backward: Option<BackwardPlans>,
}

/// The forward's gate_up and down plans for bands of routed rows per expert: a call takes
/// the band of its own `T·k/E`, since the tile and cluster that suit a few rows per expert
/// are not those of hundreds (at ~256 rows the 2x1 twin ran 35-40 % faster than at the
/// plan's 512, docs/perf-notes.md, session 21). The backward keeps the plan's `max_tokens`
/// (Training runs at its full batch).
pub(super) struct ForwardPlans {
    /// Rows-per-expert hints, descending: `⌈R/E⌉`, then every power of two below it.
    hints: Vec<usize>,
    /// `[gate_up, down]` per hint.
    plans: Vec<[GroupedPlan; 2]>,
}

impl ForwardPlans {
    /// `[gate_up, down]` for a forward of `tokens` tokens of `cfg`.
    pub(super) fn for_tokens(&self, cfg: &MoeConfig, tokens: usize) -> &[GroupedPlan; 2] {
        &self.plans[band_for(&self.hints, (tokens * cfg.top_k).div_ceil(cfg.experts))]
    }
}

/// `⌈R/E⌉` then the powers of two below it, descending (at least `[1]`).
fn band_hints(rows_per_expert: usize) -> Vec<usize> {
    let top = rows_per_expert.max(1);
    let mut hints = vec![top];
    let mut h = top.next_power_of_two();
    while h > 1 {
        h /= 2;
        if h < top {
            hints.push(h);
        }
    }
    hints
}

/// The band of a call with `rows` routed rows per expert: the largest hint not above it
/// (the first band for calls at or past the plan's own).
fn band_for(hints: &[usize], rows: usize) -> usize {
    hints
        .iter()
        .position(|&h| h <= rows)
        .unwrap_or(hints.len().saturating_sub(1))
}

pub(super) struct BackwardPlans {
    pub(super) down_dgrad: GroupedPlan,
    pub(super) gate_up_dgrad: GroupedPlan,
    /// [beta = 0, beta = 1] (accumulate).
    pub(super) down_wgrad: [GroupedPlan; 2],
    pub(super) gate_up_wgrad: [GroupedPlan; 2],
    /// The gate_up wgrad reads `x`'s token rows through `source_of` (a contiguous wgrad
    /// gathers B in its producer) instead of a regathered `x_perm`. `MOEFUSE_GATHER_X=off`
    /// keeps the regather: the gathered wgrad gives up the pair's multicast of B and runs
    /// ~190 µs slower, about what the regather costs (docs/perf-notes.md, session 16).
    pub(super) gather_x: bool,
    /// The down dgrad and wgrad read `dy`'s token rows through `source_of` (contiguous
    /// variants gather A in their producers) instead of a gathered `dy_perm`.
    pub(super) gather_dy: bool,
    /// `MOEFUSE_FUSED_ACTIVATION_BWD=on|off`: [`ActivationBackwardPath::Auto`](super::ActivationBackwardPath::Auto) fused or not
    /// whatever the rule says (A/B in `bench_moe --profile`).
    pub(super) forced_activation_backward: Option<bool>,
}

impl GemmPlans {
    pub(super) fn new(gemm: &GroupedGemm, plan: &MoePlan, mode: Mode) -> Result<Self, MoeError> {
        let c = plan.config();
        let (d, i, e, w, rows) = (
            c.hidden,
            c.intermediate,
            c.experts,
            c.gate_up_width(),
            plan.rows(),
        );
        let plan = |mut desc: GroupedDesc| {
            desc.rows_per_group_hint = Some(rows.div_ceil(e));
            gemm.plan(&desc)
        };
        let wgrad = |n: usize, kk: usize| -> Result<[GroupedPlan; 2], MoeError> {
            let (desc, swap) = GroupedDesc::wgrad_for(e, rows, n, kk, BLayout::Nk);
            debug_assert!(swap);
            Ok([plan(desc)?, plan(GroupedDesc { beta: 1.0, ..desc })?])
        };
        let backward = match mode {
            Mode::Inference => None,
            Mode::Training => {
                let (gate_up_wgrad, down_wgrad) = (wgrad(w, d)?, wgrad(d, i)?);
                let down_dgrad = plan(GroupedDesc::dgrad(e, rows, d, i, BLayout::Nk))?;
                // x and dy are gathered wherever the chosen variants can; the env knobs keep
                // the copies, to time them beside the gathers (`bench_moe --profile`).
                let env = |name: &str| std::env::var(name).ok();
                let on = env("MOEFUSE_BACKWARD_GATHER").is_none_or(|v| v != "off");
                let x_on = on && env("MOEFUSE_GATHER_X").is_none_or(|v| v != "off");
                let gather_dy = on && contiguous(&[&down_dgrad, &down_wgrad[0], &down_wgrad[1]]);
                let forced_activation_backward =
                    match env("MOEFUSE_FUSED_ACTIVATION_BWD").as_deref() {
                        Some("on") => Some(true),
                        Some("off") => Some(false),
                        _ => None,
                    };
                Some(BackwardPlans {
                    gate_up_dgrad: plan(GroupedDesc::dgrad(e, rows, w, d, BLayout::Nk))?,
                    gather_x: x_on && contiguous(&[&gate_up_wgrad[0], &gate_up_wgrad[1]]),
                    gather_dy,
                    forced_activation_backward,
                    down_dgrad,
                    down_wgrad,
                    gate_up_wgrad,
                })
            }
        };
        let hints = band_hints(rows.div_ceil(e));
        let plans = hints
            .iter()
            .map(|&h| {
                let band = |n: usize, kk: usize| {
                    let mut desc = GroupedDesc::forward(e, rows, n, kk, BLayout::Nk);
                    desc.rows_per_group_hint = Some(h);
                    gemm.plan(&desc)
                };
                Ok([band(w, d)?, band(d, i)?])
            })
            .collect::<Result<Vec<_>, MoeError>>()?;
        let plans = GemmPlans {
            forward: ForwardPlans { hints, plans },
            backward,
        };
        for p in plans.all() {
            tracing::debug!(variant = %p.variant(), "moe layer grouped GEMM");
        }
        Ok(plans)
    }

    pub(super) fn all(&self) -> Vec<&GroupedPlan> {
        let mut all: Vec<&GroupedPlan> = self.forward.plans.iter().flatten().collect();
        if let Some(b) = &self.backward {
            all.extend([&b.down_dgrad, &b.gate_up_dgrad]);
            all.extend(b.down_wgrad.iter().chain(&b.gate_up_wgrad));
        }
        all
    }
}

/// Whether every plan runs a contiguous variant (those read an operand through an index).
fn contiguous(plans: &[&GroupedPlan]) -> bool {
    plans
        .iter()
        .all(|p| p.compiled_variant().spec.schedule == moefuse_kernels::Schedule::Contiguous)
}

#[cfg(test)]
mod tests {
    use super::{band_for, band_hints};

    #[test]
    fn forward_bands_halve_down_from_the_plans_rows() {
        // Qwen3-30B-A3B at max_tokens 8192: 512 rows per expert.
        assert_eq!(band_hints(512), vec![512, 256, 128, 64, 32, 16, 8, 4, 2, 1]);
        assert_eq!(band_hints(300), vec![300, 256, 128, 64, 32, 16, 8, 4, 2, 1]);
        assert_eq!(band_hints(1), vec![1]);
        assert_eq!(band_hints(0), vec![1]);
        let h = band_hints(512);
        // T = 8192 and beyond: the plan's own band; T = 4096 (256 rows): 256's.
        assert_eq!(h[band_for(&h, 512)], 512);
        assert_eq!(h[band_for(&h, 900)], 512);
        assert_eq!(h[band_for(&h, 256)], 256);
        assert_eq!(h[band_for(&h, 383)], 256);
        assert_eq!(h[band_for(&h, 3)], 2);
        assert_eq!(h[band_for(&h, 1)], 1);
    }
}
