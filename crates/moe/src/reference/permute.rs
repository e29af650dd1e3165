//! The expert-major permutation of routed (token, slot) pairs that the grouped GEMMs run on.

use crate::model::check_routing;
use crate::MoeError;
use std::ops::Range;

/// Where each routed (token, slot) pair sits in the expert-major row order.
///
/// Rows are grouped by expert, experts ascending; within an expert rows are in ascending
/// `token·k + slot` order, which is token order since a token never routes to one expert
/// twice. Expert `e` owns rows `offsets[e-1]..offsets[e]` (with `offsets[-1] = 0`), so
/// `offsets` holds the prefix-sum *ends*, int32, as the grouped GEMM takes them; experts with
/// no tokens have empty ranges. `row_of` and `source_of` are inverse permutations of
/// `0..T·k`.
///
/// ```
/// use moefuse::reference::permutation;
/// // 3 tokens, top-2, 4 experts.
/// let p = permutation(&[2, 0, 0, 3, 2, 3], 2, 4)?;
/// assert_eq!(p.counts, vec![2, 0, 2, 2]);
/// assert_eq!(p.offsets, vec![2, 2, 4, 6]);
/// assert_eq!(p.source_of, vec![1, 2, 0, 4, 3, 5]); // (t0,s1) (t1,s0) | (t0,s0) (t2,s0) | ...
/// assert_eq!(p.row_of, vec![2, 0, 1, 4, 3, 5]);
/// assert_eq!(p.expert_rows(2), 2..4);
/// # Ok::<(), moefuse::MoeError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permutation {
    /// `[E]` rows per expert.
    pub counts: Vec<i32>,
    /// `[E]` prefix-sum ends: `offsets[e] = Σ_{e' ≤ e} counts[e']`.
    pub offsets: Vec<i32>,
    /// `[T·k]` the row of pair `token·k + slot`.
    pub row_of: Vec<i32>,
    /// `[T·k]` the pair `token·k + slot` that row `r` holds.
    pub source_of: Vec<i32>,
}

impl Permutation {
    /// The number of rows, `T·k`.
    ///
    /// ```
    /// let p = moefuse::reference::permutation(&[1, 0], 1, 2)?;
    /// assert_eq!(p.rows(), 2);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn rows(&self) -> usize {
        self.source_of.len()
    }

    /// The rows of expert `e`.
    ///
    /// ```
    /// let p = moefuse::reference::permutation(&[1, 1], 1, 3)?;
    /// assert_eq!((p.expert_rows(0), p.expert_rows(1), p.expert_rows(2)), (0..0, 0..2, 2..2));
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn expert_rows(&self, e: usize) -> Range<usize> {
        let start = if e == 0 {
            0
        } else {
            self.offsets[e - 1] as usize
        };
        start..self.offsets[e] as usize
    }

    /// The expert that owns each row, `[T·k]` (a convenience for per-row loops).
    ///
    /// ```
    /// let p = moefuse::reference::permutation(&[2, 0, 2], 1, 3)?;
    /// assert_eq!(p.expert_of_rows(), vec![0, 2, 2]);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn expert_of_rows(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.rows());
        for e in 0..self.counts.len() {
            out.extend(self.expert_rows(e).map(|_| e));
        }
        out
    }
}

/// Builds the [`Permutation`] of routing ids `topk_ids [T, k]` over `experts` experts, after
/// checking them (ids in range, no duplicate expert within a token). A counting sort,
/// stable in `token·k + slot` order.
///
/// ```
/// use moefuse::{reference::permutation, MoeError};
/// assert!(matches!(permutation(&[0, 4], 2, 4), Err(MoeError::ExpertIdOutOfRange { id: 4, .. })));
/// ```
pub fn permutation(
    topk_ids: &[i32],
    top_k: usize,
    experts: usize,
) -> Result<Permutation, MoeError> {
    check_routing(topk_ids, top_k, experts)?;
    let mut counts = vec![0i32; experts];
    for &id in topk_ids {
        counts[id as usize] += 1;
    }
    let mut offsets = Vec::with_capacity(experts);
    let mut end = 0i32;
    for &c in &counts {
        end += c;
        offsets.push(end);
    }
    let mut next: Vec<i32> = offsets.iter().zip(&counts).map(|(o, c)| o - c).collect();
    let mut row_of = vec![0i32; topk_ids.len()];
    let mut source_of = vec![0i32; topk_ids.len()];
    for (pair, &id) in topk_ids.iter().enumerate() {
        let row = next[id as usize];
        next[id as usize] += 1;
        row_of[pair] = row;
        source_of[row as usize] = pair as i32;
    }
    Ok(Permutation {
        counts,
        offsets,
        row_of,
        source_of,
    })
}
