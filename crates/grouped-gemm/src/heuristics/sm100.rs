//! Blackwell: the 2-SM 256x256 UMMA tile when there are enough tiles for the 148 SMs'
//! pairs, else the 1-SM 128x128 tile.

use super::{wave_cost, ArchSpec, Device, Problem};
use moefuse_kernels::{CompiledVariant, Schedule, VariantArch};

pub(crate) struct Sm100;

impl ArchSpec for Sm100 {
    fn arch(&self) -> VariantArch {
        VariantArch::Sm100a
    }

    fn score(&self, v: &CompiledVariant, p: &Problem, device: Device) -> Option<f64> {
        let [tm, tn, _] = v.spec.tile.map(|x| x as usize);
        let (units, efficiency) = match v.spec.schedule {
            Schedule::TwoSm => (device.sms / 2, 1.0),
            Schedule::OneSm => (device.sms, 0.8),
            _ => return None,
        };
        Some(wave_cost(p, tm, tn, units, efficiency))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heuristics::choose;
    use moefuse_kernels::{compiled, Op};

    /// The contiguous twins (`_contig`) have not run on a B200: Auto never takes them, for
    /// any shape, while a named override still can.
    #[test]
    fn contiguous_twins_are_only_taken_when_named() {
        if !moefuse_kernels::built_archs().contains(&VariantArch::Sm100a.name()) {
            println!("SKIPPED contiguous_twins_are_only_taken_when_named: sm100a not built (MOEFUSE_CUDA_ARCHS)");
            return;
        }
        let device = Device { sms: 148 };
        for op in [Op::GroupedFwdBnk, Op::GroupedFwdBkn, Op::GroupedWgrad] {
            for (groups, m) in [(128, 512), (8, 4096), (256, 16), (1, 1)] {
                let p = Problem {
                    op,
                    groups,
                    m,
                    n: 4096,
                    k: 2048,
                };
                let v = choose(&Sm100, &p, device, None).unwrap();
                assert_ne!(
                    v.spec.schedule,
                    Schedule::Contiguous,
                    "{op:?} {groups}x{m}: {}",
                    v.name()
                );
            }
            let twin = compiled()
                .iter()
                .find(|v| {
                    v.spec.arch == VariantArch::Sm100a
                        && v.spec.op == op
                        && v.spec.schedule == Schedule::Contiguous
                })
                .expect("an sm100a contiguous twin is compiled");
            let p = Problem {
                op,
                groups: 8,
                m: 256,
                n: 4096,
                k: 2048,
            };
            let named = choose(&Sm100, &p, device, Some(&twin.name())).unwrap();
            assert_eq!(named.name(), twin.name());
        }
    }
}
