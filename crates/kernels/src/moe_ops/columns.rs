//! The row kernels of moe_abi.h's `moefuse_moe_scatter_columns` and
//! `moefuse_moe_columns_to_f32`: one fp32 value per routed (token, slot) carried through an
//! exchange that sums rows (the expert-parallel layer's `d_topk_weights`).

use crate::bind::{check_range, extent, to_i32, Binder, Call};
use crate::{ffi, KernelError};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

/// `out[r, :] = 0`, `out[r, col_of[r·col_stride]] = values[r]` (bf16) for the live rows
/// (`count` on the device, clamped to `rows`; all rows when `None`). A column outside
/// `0..width` leaves the row zero and raises `MOEFUSE_MOE_ERROR_ROW` in `errors`.
///
/// ```no_run
/// # use moefuse_kernels::{Kernels, ScatterColumns};
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let s = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let (cols, vals) = (s.clone_htod(&[2i32, 0])?, s.clone_htod(&[1.5f32, -2.0])?);
/// let mut out = s.alloc_zeros::<half::bf16>(2 * 8)?;
/// kernels.launch(&s, ScatterColumns { rows: 2, width: 8, col_stride: 1, count: None,
///     col_of: &cols, values: &vals, out: &mut out, errors: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ScatterColumns<'a> {
    /// Rows of `out`.
    pub rows: usize,
    /// Columns of `out` (`>= 1`).
    pub width: usize,
    /// Elements between consecutive rows' entries of `col_of` (`>= 1`).
    pub col_stride: usize,
    /// `[1]` live rows, or `None` for all.
    pub count: Option<&'a dyn DevicePtr<i32>>,
    /// `[(rows - 1) · col_stride + 1]` (every `col_stride`-th element is read).
    pub col_of: &'a dyn DevicePtr<i32>,
    /// `[rows]`.
    pub values: &'a dyn DevicePtr<f32>,
    /// `[rows, width]` out.
    pub out: &'a mut dyn DevicePtrMut<bf16>,
    /// `[1]` error bits, or `None`.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
}

impl<'a> ScatterColumns<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        check_range(kernel, "width", self.width as i128, 1, i32::MAX as i128)?;
        check_range(kernel, "col_stride", self.col_stride as i128, 1, 64)?;
        check_range(kernel, "rows", self.rows as i128, 0, i32::MAX as i128)?;
        let count = b.read_opt("count", self.count, 1, 4)?;
        // Row r reads element r·col_stride: the last row needs (rows-1)·col_stride + 1.
        let col_len = match self.rows {
            0 => 0,
            r => extent(kernel, "rows * col_stride", &[r - 1, self.col_stride])? + 1,
        };
        let col_of = b.read("col_of", self.col_of, col_len, 4)?;
        let values = b.read("values", self.values, self.rows, 4)?;
        let out = b.write(
            "out",
            self.out,
            extent(kernel, "rows * width", &[self.rows, self.width])?,
            2,
        )?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        if self.rows == 0 {
            return Ok(None);
        }
        Ok(Some(Call::ScatterColumns(ffi::MoefuseScatterColumnsArgs {
            rows: to_i32(kernel, "rows", self.rows)?,
            width: to_i32(kernel, "width", self.width)?,
            col_stride: to_i32(kernel, "col_stride", self.col_stride)?,
            reserved: 0,
            count: count as *const i32,
            col_of: col_of as *const i32,
            values: values as *const f32,
            out: out as *mut _,
            errors: errors as *mut u32,
        })))
    }
}

/// `out[r, j] = input[r, j]` as fp32 for `r < rows`, `j < cols` (`input` bf16
/// `[rows, width]`, `cols <= width`).
///
/// ```no_run
/// # use moefuse_kernels::{ColumnsToF32, Kernels};
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let s = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let input = s.alloc_zeros::<half::bf16>(4 * 8)?;
/// let mut out = s.alloc_zeros::<f32>(4 * 2)?;
/// kernels.launch(&s, ColumnsToF32 { rows: 4, width: 8, cols: 2, input: &input, out: &mut out })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ColumnsToF32<'a> {
    /// Rows.
    pub rows: usize,
    /// Columns of `input`.
    pub width: usize,
    /// Columns read and written, `1..=width`.
    pub cols: usize,
    /// `[rows, width]`.
    pub input: &'a dyn DevicePtr<bf16>,
    /// `[rows, cols]` out.
    pub out: &'a mut dyn DevicePtrMut<f32>,
}

impl<'a> ColumnsToF32<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        check_range(kernel, "width", self.width as i128, 1, i32::MAX as i128)?;
        check_range(kernel, "cols", self.cols as i128, 1, self.width as i128)?;
        check_range(kernel, "rows", self.rows as i128, 0, i32::MAX as i128)?;
        let input = b.read(
            "input",
            self.input,
            extent(kernel, "rows * width", &[self.rows, self.width])?,
            2,
        )?;
        let out = b.write(
            "out",
            self.out,
            extent(kernel, "rows * cols", &[self.rows, self.cols])?,
            4,
        )?;
        if self.rows == 0 {
            return Ok(None);
        }
        Ok(Some(Call::ColumnsToF32(ffi::MoefuseColumnsToF32Args {
            rows: to_i32(kernel, "rows", self.rows)?,
            width: to_i32(kernel, "width", self.width)?,
            cols: to_i32(kernel, "cols", self.cols)?,
            reserved: 0,
            input: input as *const _,
            out: out as *mut f32,
        })))
    }
}
