//! cuBLAS baseline on moefuse's row-major conventions.

use cudarc::cublas::result::CublasError;
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm as _, GemmConfig};
use cudarc::driver::CudaSlice;
use half::bf16;

/// `D[m, n] = A[m, k] · B` on cuBLAS (bf16 in/out, fp32 compute), B stored `[n, k]`
/// (`b_nk = true`) or `[k, n]`: the row-major problem is the column-major `Dᵀ = op(B)·Aᵀ`.
pub fn cublas_rowmajor(
    blas: &CudaBlas,
    (m, n, k): (usize, usize, usize),
    b_nk: bool,
    a: &CudaSlice<bf16>,
    b: &CudaSlice<bf16>,
    d: &mut CudaSlice<bf16>,
) -> Result<(), CublasError> {
    assert!(
        a.len() >= m * k && b.len() >= n * k && d.len() >= m * n,
        "cublas_rowmajor: buffers smaller than the problem"
    );
    let (transa, lda) = if b_nk {
        (cublasOperation_t::CUBLAS_OP_T, k)
    } else {
        (cublasOperation_t::CUBLAS_OP_N, n)
    };
    let cfg = GemmConfig {
        transa,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: bf16::ONE,
        lda: lda as i32,
        ldb: k as i32,
        beta: bf16::ZERO,
        ldc: n as i32,
    };
    // SAFETY: a holds [m,k], b [n,k] or [k,n], d [m,n] (asserted above), all device buffers
    // of the blas handle's context: the extents cfg describes.
    unsafe { blas.gemm(cfg, b, a, d) }
}
