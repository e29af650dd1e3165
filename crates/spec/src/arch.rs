//! The GPU targets moefuse compiles: Hopper `sm_90a` and Blackwell `sm_100a`.
//!
//! Both are `a` targets: their SASS uses arch-specific instructions (WGMMA, tcgen05) and
//! runs on exactly one compute capability; there is no forward-compatible PTX.

use std::fmt;

/// A compilation target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    /// Hopper, compute capability 9.0 (H100, H200): WGMMA, TMA, clusters.
    Sm90a,
    /// Blackwell, compute capability 10.0 (B200): tcgen05 UMMA, TMEM.
    Sm100a,
}

/// Everything moefuse states about one target, in one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArchInfo {
    /// The target.
    pub arch: Arch,
    /// Short name used in variant names, folders and `built_archs()`: `sm90a`.
    pub name: &'static str,
    /// The spelling `MOEFUSE_CUDA_ARCHS` takes: `90a`.
    pub short: &'static str,
    /// The one compute capability (major, minor) the target runs on.
    pub capability: (u32, u32),
    /// nvcc's `-gencode` argument (SASS only).
    pub gencode: &'static str,
    /// The GPU family, for messages.
    pub family: &'static str,
    /// The oldest nvcc release (major, minor) that compiles this target with CUTLASS 4.2.
    pub min_nvcc: (u32, u32),
}

/// Every target, in build order.
pub const ARCHS: &[ArchInfo] = &[
    ArchInfo {
        arch: Arch::Sm90a,
        name: "sm90a",
        short: "90a",
        capability: (9, 0),
        gencode: "-gencode=arch=compute_90a,code=sm_90a",
        family: "Hopper",
        min_nvcc: (12, 3),
    },
    ArchInfo {
        arch: Arch::Sm100a,
        name: "sm100a",
        short: "100a",
        capability: (10, 0),
        gencode: "-gencode=arch=compute_100a,code=sm_100a",
        family: "Blackwell",
        min_nvcc: (12, 8),
    },
];

impl Arch {
    /// Every arch, in build order.
    pub const ALL: [Arch; 2] = [Arch::Sm90a, Arch::Sm100a];

    /// This target's row of [`ARCHS`].
    ///
    /// ```
    /// assert_eq!(moefuse_spec::Arch::Sm100a.info().family, "Blackwell");
    /// ```
    pub const fn info(self) -> &'static ArchInfo {
        match self {
            Arch::Sm90a => &ARCHS[0],
            Arch::Sm100a => &ARCHS[1],
        }
    }

    /// The short name used in variant names and folders: `sm90a`.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::Arch::Sm100a.name(), "sm100a");
    /// ```
    pub const fn name(self) -> &'static str {
        self.info().name
    }

    /// nvcc's `-gencode` argument for this arch (SASS only: `a` features have no
    /// forward-compatible PTX).
    ///
    /// ```
    /// assert_eq!(moefuse_spec::Arch::Sm90a.gencode(), "-gencode=arch=compute_90a,code=sm_90a");
    /// ```
    pub const fn gencode(self) -> &'static str {
        self.info().gencode
    }

    /// The one compute capability (major, minor) this target runs on.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::Arch::Sm90a.capability(), (9, 0));
    /// ```
    pub const fn capability(self) -> (u32, u32) {
        self.info().capability
    }

    /// The target that runs on compute capability `major.minor`, if moefuse has one.
    ///
    /// ```
    /// use moefuse_spec::Arch;
    /// assert_eq!(Arch::from_capability(10, 0), Some(Arch::Sm100a));
    /// assert_eq!(Arch::from_capability(8, 0), None);
    /// ```
    pub fn from_capability(major: u32, minor: u32) -> Option<Arch> {
        ARCHS
            .iter()
            .find(|a| a.capability == (major, minor))
            .map(|a| a.arch)
    }

    /// Parses one `MOEFUSE_CUDA_ARCHS` item: `90a`, `sm90a` or `sm_90a`.
    ///
    /// ```
    /// use moefuse_spec::Arch;
    /// assert_eq!(Arch::parse("sm_100a"), Some(Arch::Sm100a));
    /// assert_eq!(Arch::parse("90"), None); // a capability, not a target: see from_compute_cap
    /// ```
    pub fn parse(item: &str) -> Option<Arch> {
        let bare = item.trim().trim_start_matches("sm").trim_start_matches('_');
        ARCHS.iter().find(|a| a.short == bare).map(|a| a.arch)
    }

    /// Parses one `CUDA_COMPUTE_CAP` item (the variable candle and bindgen_cuda read): `90`,
    /// `9.0` or `100` name a compute capability, and the target for it is the `a` target
    /// (`90` → `sm90a`). An explicit target (`90a`) is accepted too.
    ///
    /// ```
    /// use moefuse_spec::Arch;
    /// assert_eq!(Arch::from_compute_cap("90"), Some(Arch::Sm90a));
    /// assert_eq!(Arch::from_compute_cap("10.0"), Some(Arch::Sm100a));
    /// assert_eq!(Arch::from_compute_cap("86"), None);
    /// ```
    pub fn from_compute_cap(item: &str) -> Option<Arch> {
        let item = item.trim();
        if let Some(arch) = Arch::parse(item) {
            return Some(arch);
        }
        let (major, minor) = match item.split_once('.') {
            Some((major, minor)) => (major.parse().ok()?, minor.parse().ok()?),
            None => {
                let n: u32 = item.parse().ok()?;
                (n / 10, n % 10)
            }
        };
        Arch::from_capability(major, minor)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_rows_match_their_arch() {
        for (i, arch) in Arch::ALL.iter().enumerate() {
            assert_eq!(ARCHS[i].arch, *arch);
            assert_eq!(arch.info().name, format!("sm{}", arch.info().short));
            let (major, minor) = arch.capability();
            assert!(arch
                .gencode()
                .ends_with(&format!("code=sm_{major}{minor}a")));
            assert_eq!(Arch::from_capability(major, minor), Some(*arch));
        }
        assert_eq!(ARCHS.len(), Arch::ALL.len());
    }

    #[test]
    fn compute_cap_spellings() {
        assert_eq!(Arch::from_compute_cap("100"), Some(Arch::Sm100a));
        assert_eq!(Arch::from_compute_cap("9.0"), Some(Arch::Sm90a));
        assert_eq!(Arch::from_compute_cap("sm_90a"), Some(Arch::Sm90a));
        assert_eq!(Arch::from_compute_cap("120"), None);
        assert_eq!(Arch::from_compute_cap(""), None);
    }
}
