//! [`MoeOp`]: moefuse's MoE layer as a candle [`CustomOp3`] on (x, router logits, flat
//! expert weights), forward and backward, on the CPU (moefuse's f32 reference) and, with
//! the `cuda` feature, on the GPU (moefuse's layer on candle's stream).

use crate::config::FlatLayout;
use crate::error::expect_shape;
use crate::{cpu, MoeCandleError};
use candle::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use moefuse::MoeConfig;
#[cfg(feature = "cuda")]
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(feature = "cuda")]
use std::sync::{Arc, Mutex};

/// Every call gets its own number, so a backward knows whether the GPU layer's saved state
/// is its own forward's.
#[cfg(feature = "cuda")]
static NEXT_CALL: AtomicU64 = AtomicU64::new(1);

/// The MoE block's expert part as a candle op: `y [T, D] = MoE(x [T, D])` routed by the
/// caller's router logits `[T, E]`, with the expert weights in one flat tensor
/// `[E·W·D + E·D·I]` ([`FlatLayout`]: `gate_up [E, W, D]` then `down [E, D, I]`).
///
/// [`MoeOp::apply`] records the op in candle's graph, so `loss.backward()` gives the
/// gradients of `x`, of the logits (and through them of a router weight computed by
/// candle) and of the flat weight (a [`candle::Var`] an optimizer updates in place).
/// Routing follows the config's [`RouterKind`](moefuse::RouterKind); the selection is held
/// constant in the backward, gradients flow through softmax and renormalisation.
///
/// * CPU: moefuse's reference in f32 (sums in f64), for tensors of any float dtype (the
///   output takes `x`'s dtype); the backward recomputes the forward.
/// * CUDA (feature `cuda`): moefuse's fused layer on candle's stream, `x` and the weight
///   in bf16 (`x` of another float dtype is converted, and `y` back), logits in f32
///   (converted). The op keeps one layer, its saved state and workspace for every call of
///   this `MoeOp` (and its clones); a backward whose forward's state was overwritten by a
///   later call recomputes its forward first.
///
/// ```
/// use candle::{DType, Device, Tensor, Var};
/// use moefuse_candle::{FlatLayout, MoeOp};
/// let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
/// let op = MoeOp::new(cfg)?;
/// let dev = Device::Cpu;
/// let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 64), &dev)?)?;
/// let logits = Tensor::randn(0f32, 1.0, (3, 4), &dev)?;
/// let w = Var::from_tensor(&(Tensor::randn(0f32, 1.0, FlatLayout::new(&cfg).len(), &dev)? * 0.05)?)?;
/// let y = op.apply(&x, &logits, &w)?;
/// let grads = y.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&w).unwrap().dims(), w.dims());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct MoeOp {
    cfg: MoeConfig,
    layout: FlatLayout,
    #[cfg(feature = "cuda")]
    cache: Arc<Mutex<crate::cuda::LayerCache>>,
}

impl MoeOp {
    /// An op for `cfg`: validated, and its router must route from logits (not
    /// [`RouterKind::External`](moefuse::RouterKind::External)).
    ///
    /// ```
    /// use moefuse::{MoeConfig, RouterKind};
    /// assert!(moefuse_candle::MoeOp::new(MoeConfig::new(64, 64, 4, 2)).is_ok());
    /// assert!(moefuse_candle::MoeOp::new(MoeConfig::new(64, 64, 4, 2).with_router(RouterKind::External)).is_err());
    /// ```
    pub fn new(cfg: MoeConfig) -> Result<Self, MoeCandleError> {
        cfg.validate()?;
        if !cfg.router.computes_routing() {
            return Err(MoeCandleError::Moe(moefuse::MoeError::ExternalRouter));
        }
        Ok(MoeOp {
            cfg,
            layout: FlatLayout::new(&cfg),
            #[cfg(feature = "cuda")]
            cache: Arc::default(),
        })
    }

    /// The layer's config.
    ///
    /// ```
    /// let op = moefuse_candle::MoeOp::new(moefuse::MoeConfig::new(64, 64, 4, 2))?;
    /// assert_eq!(op.config().experts, 4);
    /// # Ok::<(), moefuse_candle::MoeCandleError>(())
    /// ```
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The flat weight's layout.
    ///
    /// ```
    /// let op = moefuse_candle::MoeOp::new(moefuse::MoeConfig::new(64, 64, 4, 2))?;
    /// assert_eq!(op.layout().len(), 4 * 128 * 64 + 4 * 64 * 64);
    /// # Ok::<(), moefuse_candle::MoeCandleError>(())
    /// ```
    pub fn layout(&self) -> FlatLayout {
        self.layout
    }

    /// `y [T, D]` from `x [T, D]`, `logits [T, E]` and the flat `experts [E·W·D + E·D·I]`,
    /// recorded for candle's backward. Shapes, devices and dtypes are checked first (see
    /// the type's docs for the dtypes each device takes); non-contiguous inputs are made
    /// contiguous.
    ///
    /// ```
    /// use candle::{Device, Tensor};
    /// let cfg = moefuse::MoeConfig::new(64, 64, 2, 1);
    /// let op = moefuse_candle::MoeOp::new(cfg)?;
    /// let x = Tensor::ones((2, 64), candle::DType::F32, &Device::Cpu)?;
    /// let logits = Tensor::new(&[[1f32, 0.0], [0.0, 1.0]], &Device::Cpu)?;
    /// let w = Tensor::zeros(op.layout().len(), candle::DType::F32, &Device::Cpu)?;
    /// let y = op.apply(&x, &logits, &w)?;
    /// assert_eq!(y.sum_all()?.to_scalar::<f32>()?, 0.0); // zero experts
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply(&self, x: &Tensor, logits: &Tensor, experts: &Tensor) -> candle::Result<Tensor> {
        Ok(self.apply_checked(x, logits, experts)?)
    }

    fn apply_checked(
        &self,
        x: &Tensor,
        logits: &Tensor,
        experts: &Tensor,
    ) -> Result<Tensor, MoeCandleError> {
        let (c, dev) = (&self.cfg, x.device());
        let tokens = x.dims().first().copied().unwrap_or(0);
        expect_shape("x [T, D]", x.dims(), &[tokens, c.hidden])?;
        c.check_tokens(tokens)?;
        expect_shape("logits [T, E]", logits.dims(), &[tokens, c.experts])?;
        expect_shape(
            "experts [E·W·D + E·D·I]",
            experts.dims(),
            &[self.layout.len()],
        )?;
        for (what, t) in [("logits", logits), ("experts", experts)] {
            if !t.device().same_device(dev) {
                return Err(MoeCandleError::Device {
                    what,
                    detail: format!("on {:?}, x on {:?}", t.device(), dev),
                });
            }
        }
        for (what, t) in [("x", x), ("logits", logits), ("experts", experts)] {
            if !t.dtype().is_float() {
                return Err(MoeCandleError::DType {
                    what,
                    expected: "a float dtype",
                    found: t.dtype(),
                });
            }
        }
        let call = MoeCall {
            cfg: self.cfg,
            layout: self.layout,
            #[cfg(feature = "cuda")]
            call: NEXT_CALL.fetch_add(1, Ordering::Relaxed),
            #[cfg(feature = "cuda")]
            cache: self.cache.clone(),
            #[cfg(feature = "cuda")]
            train: x.track_op() || logits.track_op() || experts.track_op(),
        };
        if dev.is_cpu() {
            return Ok(x.contiguous()?.apply_op3(
                &logits.contiguous()?,
                &experts.contiguous()?,
                call,
            )?);
        }
        if !dev.is_cuda() || !cfg!(feature = "cuda") {
            return Err(MoeCandleError::Device {
                what: "moefuse MoE op",
                detail: format!(
                    "{dev:?} has no path: the CPU always, CUDA with the `cuda` feature"
                ),
            });
        }
        if experts.dtype() != DType::BF16 {
            return Err(MoeCandleError::DType {
                what: "experts",
                expected: "bf16 on CUDA",
                found: experts.dtype(),
            });
        }
        let xb = x.to_dtype(DType::BF16)?.contiguous()?;
        let lf = logits.to_dtype(DType::F32)?.contiguous()?;
        let y = xb.apply_op3(&lf, &experts.contiguous()?, call)?;
        Ok(y.to_dtype(x.dtype())?)
    }
}

/// One call of a [`MoeOp`]: the node candle keeps in its graph.
pub(crate) struct MoeCall {
    pub(crate) cfg: MoeConfig,
    pub(crate) layout: FlatLayout,
    /// This call's number (see [`NEXT_CALL`]).
    #[cfg(feature = "cuda")]
    pub(crate) call: u64,
    #[cfg(feature = "cuda")]
    pub(crate) cache: Arc<Mutex<crate::cuda::LayerCache>>,
    /// Whether candle tracks gradients through this call (the GPU layer then keeps state).
    #[cfg(feature = "cuda")]
    pub(crate) train: bool,
}

impl CustomOp3 for MoeCall {
    fn name(&self) -> &'static str {
        "moefuse-moe"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        Ok(cpu::forward(self, (s1, l1), (s2, l2), (s3, l3))?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> candle::Result<(candle::CudaStorage, Shape)> {
        Ok(crate::cuda::forward(self, (s1, l1), (s2, l2), (s3, l3))?)
    }

    fn bwd(
        &self,
        x: &Tensor,
        logits: &Tensor,
        experts: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dl, dw) = if x.device().is_cpu() {
            cpu::backward(self, x, logits, experts, dy)?
        } else {
            self.gpu_backward(x, logits, experts, dy)?
        };
        Ok((Some(dx), Some(dl), Some(dw)))
    }
}

impl MoeCall {
    #[cfg(feature = "cuda")]
    fn gpu_backward(
        &self,
        x: &Tensor,
        logits: &Tensor,
        experts: &Tensor,
        dy: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor), MoeCandleError> {
        crate::cuda::backward(self, x, logits, experts, dy)
    }

    #[cfg(not(feature = "cuda"))]
    fn gpu_backward(
        &self,
        x: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor), MoeCandleError> {
        Err(MoeCandleError::Device {
            what: "moefuse MoE backward",
            detail: format!("{:?} has no path without the `cuda` feature", x.device()),
        })
    }
}
