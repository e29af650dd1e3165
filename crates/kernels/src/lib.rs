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
//! 3. [`launch_gemm`] is the one `unsafe` entry: it calls a variant's launcher and turns
//!    its status into a [`KernelError`]. Safe wrappers live in `moefuse-grouped-gemm`.
//! 4. The MoE kernels that are not GEMMs (router, activation; `kernels/moe/`) are one fat
//!    object each (SASS for every built arch), so they have one launcher each, not one per
//!    variant: [`launch_moe`] with a [`MoeArgs`]. Safe wrappers live in `moefuse` (`gpu`).
//!
//! ```
//! for v in moefuse_kernels::compiled() {
//!     println!("{}", v.name());
//! }
//! ```

pub mod ffi;

mod error;
#[allow(clippy::all)]
mod variant_table;

pub use error::{KernelError, Status};
pub use variant_table::{Op, Schedule, VariantArch, VariantSpec, VARIANTS};

use std::ffi::c_void;

#[allow(unused_imports)]
use ffi::{MoefuseGemmArgs, MoefuseGroupedGemmArgs, MoefuseStatus};

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

/// Bytes of device workspace the dense `variant` needs for `args` (0 when the device or
/// the arguments do not fit the variant; [`launch_gemm`] then reports why).
pub fn gemm_workspace_bytes(
    variant: &CompiledVariant,
    args: &MoefuseGemmArgs,
) -> Result<usize, KernelError> {
    match variant.entry {
        // SAFETY: the query reads `args` (a valid reference for the call) and device
        // attributes; it dereferences none of the pointers inside `args`.
        Entry::Gemm { workspace, .. } => Ok(unsafe { workspace(args) }),
        Entry::Grouped { .. } => Err(KernelError::WrongEntry {
            variant: variant.name(),
            expected: "dense",
        }),
    }
}

/// Bytes of device workspace the grouped `variant` needs for `args` (0 when the device or
/// the arguments do not fit; [`launch_grouped`] then reports why).
pub fn grouped_workspace_bytes(
    variant: &CompiledVariant,
    args: &MoefuseGroupedGemmArgs,
) -> Result<usize, KernelError> {
    match variant.entry {
        Entry::Grouped { workspace, .. } => {
            // SAFETY: as for gemm_workspace_bytes: sizes and device attributes only.
            let bytes = unsafe { workspace(args) };
            // Any grouped problem needs its per-group arrays: 0 means the query refused.
            if bytes == 0 && args.num_groups > 0 {
                return Err(KernelError::WorkspaceQuery {
                    variant: variant.name(),
                    message: last_error(),
                });
            }
            Ok(bytes)
        }
        Entry::Gemm { .. } => Err(KernelError::WrongEntry {
            variant: variant.name(),
            expected: "grouped",
        }),
    }
}

/// Launches `variant` on `stream` with `args` and `workspace`.
///
/// # Safety
/// Every pointer in `args` must address device memory of the current context, valid for
/// the extents `args` describes (A `m x lda`, B per layout, C and D `m x ldc`/`ldd`) until
/// the kernel has finished on `stream`; `workspace` must address `workspace_bytes` of
/// device memory (or be null when 0 bytes are needed); `stream` must be a live stream of
/// the current context; the caller must have made that context current on this thread.
pub unsafe fn launch_gemm(
    variant: &CompiledVariant,
    args: &MoefuseGemmArgs,
    workspace: *mut c_void,
    workspace_bytes: usize,
    stream: *mut c_void,
) -> Result<(), KernelError> {
    let Entry::Gemm { run, .. } = variant.entry else {
        return Err(KernelError::WrongEntry {
            variant: variant.name(),
            expected: "dense",
        });
    };
    // SAFETY: forwarded from this function's contract.
    let raw = unsafe { run(args, workspace, workspace_bytes, stream) };
    status(variant, raw)
}

/// Launches the grouped `variant` on `stream` with `args` and `workspace`.
///
/// # Safety
/// `args.offsets` must address `num_groups` int32 in device memory; `a`, `b`, `d` device
/// memory of the current context valid for the extents abi.h gives for the variant's kind
/// (rows up to `total_rows`, `num_groups` weight or output matrices), until the kernels have
/// finished on `stream`; `workspace` at least the queried bytes, 256-byte aligned; `stream` a
/// live stream of the current context, made current on this thread.
pub unsafe fn launch_grouped(
    variant: &CompiledVariant,
    args: &MoefuseGroupedGemmArgs,
    workspace: *mut c_void,
    workspace_bytes: usize,
    stream: *mut c_void,
) -> Result<(), KernelError> {
    let Entry::Grouped { run, .. } = variant.entry else {
        return Err(KernelError::WrongEntry {
            variant: variant.name(),
            expected: "grouped",
        });
    };
    // SAFETY: forwarded from this function's contract.
    let raw = unsafe { run(args, workspace, workspace_bytes, stream) };
    status(variant, raw)
}

/// The arguments of one MoE kernel launch: which kernel, and its argument struct.
#[derive(Debug, Clone, Copy)]
pub enum MoeArgs<'a> {
    /// `moefuse_moe_router_fwd`: logits to top-k ids and weights.
    RouterForward(&'a ffi::MoefuseRouterArgs),
    /// `moefuse_moe_router_bwd`: `d_logits` from `d_topk_weights`.
    RouterBackward(&'a ffi::MoefuseRouterBwdArgs),
    /// `moefuse_moe_activation_fwd`: `h` from `h_pre`.
    ActivationForward(&'a ffi::MoefuseActivationArgs),
    /// `moefuse_moe_activation_bwd`: `d_h_pre` from `dh` and `h_pre`.
    ActivationBackward(&'a ffi::MoefuseActivationArgs),
    /// `moefuse_moe_permute`: expert-major rows, offsets, and the gather of x.
    Permute(&'a ffi::MoefusePermuteArgs),
    /// `moefuse_moe_combine`: weighted slot sums back to tokens.
    Combine(&'a ffi::MoefuseCombineArgs),
    /// `moefuse_moe_combine_bwd`: `dy_perm` and `d_weights`.
    CombineBackward(&'a ffi::MoefuseCombineBwdArgs),
}

impl MoeArgs<'_> {
    /// The C launcher's name.
    ///
    /// ```
    /// use moefuse_kernels::{ffi::MoefuseActivationArgs, MoeArgs};
    /// let a = MoefuseActivationArgs { activation: 0, layout: 0, intermediate: 64, max_rows: 0,
    ///     alpha: 0.0, limit: 0.0, total_rows: std::ptr::null(), h_pre: std::ptr::null(),
    ///     dh: std::ptr::null(), out: std::ptr::null_mut() };
    /// assert_eq!(MoeArgs::ActivationForward(&a).kernel(), "moefuse_moe_activation_fwd");
    /// ```
    pub fn kernel(&self) -> &'static str {
        match self {
            MoeArgs::RouterForward(_) => "moefuse_moe_router_fwd",
            MoeArgs::RouterBackward(_) => "moefuse_moe_router_bwd",
            MoeArgs::ActivationForward(_) => "moefuse_moe_activation_fwd",
            MoeArgs::ActivationBackward(_) => "moefuse_moe_activation_bwd",
            MoeArgs::Permute(_) => "moefuse_moe_permute",
            MoeArgs::Combine(_) => "moefuse_moe_combine",
            MoeArgs::CombineBackward(_) => "moefuse_moe_combine_bwd",
        }
    }
}

/// Launches the MoE kernel `args` names on `stream`. In a build without kernels it returns
/// a `Launch` error with [`Status::ArchMismatch`] and launches nothing.
///
/// # Safety
/// Every pointer inside `args` must address device memory of the current context valid for
/// the extents abi.h gives for that kernel (router: `tokens x experts` logits and
/// `tokens x top_k` ids and weights, `experts` bias; activation: `max_rows` rows of `W` and
/// `I` bf16 and one int32 row count), until the kernel has finished on `stream`; `stream`
/// must be a live stream of the current context, made current on this thread.
pub unsafe fn launch_moe(args: MoeArgs<'_>, stream: *mut c_void) -> Result<(), KernelError> {
    #[cfg(moefuse_kernels_linked)]
    {
        // SAFETY: forwarded from this function's contract; each launcher reads its argument
        // struct (a valid reference for the call) and enqueues on `stream`.
        let raw = unsafe {
            match args {
                MoeArgs::RouterForward(a) => ffi::moefuse_moe_router_fwd(a, stream),
                MoeArgs::RouterBackward(a) => ffi::moefuse_moe_router_bwd(a, stream),
                MoeArgs::ActivationForward(a) => ffi::moefuse_moe_activation_fwd(a, stream),
                MoeArgs::ActivationBackward(a) => ffi::moefuse_moe_activation_bwd(a, stream),
                MoeArgs::Permute(a) => ffi::moefuse_moe_permute(a, stream),
                MoeArgs::Combine(a) => ffi::moefuse_moe_combine(a, stream),
                MoeArgs::CombineBackward(a) => ffi::moefuse_moe_combine_bwd(a, stream),
            }
        };
        if raw == ffi::MOEFUSE_STATUS_OK {
            return Ok(());
        }
        Err(KernelError::Launch {
            variant: args.kernel().to_string(),
            status: Status::from_raw(raw),
            message: last_error(),
        })
    }
    #[cfg(not(moefuse_kernels_linked))]
    {
        let _ = stream;
        Err(KernelError::Launch {
            variant: args.kernel().to_string(),
            status: Status::ArchMismatch,
            message: "built without kernels (MOEFUSE_CUDA_ARCHS=none)".into(),
        })
    }
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

fn status(variant: &CompiledVariant, raw: MoefuseStatus) -> Result<(), KernelError> {
    if raw == ffi::MOEFUSE_STATUS_OK {
        return Ok(());
    }
    Err(KernelError::Launch {
        variant: variant.name(),
        status: Status::from_raw(raw),
        message: last_error(),
    })
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
                Schedule::Contiguous => {
                    v.arch == VariantArch::Sm90a
                        && matches!(v.op, Op::GroupedFwdBnk | Op::GroupedFwdBkn)
                }
                Schedule::OneSm | Schedule::TwoSm => v.arch == VariantArch::Sm100a,
            };
            assert!(ok, "{} pairs a schedule with the wrong arch", v.name());
        }
    }
}
