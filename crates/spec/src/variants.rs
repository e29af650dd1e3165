//! The one table of compiled kernel variants.
//!
//! `moefuse-kernels` re-exports it (its build script declares the compiled launchers from
//! it) and `cargo xtask gen-variants` writes `crates/kernels/cuda/instances/<arch>/<name>.cu`
//! from it.
//!
//! ```
//! use moefuse_spec::{Arch, VARIANTS};
//! let dense_hopper = VARIANTS
//!     .iter()
//!     .filter(|v| v.arch == Arch::Sm90a && !v.op.is_grouped())
//!     .count();
//! assert!(dense_hopper > 0);
//! ```

use crate::arch::Arch;

/// Target architecture of a variant: the same type as [`Arch`] (the name stays for the
/// users of `moefuse_kernels::VariantArch`).
///
/// ```
/// use moefuse_spec::{Arch, VariantArch};
/// assert_eq!(VariantArch::Sm90a, Arch::Sm90a);
/// ```
pub type VariantArch = Arch;

/// How the kernel walks its tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// sm90: two consumer warp groups share one tile (CUTLASS cooperative).
    Cooperative,
    /// sm90: two consumer warp groups alternate tiles (CUTLASS ping-pong).
    Pingpong,
    /// moefuse's persistent kernels over the contiguous grouped layout (tensor maps built
    /// once on the host; M-grouped: masked stores at group ends; K-grouped: a group's last
    /// chunk loaded row by row, zero-filled past its end). sm90: cooperative consumers; sm100:
    /// UMMA with tensor-memory accumulators; both kinds on both.
    Contiguous,
    /// sm100: one SM per MMA tile.
    OneSm,
    /// sm100: a CTA pair shares one MMA tile (`cta_group::2`).
    TwoSm,
}

/// Which operation a variant implements, and the layout of B.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Dense GEMM, B stored `[n, k]` (K contiguous).
    GemmBnk,
    /// Dense GEMM, B stored `[k, n]` (N contiguous).
    GemmBkn,
    /// M-grouped GEMM (forward, dgrad), each W_e stored `[n, k]`.
    GroupedFwdBnk,
    /// M-grouped GEMM (forward, dgrad), each W_e stored `[k, n]`.
    GroupedFwdBkn,
    /// K-grouped GEMM (wgrad): D_e = A_eᵀ · B_e.
    GroupedWgrad,
}

/// One kernel variant: everything its name encodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VariantSpec {
    /// Target architecture.
    pub arch: Arch,
    /// Operation and operand layout.
    pub op: Op,
    /// CTA (sm90) or MMA (sm100) tile, M x N x K.
    pub tile: [u32; 3],
    /// Cluster shape, M x N.
    pub cluster: [u32; 2],
    /// Tile schedule.
    pub schedule: Schedule,
}

/// Every variant moefuse compiles, in a stable order.
pub const VARIANTS: &[VariantSpec] = &[
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GemmBnk,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GemmBnk,
        tile: [128, 128, 64],
        cluster: [2, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GemmBnk,
        tile: [64, 128, 64],
        cluster: [1, 1],
        schedule: Schedule::Pingpong,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GemmBkn,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GemmBkn,
        tile: [64, 128, 64],
        cluster: [1, 1],
        schedule: Schedule::Pingpong,
    },
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GemmBnk,
        tile: [256, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::TwoSm,
    },
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GemmBnk,
        tile: [128, 128, 64],
        cluster: [1, 1],
        schedule: Schedule::OneSm,
    },
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GemmBkn,
        tile: [256, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::TwoSm,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBnk,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::Cooperative,
    },
    // NOTES: cluster 1x1 twin of the 128x256 tile. The grouped scheduler counts tiles in
    // cluster units, so with a 2x1 cluster a group of 5 M-tiles costs 6; routed groups are
    // ragged, and the layer's gate_up/down GEMMs ran 24-30% slower than on balanced groups.
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBnk,
        tile: [128, 256, 64],
        cluster: [1, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBnk,
        tile: [128, 128, 64],
        cluster: [2, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBnk,
        tile: [64, 128, 64],
        cluster: [1, 1],
        schedule: Schedule::Pingpong,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBkn,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBkn,
        tile: [128, 256, 64],
        cluster: [1, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBkn,
        tile: [64, 128, 64],
        cluster: [1, 1],
        schedule: Schedule::Pingpong,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedWgrad,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedWgrad,
        tile: [128, 128, 64],
        cluster: [1, 1],
        schedule: Schedule::Cooperative,
    },
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GroupedFwdBnk,
        tile: [256, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::TwoSm,
    },
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GroupedFwdBkn,
        tile: [256, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::TwoSm,
    },
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GroupedWgrad,
        tile: [256, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::TwoSm,
    },
    // NOTES: moefuse's own M-grouped kernel (kernels/include/moefuse/kernel/
    // sm90_contiguous_grouped.cuh): the ptr-array kernels above ran ~10% slower than the
    // dense kernel on the same FLOPs (Qwen3 gate_up 607 vs 554 us, down 351 vs 317).
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBnk,
        tile: [128, 256, 64],
        cluster: [1, 1],
        schedule: Schedule::Contiguous,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBkn,
        tile: [128, 256, 64],
        cluster: [1, 1],
        schedule: Schedule::Contiguous,
    },
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBnk,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::Contiguous,
    },
    // The dgrads' twin (both read their weights transposed): session 19's fused down dgrad
    // ran its W_e tiles multicast to CTA pairs and took 2.2 ms off DeepSeek-V3's stage
    // against the 1x1 dgrad plus the activation pass (docs/perf-notes.md, session 20).
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedFwdBkn,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::Contiguous,
    },
    // The Blackwell twins of the two 1x1 kernels above (kernels/include/moefuse/kernel/
    // sm100_contiguous_grouped.cuh: the same tile order and masked stores on UMMA, the
    // accumulators in tensor memory). Built and SASS-checked; no B200 has run them yet, so
    // the sm100 heuristic does not score them (Auto keeps the ptr-array 2-SM kernels).
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GroupedFwdBnk,
        tile: [128, 256, 64],
        cluster: [1, 1],
        schedule: Schedule::Contiguous,
    },
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GroupedFwdBkn,
        tile: [128, 256, 64],
        cluster: [1, 1],
        schedule: Schedule::Contiguous,
    },
    // NOTES: moefuse's own K-grouped kernel (kernels/include/moefuse/kernel/
    // sm90_contiguous_wgrad.cuh): CUTLASS's ptr-array wgrad above ran at 0.68x dense on the
    // Qwen3 shapes (gate_up wgrad 931 vs 511 us, down 481 vs 265).
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedWgrad,
        tile: [128, 256, 64],
        cluster: [1, 1],
        schedule: Schedule::Contiguous,
    },
    // Its 2x1 twin: a CTA pair shares B's strips by TMA multicast (the fused gate_up's pairs
    // measured 5-18% faster at the H200's real clocks, its L2 throughput 90% -> 78%).
    VariantSpec {
        arch: Arch::Sm90a,
        op: Op::GroupedWgrad,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule: Schedule::Contiguous,
    },
    // The Blackwell twin of the 1x1 wgrad (kernels/include/moefuse/kernel/
    // sm100_contiguous_wgrad.cuh: the same producer and tile walk, UMMA into tensor memory).
    // Built and SASS-checked; no B200 has run it yet, so the sm100 heuristic does not score
    // it (Auto keeps the ptr-array 2-SM wgrad).
    VariantSpec {
        arch: Arch::Sm100a,
        op: Op::GroupedWgrad,
        tile: [128, 256, 64],
        cluster: [1, 1],
        schedule: Schedule::Contiguous,
    },
];

impl Schedule {
    /// The name field: `coop`, `pingpong`, `contig`, `1sm`, `2sm`.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::Schedule::TwoSm.name(), "2sm");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Schedule::Cooperative => "coop",
            Schedule::Pingpong => "pingpong",
            Schedule::Contiguous => "contig",
            Schedule::OneSm => "1sm",
            Schedule::TwoSm => "2sm",
        }
    }
}

impl Op {
    /// The name field: `gemm_bnk`, `gemm_bkn`, `grouped_fwd_bnk`, `grouped_fwd_bkn`, `grouped_wgrad`.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::Op::GroupedWgrad.name(), "grouped_wgrad");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Op::GemmBnk => "gemm_bnk",
            Op::GemmBkn => "gemm_bkn",
            Op::GroupedFwdBnk => "grouped_fwd_bnk",
            Op::GroupedFwdBkn => "grouped_fwd_bkn",
            Op::GroupedWgrad => "grouped_wgrad",
        }
    }

    /// True for the grouped operations (launched with `moefuse_grouped_gemm_args`).
    ///
    /// ```
    /// assert!(!moefuse_spec::Op::GemmBnk.is_grouped());
    /// ```
    pub const fn is_grouped(self) -> bool {
        matches!(
            self,
            Op::GroupedFwdBnk | Op::GroupedFwdBkn | Op::GroupedWgrad
        )
    }
}

impl VariantSpec {
    /// The variant's one name: `{arch}_{op}_{ab}_{acc}_{M}x{N}x{K}_c{cm}x{cn}_{schedule}`,
    /// used for the instance file, the C symbol (`moefuse_<name>`), logs and bench cases.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::VARIANTS[0].name(), "sm90a_gemm_bnk_bf16_f32_128x256x64_c2x1_coop");
    /// ```
    pub fn name(&self) -> String {
        let [m, n, k] = self.tile;
        let [cm, cn] = self.cluster;
        format!(
            "{}_{}_bf16_f32_{m}x{n}x{k}_c{cm}x{cn}_{}",
            self.arch.name(),
            self.op.name(),
            self.schedule.name()
        )
    }

    /// The generated instance file's text (about ten lines of C++).
    ///
    /// ```
    /// let v = &moefuse_spec::VARIANTS[0];
    /// assert!(v.instance_source().contains(&format!("MOEFUSE_DEFINE_GEMM({},", v.name())));
    /// ```
    pub fn instance_source(&self) -> String {
        let [m, n, k] = self.tile;
        let [cm, cn] = self.cluster;
        let (ns, sched) = match self.schedule {
            Schedule::Cooperative => ("sm90", "Cooperative"),
            Schedule::Pingpong => ("sm90", "Pingpong"),
            Schedule::Contiguous if self.arch == Arch::Sm100a => ("sm100", "Contiguous"),
            Schedule::Contiguous => ("sm90", "Contiguous"),
            Schedule::OneSm => ("sm100", "OneSm"),
            Schedule::TwoSm => ("sm100", "TwoSm"),
        };
        let (header, define, template, layout) = match self.op {
            Op::GemmBnk => ("gemm", "GEMM", "GemmBf16", "MOEFUSE_B_LAYOUT_NK"),
            Op::GemmBkn => ("gemm", "GEMM", "GemmBf16", "MOEFUSE_B_LAYOUT_KN"),
            Op::GroupedFwdBnk | Op::GroupedWgrad => (
                "grouped_gemm",
                "GROUPED",
                "GroupedBf16",
                "MOEFUSE_B_LAYOUT_NK",
            ),
            Op::GroupedFwdBkn => (
                "grouped_gemm",
                "GROUPED",
                "GroupedBf16",
                "MOEFUSE_B_LAYOUT_KN",
            ),
        };
        // The ptr-array grouped templates take the kind; the contiguous one is M-grouped only.
        let kind = match self.op.grouped_kind() {
            Some(kind) if self.schedule != Schedule::Contiguous => format!("{}, ", kind.cpp()),
            _ => String::new(),
        };
        let (header, define, template) = match (self.schedule, self.op) {
            (Schedule::Contiguous, Op::GroupedWgrad) => (
                "contiguous_wgrad",
                "CONTIGUOUS_WGRAD",
                "ContiguousWgradBf16",
            ),
            (Schedule::Contiguous, _) => (
                "contiguous_grouped_gemm",
                "CONTIGUOUS",
                "ContiguousGroupedBf16",
            ),
            _ => (header, define, template),
        };
        format!(
            "// generated by `cargo xtask gen-variants` from crates/spec/src/variants.rs; do not edit\n\
             #include \"moefuse/{ns}/{header}.cuh\"\n\n\
             MOEFUSE_DEFINE_{define}({name},\n\
             \x20                   moefuse::{ns}::{template}<{m}, {n}, {k}, {cm}, {cn}, moefuse::{ns}::{sched},\n\
             \x20                                           {kind}{layout}>)\n",
            name = self.name()
        )
    }
}
