//! The layer's device weights: [`Weights`], the views every call borrows from the caller,
//! and [`DeviceWeights`], an owned upload of the host [`MoeWeights`] to take them from.

use super::MoePlan;
use crate::gpu::check_device;
use crate::model::MoeWeights;
use crate::{MoeConfig, MoeError, RouterKind};
use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use half::bf16;
use std::sync::Arc;

/// Views of the expert weights a [`MoeLayer`](super::MoeLayer) call reads, borrowed from
/// buffers the caller owns (bf16, row-major, the layouts of [`MoeWeights`]):
///
/// * `gate_up [E, W, D]`, `down [E, D, I]`, exactly that many elements;
/// * `router_bias [E]` (f32): the `SigmoidGrouped` router's selection bias, if any (other
///   routers take none).
///
/// The layer keeps no copy: each call reads the buffers as they are on its stream, so an
/// optimizer step the caller makes between calls (on the same stream, or synchronised with
/// it) is what the next forward sees. A backward must get the weights its forward used.
///
/// ```no_run
/// use moefuse::{gpu::Weights, MoeConfig};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let cfg = MoeConfig::new(64, 64, 4, 2);
/// let gate_up = stream.alloc_zeros::<half::bf16>(4 * cfg.gate_up_width() * 64)?;
/// let down = stream.alloc_zeros::<half::bf16>(4 * 64 * 64)?;
/// let w = Weights::new(gate_up.as_view(), down.as_view());
/// assert!(w.router_bias.is_none());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Weights<'w> {
    /// `[E, W, D]` bf16.
    pub gate_up: CudaView<'w, bf16>,
    /// `[E, D, I]` bf16.
    pub down: CudaView<'w, bf16>,
    /// `[E]` f32 selection bias of the `SigmoidGrouped` router.
    pub router_bias: Option<CudaView<'w, f32>>,
}

impl<'w> Weights<'w> {
    /// The expert projections, no router bias.
    ///
    /// ```no_run
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let s = ctx.default_stream();
    /// let (gu, d) = (s.alloc_zeros::<half::bf16>(8)?, s.alloc_zeros::<half::bf16>(8)?);
    /// let w = moefuse::gpu::Weights::new(gu.slice(..), d.slice(..));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(gate_up: CudaView<'w, bf16>, down: CudaView<'w, bf16>) -> Self {
        Weights {
            gate_up,
            down,
            router_bias: None,
        }
    }

    /// Adds the `SigmoidGrouped` router's `[E]` selection bias.
    ///
    /// ```no_run
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let s = ctx.default_stream();
    /// # let (gu, d) = (s.alloc_zeros::<half::bf16>(8)?, s.alloc_zeros::<half::bf16>(8)?);
    /// let bias = s.alloc_zeros::<f32>(16)?;
    /// let w = moefuse::gpu::Weights::new(gu.as_view(), d.as_view()).with_router_bias(bias.as_view());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_router_bias(mut self, bias: CudaView<'w, f32>) -> Self {
        self.router_bias = Some(bias);
        self
    }

    /// Exact shapes for `plan`, a bias only for the `SigmoidGrouped` router, and every
    /// view in `stream`'s context.
    pub(super) fn check(&self, plan: &MoePlan, stream: &CudaStream) -> Result<(), MoeError> {
        let cfg = plan.config();
        let (d, i, e, w) = (
            cfg.hidden,
            cfg.intermediate,
            cfg.experts,
            cfg.gate_up_width(),
        );
        // validate(): E <= 512, W <= 2^21, D, I <= 2^20: no product overflows.
        exact("gate_up [E, W, D]", &self.gate_up, e * w * d, stream)?;
        exact("down [E, D, I]", &self.down, e * d * i, stream)?;
        if let Some(b) = &self.router_bias {
            if !matches!(cfg.router, RouterKind::SigmoidGrouped { .. }) {
                return Err(MoeError::UnexpectedRouterBias);
            }
            exact("router bias [E]", b, e, stream)?;
        }
        Ok(())
    }
}

fn exact<T>(
    what: &'static str,
    view: &CudaView<'_, T>,
    expected: usize,
    stream: &CudaStream,
) -> Result<(), MoeError> {
    if view.len() != expected {
        return Err(MoeError::ShapeMismatch {
            what,
            expected,
            found: view.len(),
        });
    }
    check_device(what, view, stream)
}

/// Device copies of a layer's weights, rounded to bf16, owned by the caller (update them
/// in place; [`DeviceWeights::view`] lends them to each call). A convenience for tests and
/// examples: any buffers of the right shapes serve as well.
///
/// ```no_run
/// use moefuse::{gpu::DeviceWeights, model::MoeWeights, MoeConfig};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let cfg = MoeConfig::new(64, 64, 4, 2);
/// let mut w = DeviceWeights::upload(&stream, &cfg, &MoeWeights::zeros(&cfg, false))?;
/// stream.memset_zeros(&mut w.down)?; // an update the next forward sees
/// let view = w.view();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceWeights {
    /// `[E, W, D]` bf16.
    pub gate_up: CudaSlice<bf16>,
    /// `[E, D, I]` bf16.
    pub down: CudaSlice<bf16>,
    /// `[E]` f32, the `SigmoidGrouped` router's bias (from `MoeWeights::router_bias`).
    pub router_bias: Option<CudaSlice<f32>>,
}

impl DeviceWeights {
    /// Checks `cfg` and `weights` ([`MoeWeights::validate`]; a bias only for the
    /// `SigmoidGrouped` router) before copying anything, then uploads gate_up and down
    /// rounded to bf16 and the bias as f32. The router matrix stays on the host (the
    /// layer takes logits).
    pub fn upload(
        stream: &Arc<CudaStream>,
        cfg: &MoeConfig,
        weights: &MoeWeights,
    ) -> Result<Self, MoeError> {
        cfg.validate()?;
        weights.validate(cfg)?;
        if weights.router_bias.is_some() && !matches!(cfg.router, RouterKind::SigmoidGrouped { .. })
        {
            return Err(MoeError::UnexpectedRouterBias);
        }
        let bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        Ok(DeviceWeights {
            gate_up: stream.clone_htod(&bf(&weights.gate_up))?,
            down: stream.clone_htod(&bf(&weights.down))?,
            router_bias: match &weights.router_bias {
                Some(b) => Some(stream.clone_htod(b)?),
                None => None,
            },
        })
    }

    /// Views of all three for one call.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::DeviceWeights, model::MoeWeights, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let cfg = MoeConfig::new(64, 64, 4, 2);
    /// let w = DeviceWeights::upload(&ctx.default_stream(), &cfg, &MoeWeights::zeros(&cfg, false))?;
    /// assert_eq!(w.view().down.len(), 4 * 64 * 64);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn view(&self) -> Weights<'_> {
        Weights {
            gate_up: self.gate_up.as_view(),
            down: self.down.as_view(),
            router_bias: self.router_bias.as_ref().map(|b| b.as_view()),
        }
    }
}
