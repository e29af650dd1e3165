//! The op on CUDA (feature `cuda`): moefuse's [`MoeLayer`] on candle's stream, reading
//! views of candle's device buffers in place (x, logits, the flat expert weight, dy).
//!
//! One [`LayerCache`] per [`MoeOp`](crate::MoeOp) holds the layer, its plan, workspace and
//! gradient buffers, rebuilt only when a call needs more tokens, Training after
//! Inference, or another stream. The layer keeps the state of its last Training forward;
//! the cache remembers which call that was, and a backward of another call recomputes its
//! own forward first (e.g. a block applied twice before one `loss.backward()`).

use crate::op::MoeCall;
use crate::MoeCandleError;
use candle::backend::BackendStorage;
use candle::op::BackpropOp;
use candle::{CudaStorage, DType, Device, Layout, Shape, Storage, Tensor};
use half::bf16;
use moefuse::cudarc::driver::{CudaSlice, CudaStream, CudaView};
use moefuse::gpu::{Gradients, Mode, MoeLayer, MoePlan, MoeWorkspace, Routing, Weights};
use std::sync::{Arc, MutexGuard};

/// The GPU layer of one [`MoeOp`](crate::MoeOp), shared by all its calls.
#[derive(Default)]
pub(crate) struct LayerCache {
    bound: Option<Bound>,
}

/// A layer bound to a stream, with what its calls reuse.
struct Bound {
    stream: Arc<CudaStream>,
    plan: MoePlan,
    layer: MoeLayer,
    ws: MoeWorkspace,
    /// Allocated by the first backward.
    grads: Option<Gradients>,
    /// The call whose forward state the layer holds (Training only).
    last_call: Option<u64>,
}

impl LayerCache {
    /// The layer for `tokens` tokens in `mode` on `stream`: the bound one when it fits,
    /// else a new one (for at least the old token bound; Training once Training was asked).
    fn bind(
        &mut self,
        cfg: &moefuse::MoeConfig,
        stream: &Arc<CudaStream>,
        tokens: usize,
        mode: Mode,
    ) -> Result<&mut Bound, MoeCandleError> {
        let old = self.bound.take().filter(|b| Arc::ptr_eq(&b.stream, stream));
        if let Some(b) = old {
            let training_ok = mode == Mode::Inference || b.layer.mode() == Mode::Training;
            if b.plan.max_tokens() >= tokens && training_ok {
                return Ok(self.bound.insert(b));
            }
            self.bound = Some(b);
        }
        let (max_tokens, mode) = match self.bound.take() {
            Some(b) => (
                b.plan.max_tokens().max(tokens),
                match b.layer.mode() {
                    Mode::Training => Mode::Training,
                    Mode::Inference => mode,
                },
            ),
            None => (tokens, mode),
        };
        let plan = MoePlan::new(*cfg, max_tokens)?;
        let layer = MoeLayer::new(stream, &plan, mode)?;
        let ws = MoeWorkspace::new(stream, layer.workspace_bytes())?; // what its paths need
        tracing::debug!(max_tokens, %mode, memory = %layer.memory(), "moefuse-candle: bound a GPU layer");
        Ok(self.bound.insert(Bound {
            stream: stream.clone(),
            plan,
            layer,
            ws,
            grads: None,
            last_call: None,
        }))
    }
}

impl Bound {
    /// The layer's forward of `call` into `y`; remembers the call when the layer kept state.
    fn forward(
        &mut self,
        call: &MoeCall,
        x: &CudaView<'_, bf16>,
        logits: &CudaSlice<f32>,
        experts: &CudaView<'_, bf16>,
        tokens: usize,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), MoeCandleError> {
        self.last_call = None;
        let n = call.layout.gate_up;
        let weights = Weights::new(experts.slice(..n), experts.slice(n..));
        let routing = Routing::Logits(logits);
        self.layer
            .forward(&weights, x, tokens, routing, y, &mut self.ws)?;
        if self.layer.mode() == Mode::Training {
            self.last_call = Some(call.call);
        }
        Ok(())
    }
}

/// The cache of `call`, recovered (emptied) if an earlier call panicked holding it.
fn lock(call: &MoeCall) -> MutexGuard<'_, LayerCache> {
    call.cache.lock().unwrap_or_else(|poisoned| {
        call.cache.clear_poison();
        let mut cache = poisoned.into_inner();
        cache.bound = None;
        cache
    })
}

/// `(T, D, E)` of the call's inputs, checked.
fn dims(
    call: &MoeCall,
    x: &Layout,
    logits: &Layout,
    experts: &Layout,
) -> Result<(usize, usize, usize), MoeCandleError> {
    let c = &call.cfg;
    let t = x.dims().first().copied().unwrap_or(0);
    crate::error::expect_shape("x [T, D]", x.dims(), &[t, c.hidden])?;
    crate::error::expect_shape("logits [T, E]", logits.dims(), &[t, c.experts])?;
    crate::error::expect_shape("experts", experts.dims(), &[call.layout.len()])?;
    Ok((t, c.hidden, c.experts))
}

/// The contiguous elements of a storage of dtype `T` as a view.
fn view<'a, T: candle::cuda_backend::CudaDType>(
    what: &'static str,
    expected: &'static str,
    dtype: DType,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>, MoeCandleError> {
    if s.dtype() != dtype {
        return Err(MoeCandleError::DType {
            what,
            expected,
            found: s.dtype(),
        });
    }
    let (start, end) = l
        .contiguous_offsets()
        .ok_or(MoeCandleError::NotContiguous { what })?;
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// The logits as the `CudaSlice` the layer takes: candle's own when they start at offset 0,
/// else a copy of their range into `owned`.
fn logits_slice<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    stream: &Arc<CudaStream>,
    owned: &'a mut Option<CudaSlice<f32>>,
) -> Result<&'a CudaSlice<f32>, MoeCandleError> {
    let v = view::<f32>("logits", "f32 on CUDA", DType::F32, s, l)?;
    if l.start_offset() == 0 {
        return Ok(s.as_cuda_slice::<f32>()?);
    }
    Ok(owned.insert(stream.clone_dtod(&v)?))
}

/// The CUDA storage behind a tensor's storage guard.
fn cuda<'a>(what: &'static str, s: &'a Storage) -> Result<&'a CudaStorage, MoeCandleError> {
    match s {
        Storage::Cuda(c) => Ok(c),
        other => Err(MoeCandleError::Device {
            what,
            detail: format!("expected a CUDA tensor, found one on {:?}", other.device()),
        }),
    }
}

/// The op's CUDA forward: `y [T, D]` bf16.
pub(crate) fn forward(
    call: &MoeCall,
    x: (&CudaStorage, &Layout),
    logits: (&CudaStorage, &Layout),
    experts: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape), MoeCandleError> {
    let (t, d, _) = dims(call, x.1, logits.1, experts.1)?;
    let dev = x.0.device.clone();
    let stream = dev.cuda_stream();
    let xv = view::<bf16>("x", "bf16 on CUDA", DType::BF16, x.0, x.1)?;
    let wv = view::<bf16>("experts", "bf16 on CUDA", DType::BF16, experts.0, experts.1)?;
    let mut owned = None;
    let lg = logits_slice(logits.0, logits.1, &stream, &mut owned)?;
    let mode = if call.train {
        Mode::Training
    } else {
        Mode::Inference
    };
    let mut cache = lock(call);
    let bound = cache.bind(&call.cfg, &stream, t, mode)?;
    let mut y = stream.alloc_zeros::<bf16>(t * d)?;
    bound.forward(call, &xv, lg, &wv, t, &mut y)?;
    Ok((CudaStorage::wrap_cuda_slice(y, dev), Shape::from((t, d))))
}

/// The op's CUDA backward: `(dx [T, D] bf16, d_logits [T, E] f32, d_experts bf16)`.
pub(crate) fn backward(
    call: &MoeCall,
    x: &Tensor,
    logits: &Tensor,
    experts: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor, Tensor), MoeCandleError> {
    let Device::Cuda(dev) = x.device() else {
        return Err(MoeCandleError::Device {
            what: "moefuse MoE backward",
            detail: format!("expected CUDA, found {:?}", x.device()),
        });
    };
    let stream = dev.cuda_stream();
    let dy = dy.to_dtype(DType::BF16)?.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (ls, ll) = logits.storage_and_layout();
    let (ws, wl) = experts.storage_and_layout();
    let (ds, dl) = dy.storage_and_layout();
    let (t, d, e) = dims(call, xl, ll, wl)?;
    crate::error::expect_shape("dy [T, D]", dl.dims(), &[t, d])?;
    let bf = "bf16 on CUDA";
    let xv = view::<bf16>("x", bf, DType::BF16, cuda("x", &xs)?, xl)?;
    let wv = view::<bf16>("experts", bf, DType::BF16, cuda("experts", &ws)?, wl)?;
    let dyv = view::<bf16>("dy", bf, DType::BF16, cuda("dy", &ds)?, dl)?;
    let mut owned = None;
    let lg = logits_slice(cuda("logits", &ls)?, ll, &stream, &mut owned)?;

    let mut cache = lock(call);
    let bound = cache.bind(&call.cfg, &stream, t, Mode::Training)?;
    if bound.last_call != Some(call.call) {
        tracing::debug!(
            call = call.call,
            "moefuse-candle: recomputing the forward for its backward"
        );
        let mut y = stream.alloc_zeros::<bf16>(t * d)?;
        bound.forward(call, &xv, lg, &wv, t, &mut y)?;
    }
    let Bound {
        layer, ws, grads, ..
    } = bound;
    let g = match grads {
        Some(g) => g,
        None => grads.insert(layer.gradients()?),
    };
    let n = call.layout.gate_up;
    let weights = Weights::new(wv.slice(..n), wv.slice(n..));
    let mut dx = stream.alloc_zeros::<bf16>(t * d)?;
    layer.backward(&weights, &dyv, &mut dx, g, false, ws)?;
    let d_logits = stream.clone_dtod(&g.d_logits.slice(..t * e))?;
    let mut dw = stream.alloc_zeros::<bf16>(call.layout.len())?;
    stream.memcpy_dtod(&g.d_gate_up, &mut dw.slice_mut(..n))?;
    stream.memcpy_dtod(&g.d_down, &mut dw.slice_mut(n..))?;
    let wrap = |s: CudaStorage, shape: &Shape| {
        Tensor::from_storage(Storage::Cuda(s), shape.clone(), BackpropOp::none(), false)
    };
    let dev = dev.clone();
    Ok((
        wrap(CudaStorage::wrap_cuda_slice(dx, dev.clone()), x.shape()),
        wrap(
            CudaStorage::wrap_cuda_slice(d_logits, dev.clone()),
            logits.shape(),
        ),
        wrap(CudaStorage::wrap_cuda_slice(dw, dev), experts.shape()),
    ))
}
