//! Which GPU targets a build compiles: the [`Arch`] table lives in `moefuse-spec`; this
//! module reads the variables that choose among them.

use crate::BuildError;
pub use moefuse_spec::Arch;

/// The variables [`archs_from_env`] reads, in the order they win.
pub const ARCH_ENV: &[&str] = &["DOCS_RS", "MOEFUSE_CUDA_ARCHS", "CUDA_COMPUTE_CAP"];

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
    collect(list, |item| {
        Arch::parse(item).ok_or_else(|| BuildError::UnknownArch(item.to_string()))
    })
}

/// Parses `CUDA_COMPUTE_CAP` (the variable candle's and bindgen_cuda's build scripts read):
/// compute capabilities such as `90` or `10.0`, comma-separated; each selects its `a`
/// target (`90` → `sm90a`, `100` → `sm100a`).
///
/// ```
/// use moefuse_kernel_build::{parse_compute_cap, Arch};
/// assert_eq!(parse_compute_cap("90").unwrap(), vec![Arch::Sm90a]);
/// assert_eq!(parse_compute_cap("100,90").unwrap(), vec![Arch::Sm90a, Arch::Sm100a]);
/// assert!(parse_compute_cap("86").is_err());
/// ```
pub fn parse_compute_cap(list: &str) -> Result<Vec<Arch>, BuildError> {
    collect(list, |item| {
        Arch::from_compute_cap(item).ok_or_else(|| BuildError::UnknownComputeCap(item.to_string()))
    })
}

fn collect(
    list: &str,
    parse: impl Fn(&str) -> Result<Arch, BuildError>,
) -> Result<Vec<Arch>, BuildError> {
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if item == "none" {
            continue;
        }
        let arch = parse(item)?;
        if !out.contains(&arch) {
            out.push(arch);
        }
    }
    out.sort();
    Ok(out)
}

/// The targets a build compiles and the variable that chose them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchSelection {
    /// The targets, sorted; empty for a build without kernels.
    pub archs: Vec<Arch>,
    /// Why: `DOCS_RS`, `MOEFUSE_CUDA_ARCHS=...`, `CUDA_COMPUTE_CAP=...` or `default`.
    pub reason: String,
}

/// The targets chosen by the environment:
///
/// 1. `DOCS_RS` set: none (docs.rs has no CUDA toolchain; docs need no kernels).
/// 2. `MOEFUSE_CUDA_ARCHS` (`90a,100a`, `none`).
/// 3. `CUDA_COMPUTE_CAP` (`90`, `100`, as candle users set it).
/// 4. Otherwise every target moefuse has: `90a,100a`.
///
/// ```
/// // Reads the real environment; `select_archs` is the same rule on given values.
/// let sel = moefuse_kernel_build::archs_from_env().unwrap();
/// println!("{:?} ({})", sel.archs, sel.reason);
/// ```
pub fn archs_from_env() -> Result<ArchSelection, BuildError> {
    let var = |k: &str| std::env::var(k).ok();
    select_archs(
        var("DOCS_RS").is_some(),
        var("MOEFUSE_CUDA_ARCHS").as_deref(),
        var("CUDA_COMPUTE_CAP").as_deref(),
    )
}

/// [`archs_from_env`]'s rule on given values.
///
/// ```
/// use moefuse_kernel_build::{select_archs, Arch};
/// assert!(select_archs(true, Some("90a"), None).unwrap().archs.is_empty());
/// assert_eq!(select_archs(false, Some("100a"), Some("90")).unwrap().archs, [Arch::Sm100a]);
/// assert_eq!(select_archs(false, None, Some("90")).unwrap().archs, [Arch::Sm90a]);
/// assert_eq!(select_archs(false, None, None).unwrap().archs, Arch::ALL);
/// ```
pub fn select_archs(
    docs_rs: bool,
    moefuse_cuda_archs: Option<&str>,
    cuda_compute_cap: Option<&str>,
) -> Result<ArchSelection, BuildError> {
    if docs_rs {
        return Ok(ArchSelection {
            archs: Vec::new(),
            reason: "DOCS_RS".into(),
        });
    }
    if let Some(list) = moefuse_cuda_archs {
        return Ok(ArchSelection {
            archs: parse_archs(list)?,
            reason: format!("MOEFUSE_CUDA_ARCHS={list}"),
        });
    }
    if let Some(list) = cuda_compute_cap {
        return Ok(ArchSelection {
            archs: parse_compute_cap(list)?,
            reason: format!("CUDA_COMPUTE_CAP={list}"),
        });
    }
    Ok(ArchSelection {
        archs: Arch::ALL.to_vec(),
        reason: "default".into(),
    })
}
