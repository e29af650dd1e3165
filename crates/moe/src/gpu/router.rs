//! The router on the GPU: [`route`] and [`route_backward`], one warp per token, scores in
//! fp64 (kernels/moe/router.cu).

use super::{check_buffer, kernels_for};
use crate::{MoeConfig, MoeError, RouterKind};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use moefuse_kernels::{Kernels, RouterBackward, RouterForward, RouterScoring};
use std::sync::Arc;

/// The kernels' scoring and renormalisation of `config.router`. `External` computes no
/// routing.
fn scoring(config: &MoeConfig) -> Result<(RouterScoring, bool), MoeError> {
    match config.router {
        RouterKind::SoftmaxTopK { renormalize } => Ok((RouterScoring::Softmax, renormalize)),
        RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            routed_scaling_factor,
            renormalize,
        } => Ok((
            RouterScoring::SigmoidGrouped {
                n_group,
                topk_group,
                routed_scaling_factor,
            },
            renormalize,
        )),
        RouterKind::External => Err(MoeError::ExternalRouter),
    }
}

/// The checks both directions share: a valid config that routes, a token count in range.
/// Returns the kernels' scoring and renormalisation.
fn check_config(config: &MoeConfig, tokens: usize) -> Result<(RouterScoring, bool), MoeError> {
    config.validate()?;
    let fields = scoring(config)?;
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
    route_with(
        None,
        config,
        stream,
        tokens,
        logits,
        bias,
        topk_ids,
        topk_weights,
    )
}

/// [`route`] through `kernels` (the layer's handle), or a handle bound for the call.
#[allow(clippy::too_many_arguments)]
pub(super) fn route_with(
    kernels: Option<&Kernels>,
    config: &MoeConfig,
    stream: &Arc<CudaStream>,
    tokens: usize,
    logits: &dyn DevicePtr<f32>,
    bias: Option<&dyn DevicePtr<f32>>,
    topk_ids: &mut dyn DevicePtrMut<i32>,
    topk_weights: &mut dyn DevicePtrMut<f32>,
) -> Result<(), MoeError> {
    let (scoring, renormalize) = check_config(config, tokens)?;
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
    let mut owned = None;
    kernels_for(kernels, &mut owned, stream)?.launch(
        stream,
        RouterForward {
            tokens,
            experts: e,
            top_k: k,
            scoring,
            renormalize,
            logits,
            bias,
            topk_ids,
            topk_weights,
        },
    )?;
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
    route_backward_with(
        None,
        config,
        stream,
        tokens,
        logits,
        topk_ids,
        d_topk_weights,
        d_logits,
    )
}

/// [`route_backward`] through `kernels` (the layer's handle), or a handle bound for the call.
#[allow(clippy::too_many_arguments)]
pub(super) fn route_backward_with(
    kernels: Option<&Kernels>,
    config: &MoeConfig,
    stream: &Arc<CudaStream>,
    tokens: usize,
    logits: &dyn DevicePtr<f32>,
    topk_ids: &dyn DevicePtr<i32>,
    d_topk_weights: &dyn DevicePtr<f32>,
    d_logits: &mut dyn DevicePtrMut<f32>,
) -> Result<(), MoeError> {
    let (scoring, renormalize) = check_config(config, tokens)?;
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
    let mut owned = None;
    kernels_for(kernels, &mut owned, stream)?.launch(
        stream,
        RouterBackward {
            tokens,
            experts: e,
            top_k: k,
            scoring,
            renormalize,
            logits,
            topk_ids,
            d_topk_weights,
            d_logits,
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoring_follows_the_kind() {
        let cfg = MoeConfig::new(64, 64, 16, 4);
        assert_eq!(scoring(&cfg).unwrap(), (RouterScoring::Softmax, true));
        let cfg = cfg.with_router(RouterKind::SigmoidGrouped {
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5,
            renormalize: false,
        });
        assert_eq!(
            scoring(&cfg).unwrap(),
            (
                RouterScoring::SigmoidGrouped {
                    n_group: 4,
                    topk_group: 2,
                    routed_scaling_factor: 2.5
                },
                false
            )
        );
        let ext = cfg.with_router(RouterKind::External);
        assert_eq!(scoring(&ext), Err(MoeError::ExternalRouter));
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
