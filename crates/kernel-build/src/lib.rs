//! Compiles moefuse's CUDA kernels: one library used by `crates/kernels/build.rs`,
//! `crates/comm/build.rs` and `cargo xtask build-kernels`, so all build the same objects
//! and share one cache.
//!
//! 1. [`archs_from_env`] picks the targets: `DOCS_RS` (none), `MOEFUSE_CUDA_ARCHS`,
//!    `CUDA_COMPUTE_CAP`, else every target in `moefuse-spec`'s table.
//! 2. [`Toolchain::discover`] finds nvcc, CUTLASS and NVSHMEM where cudarc and candle
//!    users keep them (`CUDA_HOME`/`CUDA_PATH`/..., the pinned install in
//!    [`toolchain_dir`], `nvcc` on `PATH`, `/usr/local/cuda`; `CUTLASS_DIR` or the
//!    `nvidia-cutlass` wheel), writing nothing; without one it fails with the one pip
//!    command ([`install_command`]) that installs the hash-pinned toolchain.
//! 3. [`units_for`] lists the translation units of the chosen [`KernelFamilies`] for the
//!    chosen [`Arch`]es: the host-only ABI file, one generated instance file per GEMM
//!    variant, and the MoE kernels of `cuda/moe/` as fat objects.
//! 4. [`compile_all`] compiles them in parallel (jobs capped by cores and memory), reusing
//!    cached objects keyed by content (see the cache module), never by path.
//! 5. [`archive`] packs the objects into one static library for the linker;
//!    [`write_unit_log`] records which units were compiled and which came from the cache.
//!
//! ```no_run
//! use moefuse_kernel_build::{archive, compile_all, parse_archs, units, Cache, Toolchain};
//! let tc = Toolchain::discover()?;
//! let archs = parse_archs("90a,100a")?;
//! tc.check_archs(&archs)?;
//! let kernels = std::path::Path::new("crates/kernels/cuda");
//! let objects = compile_all(&tc, kernels, &units(kernels, &archs)?, 2, &Cache::default_dir()?, |_| {})?;
//! archive(&objects, std::path::Path::new("target/libmoefuse_kernels.a"))?;
//! # Ok::<(), moefuse_kernel_build::BuildError>(())
//! ```

mod arch;
mod cache;
mod compile;
mod toolchain;

pub use arch::{
    archs_from_env, parse_archs, parse_compute_cap, select_archs, Arch, ArchSelection, ARCH_ENV,
};
pub use cache::{Cache, DepRoots};
pub use compile::{
    archive, compile_all, default_jobs, nvshmem_modules, units, units_for, write_unit_log, Event,
    KernelFamilies, Object, Unit, UnitKind, NVCC_FLAGS,
};
pub use toolchain::{
    install_command, requirements_path, site_dir, toolchain_dir, Pins, Toolchain, CUDA_ROOT_ENV,
    CUDA_TYPICAL_ROOTS, PINNED_PLATFORM, PINS, TOOLCHAIN_ENV,
};

use std::path::PathBuf;

/// Everything that can stop a kernel build, each with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// No CUDA toolchain was found where we looked.
    #[error(
        "no CUDA toolchain found (looked at: {looked}).\n\
         Install the pinned one (nvcc 13.0, CUTLASS 4.2, NVSHMEM 3.4.5; ~180 MB from PyPI, \
         every wheel checked by sha256) with:\n\n    {install}\n\n\
         or point CUDA_HOME at a CUDA 12.8+ install and CUTLASS_DIR at CUTLASS 4.2, or build \
         without kernels with MOEFUSE_CUDA_ARCHS=none"
    )]
    NoToolchain {
        /// Places searched, in order.
        looked: String,
        /// The one command that installs the pinned toolchain where discovery looks.
        install: String,
    },
    /// The nvcc found cannot compile one of the requested targets.
    #[error(
        "{nvcc} is CUDA {release}, but {arch} needs CUDA {needs} or newer: point CUDA_HOME at \
         a newer toolkit, or install the pinned one with\n\n    {install}\n\n\
         (or leave {arch} out of MOEFUSE_CUDA_ARCHS)"
    )]
    NvccTooOld {
        /// The nvcc found.
        nvcc: String,
        /// Its release, `12.4`.
        release: String,
        /// The target it cannot build.
        arch: String,
        /// The oldest release that can.
        needs: String,
        /// The pinned install command.
        install: String,
    },
    /// An arch string that is not one we build.
    #[error("unknown CUDA arch `{0}` in MOEFUSE_CUDA_ARCHS: expected a comma list of 90a, 100a (or `none`)")]
    UnknownArch(String),
    /// A compute capability moefuse has no kernels for.
    #[error(
        "CUDA_COMPUTE_CAP names `{0}`, a compute capability moefuse has no kernels for: its \
         kernels need 90 (Hopper, sm_90a) or 100 (Blackwell, sm_100a); set \
         MOEFUSE_CUDA_ARCHS (it wins over CUDA_COMPUTE_CAP), e.g. MOEFUSE_CUDA_ARCHS=none to \
         build without kernels"
    )]
    UnknownComputeCap(String),
    /// nvcc failed on one unit.
    #[error("nvcc failed on {source_file} for {arch}:\n{stderr}")]
    Nvcc {
        /// The translation unit.
        source_file: PathBuf,
        /// Its target.
        arch: String,
        /// nvcc's error output.
        stderr: String,
    },
    /// ptxas reported a register spill or local-memory use in a kernel.
    #[error(
        "{source_file}: ptxas reports spills or local memory in a kernel (set \
         MOEFUSE_ALLOW_SPILLS=1 to build anyway):\n{report}"
    )]
    Spill {
        /// The translation unit.
        source_file: PathBuf,
        /// The warning lines.
        report: String,
    },
    /// A tool (ar, nvcc --version) could not be run.
    #[error("could not run {tool}: {detail}")]
    Tool {
        /// Which program.
        tool: String,
        /// What went wrong.
        detail: String,
    },
    /// The kernel cache folder cannot be used safely.
    #[error("kernel cache {path}: {reason}")]
    CacheDir {
        /// The folder (empty when none could be chosen).
        path: PathBuf,
        /// Why it was refused.
        reason: String,
    },
    /// Filesystem error at a path.
    #[error("{path}: {source}")]
    Io {
        /// Where.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> BuildError {
    let path = path.into();
    move |source| BuildError::Io { path, source }
}

/// Prints `cargo:rerun-if-changed` for every file under `dir` (real paths, never globs) and
/// `cargo:rerun-if-env-changed` for `vars` and every variable toolchain discovery reads:
/// the part of a build script that decides when cargo reruns it.
pub fn cargo_rerun_if_changed(dir: &std::path::Path, vars: &[&str]) -> Result<(), BuildError> {
    for var in vars.iter().chain(TOOLCHAIN_ENV) {
        println!("cargo:rerun-if-env-changed={var}");
    }
    watch(dir)
}

fn watch(dir: &std::path::Path) -> Result<(), BuildError> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        if path.is_dir() {
            watch(&path)?;
        } else {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    println!("cargo:rerun-if-changed={}", dir.display());
    Ok(())
}
