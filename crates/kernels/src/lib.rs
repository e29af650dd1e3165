//! moefuse's CUDA kernels behind a C ABI.
//!
//! **Loading path:** kernels are compiled ahead of time by `build.rs` (through
//! `moefuse-kernel-build`, the same code as `cargo xtask build-kernels`) for the targets
//! in `MOEFUSE_CUDA_ARCHS` (default `90a,100a`; `none` for a build without kernels),
//! archived into a static library and linked with the static CUDA runtime. Nothing is
//! loaded or JIT-compiled at run time, and nothing links against `libcuda`: the runtime
//! finds the driver when the first kernel launches.
//!
//! 1. [`VARIANTS`] is the table of every variant; [`compiled`] lists those in this build.
//! 2. [`built_archs`] says which targets were compiled.
//! 3. [`Kernels`] is the typed launch layer (module `launch`), the one door to the C
//!    launchers: a per-context handle checks the ABI and the architecture once;
//!    [`Kernels::launch`] takes an operation ([`Gemm`], [`GroupedGemm`], [`RouterForward`],
//!    [`RouterBackward`], [`Activation`], [`Permute`], [`GateUpFused`], [`CombineForward`],
//!    [`CombineBackward`]) whose buffers are cudarc slices or views, checks sizes, limits,
//!    device, length and alignment on the host, holds the buffers' guards and makes the one
//!    `unsafe` call. Crates above this one need no `unsafe`.
//! 4. The MoE kernels that are not GEMMs (router, activation, permutation, combine;
//!    `cuda/moe/`) are one fat object each (SASS for every built arch), so they have one
//!    launcher each, not one per variant; [`Kernels::launch`] reaches them too, and
//!    [`moe_permute_workspace`] sizes the permutation's scratch.
//!
//! ```
//! for v in moefuse_kernels::compiled() {
//!     println!("{}", v.name());
//! }
//! ```

pub mod ffi;

mod bind;
#[cfg(feature = "c-bridge")]
pub mod bridge;
mod error;
mod foreign;
mod handle;
mod launch;
mod moe_ops;
mod ops;

pub use error::{KernelError, Status};
pub use handle::{arch_of, Kernels};
pub use launch::Launch;
pub use moe_ops::{
    Activation, ActivationBackwardRouted, ActivationKind, ColumnsToF32, CombineBackward,
    CombineForward, DecodeForward, DownDgradFused, DownScatter, GateUpFused, GateUpLayout,
    GateUpRows, GatherRows, PeerRows, Permute, RouterBackward, RouterForward, RouterScoring,
    ScatterColumns, ScatterRows, ScatterWeights, DECODE_DIM_MULTIPLE, DOWN_DGRAD_COLUMN_BLOCK,
};
/// The facts shared with the build scripts, xtask and the C side (`moefuse-spec`): arch
/// table, variant table, limits, grouped kinds, tile-order fields. Re-exported so a crate
/// that depends on this one reads the same values without a second dependency.
///
/// ```
/// assert_eq!(moefuse_kernels::spec::MAX_TOP_K, 16);
/// ```
pub use moefuse_spec as spec;
pub use moefuse_spec::{
    GroupedKind, Op, Schedule, VariantArch, VariantSpec, CONTIGUOUS_MAX_GROUPS, VARIANTS,
    ZERO_EMPTY_GROUPS_MAX,
};
pub use ops::{GatheredRows, Gemm, GemmShape, GroupedGemm, GroupedShape, RawGrouped};

// The generated registry (`registry.rs`, included below) names these unqualified in its
// `extern` block; a build without GEMM kernels (no arch, or feature `gemm` off) has none.
#[allow(unused_imports)]
use ffi::{MoefuseGemmArgs, MoefuseGroupedGemmArgs, MoefuseStatus};
#[allow(unused_imports)]
use std::ffi::c_void;

/// A variant's two C entry points, typed by the argument struct they take.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(moefuse_kernels_linked), allow(dead_code))]
enum Entry {
    Gemm {
        run: ffi::GemmLaunchFn,
        workspace: ffi::GemmWorkspaceFn,
    },
    Grouped {
        run: ffi::GroupedLaunchFn,
        workspace: ffi::GroupedWorkspaceFn,
    },
}

/// A variant compiled into this build: its spec and its C entry points.
#[derive(Debug, Clone, Copy)]
pub struct CompiledVariant {
    /// What the variant is.
    pub spec: &'static VariantSpec,
    entry: Entry,
}

impl CompiledVariant {
    /// The variant's name (see [`VariantSpec::name`]).
    pub fn name(&self) -> String {
        self.spec.name()
    }
}

include!(concat!(env!("OUT_DIR"), "/registry.rs"));

/// The variants compiled into this build, in table order.
///
/// ```
/// let n = moefuse_kernels::compiled().len();
/// assert!(n <= moefuse_kernels::VARIANTS.len());
/// ```
pub fn compiled() -> &'static [CompiledVariant] {
    COMPILED
}

/// The targets this build compiled, e.g. `["sm90a", "sm100a"]` (empty for `none`).
///
/// ```
/// let archs = moefuse_kernels::built_archs();
/// assert!(archs.iter().all(|a| *a == "sm90a" || *a == "sm100a"));
/// ```
pub fn built_archs() -> Vec<&'static str> {
    env!("MOEFUSE_BUILT_ARCHS")
        .split(',')
        .filter(|s| !s.is_empty())
        .collect()
}

/// Checks the linked library's ABI version against these bindings.
///
/// ```
/// moefuse_kernels::check_abi().unwrap();
/// ```
pub fn check_abi() -> Result<(), KernelError> {
    #[cfg(moefuse_kernels_linked)]
    {
        // SAFETY: a plain getter with no arguments and no side effects.
        let found = unsafe { ffi::moefuse_abi_version() };
        if found != ffi::MOEFUSE_ABI_VERSION {
            return Err(KernelError::AbiMismatch {
                found,
                expected: ffi::MOEFUSE_ABI_VERSION,
            });
        }
    }
    Ok(())
}

/// Bytes of workspace `moefuse_moe_permute` needs for `tokens` tokens over `experts`
/// experts (the same formula without kernels, so sizes never depend on the build).
///
/// ```
/// assert_eq!(moefuse_kernels::moe_permute_workspace(512, 8), 2 * 8 * 4);
/// ```
pub fn moe_permute_workspace(tokens: usize, experts: usize) -> usize {
    let chunks = tokens.div_ceil(256).max(1);
    chunks * experts.max(1) * 4
}

/// The library's message for the last failure on this thread.
fn last_error() -> String {
    #[cfg(moefuse_kernels_linked)]
    {
        // SAFETY: moefuse_last_error returns a pointer to a thread-local, NUL-terminated
        // buffer that lives as long as the thread; it is copied before anything else runs.
        let msg = unsafe { std::ffi::CStr::from_ptr(ffi::moefuse_last_error()) };
        msg.to_string_lossy().into_owned()
    }
    #[cfg(not(moefuse_kernels_linked))]
    String::new()
}

#[cfg(test)]
mod spec_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn variant_names_are_unique_and_follow_the_grammar() {
        let mut seen = HashSet::new();
        for v in VARIANTS {
            let name = v.name();
            assert!(seen.insert(name.clone()), "duplicate variant {name}");
            let fields: Vec<&str> = name.split('_').collect();
            assert_eq!(fields[0], v.arch.name(), "{name}");
            assert!(name.contains("_bf16_f32_"), "{name}");
            assert!(name.ends_with(v.schedule.name()), "{name}");
        }
    }

    #[test]
    fn compiled_variants_match_built_archs() {
        let archs = built_archs();
        for v in compiled() {
            assert!(
                archs.contains(&v.spec.arch.name()),
                "{} compiled but its arch is not built",
                v.name()
            );
        }
        let expected = VARIANTS
            .iter()
            .filter(|v| archs.contains(&v.arch.name()))
            .count();
        assert_eq!(compiled().len(), expected);
    }

    #[test]
    fn entries_match_ops() {
        for v in compiled() {
            let grouped = matches!(v.entry, Entry::Grouped { .. });
            assert_eq!(grouped, v.spec.op.is_grouped(), "{}", v.name());
        }
    }

    #[test]
    fn schedules_belong_to_their_arch() {
        for v in VARIANTS {
            let ok = match v.schedule {
                Schedule::Cooperative | Schedule::Pingpong => v.arch == VariantArch::Sm90a,
                // moefuse's own kernels: M-grouped (fwd/dgrad) and K-grouped (wgrad) on
                // both archs.
                Schedule::Contiguous => v.op.is_grouped(),
                Schedule::OneSm | Schedule::TwoSm => v.arch == VariantArch::Sm100a,
            };
            assert!(ok, "{} pairs a schedule with the wrong arch", v.name());
        }
    }
}
