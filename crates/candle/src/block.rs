//! [`MoeBlock`]: a trainable MoE block on candle — the router weight and the flat expert
//! weight as [`Var`]s, the router's logits by candle, the experts by [`MoeOp`].

use crate::config::FlatLayout;
use crate::error::expect_shape;
use crate::{MoeCandleError, MoeOp};
use candle::{DType, Module, Tensor, Var};
use moefuse::MoeConfig;

/// An MoE block (router + experts) whose parameters are candle [`Var`]s:
///
/// * `router [E, D]`: `logits = x·routerᵀ`, computed by candle (in the router's dtype, then
///   f32), so the router trains through candle's own matmul backward;
/// * `experts [E·W·D + E·D·I]`: one flat Var, `gate_up [E, W, D]` then `down [E, D, I]`
///   ([`FlatLayout`]), read in place by [`MoeOp`] on every forward; an optimizer's step
///   (`Var::set`) writes into the same storage, so the next forward sees it.
///
/// `forward` takes `x [.., D]` (leading dimensions are flattened into tokens) and returns
/// `y` of the same shape. Build one with [`MoeBlock::new`], or load it from a Hugging Face
/// checkpoint ([`load_qwen3_moe`](crate::load_qwen3_moe), [`load_mixtral`](crate::load_mixtral)).
///
/// ```
/// use candle::{DType, Device, Module, Tensor, Var};
/// use candle_nn::{Optimizer, SGD};
/// use moefuse_candle::{FlatLayout, MoeBlock};
/// let cfg = moefuse_candle::qwen3_moe_config(64, 64, 4, 2, true)?;
/// let dev = Device::Cpu;
/// let router = Var::randn(0f32, 0.1, (4, 64), &dev)?;
/// let experts = Var::randn(0f32, 0.05, FlatLayout::new(&cfg).len(), &dev)?;
/// let block = MoeBlock::new(cfg, router, experts)?;
/// let mut opt = SGD::new(block.vars(), 0.1)?;
/// let x = Tensor::randn(0f32, 1.0, (2, 5, 64), &dev)?;
/// let loss = block.forward(&x)?.sqr()?.mean_all()?;
/// opt.backward_step(&loss)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct MoeBlock {
    op: MoeOp,
    router: Var,
    experts: Var,
}

impl MoeBlock {
    /// A block of `cfg` over the given Vars: `router [E, D]` (any float dtype) and
    /// `experts [E·W·D + E·D·I]` (bf16 to run on CUDA; any float dtype on the CPU), on one
    /// device. Checked: the config (as [`MoeOp::new`]), the shapes and the device.
    ///
    /// ```
    /// use candle::{Device, Var};
    /// let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// let bad = Var::zeros((4, 32), candle::DType::F32, &Device::Cpu)?;
    /// let experts = Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?;
    /// assert!(moefuse_candle::MoeBlock::new(cfg, bad, experts).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(cfg: MoeConfig, router: Var, experts: Var) -> Result<Self, MoeCandleError> {
        let op = MoeOp::new(cfg)?;
        expect_shape("router [E, D]", router.dims(), &[cfg.experts, cfg.hidden])?;
        expect_shape(
            "experts [E·W·D + E·D·I]",
            experts.dims(),
            &[op.layout().len()],
        )?;
        if !router.device().same_device(experts.device()) {
            return Err(MoeCandleError::Device {
                what: "router and experts",
                detail: format!("{:?} vs {:?}", router.device(), experts.device()),
            });
        }
        Ok(MoeBlock {
            op,
            router,
            experts,
        })
    }

    /// The layer's config.
    ///
    /// ```
    /// # use candle::{Device, Var};
    /// # let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// # let block = moefuse_candle::MoeBlock::new(cfg, Var::zeros((4, 64), candle::DType::F32, &Device::Cpu)?,
    /// #     Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(block.config().top_k, 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn config(&self) -> &MoeConfig {
        self.op.config()
    }

    /// The op that runs the experts (shares this block's GPU layer state).
    ///
    /// ```
    /// # use candle::{Device, Var};
    /// # let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// # let block = moefuse_candle::MoeBlock::new(cfg, Var::zeros((4, 64), candle::DType::F32, &Device::Cpu)?,
    /// #     Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(block.op().layout(), moefuse_candle::FlatLayout::new(&cfg));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn op(&self) -> &MoeOp {
        &self.op
    }

    /// The router weight `[E, D]`.
    ///
    /// ```
    /// # use candle::{Device, Var};
    /// # let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// # let block = moefuse_candle::MoeBlock::new(cfg, Var::zeros((4, 64), candle::DType::F32, &Device::Cpu)?,
    /// #     Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(block.router().dims(), &[4, 64]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn router(&self) -> &Var {
        &self.router
    }

    /// The flat expert weight `[E·W·D + E·D·I]`.
    ///
    /// ```
    /// # use candle::{Device, Var};
    /// # let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// # let block = moefuse_candle::MoeBlock::new(cfg, Var::zeros((4, 64), candle::DType::F32, &Device::Cpu)?,
    /// #     Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(block.experts().dims(), &[4 * 128 * 64 + 4 * 64 * 64]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn experts(&self) -> &Var {
        &self.experts
    }

    /// Both Vars, router first, for an optimizer.
    ///
    /// ```
    /// # use candle::{Device, Var};
    /// # let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// # let block = moefuse_candle::MoeBlock::new(cfg, Var::zeros((4, 64), candle::DType::F32, &Device::Cpu)?,
    /// #     Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?)?;
    /// use candle_nn::Optimizer;
    /// let opt = candle_nn::SGD::new(block.vars(), 1e-3)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn vars(&self) -> Vec<Var> {
        vec![self.router.clone(), self.experts.clone()]
    }

    /// `gate_up [E, W, D]`: a view of the flat Var (same storage, no copy; differentiable).
    ///
    /// ```
    /// # use candle::{Device, Var};
    /// # let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// # let block = moefuse_candle::MoeBlock::new(cfg, Var::zeros((4, 64), candle::DType::F32, &Device::Cpu)?,
    /// #     Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(block.gate_up()?.dims(), &[4, 128, 64]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn gate_up(&self) -> candle::Result<Tensor> {
        gate_up_view(self.experts.as_tensor(), self.op.layout())
    }

    /// `down [E, D, I]`: a view of the flat Var (same storage, no copy; differentiable).
    ///
    /// ```
    /// # use candle::{Device, Var};
    /// # let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// # let block = moefuse_candle::MoeBlock::new(cfg, Var::zeros((4, 64), candle::DType::F32, &Device::Cpu)?,
    /// #     Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(block.down()?.dims(), &[4, 64, 64]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn down(&self) -> candle::Result<Tensor> {
        down_view(self.experts.as_tensor(), self.op.layout())
    }

    /// Router logits `[T, E]` (f32) of `x [T, D]`: `x·routerᵀ` in the router's dtype.
    ///
    /// ```
    /// # use candle::{Device, Tensor, Var};
    /// # let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
    /// # let block = moefuse_candle::MoeBlock::new(cfg, Var::ones((4, 64), candle::DType::F32, &Device::Cpu)?,
    /// #     Var::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?)?;
    /// let l = block.router_logits(&Tensor::ones((3, 64), candle::DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(l.to_vec2::<f32>()?[0], vec![64.0; 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn router_logits(&self, x: &Tensor) -> candle::Result<Tensor> {
        let r = self.router.as_tensor();
        x.to_dtype(r.dtype())?.matmul(&r.t()?)?.to_dtype(DType::F32)
    }
}

impl Module for MoeBlock {
    /// `y [.., D]` for `x [.., D]`: router logits by candle, experts by [`MoeOp`].
    fn forward(&self, x: &Tensor) -> candle::Result<Tensor> {
        let d = self.config().hidden;
        let dims = x.dims().to_vec();
        if dims.last() != Some(&d) {
            let mut expected = dims.clone();
            if let Some(last) = expected.last_mut() {
                *last = d;
            }
            return Err(MoeCandleError::Shape {
                what: "x [.., D]",
                expected,
                found: dims,
            }
            .into());
        }
        let x2 = x.reshape(((), d))?;
        let logits = self.router_logits(&x2)?;
        self.op
            .apply(&x2, &logits, self.experts.as_tensor())?
            .reshape(dims)
    }
}

/// `gate_up [E, W, D]` of a flat expert tensor.
pub(crate) fn gate_up_view(flat: &Tensor, l: FlatLayout) -> candle::Result<Tensor> {
    flat.narrow(0, 0, l.gate_up)?
        .reshape(l.gate_up_shape().to_vec())
}

/// `down [E, D, I]` of a flat expert tensor.
pub(crate) fn down_view(flat: &Tensor, l: FlatLayout) -> candle::Result<Tensor> {
    flat.narrow(0, l.gate_up, l.down)?
        .reshape(l.down_shape().to_vec())
}
