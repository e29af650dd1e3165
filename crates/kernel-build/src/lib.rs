//! Compiles moefuse's CUDA kernels: one library used by `crates/kernels/build.rs` and by
//! `cargo xtask build-kernels`, so both build the same objects and share one cache.
//!
//! 1. [`Toolchain::discover`] finds nvcc, CUTLASS and NVSHMEM: explicit `CUDA_HOME`,
//!    `CUTLASS_DIR`, `NVSHMEM_HOME` first, else the folder `cargo xtask setup` fills
//!    ([`toolchain_dir`]).
//! 2. [`units`] lists the translation units for the chosen [`Arch`]es: the host-only ABI
//!    file, one generated instance file per kernel variant, and the MoE kernels of
//!    `kernels/moe/` as fat objects (one object with SASS for every arch).
//! 3. [`compile_all`] compiles them in parallel (jobs capped by cores and memory), reusing
//!    cached objects keyed by source, flags, toolchain pins and arch, and checked against
//!    every header nvcc's depfile names inside the kernel tree.
//! 4. [`archive`] packs the objects into one static library for the linker.
//!
//! ```no_run
//! use moefuse_kernel_build::{archive, compile_all, parse_archs, units, Cache, Toolchain};
//! let tc = Toolchain::discover()?;
//! let archs = parse_archs("90a,100a")?;
//! let kernels = std::path::Path::new("kernels");
//! let objects = compile_all(&tc, kernels, &units(kernels, &archs)?, 2, &Cache::default_dir()?, |_| {})?;
//! archive(&objects, std::path::Path::new("target/libmoefuse_kernels.a"))?;
//! # Ok::<(), moefuse_kernel_build::BuildError>(())
//! ```

mod arch;
mod cache;
mod compile;
mod toolchain;

pub use arch::{parse_archs, Arch};
pub use cache::{Cache, DepRoots};
pub use compile::{
    archive, compile_all, default_jobs, nvshmem_modules, units, Event, Object, Unit, UnitKind,
    NVCC_FLAGS,
};
pub use toolchain::{toolchain_dir, Pins, Toolchain, PINS, TOOLCHAIN_ENV};

use std::path::PathBuf;

/// Everything that can stop a kernel build, each with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// No CUDA toolchain was found where we looked.
    #[error(
        "no CUDA toolchain found (looked in: {looked}). Run `cargo xtask setup` to install the \
         pinned toolchain into {default}, or set CUDA_HOME, CUTLASS_DIR and NVSHMEM_HOME, or \
         build without kernels with MOEFUSE_CUDA_ARCHS=none"
    )]
    NoToolchain {
        /// Places searched, in order.
        looked: String,
        /// Where `cargo xtask setup` installs.
        default: String,
    },
    /// An arch string that is not one we build.
    #[error("unknown CUDA arch `{0}`: expected a comma list of 90a, 100a (or `none`)")]
    UnknownArch(String),
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
