//! CPU reference: the same problems computed on the host with rayon, accumulating in f64
//! from the bf16 inputs. The tests and the demo compare every kernel with these.

use crate::{BLayout, GemmDesc, GroupedDesc, GroupedOp};
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
pub fn gemm(
    desc: &GemmDesc,
    a: &[bf16],
    b: &[bf16],
    d0: Option<&[bf16]>,
    rows: &[usize],
) -> Vec<f32> {
    let (n, k) = (desc.n, desc.k);
    assert!(
        a.len() >= desc.m * k && b.len() >= n * k,
        "reference::gemm: operands smaller than the problem"
    );
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

/// Rows `[start, end)` of each group from prefix-sum `ends` (clamped like the kernels).
///
/// ```
/// assert_eq!(moefuse_grouped_gemm::reference::group_ranges(&[2, 2, 5], 4), vec![0..2, 2..2, 2..4]);
/// ```
pub fn group_ranges(ends: &[i32], rows: usize) -> Vec<std::ops::Range<usize>> {
    let mut prev = 0usize;
    ends.iter()
        .map(|&e| {
            let end = (e.max(0) as usize).min(rows);
            let start = prev.min(end);
            prev = end;
            start..end
        })
        .collect()
}

/// The grouped problem `desc` on the CPU with group ends `ends`: the full expected D as
/// f32 (`d0` is D before the call; outside every group, and for empty K-grouped groups
/// with beta ≠ 0, D keeps `d0`).
pub fn grouped(desc: &GroupedDesc, ends: &[i32], a: &[bf16], b: &[bf16], d0: &[bf16]) -> Vec<f32> {
    let (n, k) = (desc.n, desc.k);
    let mut out: Vec<f32> = d0.iter().map(|x| x.to_f32()).collect();
    for (e, range) in group_ranges(ends, desc.rows).into_iter().enumerate() {
        match desc.op {
            GroupedOp::MGrouped(layout) => {
                if range.is_empty() {
                    continue;
                }
                let sub = GemmDesc {
                    m: desc.rows,
                    n,
                    k,
                    b_layout: layout,
                    alpha: desc.alpha,
                    beta: desc.beta,
                };
                let rows: Vec<usize> = range.clone().collect();
                let y = gemm(&sub, a, &b[e * n * k..(e + 1) * n * k], Some(d0), &rows);
                for (i, r) in range.enumerate() {
                    out[r * n..(r + 1) * n].copy_from_slice(&y[i * n..(i + 1) * n]);
                }
            }
            GroupedOp::KGrouped => {
                let dst = e * k * n..(e + 1) * k * n;
                if range.is_empty() {
                    if desc.beta == 0.0 {
                        out[dst].iter_mut().for_each(|x| *x = 0.0);
                    }
                    continue;
                }
                // D_e [k, n] = A_eᵀ · B_e: a GEMM with A_eᵀ [k, m_e] and B_e read as [m_e, n] (Kn).
                let m_e = range.len();
                let mut at = vec![bf16::ZERO; k * m_e];
                for (i, r) in range.clone().enumerate() {
                    for p in 0..k {
                        at[p * m_e + i] = a[r * k + p];
                    }
                }
                let sub = GemmDesc {
                    m: k,
                    n,
                    k: m_e,
                    b_layout: BLayout::Kn,
                    alpha: desc.alpha,
                    beta: desc.beta,
                };
                let rows: Vec<usize> = (0..k).collect();
                let y = gemm(
                    &sub,
                    &at,
                    &b[range.start * n..range.end * n],
                    Some(&d0[dst.clone()]),
                    &rows,
                );
                out[dst].copy_from_slice(&y);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kn_layout_equals_nk_layout_of_the_transpose() {
        let (m, n, k) = (3, 8, 16);
        let a: Vec<bf16> = (0..m * k)
            .map(|i| bf16::from_f32((i % 7) as f32 - 3.0))
            .collect();
        let b_nk: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32((i % 5) as f32 - 2.0))
            .collect();
        let mut b_kn = vec![bf16::ZERO; n * k];
        for j in 0..n {
            for kk in 0..k {
                b_kn[kk * n + j] = b_nk[j * k + kk];
            }
        }
        let nk = gemm_all(&GemmDesc::new(m, n, k), &a, &b_nk, None);
        let kn = gemm_all(
            &GemmDesc {
                b_layout: BLayout::Kn,
                ..GemmDesc::new(m, n, k)
            },
            &a,
            &b_kn,
            None,
        );
        assert_eq!(nk, kn);
    }

    #[test]
    fn alpha_and_beta_scale_product_and_previous_output() {
        let one = bf16::from_f32(1.0);
        let desc = GemmDesc {
            alpha: 2.0,
            beta: -1.0,
            ..GemmDesc::new(1, 8, 8)
        };
        let d0 = vec![bf16::from_f32(3.0); 8];
        let d = gemm(&desc, &[one; 8], &[one; 64], Some(&d0), &[0]);
        assert!(d.iter().all(|&x| x == 2.0 * 8.0 - 3.0), "{d:?}");
    }

    #[test]
    fn grouped_forward_uses_each_groups_weights_and_skips_tail_rows() {
        let (g, rows, n, k) = (2, 5, 8, 8);
        let a = vec![bf16::ONE; rows * k];
        let mut w = vec![bf16::ONE; g * n * k];
        w[n * k..].iter_mut().for_each(|x| *x = bf16::from_f32(2.0));
        let d0 = vec![bf16::from_f32(-7.0); rows * n];
        let desc = GroupedDesc::forward(g, rows, n, k, BLayout::Nk);
        let d = grouped(&desc, &[1, 3], &a, &w, &d0);
        assert!(d[..n].iter().all(|&x| x == 8.0));
        assert!(d[n..3 * n].iter().all(|&x| x == 16.0));
        assert!(
            d[3 * n..].iter().all(|&x| x == -7.0),
            "rows past the last end keep D"
        );
    }

    #[test]
    fn grouped_wgrad_zeroes_empty_groups_unless_accumulating() {
        let (g, rows, n, k) = (2, 4, 8, 8);
        let a = vec![bf16::ONE; rows * k];
        let b = vec![bf16::from_f32(0.5); rows * n];
        let d0 = vec![bf16::from_f32(3.0); g * k * n];
        let desc = GroupedDesc::wgrad(g, rows, n, k);
        let d = grouped(&desc, &[4, 4], &a, &b, &d0);
        assert!(d[..k * n].iter().all(|&x| x == 2.0) && d[k * n..].iter().all(|&x| x == 0.0));
        let acc = GroupedDesc { beta: 1.0, ..desc };
        let d = grouped(&acc, &[4, 4], &a, &b, &d0);
        assert!(d[..k * n].iter().all(|&x| x == 5.0) && d[k * n..].iter().all(|&x| x == 3.0));
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
