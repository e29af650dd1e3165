//! CPU reference: the same problems computed on the host with rayon, accumulating in f64
//! from the bf16 inputs. The tests and the demo compare every kernel with these.

use crate::{BLayout, GemmDesc};
use half::bf16;
use rayon::prelude::*;

/// All rows `0..m` of the problem: [`gemm`] over every row.
///
/// ```
/// use half::bf16;
/// let one = bf16::from_f32(1.0);
/// let d = moefuse_grouped_gemm::reference::gemm_all(&moefuse_grouped_gemm::GemmDesc::new(3, 8, 8), &[one; 24], &[one; 64], None);
/// assert_eq!(d.len(), 24);
/// ```
pub fn gemm_all(desc: &GemmDesc, a: &[bf16], b: &[bf16], d0: Option<&[bf16]>) -> Vec<f32> {
    gemm(desc, a, b, d0, &(0..desc.m).collect::<Vec<_>>())
}

/// `alpha · A · B + beta · D0` for the rows `rows` of A (in that order), as f32,
/// row-major `[rows.len(), n]`. `d0` is D's previous content (ignored when beta = 0).
/// B is converted once per call, so pass every sampled row in one call.
///
/// ```
/// use half::bf16;
/// use moefuse_grouped_gemm::{reference, GemmDesc};
/// let one = bf16::from_f32(1.0);
/// let desc = GemmDesc::new(2, 8, 8);
/// let d = reference::gemm(&desc, &[one; 16], &[one; 64], None, &[0, 1]);
/// assert!(d.iter().all(|&x| x == 8.0));
/// ```
pub fn gemm(desc: &GemmDesc, a: &[bf16], b: &[bf16], d0: Option<&[bf16]>, rows: &[usize]) -> Vec<f32> {
    let (n, k) = (desc.n, desc.k);
    assert!(a.len() >= desc.m * k && b.len() >= n * k, "reference::gemm: operands smaller than the problem");
    let bf: Vec<f64> = match desc.b_layout {
        BLayout::Nk => b[..n * k].iter().map(|x| x.to_f64()).collect(),
        // Transpose once to [n, k] so the inner loop is contiguous.
        BLayout::Kn => {
            let mut t = vec![0f64; n * k];
            for kk in 0..k {
                for j in 0..n {
                    t[j * k + kk] = b[kk * n + j].to_f64();
                }
            }
            t
        }
    };
    let mut out = vec![0f32; rows.len() * n];
    out.par_chunks_mut(n).zip(rows).for_each(|(row, &i)| {
        let ai: Vec<f64> = a[i * k..(i + 1) * k].iter().map(|x| x.to_f64()).collect();
        for (j, o) in row.iter_mut().enumerate() {
            let bj = &bf[j * k..(j + 1) * k];
            let dot: f64 = ai.iter().zip(bj).map(|(x, y)| x * y).sum();
            let prev = match d0 {
                Some(d0) if desc.beta != 0.0 => desc.beta as f64 * d0[i * n + j].to_f64(),
                _ => 0.0,
            };
            *o = (desc.alpha as f64 * dot + prev) as f32;
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kn_layout_equals_nk_layout_of_the_transpose() {
        let (m, n, k) = (3, 8, 16);
        let a: Vec<bf16> = (0..m * k).map(|i| bf16::from_f32((i % 7) as f32 - 3.0)).collect();
        let b_nk: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32((i % 5) as f32 - 2.0)).collect();
        let mut b_kn = vec![bf16::ZERO; n * k];
        for j in 0..n {
            for kk in 0..k {
                b_kn[kk * n + j] = b_nk[j * k + kk];
            }
        }
        let nk = gemm_all(&GemmDesc::new(m, n, k), &a, &b_nk, None);
        let kn = gemm_all(&GemmDesc { b_layout: BLayout::Kn, ..GemmDesc::new(m, n, k) }, &a, &b_kn, None);
        assert_eq!(nk, kn);
    }

    #[test]
    fn alpha_and_beta_scale_product_and_previous_output() {
        let one = bf16::from_f32(1.0);
        let desc = GemmDesc { alpha: 2.0, beta: -1.0, ..GemmDesc::new(1, 8, 8) };
        let d0 = vec![bf16::from_f32(3.0); 8];
        let d = gemm(&desc, &[one; 8], &[one; 64], Some(&d0), &[0]);
        assert!(d.iter().all(|&x| x == 2.0 * 8.0 - 3.0), "{d:?}");
    }

    #[test]
    fn row_range_selects_rows() {
        let desc = GemmDesc::new(4, 8, 8);
        let a: Vec<bf16> = (0..32).map(|i| bf16::from_f32((i / 8) as f32)).collect();
        let b = vec![bf16::from_f32(1.0); 64];
        let d = gemm(&desc, &a, &b, None, &[2, 3]);
        assert_eq!(d.len(), 16);
        assert!(d[..8].iter().all(|&x| x == 16.0) && d[8..].iter().all(|&x| x == 24.0));
    }
}
