//! The op on the CPU: moefuse's reference (f32 values, f64 sums) for forward and backward,
//! on candle CPU storages of any float dtype.

use crate::error::expect_shape;
use crate::op::MoeCall;
use crate::MoeCandleError;
use candle::backend::BackendStorage;
use candle::{CpuStorage, DType, Device, Layout, Shape, Tensor};
use half::{bf16, f16};
use moefuse::model::MoeWeights;
use moefuse::reference::{self, ForwardOutput, Routing, RoutingInput};

/// `y [T, D]` in `x`'s dtype.
pub(crate) fn forward(
    op: &MoeCall,
    x: (&CpuStorage, &Layout),
    logits: (&CpuStorage, &Layout),
    experts: (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape), MoeCandleError> {
    let (t, d) = (x.1.dims().first().copied().unwrap_or(0), op.cfg.hidden);
    expect_shape("x [T, D]", x.1.dims(), &[t, d])?;
    expect_shape("logits [T, E]", logits.1.dims(), &[t, op.cfg.experts])?;
    expect_shape("experts", experts.1.dims(), &[op.layout.len()])?;
    let xs = host_f32("x", x.0, x.1)?;
    let ls = host_f32("logits", logits.0, logits.1)?;
    let ws = host_f32("experts", experts.0, experts.1)?;
    let (out, _, _) = run_forward(op, &xs, &ls, &ws)?;
    Ok((from_f32(out.y, x.0.dtype())?, Shape::from((t, d))))
}

/// `(dx, d_logits, d_experts)` for `dy`, each in its input's dtype and shape: the forward
/// is recomputed, then moefuse's reference backward (`dx` through the experts only: the
/// router's share reaches `x` through candle's graph of the logits) and its router
/// backward for `d_logits`.
pub(crate) fn backward(
    op: &MoeCall,
    x: &Tensor,
    logits: &Tensor,
    experts: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor, Tensor), MoeCandleError> {
    let host = |t: &Tensor| -> Result<Vec<f32>, MoeCandleError> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (xs, ls, ws, dys) = (host(x)?, host(logits)?, host(experts)?, host(dy)?);
    expect_shape("dy [T, D]", dy.dims(), x.dims())?;
    let (out, weights, routing) = run_forward(op, &xs, &ls, &ws)?;
    let g = reference::backward(&op.cfg, &weights, &xs, &out, &dys)?;
    let d_logits = reference::route_backward(&op.cfg, &ls, &routing, &g.d_topk_weights)?;
    let mut dw = g.d_gate_up;
    dw.extend_from_slice(&g.d_down);
    let back = |v: Vec<f32>, like: &Tensor| -> Result<Tensor, MoeCandleError> {
        Ok(Tensor::from_vec(v, like.shape(), &Device::Cpu)?.to_dtype(like.dtype())?)
    };
    Ok((back(g.dx, x)?, back(d_logits, logits)?, back(dw, experts)?))
}

/// Routes from the logits with the config's router, then runs the reference forward with
/// that routing (external to the reference, so its backward gives no router term).
fn run_forward(
    op: &MoeCall,
    x: &[f32],
    logits: &[f32],
    experts: &[f32],
) -> Result<(ForwardOutput, MoeWeights, Routing), MoeCandleError> {
    let routing = reference::route(&op.cfg, logits, None)?;
    let (gate_up, down) = experts.split_at(op.layout.gate_up);
    let weights = MoeWeights {
        router: None,
        router_bias: None,
        gate_up: gate_up.to_vec(),
        down: down.to_vec(),
    };
    let input = RoutingInput::External {
        topk_ids: &routing.topk_ids,
        topk_weights: &routing.topk_weights,
    };
    let out = reference::forward(&op.cfg, &weights, x, input)?;
    Ok((out, weights, routing))
}

/// A contiguous CPU storage's elements as f32.
fn host_f32(what: &'static str, s: &CpuStorage, l: &Layout) -> Result<Vec<f32>, MoeCandleError> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or(MoeCandleError::NotContiguous { what })?;
    Ok(match s {
        CpuStorage::F32(v) => v[start..end].to_vec(),
        CpuStorage::BF16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F64(v) => v[start..end].iter().map(|&x| x as f32).collect(),
        other => {
            return Err(MoeCandleError::DType {
                what,
                expected: "f32, bf16, f16 or f64",
                found: other.dtype(),
            })
        }
    })
}

/// `v` as a CPU storage of `dtype`.
fn from_f32(v: Vec<f32>, dtype: DType) -> Result<CpuStorage, MoeCandleError> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        DType::F64 => CpuStorage::F64(v.into_iter().map(f64::from).collect()),
        found => {
            return Err(MoeCandleError::DType {
                what: "y",
                expected: "f32, bf16, f16 or f64",
                found,
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_conversion_reads_the_layout_and_rejects_integers() {
        let s = CpuStorage::BF16(vec![bf16::from_f32(1.5); 6]);
        let l = Layout::contiguous_with_offset((2, 2), 2);
        assert_eq!(host_f32("x", &s, &l).unwrap(), vec![1.5; 4]);
        let t = Layout::contiguous((2, 3)).transpose(0, 1).unwrap();
        assert!(matches!(
            host_f32("x", &s, &t),
            Err(MoeCandleError::NotContiguous { what: "x" })
        ));
        let u = CpuStorage::U32(vec![1; 4]);
        assert!(matches!(
            host_f32("x", &u, &Layout::contiguous(4)),
            Err(MoeCandleError::DType { what: "x", .. })
        ));
        assert!(matches!(from_f32(vec![2.0], DType::F64), Ok(CpuStorage::F64(v)) if v == [2.0]));
        assert!(from_f32(vec![2.0], DType::U8).is_err());
    }
}
