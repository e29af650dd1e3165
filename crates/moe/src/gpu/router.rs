//! The router on the GPU: [`route`] and [`route_backward`], one warp per token, scores in
//! fp64 (kernels/moe/router.cu).

use super::{check_buffer, prepare_device};
use crate::{MoeConfig, MoeError, RouterKind};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use moefuse_kernels::{ffi, MoeArgs};
use std::sync::Arc;

/// The ABI's router fields of `config.router`: (kind, n_group, topk_group, renormalize,
/// routed_scaling_factor). `External` computes no routing.
fn router_fields(config: &MoeConfig) -> Result<(i32, i32, i32, i32, f32), MoeError> {
    match config.router {
        RouterKind::SoftmaxTopK { renormalize } => Ok((
            ffi::MOEFUSE_ROUTER_SOFTMAX_TOPK,
            0,
            0,
            i32::from(renormalize),
            1.0,
        )),
        RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            routed_scaling_factor,
            renormalize,
        } => Ok((
            ffi::MOEFUSE_ROUTER_SIGMOID_GROUPED,
            n_group as i32, // validate(): n_group <= experts <= 512
            topk_group as i32,
            i32::from(renormalize),
            routed_scaling_factor,
        )),
        RouterKind::External => Err(MoeError::ExternalRouter),
    }
}

/// The checks both directions share: a valid config that routes, a token count in range.
/// Returns the ABI router fields.
fn check_config(config: &MoeConfig, tokens: usize) -> Result<(i32, i32, i32, i32, f32), MoeError> {
    config.validate()?;
    let fields = router_fields(config)?;
    if tokens > 0 {
        config.check_tokens(tokens)?;
    }
    Ok(fields)
}

/// Routes `tokens` tokens on `stream`, as [`reference::route`](crate::reference::route)
/// defines it: from `logits [tokens, E]` (f32, row-major) into `topk_ids [tokens, k]` (i32)
/// and `topk_weights [tokens, k]` (f32), slot 0 the best expert, ties to the lower id.
/// `bias` (`[E]`, f32) is the `SigmoidGrouped` selection bias (`None` = zeros). Buffers
/// may be longer than needed; `tokens == 0` launches nothing. Logits and bias must be
/// finite (not checked: they live on the device).
///
/// ```no_run
/// use moefuse::{gpu, MoeConfig, RouterKind};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let cfg = MoeConfig::new(64, 64, 16, 4).with_router(RouterKind::SigmoidGrouped {
///     n_group: 4, topk_group: 2, routed_scaling_factor: 2.5, renormalize: true });
/// let logits = stream.clone_htod(&vec![0.1f32; 5 * 16])?;
/// let bias = stream.clone_htod(&vec![0.0f32; 16])?;
/// let (mut ids, mut w) = (stream.alloc_zeros::<i32>(5 * 4)?, stream.alloc_zeros::<f32>(5 * 4)?);
/// gpu::route(&cfg, &stream, 5, &logits, Some(&bias), &mut ids, &mut w)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn route<L, I, W>(
    config: &MoeConfig,
    stream: &Arc<CudaStream>,
    tokens: usize,
    logits: &L,
    bias: Option<&dyn DevicePtr<f32>>,
    topk_ids: &mut I,
    topk_weights: &mut W,
) -> Result<(), MoeError>
where
    L: DevicePtr<f32>,
    I: DevicePtrMut<i32>,
    W: DevicePtrMut<f32>,
{
    let (kind, n_group, topk_group, renormalize, rsf) = check_config(config, tokens)?;
    let (e, k) = (config.experts, config.top_k);
    check_buffer("logits [tokens, experts]", logits, tokens * e, stream)?;
    match (config.router, bias) {
        (RouterKind::SoftmaxTopK { .. }, Some(_)) => return Err(MoeError::UnexpectedRouterBias),
        (_, Some(b)) => check_buffer("router_bias [experts]", b, e, stream)?,
        _ => {}
    }
    check_buffer("topk_ids [tokens, top_k]", topk_ids, tokens * k, stream)?;
    check_buffer(
        "topk_weights [tokens, top_k]",
        topk_weights,
        tokens * k,
        stream,
    )?;
    if tokens == 0 {
        return Ok(());
    }
    prepare_device(stream)?;
    let (logits_ptr, _logits_sync) = logits.device_ptr(stream);
    let bias_guard = bias.map(|b| b.device_ptr(stream));
    let bias_ptr = bias_guard.as_ref().map_or(0, |(p, _)| *p);
    let (ids_ptr, _ids_sync) = topk_ids.device_ptr_mut(stream);
    let (weights_ptr, _weights_sync) = topk_weights.device_ptr_mut(stream);
    let args = ffi::MoefuseRouterArgs {
        tokens: tokens as i32, // check_tokens: <= 65536
        experts: e as i32,     // validate: <= 512
        top_k: k as i32,       // validate: <= 16
        kind,
        n_group,
        topk_group,
        renormalize,
        routed_scaling_factor: rsf,
        logits: logits_ptr as *const f32,
        bias: bias_ptr as *const f32,
        topk_ids: ids_ptr as *mut i32,
        topk_weights: weights_ptr as *mut f32,
    };
    // SAFETY: logits hold >= tokens·E f32, bias (if any) >= E, ids and weights >= tokens·k
    // elements, all on the stream's device (checked above); the device_ptr guards, alive
    // until the end of this scope, order the buffers on `stream` around the launch; the
    // stream's context is current (prepare_device). The kernel writes only rows < tokens.
    unsafe {
        moefuse_kernels::launch_moe(
            MoeArgs::RouterForward(&args),
            stream.cu_stream() as *mut std::ffi::c_void,
        )?;
    }
    Ok(())
}

/// The router's backward on `stream`, as
/// [`reference::route_backward`](crate::reference::route_backward) defines it: from
/// `d_topk_weights [tokens, k]` (f32) to `d_logits [tokens, E]` (f32, every element
/// written), with the forward's `logits [tokens, E]` and `topk_ids [tokens, k]` (the
/// selection held constant). Ids must be distinct within a token; ids outside `0..E` are
/// ignored (they live on the device and are not checked).
///
/// ```no_run
/// use moefuse::{gpu, MoeConfig};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let cfg = MoeConfig::new(64, 64, 8, 2);
/// let logits = stream.clone_htod(&[0.5f32; 8])?;
/// let ids = stream.clone_htod(&[0i32, 1])?;
/// let dw = stream.clone_htod(&[1.0f32, -1.0])?;
/// let mut dl = stream.alloc_zeros::<f32>(8)?;
/// gpu::route_backward(&cfg, &stream, 1, &logits, &ids, &dw, &mut dl)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn route_backward<L, I, G, D>(
    config: &MoeConfig,
    stream: &Arc<CudaStream>,
    tokens: usize,
    logits: &L,
    topk_ids: &I,
    d_topk_weights: &G,
    d_logits: &mut D,
) -> Result<(), MoeError>
where
    L: DevicePtr<f32>,
    I: DevicePtr<i32>,
    G: DevicePtr<f32>,
    D: DevicePtrMut<f32>,
{
    let (kind, _, _, renormalize, rsf) = check_config(config, tokens)?;
    let (e, k) = (config.experts, config.top_k);
    check_buffer("logits [tokens, experts]", logits, tokens * e, stream)?;
    check_buffer("topk_ids [tokens, top_k]", topk_ids, tokens * k, stream)?;
    check_buffer(
        "d_topk_weights [tokens, top_k]",
        d_topk_weights,
        tokens * k,
        stream,
    )?;
    check_buffer("d_logits [tokens, experts]", d_logits, tokens * e, stream)?;
    if tokens == 0 {
        return Ok(());
    }
    prepare_device(stream)?;
    let (logits_ptr, _logits_sync) = logits.device_ptr(stream);
    let (ids_ptr, _ids_sync) = topk_ids.device_ptr(stream);
    let (dw_ptr, _dw_sync) = d_topk_weights.device_ptr(stream);
    let (dl_ptr, _dl_sync) = d_logits.device_ptr_mut(stream);
    let args = ffi::MoefuseRouterBwdArgs {
        tokens: tokens as i32,
        experts: e as i32,
        top_k: k as i32,
        kind,
        renormalize,
        routed_scaling_factor: rsf,
        logits: logits_ptr as *const f32,
        topk_ids: ids_ptr as *const i32,
        d_topk_weights: dw_ptr as *const f32,
        d_logits: dl_ptr as *mut f32,
    };
    // SAFETY: logits and d_logits hold >= tokens·E f32, ids and d_weights >= tokens·k
    // elements on the stream's device (checked above); the kernel skips ids outside 0..E,
    // so their values cannot lead it outside d_logits' rows; the guards order the buffers on
    // `stream` until the end of this scope; the context is current (prepare_device).
    unsafe {
        moefuse_kernels::launch_moe(
            MoeArgs::RouterBackward(&args),
            stream.cu_stream() as *mut std::ffi::c_void,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_fields_follow_the_kind() {
        let cfg = MoeConfig::new(64, 64, 16, 4);
        assert_eq!(
            router_fields(&cfg).unwrap(),
            (ffi::MOEFUSE_ROUTER_SOFTMAX_TOPK, 0, 0, 1, 1.0)
        );
        let cfg = cfg.with_router(RouterKind::SigmoidGrouped {
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5,
            renormalize: false,
        });
        assert_eq!(
            router_fields(&cfg).unwrap(),
            (ffi::MOEFUSE_ROUTER_SIGMOID_GROUPED, 4, 2, 0, 2.5)
        );
        let ext = cfg.with_router(RouterKind::External);
        assert_eq!(router_fields(&ext), Err(MoeError::ExternalRouter));
    }

    #[test]
    fn config_checks_come_first() {
        let bad = MoeConfig::new(64, 64, 4, 5);
        assert!(matches!(
            check_config(&bad, 1),
            Err(MoeError::TopKOutOfRange { .. })
        ));
        let cfg = MoeConfig::new(64, 64, 4, 2);
        assert!(check_config(&cfg, 0).is_ok());
        assert!(matches!(
            check_config(&cfg, 65537),
            Err(MoeError::TokensOutOfRange { .. })
        ));
    }
}
