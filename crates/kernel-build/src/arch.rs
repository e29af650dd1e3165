//! The GPU targets moefuse builds: Hopper `sm_90a` and Blackwell `sm_100a`.

use crate::BuildError;
use std::fmt;

/// A compilation target. `a` targets run on exactly one compute capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    /// Hopper, compute capability 9.0 (H100, H200): WGMMA, TMA, clusters.
    Sm90a,
    /// Blackwell, compute capability 10.0 (B200): tcgen05 UMMA, TMEM.
    Sm100a,
}

impl Arch {
    /// Every arch, in build order.
    pub const ALL: [Arch; 2] = [Arch::Sm90a, Arch::Sm100a];

    /// The short name used in variant names and folders: `sm90a`.
    ///
    /// ```
    /// assert_eq!(moefuse_kernel_build::Arch::Sm100a.name(), "sm100a");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm90a => "sm90a",
            Arch::Sm100a => "sm100a",
        }
    }

    /// nvcc's `-gencode` argument for this arch (SASS only: `a` features have no
    /// forward-compatible PTX).
    pub fn gencode(self) -> &'static str {
        match self {
            Arch::Sm90a => "-gencode=arch=compute_90a,code=sm_90a",
            Arch::Sm100a => "-gencode=arch=compute_100a,code=sm_100a",
        }
    }

    /// The one compute capability (major, minor) this target runs on.
    pub fn capability(self) -> (u32, u32) {
        match self {
            Arch::Sm90a => (9, 0),
            Arch::Sm100a => (10, 0),
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a comma list such as `90a,100a` (also `sm_90a`, `sm90a`); `none` or an empty
/// string gives no archs (a build without kernels).
///
/// ```
/// use moefuse_kernel_build::{parse_archs, Arch};
/// assert_eq!(parse_archs("100a, sm_90a").unwrap(), vec![Arch::Sm90a, Arch::Sm100a]);
/// assert!(parse_archs("none").unwrap().is_empty());
/// assert!(parse_archs("80").is_err());
/// ```
pub fn parse_archs(list: &str) -> Result<Vec<Arch>, BuildError> {
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bare = item.trim_start_matches("sm").trim_start_matches('_');
        let arch = match bare {
            "90a" => Arch::Sm90a,
            "100a" => Arch::Sm100a,
            "none" => continue,
            _ => return Err(BuildError::UnknownArch(item.to_string())),
        };
        if !out.contains(&arch) {
            out.push(arch);
        }
    }
    out.sort();
    Ok(out)
}
