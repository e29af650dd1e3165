//! Loading a Hugging Face MoE block (Qwen3-MoE, Mixtral) through candle-nn's
//! [`VarBuilder`]: the per-expert `[I, D]`/`[D, I]` projections are stacked into our flat
//! expert weight ([`FlatLayout`](crate::FlatLayout)), in the config's gate/up layout.

use crate::{MoeBlock, MoeCandleError};
use candle::{DType, Tensor, Var};
use candle_nn::VarBuilder;
use moefuse::{GateUpLayout, MoeConfig};

/// The tensor names of a Hugging Face MoE block under a layer prefix such as
/// `model.layers.3` (weights as `nn.Linear` stores them, `[out, in]`):
///
/// | | router `[E, D]` | gate `[I, D]` | up `[I, D]` | down `[D, I]` |
/// |---|---|---|---|---|
/// | `Qwen3Moe` | `mlp.gate.weight` | `mlp.experts.{e}.gate_proj.weight` | `….up_proj.weight` | `….down_proj.weight` |
/// | `Mixtral` | `block_sparse_moe.gate.weight` | `block_sparse_moe.experts.{e}.w1.weight` | `….w3.weight` | `….w2.weight` |
///
/// HF's `gate_proj`/`w1` rows are our gate columns and `up_proj`/`w3` rows our up
/// columns: with the split layout expert `e`'s `gate_up` is `[gate; up]` (rows `0..I`
/// gate, `I..2I` up), with the interleaved one row `2j` is gate `j` and `2j + 1` up `j`.
/// `down_proj`/`w2` is our `down[e]` as it is.
///
/// ```
/// use moefuse_candle::HfNaming;
/// assert_eq!(HfNaming::Qwen3Moe.router("model.layers.0"), "model.layers.0.mlp.gate.weight");
/// assert_eq!(HfNaming::Mixtral.expert("model.layers.1", 7)[2],
///     "model.layers.1.block_sparse_moe.experts.7.w2.weight");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HfNaming {
    /// `Qwen3MoeSparseMoeBlock` (also Qwen2-MoE's experts, without its shared expert).
    Qwen3Moe,
    /// `MixtralSparseMoeBlock`.
    Mixtral,
}

impl HfNaming {
    fn block(&self) -> &'static str {
        match self {
            HfNaming::Qwen3Moe => "mlp",
            HfNaming::Mixtral => "block_sparse_moe",
        }
    }

    /// The router weight's name.
    ///
    /// ```
    /// assert_eq!(moefuse_candle::HfNaming::Mixtral.router(""), "block_sparse_moe.gate.weight");
    /// ```
    pub fn router(&self, layer_prefix: &str) -> String {
        format!("{}{}.gate.weight", dotted(layer_prefix), self.block())
    }

    /// Expert `e`'s `[gate, up, down]` weight names.
    ///
    /// ```
    /// let [gate, up, _] = moefuse_candle::HfNaming::Qwen3Moe.expert("model.layers.0", 2);
    /// assert_eq!(gate, "model.layers.0.mlp.experts.2.gate_proj.weight");
    /// assert_eq!(up, "model.layers.0.mlp.experts.2.up_proj.weight");
    /// ```
    pub fn expert(&self, layer_prefix: &str, e: usize) -> [String; 3] {
        let base = format!("{}{}.experts.{e}", dotted(layer_prefix), self.block());
        let [g, u, d] = match self {
            HfNaming::Qwen3Moe => ["gate_proj", "up_proj", "down_proj"],
            HfNaming::Mixtral => ["w1", "w3", "w2"],
        };
        [g, u, d].map(|p| format!("{base}.{p}.weight"))
    }
}

fn dotted(prefix: &str) -> String {
    if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}.")
    }
}

/// Loads a Qwen3-MoE block (`model.layers.{i}.mlp.…`, see [`HfNaming`]) from `vb` (e.g.
/// `VarBuilder::from_tensors(candle::safetensors::load(path, &dev)?, DType::BF16, &dev)`):
/// the router as an f32 Var `[E, D]`, the experts stacked into one flat Var in `vb`'s
/// dtype and on its device. Every tensor's shape is checked against `cfg`.
///
/// ```no_run
/// use candle::{DType, Device};
/// use candle_nn::VarBuilder;
/// let dev = Device::new_cuda(0)?;
/// let tensors = candle::safetensors::load("model-00001-of-00016.safetensors", &dev)?;
/// let vb = VarBuilder::from_tensors(tensors, DType::BF16, &dev);
/// let cfg = moefuse_candle::qwen3_moe_config(2048, 768, 128, 8, true)?;
/// let block = moefuse_candle::load_qwen3_moe(&vb, &cfg, "model.layers.0")?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load_qwen3_moe(
    vb: &VarBuilder,
    cfg: &MoeConfig,
    layer_prefix: &str,
) -> Result<MoeBlock, MoeCandleError> {
    load_hf(vb, cfg, layer_prefix, HfNaming::Qwen3Moe)
}

/// Loads a Mixtral block (`model.layers.{i}.block_sparse_moe.…`, `w1` gate, `w3` up, `w2`
/// down; see [`HfNaming`]) from `vb`, as [`load_qwen3_moe`] does.
///
/// ```no_run
/// use candle::{DType, Device};
/// let dev = Device::Cpu;
/// let vb = candle_nn::VarBuilder::from_tensors(candle::safetensors::load("mixtral.safetensors", &dev)?, DType::F32, &dev);
/// let cfg = moefuse_candle::mixtral_config(4096, 14336, 8, 2)?;
/// let block = moefuse_candle::load_mixtral(&vb, &cfg, "model.layers.0")?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load_mixtral(
    vb: &VarBuilder,
    cfg: &MoeConfig,
    layer_prefix: &str,
) -> Result<MoeBlock, MoeCandleError> {
    load_hf(vb, cfg, layer_prefix, HfNaming::Mixtral)
}

/// Loads the block named by `naming` under `layer_prefix` (see [`load_qwen3_moe`]).
/// The config's activation must be gated (HF blocks have a gate and an up projection).
///
/// ```no_run
/// # use candle::{DType, Device};
/// # let dev = Device::Cpu;
/// # let vb = candle_nn::VarBuilder::from_tensors(Default::default(), DType::F32, &dev);
/// let cfg = moefuse_candle::qwen3_moe_config(64, 64, 4, 2, true)?;
/// let block = moefuse_candle::load_hf(&vb, &cfg, "model.layers.0", moefuse_candle::HfNaming::Qwen3Moe)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load_hf(
    vb: &VarBuilder,
    cfg: &MoeConfig,
    layer_prefix: &str,
    naming: HfNaming,
) -> Result<MoeBlock, MoeCandleError> {
    cfg.validate()?;
    if !cfg.activation.is_gated() {
        return Err(MoeCandleError::Unsupported {
            what: format!(
                "{naming:?} blocks are gated (gate and up projections); {:?} is not",
                cfg.activation
            ),
        });
    }
    let (d, i, e_count) = (cfg.hidden, cfg.intermediate, cfg.experts);
    let router = vb
        .get((e_count, d), &naming.router(layer_prefix))?
        .to_dtype(DType::F32)?;
    let mut gate_ups = Vec::with_capacity(e_count);
    let mut downs = Vec::with_capacity(e_count);
    for e in 0..e_count {
        let [g, u, dn] = naming.expert(layer_prefix, e);
        let (gate, up) = (vb.get((i, d), &g)?, vb.get((i, d), &u)?);
        let gate_up = match cfg.gate_up_layout {
            GateUpLayout::Split => Tensor::cat(&[&gate, &up], 0)?,
            GateUpLayout::Interleaved => Tensor::stack(&[&gate, &up], 1)?.reshape((2 * i, d))?,
        };
        gate_ups.push(gate_up.flatten_all()?);
        downs.push(vb.get((d, i), &dn)?.flatten_all()?);
    }
    gate_ups.extend(downs);
    let flat = Tensor::cat(&gate_ups, 0)?;
    tracing::debug!(?naming, layer_prefix, experts = e_count, dtype = ?vb.dtype(), "loaded HF MoE block");
    MoeBlock::new(*cfg, Var::from_tensor(&router)?, Var::from_tensor(&flat)?)
}
