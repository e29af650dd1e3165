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
