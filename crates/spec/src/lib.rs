//! One source of truth for facts that moefuse's build scripts, `xtask` and its libraries
//! all need, so none of them repeats a table:
//!
//! * [`arch`]: the GPU targets moefuse compiles (name, compute capability, nvcc `-gencode`),
//!   and how `MOEFUSE_CUDA_ARCHS` / `CUDA_COMPUTE_CAP` values name them.
//! * [`variants`]: the table of compiled kernel variants, their names and the instance file
//!   each one generates.
//! * [`limits`]: the bounds the kernels are written for (experts, top-k).
//!
//! The crate depends on nothing but `std`, so build scripts can use it as a
//! build-dependency without slowing the build down.
//!
//! ```
//! use moefuse_spec::{Arch, VARIANTS};
//! let hopper = Arch::from_capability(9, 0).unwrap();
//! assert_eq!(hopper.name(), "sm90a");
//! assert!(VARIANTS.iter().any(|v| v.arch == hopper));
//! ```

pub mod arch;
pub mod limits;
pub mod variants;

pub use arch::{Arch, ArchInfo, ARCHS};
pub use limits::{MAX_EXPERTS, MAX_TOP_K};
pub use variants::{Op, Schedule, VariantArch, VariantSpec, VARIANTS};
