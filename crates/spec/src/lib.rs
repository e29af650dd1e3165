//! One source of truth for facts that moefuse's build scripts, `xtask` and its libraries
//! all need, so none of them repeats a table:
//!
//! * [`arch`]: the GPU targets moefuse compiles (name, compute capability, nvcc `-gencode`),
//!   and how `MOEFUSE_CUDA_ARCHS` / `CUDA_COMPUTE_CAP` values name them.
//! * [`variants`]: the table of compiled kernel variants, their names and the instance file
//!   each one generates.
//! * [`limits`]: the bounds the kernels are written for (experts, top-k, groups).
//! * [`grouped`]: the grouped-layout kinds (M-grouped, K-grouped), one enum for C++ and Rust.
//! * [`tile_order`]: the fields of the grouped GEMM's tile-order word.
//! * [`c_header()`]: the same limits, kinds and fields as `spec.h` for C, written by
//!   `cargo xtask gen-spec`.
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
pub mod c_header;
pub mod grouped;
pub mod limits;
pub mod tile_order;
pub mod variants;

pub use arch::{Arch, ArchInfo, ARCHS};
pub use c_header::{c_header, C_HEADER_PATH};
pub use grouped::GroupedKind;
pub use limits::{CONTIGUOUS_MAX_GROUPS, MAX_EXPERTS, MAX_TOP_K, ZERO_EMPTY_GROUPS_MAX};
pub use tile_order::{Raster, TileOrder, TileOrderError};
pub use variants::{Op, Schedule, VariantArch, VariantSpec, VARIANTS};
