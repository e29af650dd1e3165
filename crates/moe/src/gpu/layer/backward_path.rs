//! [`ActivationBackwardPath`]: whether a Training layer's backward runs the routed
//! activation backward in the down dgrad's epilogue (one kernel, sm_90a or its sm_100a
//! twin) or as a kernel of its own after the dgrad.

use super::MoeLayer;
use crate::MoeError;

/// Where [`MoeLayer::backward`] runs the routed activation backward (`d_h_pre`, `h_scaled`,
/// `d_topk_weights` from the down dgrad's `dh_u` and the saved `h_pre`).
///
/// ```
/// use moefuse::gpu::ActivationBackwardPath;
/// assert_eq!(ActivationBackwardPath::default(), ActivationBackwardPath::Auto);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActivationBackwardPath {
    /// [`ActivationBackwardPath::Unfused`] while [`AUTO_FUSES_ACTIVATION_BACKWARD`] is off;
    /// when on, [`ActivationBackwardPath::Fused`] where the device runs it and
    /// [`fused_activation_backward_preferred`](crate::gpu::fused_activation_backward_preferred)
    /// holds. `MOEFUSE_FUSED_ACTIVATION_BWD=on|off` (read at layer creation) overrides both.
    #[default]
    Auto,
    /// The down dgrad writes `dh_u`, then the routed activation backward reads it.
    Unfused,
    /// One kernel (sm_90a, or its sm_100a twin where asked for; it reads `dy`'s token rows
    /// by `source_of`): the down dgrad's epilogue runs the routed activation backward on its
    /// tile; `dh_u` is never written.
    Fused,
}

/// Whether [`ActivationBackwardPath::Auto`] takes the fused kernel where
/// [`fused_activation_backward_preferred`](crate::gpu::fused_activation_backward_preferred)
/// holds. NOTES: off again (session 20). The fused kernel is verified with the layer's
/// wiring (`layer_gpu`'s moe_layer_activation_backward_paths_match_reference, H100), but the
/// rule it would apply was measured against the unfused down dgrad on the 1x1 contiguous
/// kernel; the dgrads now run the 2x1 twin, which took 44 % off GPT-OSS-120B's down dgrad
/// (2089 -> 1168 us) and 39 % off DeepSeek-V3's gate_up dgrad on the same H100, so the
/// unfused stage is expected to beat the fused one (DeepSeek-V3: ~4.6-5.0 ms against
/// 5.55 ms) until the two are timed side by side again (docs/perf-notes.md, session 20).
///
/// ```
/// use moefuse::gpu::AUTO_FUSES_ACTIVATION_BACKWARD;
/// println!("Auto fuses the activation backward: {AUTO_FUSES_ACTIVATION_BACKWARD}");
/// ```
pub const AUTO_FUSES_ACTIVATION_BACKWARD: bool = false;

impl MoeLayer {
    /// Where backwards run the routed activation backward ([`ActivationBackwardPath::Auto`]
    /// by default).
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Training)?;
    /// println!("activation backward: {:?}", layer.activation_backward_path());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn activation_backward_path(&self) -> ActivationBackwardPath {
        self.activation_backward_path
    }

    /// Chooses where backwards run the routed activation backward.
    /// [`ActivationBackwardPath::Fused`] on an Inference layer is [`MoeError::NotTraining`],
    /// and where the device cannot run it [`MoeError::Unsupported`].
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{ActivationBackwardPath, Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let mut layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Training)?;
    /// layer.set_activation_backward_path(ActivationBackwardPath::Unfused)?;
    /// assert_eq!(layer.activation_backward_path(), ActivationBackwardPath::Unfused);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_activation_backward_path(
        &mut self,
        path: ActivationBackwardPath,
    ) -> Result<(), MoeError> {
        if path == ActivationBackwardPath::Fused {
            if self.gemms.backward.is_none() {
                return Err(MoeError::NotTraining { mode: self.mode });
            }
            if !self.fused_activation_backward_runs() {
                return Err(MoeError::Unsupported {
                    what: "the fused activation backward needs an sm_90a or sm_100a device and \
                           a build with its kernels",
                });
            }
        }
        self.activation_backward_path = path;
        Ok(())
    }

    /// Whether the device runs the fused kernel (sm_90a or its sm_100a twin; it reads dy by
    /// `source_of` itself, whatever variant the unfused dgrad's plan chose).
    fn fused_activation_backward_runs(&self) -> bool {
        crate::gpu::fused::fused_kernels_run_on(self.gemm.kernels())
    }

    /// Whether this backward runs the fused kernel.
    pub(super) fn fuses_activation_backward(&self) -> bool {
        let Some(b) = &self.gemms.backward else {
            return false;
        };
        self.fused_activation_backward_runs()
            && match self.activation_backward_path {
                ActivationBackwardPath::Fused => true,
                ActivationBackwardPath::Unfused => false,
                // Auto (and its A/B override) only where the kernel was measured: sm_90a.
                ActivationBackwardPath::Auto => {
                    crate::gpu::fused::supported_by(self.gemm.kernels())
                        && b.forced_activation_backward.unwrap_or_else(|| {
                            AUTO_FUSES_ACTIVATION_BACKWARD
                                && crate::gpu::fused_activation_backward_preferred(
                                    self.plan.config(),
                                )
                        })
                }
            }
    }
}
