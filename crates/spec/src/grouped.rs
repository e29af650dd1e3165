//! The grouped-layout kinds, one enum for C++ and Rust.
//!
//! Groups are given by prefix-sum row ends (`offsets[e]` is the end row of group e), the
//! canonical form of every grouped kernel; empty groups own no tiles. Two kinds exist:
//!
//! | kind | product per group e | used for | C++ (`common/group_layout.cuh`) |
//! |---|---|---|---|
//! | [`GroupedKind::MGrouped`] | `D[rows_e] = A[rows_e] · W_e` | forward, dgrad | `GroupedKind::kMGrouped` |
//! | [`GroupedKind::KGrouped`] | `D_e = A[rows_e]ᵀ · B[rows_e]` | wgrad | `GroupedKind::kKGrouped` |
//!
//! An M-masked kind (DeepGEMM's: a fixed row capacity per group and a count) has no kernel
//! in moefuse, so it has no value here.
//!
//! ```
//! use moefuse_spec::{GroupedKind, Op};
//! assert_eq!(Op::GroupedWgrad.grouped_kind(), Some(GroupedKind::KGrouped));
//! assert_eq!(Op::GemmBnk.grouped_kind(), None);
//! ```

use crate::variants::Op;
use std::fmt;

/// How a grouped problem splits into per-group GEMMs. The discriminant is the value of
/// `MOEFUSE_SPEC_GROUPED_KIND_*` in `spec.h` and of the C++ `enum class GroupedKind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i32)]
pub enum GroupedKind {
    /// M-grouped: group e is the GEMM `(m_e, n, k)` on rows `[start_e, end_e)` of A and D,
    /// with its own weights `W_e`. Forward, and dgrad with the weights read transposed.
    MGrouped = 0,
    /// K-grouped: group e is the GEMM `(k, n, m_e)`, `D_e = A_eᵀ · B_e`: the reduction runs
    /// over the group's rows. Weight gradients.
    KGrouped = 1,
}

impl GroupedKind {
    /// Both kinds, in value order.
    pub const ALL: [GroupedKind; 2] = [GroupedKind::MGrouped, GroupedKind::KGrouped];

    /// The value C sees (`spec.h`, the C++ enum's underlying value).
    ///
    /// ```
    /// assert_eq!(moefuse_spec::GroupedKind::KGrouped.code(), 1);
    /// ```
    pub const fn code(self) -> i32 {
        self as i32
    }

    /// The kind of C value `code`, if there is one.
    ///
    /// ```
    /// use moefuse_spec::GroupedKind;
    /// assert_eq!(GroupedKind::from_code(0), Some(GroupedKind::MGrouped));
    /// assert_eq!(GroupedKind::from_code(2), None);
    /// ```
    pub const fn from_code(code: i32) -> Option<GroupedKind> {
        match code {
            0 => Some(GroupedKind::MGrouped),
            1 => Some(GroupedKind::KGrouped),
            _ => None,
        }
    }

    /// Short name, also the suffix of the C macro: `m_grouped`, `k_grouped`.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::GroupedKind::MGrouped.name(), "m_grouped");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            GroupedKind::MGrouped => "m_grouped",
            GroupedKind::KGrouped => "k_grouped",
        }
    }

    /// The C++ enumerator the generated instance files name.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::GroupedKind::MGrouped.cpp(), "moefuse::GroupedKind::kMGrouped");
    /// ```
    pub const fn cpp(self) -> &'static str {
        match self {
            GroupedKind::MGrouped => "moefuse::GroupedKind::kMGrouped",
            GroupedKind::KGrouped => "moefuse::GroupedKind::kKGrouped",
        }
    }
}

impl fmt::Display for GroupedKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Op {
    /// The grouped kind of a grouped operation; `None` for the dense ones.
    ///
    /// ```
    /// use moefuse_spec::{GroupedKind, Op};
    /// assert_eq!(Op::GroupedFwdBkn.grouped_kind(), Some(GroupedKind::MGrouped));
    /// ```
    pub const fn grouped_kind(self) -> Option<GroupedKind> {
        match self {
            Op::GemmBnk | Op::GemmBkn => None,
            Op::GroupedFwdBnk | Op::GroupedFwdBkn => Some(GroupedKind::MGrouped),
            Op::GroupedWgrad => Some(GroupedKind::KGrouped),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_cover_the_grouped_ops() {
        for (i, kind) in GroupedKind::ALL.iter().enumerate() {
            assert_eq!(
                kind.code(),
                i as i32,
                "{kind}: codes follow the C++ enum order"
            );
            assert_eq!(GroupedKind::from_code(kind.code()), Some(*kind));
        }
        for op in [
            Op::GemmBnk,
            Op::GemmBkn,
            Op::GroupedFwdBnk,
            Op::GroupedFwdBkn,
            Op::GroupedWgrad,
        ] {
            assert_eq!(op.grouped_kind().is_some(), op.is_grouped(), "{op:?}");
        }
    }
}
