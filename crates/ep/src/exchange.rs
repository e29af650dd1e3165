//! [`ExchangeLayer`], the layer at two or more ranks: route → dispatch → local gate_up
//! GEMM → activation → local down GEMM → combine, on the stream of its [`ExpertParallel`].
//! The public [`EpMoeLayer`](crate::EpMoeLayer) wraps it (and, at one rank, the
//! single-GPU layer instead).

use crate::error::need;
use crate::EpError;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse::gpu::{
    activation_forward, gate_up_fused, gate_up_fused_auto, gate_up_fused_preferred, route,
    ActivationDesc, DeviceErrors, GateUpInputs, GateUpRows, Mode, Rows,
};
use moefuse::MoeConfig;
use moefuse_comm::{CommError, EpConfig, ExpertParallel, Runtime, MAX_PULL_RANKS};
use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedGemm, GroupedPlan};
use moefuse_kernels::{DownScatter, Kernels, ScatterWeights};
use std::sync::Arc;

/// The weights of this rank's experts (experts `rank·E/N .. (rank+1)·E/N`), borrowed from
/// the caller for one call: `gate_up [E/N, W, D]` (`W = 2I` gated, in the config's gate/up
/// layout; `I` for `Relu2`) and `down [E/N, D, I]`, bf16.
///
/// ```no_run
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let s = ctx.default_stream();
/// let (gate_up, down) = (s.alloc_zeros::<half::bf16>(2 * 256 * 128)?, s.alloc_zeros::<half::bf16>(2 * 128 * 128)?);
/// let w = moefuse_ep::LocalWeights { gate_up: gate_up.as_view(), down: down.as_view() };
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct LocalWeights<'w> {
    /// `[E/N, W, D]`.
    pub gate_up: CudaView<'w, bf16>,
    /// `[E/N, D, I]`.
    pub down: CudaView<'w, bf16>,
}

/// Where a forward's routing comes from.
pub enum EpRouting<'a> {
    /// Router logits `[T, E]` (fp32, over all experts): the layer routes with the config's
    /// router (`MoeConfig::router`).
    Logits(&'a CudaSlice<f32>),
    /// Routing already on the device, read in place: expert ids `[T, k]` (global ids) and
    /// weights `[T, k]`.
    External {
        /// `[T, k]` expert ids in `0..E`.
        topk_ids: &'a CudaSlice<i32>,
        /// `[T, k]` routing weights.
        topk_weights: &'a CudaSlice<f32>,
    },
}

/// One rank's part of the exchange layer: built collectively (every rank, same `config` and
/// `max_tokens`), then called collectively, in the same order, on every rank.
pub(crate) struct ExchangeLayer {
    cfg: MoeConfig,
    max_tokens: usize,
    ep: ExpertParallel,
    stream: Arc<CudaStream>,
    gemm: GroupedGemm,
    gate_up: GroupedPlan,
    down: GroupedPlan,
    gemm_ws: CudaSlice<u8>,
    act: ActivationDesc,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    h_pre: CudaSlice<bf16>,
    h: CudaSlice<bf16>,
    y_e: CudaSlice<bf16>,
    /// The copied exchange's gate_up may be the fused one ([`gate_up_fused_auto`]: sm_90a).
    fused_auto: bool,
    /// The forward's exchange reads rows in place ([`RowDelivery::Pull`]).
    pull: bool,
    /// The launch layer (the pulled forward's scattered down GEMM).
    kernels: Kernels,
    /// The fused gate_up's error word (raised by a bad received-row table entry).
    errors: DeviceErrors,
    /// `Some` in Training: the backward's exchanges, plans, saved rows and scratch.
    pub(crate) train: Option<crate::backward::Training>,
    /// The last forward's token count, `Some` once a Training forward succeeded.
    pub(crate) last: Option<Last>,
}

/// The layer's buffers a backward reads and writes at once.
pub(crate) struct Parts<'a> {
    pub(crate) train: &'a mut crate::backward::Training,
    pub(crate) ep: &'a mut ExpertParallel,
    pub(crate) ids: &'a CudaSlice<i32>,
    pub(crate) gemm_ws: &'a mut CudaSlice<u8>,
    pub(crate) y_e: &'a CudaSlice<bf16>,
    pub(crate) h: &'a CudaSlice<bf16>,
    pub(crate) h_pre: &'a CudaSlice<bf16>,
}

/// What the backward needs to know of the last forward.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Last {
    pub(crate) tokens: usize,
    pub(crate) routed: bool,
}

impl ExchangeLayer {
    /// A layer of `config` for up to `max_tokens` tokens per rank and call, on `runtime`'s
    /// world (experts split evenly over the ranks, rank r holding experts `r·E/N..`), in
    /// `mode`. Collective: sizes are compared across ranks
    /// ([`moefuse_comm::CommError::ConfigMismatch`]). Allocates the exchange's symmetric
    /// buffers and the local intermediates for the worst case the exchange can deliver
    /// (`recv_rows_capacity` rows); Training also builds the backward's two exchanges (dy
    /// out and dx back; the `d_topk_weights` values back) and keeps the forward's received
    /// rows.
    pub fn with_mode(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        config: MoeConfig,
        max_tokens: usize,
        mode: Mode,
        delivery: RowDelivery,
    ) -> Result<Self, EpError> {
        config.validate()?;
        let (d, i, w, k) = (
            config.hidden,
            config.intermediate,
            config.gate_up_width(),
            config.top_k,
        );
        // The pulled path needs the sm_90a kernels (the fused gate_up and the scattered down
        // GEMM), as does the copied path's fused gate_up.
        let fused_ok = gate_up_fused_auto(stream)?;
        let exchange = EpConfig::new(config.experts, k, d, max_tokens);
        let ep = match delivery.resolve(fused_ok, runtime.ranks())? {
            // Auto falls back to copies where the peers are not load/store reachable: every
            // rank meets the same reachability (one NVLink domain or not), so all of them
            // fall back together. An explicit Pull fails instead.
            RowDelivery::Pull => match ExpertParallel::new(runtime, stream, exchange.pulled()) {
                Err(CommError::Unsupported(why)) if delivery == RowDelivery::Auto => {
                    tracing::info!(%why, "expert-parallel rows are copied, not pulled");
                    ExpertParallel::new(runtime, stream, exchange)?
                }
                other => other?,
            },
            _ => ExpertParallel::new(runtime, stream, exchange)?,
        };
        let pull = ep.config().pull_rows;
        let (local, rows) = (ep.placement().per_rank(), ep.recv_rows_capacity());
        if rows > i32::MAX as usize {
            return Err(EpError::Config(format!(
                "{rows} receive rows exceed the kernels' int32 row index"
            )));
        }
        let gemm = GroupedGemm::new(stream.context())?;
        let gate_up = gemm.plan(&GroupedDesc::forward(local, rows, w, d, BLayout::Nk))?;
        let down = gemm.plan(&GroupedDesc::forward(local, rows, d, i, BLayout::Nk))?;
        let train = match mode {
            Mode::Inference => None,
            Mode::Training => Some(crate::backward::Training::new(
                runtime, stream, &gemm, &config, max_tokens, local, rows, pull,
            )?),
        };
        let ws = [&gate_up, &down]
            .into_iter()
            .chain(train.iter().flat_map(|t| t.plans()))
            .map(|p| p.workspace_bytes())
            .max()
            .unwrap_or(0)
            .max(256);
        let slots = max_tokens * k;
        Ok(ExchangeLayer {
            cfg: config,
            max_tokens,
            stream: stream.clone(),
            gemm_ws: stream.alloc_zeros(ws)?,
            act: ActivationDesc::from_config(&config),
            ids: stream.alloc_zeros(slots.max(1))?,
            weights: stream.alloc_zeros(slots.max(1))?,
            // Pulled rows always take the fused gate_up: h_pre only for a backward.
            h_pre: stream.alloc_zeros(if pull && train.is_none() { 1 } else { rows * w })?,
            h: stream.alloc_zeros(rows * i)?,
            // Pulled: expert outputs go straight to the homes' slots (the backward reads
            // them there), never into a local y_e.
            y_e: stream.alloc_zeros(if pull { 1 } else { rows * d })?,
            kernels: Kernels::new(stream.context())?,
            fused_auto: fused_ok,
            pull,
            errors: DeviceErrors::new(stream)?,
            ep,
            gemm,
            gate_up,
            down,
            train,
            last: None,
        })
    }

    /// The stream every call runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Most tokens per call on this rank.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The exchanges' memory and this layer's own buffers ([`crate::EpLayerMemory`]).
    pub(crate) fn memory(&self) -> crate::EpLayerMemory {
        let mut m = crate::EpLayerMemory::default();
        m.add_exchange(self.ep.memory());
        m.layer = self.gemm_ws.len()
            + 4 * (self.ids.len() + self.weights.len())
            + 2 * (self.h_pre.len() + self.h.len() + self.y_e.len());
        if let Some(t) = &self.train {
            t.add_memory(&mut m);
        }
        m
    }

    /// The fields a backward uses at once (disjoint borrows), `None` in Inference.
    pub(crate) fn backward_parts(&mut self) -> Option<(Parts<'_>, &GroupedGemm, &ActivationDesc)> {
        let train = self.train.as_mut()?;
        Some((
            Parts {
                train,
                ep: &mut self.ep,
                ids: &self.ids,
                gemm_ws: &mut self.gemm_ws,
                y_e: &self.y_e,
                h: &self.h,
                h_pre: &self.h_pre,
            },
            &self.gemm,
            &self.act,
        ))
    }

    /// Whether the forward's rows are read in place ([`RowDelivery::Pull`]).
    pub fn rows_pulled(&self) -> bool {
        self.pull
    }

    /// Experts this rank holds (`E / ranks`).
    pub fn local_experts(&self) -> usize {
        self.ep.placement().per_rank()
    }

    /// The first global expert id this rank holds.
    pub fn first_expert(&self) -> usize {
        self.ep.rank() * self.local_experts()
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// Rows the local expert MLP can receive in one call (the exchange's worst case).
    pub fn recv_rows_capacity(&self) -> usize {
        self.ep.recv_rows_capacity()
    }

    /// `y [T, D] = MoE(x [T, D])` for this rank's `tokens` tokens (bf16, 16-byte aligned),
    /// with this rank's experts' `weights`, on the layer's stream. Collective. Every
    /// host-knowable check runs before any launch; a failure on one rank inside the
    /// exchange reaches the others as [`moefuse_comm::CommError::PeerAborted`] (no hang).
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
        self.last = None;
        self.check(weights, x, tokens, &routing, &*y)?;
        let (cfg, s, k) = (self.cfg, &self.stream, self.cfg.top_k);
        let routed = matches!(routing, EpRouting::Logits(_));
        // `None`: the layer's own copy (self.ids, self.weights), borrowed in the stage.
        let caller: Option<(&CudaSlice<i32>, &CudaSlice<f32>)> = match routing {
            EpRouting::Logits(logits) => {
                route(
                    &cfg,
                    s,
                    tokens,
                    logits,
                    None,
                    &mut self.ids,
                    &mut self.weights,
                )?;
                if let Some(t) = &mut self.train {
                    t.save_logits(s, logits, tokens * cfg.experts)?;
                }
                None
            }
            EpRouting::External {
                topk_ids,
                topk_weights,
            } if self.train.is_some() => {
                // Training: the backward re-sends by the same routing after the caller may
                // have moved on, so it is copied.
                let n = tokens * k;
                s.memcpy_dtod(&topk_ids.slice(..n), &mut self.ids.slice_mut(..n))?;
                s.memcpy_dtod(&topk_weights.slice(..n), &mut self.weights.slice_mut(..n))?;
                None
            }
            EpRouting::External {
                topk_ids,
                topk_weights,
            } => Some((topk_ids, topk_weights)),
        };
        if self.pull {
            self.forward_pulled(weights, x, tokens, caller, y)?;
        } else {
            self.forward_copied(weights, x, tokens, caller, y)?;
        }
        if self.train.is_some() {
            self.last = Some(Last { tokens, routed });
        }
        Ok(())
    }

    /// The forward's exchange and expert MLP with rows copied to the receivers: dispatch,
    /// the gate_up (fused over the received rows where that is faster, else the grouped
    /// GEMM and the activation), the down GEMM, combine.
    fn forward_copied<X, Y>(
        &mut self,
        weights: &LocalWeights<'_>,
        x: &X,
        tokens: usize,
        routing: Option<(&CudaSlice<i32>, &CudaSlice<f32>)>,
        y: &mut Y,
    ) -> Result<(), EpError>
    where
        X: DevicePtr<bf16>,
        Y: DevicePtrMut<bf16>,
    {
        let (cfg, s) = (self.cfg, &self.stream);
        let (ids, wts) = routing.unwrap_or((&self.ids, &self.weights));
        let (recv, local) = (self.ep.recv_rows_capacity(), self.local_experts());
        let (last, ranks) = (local - 1, self.ep.placement().ranks());
        let d = self.ep.dispatch(x, ids, wts, tokens)?;
        let offsets = d.offsets();
        // Each stage below reads the received-row count on the device (the last offset).
        // The received rows are already expert-major: where the single-GPU layer would fuse
        // (sm_90a, few rows per expert: every rank sends `tokens`), one kernel runs the
        // gate_up GEMM over them with the activation in its epilogue (h_pre only in
        // Training, for the backward). Its tile order follows the launch's rows, here the
        // receive capacity (every rank's worst case), not this call's count.
        if self.fused_auto && gate_up_fused_preferred(&cfg, tokens * ranks) {
            let inputs = GateUpInputs {
                tokens: recv,
                top_k: 1,
                experts: local,
                hidden: cfg.hidden,
                offsets,
                rows: GateUpRows::InOrder { x: d.x() },
                w: &weights.gate_up,
            };
            let h_pre = self
                .train
                .is_some()
                .then_some(&mut self.h_pre as &mut dyn DevicePtrMut<bf16>);
            gate_up_fused(&self.act, s, inputs, &mut self.h, h_pre, &mut self.errors)?;
        } else {
            self.gemm.run(
                &self.gate_up,
                s,
                offsets,
                d.x(),
                &weights.gate_up,
                &mut self.h_pre,
                &mut self.gemm_ws,
            )?;
            let last_offset = offsets.slice(last..);
            activation_forward(
                &self.act,
                s,
                Rows::from_device(&last_offset, recv),
                &self.h_pre,
                &mut self.h,
            )?;
        }
        self.gemm.run(
            &self.down,
            s,
            offsets,
            &self.h,
            &weights.down,
            &mut self.y_e,
            &mut self.gemm_ws,
        )?;
        Ok(d.combine(&self.y_e, y)?)
    }

    /// The forward with rows pulled (one NVLink domain): the dispatch moves only
    /// routing, the fused gate_up's producer reads every received row at its home rank
    /// (peer addresses), the down GEMM's epilogue writes every output row into its token's
    /// slot at home, and each rank sums its tokens' slots in slot order: no staged, received
    /// or expert-output row buffer, and the single-GPU layer's combine arithmetic. Training
    /// keeps h_pre; the received rows' table and the homes' slots stay in the exchange for
    /// the backward.
    fn forward_pulled<X, Y>(
        &mut self,
        weights: &LocalWeights<'_>,
        x: &X,
        tokens: usize,
        routing: Option<(&CudaSlice<i32>, &CudaSlice<f32>)>,
        y: &mut Y,
    ) -> Result<(), EpError>
    where
        X: DevicePtr<bf16>,
        Y: DevicePtrMut<bf16>,
    {
        let (cfg, s) = (self.cfg, &self.stream);
        let (ids, wts) = routing.unwrap_or((&self.ids, &self.weights));
        let (recv, local) = (self.ep.recv_rows_capacity(), self.local_experts());
        let d = self.ep.dispatch_pull(x, ids, wts, tokens)?;
        let inputs = GateUpInputs {
            tokens: recv,
            top_k: 1,
            experts: local,
            hidden: cfg.hidden,
            offsets: d.offsets(),
            rows: GateUpRows::Peers {
                peers: d.peer_rows(),
                source_of: d.row_sources(),
            },
            w: &weights.gate_up,
        };
        let h_pre = self
            .train
            .is_some()
            .then_some(&mut self.h_pre as &mut dyn DevicePtrMut<bf16>);
        gate_up_fused(&self.act, s, inputs, &mut self.h, h_pre, &mut self.errors)?;
        // The down GEMM stores each row's output straight into its token's slot at home;
        // combine_slots then sums every token's slots there, as the single-GPU combine.
        let dst = d.row_destinations();
        let down = DownScatter {
            rows: recv,
            experts: local,
            hidden: cfg.hidden,
            intermediate: cfg.intermediate,
            weights: ScatterWeights::OutByIn,
            offsets: d.offsets(),
            h: &self.h,
            w: &weights.down,
            dst: &dst,
        };
        self.kernels.launch(s, down)?;
        drop(dst);
        Ok(d.combine_slots(ids, wts, y)?)
    }

    /// Every host-knowable check of a forward.
    fn check(
        &self,
        weights: &LocalWeights<'_>,
        x: &dyn DevicePtr<bf16>,
        tokens: usize,
        routing: &EpRouting<'_>,
        y: &dyn DevicePtrMut<bf16>,
    ) -> Result<(), EpError> {
        let c = &self.cfg;
        let (local, d, i, w, k) = (
            self.local_experts(),
            c.hidden,
            c.intermediate,
            c.gate_up_width(),
            c.top_k,
        );
        if tokens > self.max_tokens {
            return Err(EpError::TooManyTokens {
                tokens,
                max: self.max_tokens,
            });
        }
        need("gate_up [E/N, W, D]", weights.gate_up.len(), local * w * d)?;
        need("down [E/N, D, I]", weights.down.len(), local * d * i)?;
        need("x [T, D]", x.len(), tokens * d)?;
        need("y [T, D]", y.len(), tokens * d)?;
        match routing {
            EpRouting::Logits(l) => need("logits [T, E]", l.len(), tokens * c.experts)?,
            EpRouting::External {
                topk_ids,
                topk_weights,
            } => {
                need("topk_ids [T, k]", topk_ids.len(), tokens * k)?;
                need("topk_weights [T, k]", topk_weights.len(), tokens * k)?;
            }
        }
        Ok(())
    }
}

/// How an [`EpMoeLayer`](crate::EpMoeLayer)'s forward brings token rows to the ranks of
/// their experts ([`EpMoeLayer::with_delivery`](crate::EpMoeLayer::with_delivery)).
///
/// ```
/// use moefuse_ep::RowDelivery;
/// assert_eq!(RowDelivery::default(), RowDelivery::Auto);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowDelivery {
    /// [`RowDelivery::Copy`] for now: whether pulling pays is for the multi-GPU run to
    /// measure (`bench_ep_layer` records both; pulling reads a token's row once per local
    /// expert it picks, ~1.5x the NVLink bytes of a copy for Qwen3-30B-A3B at EP = 8, and
    /// saves the staging write, the expand copy and a separate transfer phase).
    /// `MOEFUSE_EP_ROWS=pull` makes `Auto` pull where it can (A/B benchmarks).
    #[default]
    Auto,
    /// Each token row is copied once to every rank that holds one of its experts, into
    /// that rank's expert-major buffer (any world, any mode).
    Copy,
    /// Rows stay home: the dispatch sends only routing, the receivers' fused gate_up reads
    /// each row in place over NVLink, and the down GEMM stores each output row into its
    /// token's slot at home; the backward gathers `w · dy` and `x` rows from the homes the
    /// same way, computes `d_topk_weights` at home from the slots, and stores each `dx` row
    /// into its token's slot at home. Needs the fused gate_up (sm_90a), at most
    /// [`MAX_PULL_RANKS`] ranks, all reachable by load/store. Saves the staging,
    /// expert-major and expert-output row buffers and the backward's value exchange.
    Pull,
}

impl RowDelivery {
    /// The delivery a layer uses (`fused_ok`: the device runs the sm_90a fused kernels; `ranks`
    /// in the world): [`RowDelivery::Copy`] or [`RowDelivery::Pull`] (a Pull that cannot
    /// apply is an error).
    pub(crate) fn resolve(self, fused_ok: bool, ranks: usize) -> Result<Self, EpError> {
        let possible = fused_ok && (1..=MAX_PULL_RANKS).contains(&ranks);
        let asked = match (self, std::env::var("MOEFUSE_EP_ROWS").ok().as_deref()) {
            (RowDelivery::Auto, Some("pull")) if possible => RowDelivery::Pull,
            (RowDelivery::Auto, _) => RowDelivery::Copy,
            (explicit, _) => explicit,
        };
        if asked == RowDelivery::Pull && !possible {
            return Err(EpError::Config(format!(
                "RowDelivery::Pull needs a device that runs the fused gate_up (sm_90a: {fused_ok}) and 1..={MAX_PULL_RANKS} ranks ({ranks})"
            )));
        }
        Ok(asked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_pulled_only_when_asked_in_one_nvlink_domain() {
        let pick = |d: RowDelivery, ok: bool, n: usize| d.resolve(ok, n).ok();
        let (auto, copy, pull) = (RowDelivery::Auto, RowDelivery::Copy, RowDelivery::Pull);
        if std::env::var_os("MOEFUSE_EP_ROWS").is_none() {
            assert_eq!(pick(auto, true, 8), Some(copy));
        }
        assert_eq!(pick(pull, true, 8), Some(pull));
        assert_eq!(pick(pull, true, 2), Some(pull));
        assert_eq!(pick(copy, true, 8), Some(copy));
        assert_eq!(pick(pull, true, 1), Some(pull));
        for (ok, n) in [(false, 8), (true, 9), (true, 0)] {
            assert!(pick(pull, ok, n).is_none(), "{ok} {n}");
        }
    }
}
