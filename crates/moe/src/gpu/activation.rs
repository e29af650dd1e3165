//! The activation on the GPU: [`activation_forward`] and [`activation_backward`] over the
//! expert-major intermediate, bf16 in and out, fp32 math (kernels/moe/activation.cu).

use super::{check_buffer, check_max, kernels_for};
use crate::{Activation, GateUpLayout, MoeConfig, MoeError};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{self as mk, Kernels};
use std::sync::Arc;

/// The largest intermediate size `I` the kernels take.
const MAX_INTERMEDIATE: usize = 1 << 29;

/// What the activation kernels apply: the [`Activation`], the [`GateUpLayout`] of gated
/// rows, and the intermediate size `I` (any `I >= 1`; a [`MoeConfig`] asks multiples of 64).
///
/// ```
/// use moefuse::{gpu::ActivationDesc, Activation, GateUpLayout, MoeConfig};
/// let d = ActivationDesc::from_config(&MoeConfig::new(64, 128, 8, 2));
/// assert_eq!((d.intermediate, d.width()), (128, 256));
/// assert_eq!(ActivationDesc::new(Activation::Relu2, GateUpLayout::Split, 40).width(), 40);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationDesc {
    /// The activation.
    pub activation: Activation,
    /// Gate/up column order (ignored by `Relu2`).
    pub layout: GateUpLayout,
    /// `I`, the width of `h`.
    pub intermediate: usize,
}

impl ActivationDesc {
    /// A description from its parts.
    ///
    /// ```
    /// use moefuse::{gpu::ActivationDesc, Activation, GateUpLayout};
    /// let d = ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Interleaved, 64);
    /// assert_eq!(d.width(), 128);
    /// ```
    pub fn new(activation: Activation, layout: GateUpLayout, intermediate: usize) -> Self {
        ActivationDesc {
            activation,
            layout,
            intermediate,
        }
    }

    /// The activation, layout and intermediate size of `config`.
    ///
    /// ```
    /// use moefuse::{gpu::ActivationDesc, MoeConfig};
    /// assert_eq!(ActivationDesc::from_config(&MoeConfig::new(64, 64, 4, 1)).intermediate, 64);
    /// ```
    pub fn from_config(config: &MoeConfig) -> Self {
        Self::new(
            config.activation,
            config.gate_up_layout,
            config.intermediate,
        )
    }

    /// `W`, the width of `h_pre`: `2·I` for gated activations, `I` for `Relu2`.
    ///
    /// ```
    /// use moefuse::{gpu::ActivationDesc, Activation, GateUpLayout};
    /// assert_eq!(ActivationDesc::new(Activation::GeGlu, GateUpLayout::Split, 7).width(), 14);
    /// ```
    pub fn width(&self) -> usize {
        self.activation.gate_up_width(self.intermediate)
    }

    /// Checks the activation's parameters and `1 <= I <= 2^29`.
    ///
    /// ```
    /// use moefuse::{gpu::ActivationDesc, Activation, GateUpLayout};
    /// assert!(ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Split, 0).validate().is_err());
    /// assert!(ActivationDesc::new(Activation::Relu2, GateUpLayout::Split, 3).validate().is_ok());
    /// ```
    pub fn validate(&self) -> Result<(), MoeError> {
        self.activation.validate()?;
        if self.intermediate == 0 {
            return Err(MoeError::DimNotMultiple {
                what: "intermediate",
                value: 0,
                multiple: 1,
            });
        }
        check_max("intermediate", self.intermediate, MAX_INTERMEDIATE)
    }

    /// The kernels' activation and gate/up layout (`moefuse_kernels`' enums), for calling
    /// the kernel ops of `moefuse_kernels` directly.
    ///
    /// ```
    /// use moefuse::gpu::ActivationDesc;
    /// use moefuse::{Activation, GateUpLayout};
    /// let desc = ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Split, 64);
    /// let (kind, layout) = desc.kernel_kind();
    /// assert_eq!(kind, moefuse_kernels::ActivationKind::SwiGlu);
    /// assert_eq!(layout, moefuse_kernels::GateUpLayout::Split);
    /// ```
    pub fn kernel_kind(&self) -> (mk::ActivationKind, mk::GateUpLayout) {
        let layout = match self.layout {
            GateUpLayout::Split => mk::GateUpLayout::Split,
            GateUpLayout::Interleaved => mk::GateUpLayout::Interleaved,
        };
        let kind = match self.activation {
            Activation::SwiGlu => mk::ActivationKind::SwiGlu,
            Activation::GeGlu => mk::ActivationKind::GeGlu,
            Activation::SwiGluOai { alpha, limit } => {
                mk::ActivationKind::SwiGluOai { alpha, limit }
            }
            Activation::BoundedSwiGlu { limit } => mk::ActivationKind::BoundedSwiGlu { limit },
            Activation::Relu2 => mk::ActivationKind::Relu2,
        };
        (kind, layout)
    }
}

/// The rows an activation call processes: all `capacity` rows, or a count read on the
/// device (so the call needs no host synchronisation) clamped to `0..=capacity`. Buffers
/// hold `capacity` rows; rows past the count are left untouched.
///
/// ```no_run
/// use moefuse::gpu::Rows;
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let offsets = stream.clone_htod(&[3i32, 3, 10])?; // prefix-sum ends of 3 experts
/// let last = offsets.slice(2..);                      // offsets[E-1]: the routed rows
/// let rows = Rows::from_device(&last, 4 * 8);         // capacity: tokens × top-k
/// assert_eq!(rows.capacity(), 32);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    capacity: usize,
    count: Option<&'a dyn DevicePtr<i32>>,
}

impl std::fmt::Debug for Rows<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rows")
            .field("capacity", &self.capacity)
            .field("count_on_device", &self.count.is_some())
            .finish()
    }
}

impl<'a> Rows<'a> {
    /// Exactly `rows` rows, known on the host.
    ///
    /// ```
    /// assert_eq!(moefuse::gpu::Rows::all(5).capacity(), 5);
    /// ```
    pub fn all(rows: usize) -> Self {
        Rows {
            capacity: rows,
            count: None,
        }
    }

    /// The count is the first int32 of `count` (device memory, e.g. the view
    /// `offsets.slice(E - 1..)` of the prefix-sum offsets), clamped to `0..=capacity`.
    pub fn from_device(count: &'a dyn DevicePtr<i32>, capacity: usize) -> Self {
        Rows {
            capacity,
            count: Some(count),
        }
    }

    /// The rows the buffers must hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Checks what both directions share; returns `(I, W)`.
fn check_common(
    desc: &ActivationDesc,
    stream: &CudaStream,
    rows: &Rows<'_>,
    h_pre: &dyn DevicePtr<bf16>,
) -> Result<(usize, usize), MoeError> {
    desc.validate()?;
    check_max("rows capacity", rows.capacity, i32::MAX as usize)?;
    let (i, w) = (desc.intermediate, desc.width());
    let elems = rows.capacity.checked_mul(w).ok_or(MoeError::TooLarge {
        what: "rows capacity x W",
        value: usize::MAX,
        max: isize::MAX as usize,
    })?;
    check_buffer("h_pre [rows, W]", h_pre, elems, stream)?;
    if let Some(count) = rows.count {
        check_buffer("row count", count, 1, stream)?;
    }
    Ok((i, w))
}

/// Launches the activation (forward, or backward with `backward = Some(dh)`) on checked
/// buffers: `rows.capacity() > 0`, lengths and devices checked by the caller.
fn launch(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    desc: &ActivationDesc,
    rows: &Rows<'_>,
    h_pre: &dyn DevicePtr<bf16>,
    backward: Option<&dyn DevicePtr<bf16>>,
    out: &mut dyn DevicePtrMut<bf16>,
) -> Result<(), MoeError> {
    let (kind, layout) = desc.kernel_kind();
    kernels.launch(
        stream,
        mk::Activation {
            kind,
            layout,
            intermediate: desc.intermediate,
            max_rows: rows.capacity,
            total_rows: rows.count,
            h_pre,
            backward,
            out,
        },
    )?;
    Ok(())
}

/// `h [rows, I] = act(h_pre [rows, W])` on `stream`, bf16 in and out, fp32 math, as
/// [`reference::activation::forward_row`](crate::reference::activation::forward_row)
/// defines it row by row. Buffers hold `rows.capacity()` rows (or more).
///
/// ```no_run
/// use moefuse::{gpu::{activation_forward, ActivationDesc, Rows}, Activation, GateUpLayout};
/// use half::bf16;
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let desc = ActivationDesc::new(Activation::swiglu_oai(), GateUpLayout::Interleaved, 64);
/// let h_pre = stream.clone_htod(&vec![bf16::from_f32(0.5); 10 * 128])?;
/// let mut h = stream.alloc_zeros::<bf16>(10 * 64)?;
/// activation_forward(&desc, &stream, Rows::all(10), &h_pre, &mut h)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn activation_forward<X, H>(
    desc: &ActivationDesc,
    stream: &Arc<CudaStream>,
    rows: Rows<'_>,
    h_pre: &X,
    h: &mut H,
) -> Result<(), MoeError>
where
    X: DevicePtr<bf16>,
    H: DevicePtrMut<bf16>,
{
    activation_forward_with(None, desc, stream, rows, h_pre, h)
}

/// [`activation_forward`] through `kernels` (the layer's handle), or a handle bound for the
/// call.
pub(super) fn activation_forward_with(
    kernels: Option<&Kernels>,
    desc: &ActivationDesc,
    stream: &Arc<CudaStream>,
    rows: Rows<'_>,
    h_pre: &dyn DevicePtr<bf16>,
    h: &mut dyn DevicePtrMut<bf16>,
) -> Result<(), MoeError> {
    let (i, _) = check_common(desc, stream, &rows, h_pre)?;
    check_buffer("h [rows, I]", h, rows.capacity * i, stream)?;
    if rows.capacity == 0 {
        return Ok(());
    }
    let mut owned = None;
    let kernels = kernels_for(kernels, &mut owned, stream)?;
    launch(kernels, stream, desc, &rows, h_pre, None, h)
}

/// `d_h_pre [rows, W]` from `dh [rows, I]` and the forward's `h_pre [rows, W]` on `stream`
/// (the activation recomputed, gradients zero where a clamp is active), as
/// [`reference::activation::backward_row`](crate::reference::activation::backward_row)
/// defines it; bf16 in and out, fp32 math.
///
/// ```no_run
/// use moefuse::{gpu::{activation_backward, ActivationDesc, Rows}, Activation, GateUpLayout};
/// use half::bf16;
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let desc = ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Split, 64);
/// let h_pre = stream.clone_htod(&vec![bf16::from_f32(0.5); 10 * 128])?;
/// let dh = stream.clone_htod(&vec![bf16::from_f32(1.0); 10 * 64])?;
/// let mut d_h_pre = stream.alloc_zeros::<bf16>(10 * 128)?;
/// activation_backward(&desc, &stream, Rows::all(10), &h_pre, &dh, &mut d_h_pre)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn activation_backward<X, G, D>(
    desc: &ActivationDesc,
    stream: &Arc<CudaStream>,
    rows: Rows<'_>,
    h_pre: &X,
    dh: &G,
    d_h_pre: &mut D,
) -> Result<(), MoeError>
where
    X: DevicePtr<bf16>,
    G: DevicePtr<bf16>,
    D: DevicePtrMut<bf16>,
{
    activation_backward_with(None, desc, stream, rows, h_pre, dh, d_h_pre)
}

/// [`activation_backward`] through `kernels` (the layer's handle), or a handle bound for
/// the call.
pub(super) fn activation_backward_with(
    kernels: Option<&Kernels>,
    desc: &ActivationDesc,
    stream: &Arc<CudaStream>,
    rows: Rows<'_>,
    h_pre: &dyn DevicePtr<bf16>,
    dh: &dyn DevicePtr<bf16>,
    d_h_pre: &mut dyn DevicePtrMut<bf16>,
) -> Result<(), MoeError> {
    let (i, w) = check_common(desc, stream, &rows, h_pre)?;
    check_buffer("dh [rows, I]", dh, rows.capacity * i, stream)?;
    check_buffer("d_h_pre [rows, W]", d_h_pre, rows.capacity * w, stream)?;
    if rows.capacity == 0 {
        return Ok(());
    }
    let mut owned = None;
    let kernels = kernels_for(kernels, &mut owned, stream)?;
    launch(kernels, stream, desc, &rows, h_pre, Some(dh), d_h_pre)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_kind_follows_the_activation() {
        let d = |a| ActivationDesc::new(a, GateUpLayout::Interleaved, 64).kernel_kind();
        assert_eq!(
            d(Activation::swiglu_oai()),
            (
                mk::ActivationKind::SwiGluOai {
                    alpha: 1.702,
                    limit: 7.0
                },
                mk::GateUpLayout::Interleaved
            )
        );
        assert_eq!(
            d(Activation::BoundedSwiGlu { limit: 3.0 }).0,
            mk::ActivationKind::BoundedSwiGlu { limit: 3.0 }
        );
        assert_eq!(d(Activation::Relu2).0, mk::ActivationKind::Relu2);
        assert_eq!(d(Activation::GeGlu).0, mk::ActivationKind::GeGlu);
        assert_eq!(d(Activation::SwiGlu).0, mk::ActivationKind::SwiGlu);
        let split = ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Split, 64);
        assert_eq!(split.kernel_kind().1, mk::GateUpLayout::Split);
    }

    #[test]
    fn validation_rejects_bad_sizes_and_parameters() {
        let ok = ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Split, 7);
        assert!(ok.validate().is_ok());
        let big = ActivationDesc {
            intermediate: MAX_INTERMEDIATE + 1,
            ..ok
        };
        assert!(matches!(big.validate(), Err(MoeError::TooLarge { .. })));
        let bad = ActivationDesc {
            activation: Activation::BoundedSwiGlu { limit: -1.0 },
            ..ok
        };
        assert!(matches!(
            bad.validate(),
            Err(MoeError::InvalidParameter { .. })
        ));
    }
}
