//! [`EpMoeLayer`], the expert-parallel layer's API: at one rank the single-GPU
//! [`MoeLayer`] itself (no exchange, no symmetric buffers), at two or more ranks the
//! exchange layer ([`crate::exchange`]).

use crate::exchange::ExchangeLayer;
use crate::{EpError, EpGradients, EpRouting, LocalWeights, RowDelivery};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse::gpu::{Mode, MoeLayer, MoePlan, MoeWorkspace, Routing, Weights};
use moefuse::MoeConfig;
use moefuse_comm::Runtime;
use std::sync::Arc;

/// One rank's part of an expert-parallel MoE layer: built collectively (every rank, same
/// `config` and `max_tokens`), then called collectively, in the same order, on every rank.
///
/// At one rank it is moefuse's single-GPU [`MoeLayer`] (the same kernels, the same bits,
/// nothing exchanged); from two ranks on, each rank holds `E/N` experts and tokens travel
/// to them and back through NVSHMEM exchanges.
///
/// ```no_run
/// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>,
/// #         stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<(), moefuse_ep::EpError> {
/// let layer = moefuse_ep::EpMoeLayer::new(rt, stream, moefuse::MoeConfig::new(1024, 512, 16, 4), 256)?;
/// assert_eq!(layer.local_experts() * rt.ranks(), 16);
/// # Ok(()) }
/// ```
pub struct EpMoeLayer {
    inner: Inner,
}

enum Inner {
    /// One rank: the single-GPU layer and its workspace.
    Single(Box<Single>),
    /// Two or more ranks.
    Exchange(Box<ExchangeLayer>),
}

struct Single {
    layer: MoeLayer,
    workspace: MoeWorkspace,
    stream: Arc<CudaStream>,
    max_tokens: usize,
}

impl EpMoeLayer {
    /// An Inference layer ([`EpMoeLayer::with_mode`]).
    ///
    /// ```no_run
    /// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>,
    /// #         stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<(), moefuse_ep::EpError> {
    /// let layer = moefuse_ep::EpMoeLayer::new(rt, stream, moefuse::MoeConfig::new(1024, 512, 16, 4), 256)?;
    /// # Ok(()) }
    /// ```
    pub fn new(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        config: MoeConfig,
        max_tokens: usize,
    ) -> Result<Self, EpError> {
        Self::with_mode(runtime, stream, config, max_tokens, Mode::Inference)
    }

    /// A layer of `config` for up to `max_tokens` tokens per rank and call, on `runtime`'s
    /// world (experts split evenly over the ranks, rank r holding experts `r·E/N..`), in
    /// `mode` (Training keeps what the backward needs). Collective from two ranks on: sizes
    /// are compared across ranks ([`moefuse_comm::CommError::ConfigMismatch`]), the
    /// exchanges' symmetric buffers are allocated for the worst case they can deliver.
    ///
    /// ```no_run
    /// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>,
    /// #         stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<(), moefuse_ep::EpError> {
    /// use moefuse::gpu::Mode;
    /// let cfg = moefuse::MoeConfig::new(1024, 512, 16, 4);
    /// let layer = moefuse_ep::EpMoeLayer::with_mode(rt, stream, cfg, 256, Mode::Training)?;
    /// # Ok(()) }
    /// ```
    pub fn with_mode(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        config: MoeConfig,
        max_tokens: usize,
        mode: Mode,
    ) -> Result<Self, EpError> {
        Self::with_delivery(runtime, stream, config, max_tokens, mode, RowDelivery::Auto)
    }

    /// [`EpMoeLayer::with_mode`] with the forward's row delivery chosen ([`RowDelivery`]):
    /// `Auto` copies (see [`RowDelivery::Auto`]); an explicit `Pull` that cannot apply (a
    /// device without the fused gate_up, more than 8 ranks, peers not load/store
    /// reachable) is an error on every rank. Both modes pull (the backward too). At one
    /// rank `Auto` is the single-GPU layer, and an explicit `Copy` or `Pull` runs the
    /// exchange against this rank alone (to measure what the exchange costs).
    ///
    /// ```no_run
    /// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>,
    /// #         stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<(), moefuse_ep::EpError> {
    /// use moefuse::gpu::Mode;
    /// use moefuse_ep::{EpMoeLayer, RowDelivery};
    /// let cfg = moefuse::MoeConfig::new(2048, 768, 128, 8);
    /// let layer = EpMoeLayer::with_delivery(rt, stream, cfg, 4096, Mode::Inference, RowDelivery::Pull)?;
    /// assert!(layer.rows_pulled());
    /// # Ok(()) }
    /// ```
    pub fn with_delivery(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        config: MoeConfig,
        max_tokens: usize,
        mode: Mode,
        delivery: RowDelivery,
    ) -> Result<Self, EpError> {
        // One rank: the single-GPU layer, unless a delivery was asked for explicitly (then
        // the exchange runs against this rank alone: what it costs over the permutation).
        let inner = if runtime.ranks() == 1 && delivery == RowDelivery::Auto {
            let plan = MoePlan::new(config, max_tokens)?;
            let layer = MoeLayer::new(stream, &plan, mode)?;
            // What this layer's paths need (below the plan's bound where the GEMMs gather).
            let workspace = MoeWorkspace::new(stream, layer.workspace_bytes())?;
            Inner::Single(Box::new(Single {
                layer,
                workspace,
                stream: stream.clone(),
                max_tokens,
            }))
        } else {
            let layer =
                ExchangeLayer::with_mode(runtime, stream, config, max_tokens, mode, delivery)?;
            Inner::Exchange(Box::new(layer))
        };
        Ok(EpMoeLayer { inner })
    }

    /// The stream every call runs on.
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) { let _ = layer.stream(); }
    /// ```
    pub fn stream(&self) -> &Arc<CudaStream> {
        match &self.inner {
            Inner::Single(s) => &s.stream,
            Inner::Exchange(x) => x.stream(),
        }
    }

    /// What this rank's layer holds on its device ([`crate::EpLayerMemory`]): at one rank
    /// no exchange, the single-GPU layer's memory and its workspace; from two ranks the
    /// exchanges' symmetric and local buffers (allocated once, from `max_tokens · top_k`)
    /// and the layer's own.
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) {
    /// let m = layer.memory();
    /// println!("{m}"); // e.g. "1 exchange(s): 561.1 MiB symmetric + ...; total ... MiB"
    /// # }
    /// ```
    pub fn memory(&self) -> crate::EpLayerMemory {
        match &self.inner {
            Inner::Single(s) => crate::EpLayerMemory {
                layer: s.layer.memory().total() + s.workspace.bytes(),
                ..Default::default()
            },
            Inner::Exchange(x) => x.memory(),
        }
    }

    /// Most tokens per call on this rank.
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) { assert!(layer.max_tokens() > 0); }
    /// ```
    pub fn max_tokens(&self) -> usize {
        match &self.inner {
            Inner::Single(s) => s.max_tokens,
            Inner::Exchange(x) => x.max_tokens(),
        }
    }

    /// Whether the forward reads its received rows in place at their home ranks
    /// ([`RowDelivery::Pull`]); `false` for the single-GPU layer (one rank, `Auto`).
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) { println!("pulled: {}", layer.rows_pulled()); }
    /// ```
    pub fn rows_pulled(&self) -> bool {
        match &self.inner {
            Inner::Single(_) => false,
            Inner::Exchange(x) => x.rows_pulled(),
        }
    }

    /// Experts this rank holds (`E / ranks`).
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) { println!("{}", layer.local_experts()); }
    /// ```
    pub fn local_experts(&self) -> usize {
        match &self.inner {
            Inner::Single(s) => s.layer.config().experts,
            Inner::Exchange(x) => x.local_experts(),
        }
    }

    /// The first global expert id this rank holds.
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) { println!("{}", layer.first_expert()); }
    /// ```
    pub fn first_expert(&self) -> usize {
        match &self.inner {
            Inner::Single(_) => 0,
            Inner::Exchange(x) => x.first_expert(),
        }
    }

    /// The configuration.
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) { println!("{:?}", layer.config()); }
    /// ```
    pub fn config(&self) -> &MoeConfig {
        match &self.inner {
            Inner::Single(s) => s.layer.config(),
            Inner::Exchange(x) => x.config(),
        }
    }

    /// Rows the local expert MLP can receive in one call: the exchange's worst case, or at
    /// one rank `max_tokens · top_k`.
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) { println!("{}", layer.recv_rows_capacity()); }
    /// ```
    pub fn recv_rows_capacity(&self) -> usize {
        match &self.inner {
            Inner::Single(s) => s.max_tokens * s.layer.config().top_k,
            Inner::Exchange(x) => x.recv_rows_capacity(),
        }
    }

    /// `y [T, D] = MoE(x [T, D])` for this rank's `tokens` tokens (bf16, 16-byte aligned),
    /// with this rank's experts' `weights`, on the layer's stream. Collective. Every
    /// host-knowable check runs before any launch; a failure on one rank inside the
    /// exchange reaches the others as [`moefuse_comm::CommError::PeerAborted`] (no hang).
    ///
    /// ```no_run
    /// # fn demo(layer: &mut moefuse_ep::EpMoeLayer, w: &moefuse_ep::LocalWeights<'_>,
    /// #         x: &cudarc::driver::CudaSlice<half::bf16>, logits: &cudarc::driver::CudaSlice<f32>,
    /// #         y: &mut cudarc::driver::CudaSlice<half::bf16>) -> Result<(), moefuse_ep::EpError> {
    /// layer.forward(w, x, 128, moefuse_ep::EpRouting::Logits(logits), y)?;
    /// # Ok(()) }
    /// ```
    pub fn forward<X, Y>(
        &mut self,
        weights: &LocalWeights<'_>,
        x: &X,
        tokens: usize,
        routing: EpRouting<'_>,
        y: &mut Y,
    ) -> Result<(), EpError>
    where
        X: DevicePtr<bf16>,
        Y: DevicePtrMut<bf16>,
    {
        match &mut self.inner {
            Inner::Exchange(l) => l.forward(weights, x, tokens, routing, y),
            Inner::Single(s) => {
                if tokens > s.max_tokens {
                    return Err(EpError::TooManyTokens {
                        tokens,
                        max: s.max_tokens,
                    });
                }
                let routing = match routing {
                    EpRouting::Logits(l) => Routing::Logits(l),
                    EpRouting::External {
                        topk_ids,
                        topk_weights,
                    } => Routing::External {
                        topk_ids,
                        topk_weights,
                    },
                };
                let w = s.weights(weights)?;
                Ok(s.layer
                    .forward(&w, x, tokens, routing, y, &mut s.workspace)?)
            }
        }
    }

    /// Gradient buffers for this layer's backward (zeroed).
    ///
    /// ```no_run
    /// # fn demo(layer: &moefuse_ep::EpMoeLayer) -> Result<(), moefuse_ep::EpError> {
    /// let grads = layer.gradients()?;
    /// # Ok(()) }
    /// ```
    pub fn gradients(&self) -> Result<EpGradients, EpError> {
        match &self.inner {
            Inner::Single(s) => Ok(s.layer.gradients()?),
            Inner::Exchange(x) => x.gradients(),
        }
    }

    /// Gradients of the last forward for `dy [T, D]` (this rank's tokens): `dx [T, D]`, and
    /// into `grads` the local experts' weight gradients (added to their content when
    /// `accumulate`), `d_topk_weights`, and `d_logits` when the forward routed from
    /// logits. Collective; needs a Training layer and a forward that returned `Ok` (with
    /// pulled rows, one backward per forward: the backward reuses the forward's slots).
    ///
    /// ```no_run
    /// # fn demo(layer: &mut moefuse_ep::EpMoeLayer, w: &moefuse_ep::LocalWeights<'_>,
    /// #         dy: &cudarc::driver::CudaSlice<half::bf16>, dx: &mut cudarc::driver::CudaSlice<half::bf16>)
    /// #         -> Result<(), moefuse_ep::EpError> {
    /// let mut grads = layer.gradients()?;
    /// layer.backward(w, dy, dx, &mut grads, false)?;
    /// # Ok(()) }
    /// ```
    pub fn backward<G, X>(
        &mut self,
        weights: &LocalWeights<'_>,
        dy: &G,
        dx: &mut X,
        grads: &mut EpGradients,
        accumulate: bool,
    ) -> Result<(), EpError>
    where
        G: DevicePtr<bf16>,
        X: DevicePtrMut<bf16>,
    {
        match &mut self.inner {
            Inner::Exchange(l) => l.backward(weights, dy, dx, grads, accumulate),
            Inner::Single(s) => {
                let w = s.weights(weights)?;
                Ok(s.layer
                    .backward(&w, dy, dx, grads, accumulate, &mut s.workspace)?)
            }
        }
    }
}

impl Single {
    /// The caller's local weights as the single-GPU layer's exact-length views.
    fn weights<'w>(&self, w: &LocalWeights<'w>) -> Result<Weights<'w>, EpError> {
        let c = self.layer.config();
        let (gu, dn) = (
            c.experts * c.gate_up_width() * c.hidden,
            c.experts * c.hidden * c.intermediate,
        );
        crate::error::need("gate_up [E/N, W, D]", w.gate_up.len(), gu)?;
        crate::error::need("down [E/N, D, I]", w.down.len(), dn)?;
        Ok(Weights::new(w.gate_up.slice(..gu), w.down.slice(..dn)))
    }
}
