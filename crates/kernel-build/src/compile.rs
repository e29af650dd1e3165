//! Translation units, parallel nvcc with the cache, and the static archive.

use crate::cache::{hash_bytes, parse_depfile, Cache, DepRoots, CACHE_FORMAT};
use crate::{io_err, Arch, BuildError, Toolchain};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{mpsc, Mutex};
use std::time::Instant;

/// Flags every unit gets. `-DNDEBUG` matters: without it ptxas serialises WGMMA (C7510).
pub const NVCC_FLAGS: &[&str] = &[
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-DNDEBUG",
    "-O3",
    "-Xcompiler=-fPIC",
    "-Xptxas=-warn-spills,-warn-lmem-usage",
];

/// One translation unit: a kernel instance for one arch, host-only code (`arch: None`), or
/// a fat object for several archs (`arch: None`, [`UnitKind::FatObject`], `fat_archs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// The `.cu`/`.cpp` file.
    pub source: PathBuf,
    /// Target arch; `None` for host-only files and fat objects.
    pub arch: Option<Arch>,
    /// What the unit becomes.
    pub kind: UnitKind,
    /// [`UnitKind::FatObject`] only: every arch it carries SASS for (empty otherwise).
    pub fat_archs: Vec<Arch>,
}

/// What a unit is compiled into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitKind {
    /// A relocatable-free object for the static library (whole-program compile).
    Object,
    /// A device module using NVSHMEM: compiled with `-rdc=true`, then device-linked against
    /// `libnvshmem_device` into a fatbin the driver API loads (`cuModuleLoadData`) and
    /// `nvshmemx_cumodule_init` binds.
    NvshmemModule,
    /// Plain CUDA C++ with no arch-specific instructions (`kernels/moe/*.cu`): one object
    /// with SASS for every built arch (one `-gencode` each), so its launchers exist once
    /// and the runtime picks the image for the device.
    FatObject,
}

impl Unit {
    /// A short label: `sm90a/<file stem>`, `host/<file stem>` or `fat/<file stem>`.
    pub fn label(&self) -> String {
        let stem = self
            .source
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy();
        let prefix = match (self.kind, self.arch) {
            (UnitKind::FatObject, _) => "fat",
            (_, arch) => arch.map_or("host", Arch::name),
        };
        format!("{prefix}/{stem}")
    }
}

/// A compiled object.
#[derive(Debug, Clone)]
pub struct Object {
    /// The unit it came from.
    pub unit: Unit,
    /// Path of the object in the cache.
    pub path: PathBuf,
    /// True when the cache supplied it and nvcc did not run.
    pub cached: bool,
    /// Seconds nvcc took (0 when cached).
    pub seconds: f64,
}

/// Progress of [`compile_all`], for bars and logs.
#[derive(Debug, Clone)]
pub enum Event {
    /// nvcc started on a unit.
    Started(Unit),
    /// A unit is done (compiled or taken from the cache).
    Finished(Object),
}

/// Which kernel families a build compiles (moefuse-kernels' cargo features `gemm`, `moe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelFamilies {
    /// Dense and grouped GEMM variants: `instances/<arch>/*.cu`.
    pub gemm: bool,
    /// The MoE layer's own kernels: `moe/*.cu` (router, permutation, activation, combine).
    pub moe: bool,
}

impl KernelFamilies {
    /// Every family.
    pub const ALL: KernelFamilies = KernelFamilies {
        gemm: true,
        moe: true,
    };

    /// True when at least one family is on (then the host-only ABI file is built too).
    ///
    /// ```
    /// use moefuse_kernel_build::KernelFamilies;
    /// assert!(KernelFamilies::ALL.any());
    /// assert!(!KernelFamilies { gemm: false, moe: false }.any());
    /// ```
    pub fn any(self) -> bool {
        self.gemm || self.moe
    }
}

/// Every unit of `kernels_dir` for `archs`: [`units_for`] with [`KernelFamilies::ALL`].
///
/// ```no_run
/// use moefuse_kernel_build::{units, Arch};
/// let all = units(std::path::Path::new("crates/kernels/cuda"), &[Arch::Sm90a])?;
/// # Ok::<(), moefuse_kernel_build::BuildError>(())
/// ```
pub fn units(kernels_dir: &Path, archs: &[Arch]) -> Result<Vec<Unit>, BuildError> {
    units_for(kernels_dir, archs, KernelFamilies::ALL)
}

/// The units of `kernels_dir` for `archs` and `families`: `abi/*.cpp` (host-only, when any
/// family is on), `instances/<arch>/*.cu` (`gemm`), and `moe/*.cu` as fat objects for all
/// of `archs` (`moe`), sorted. With no archs or no family, no units (a build without
/// kernels).
///
/// ```no_run
/// use moefuse_kernel_build::{units_for, Arch, KernelFamilies};
/// let gemm_only = KernelFamilies { gemm: true, moe: false };
/// let units = units_for(std::path::Path::new("crates/kernels/cuda"), &[Arch::Sm90a], gemm_only)?;
/// assert!(units.iter().all(|u| !u.label().starts_with("fat/")));
/// # Ok::<(), moefuse_kernel_build::BuildError>(())
/// ```
pub fn units_for(
    kernels_dir: &Path,
    archs: &[Arch],
    families: KernelFamilies,
) -> Result<Vec<Unit>, BuildError> {
    if archs.is_empty() || !families.any() {
        return Ok(Vec::new());
    }
    let mut out = list(&kernels_dir.join("abi"), "cpp")?
        .into_iter()
        .map(|source| Unit {
            source,
            arch: None,
            kind: UnitKind::Object,
            fat_archs: Vec::new(),
        })
        .collect::<Vec<_>>();
    if families.gemm {
        for &arch in archs {
            for source in list(&kernels_dir.join("instances").join(arch.name()), "cu")? {
                out.push(Unit {
                    source,
                    arch: Some(arch),
                    kind: UnitKind::Object,
                    fat_archs: Vec::new(),
                });
            }
        }
    }
    if families.moe {
        for source in list(&kernels_dir.join("moe"), "cu")? {
            out.push(Unit {
                source,
                arch: None,
                kind: UnitKind::FatObject,
                fat_archs: archs.to_vec(),
            });
        }
    }
    Ok(out)
}

/// Writes one line per object to `path` (`compiled <label> <seconds>` or `cached <label>`)
/// and returns (compiled, cached): the record build scripts leave in `OUT_DIR`, which CI
/// reads to check what a build compiled.
///
/// ```no_run
/// # let objects: Vec<moefuse_kernel_build::Object> = Vec::new();
/// let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
/// let (compiled, cached) = moefuse_kernel_build::write_unit_log(&objects, &out.join("kernel-units.txt"))?;
/// # Ok::<(), moefuse_kernel_build::BuildError>(())
/// ```
pub fn write_unit_log(objects: &[Object], path: &Path) -> Result<(usize, usize), BuildError> {
    let mut text = String::new();
    let mut compiled = 0;
    for obj in objects {
        if obj.cached {
            text.push_str(&format!("cached {}\n", obj.unit.label()));
        } else {
            compiled += 1;
            text.push_str(&format!(
                "compiled {} {:.1}\n",
                obj.unit.label(),
                obj.seconds
            ));
        }
    }
    fs::write(path, text).map_err(io_err(path))?;
    Ok((compiled, objects.len() - compiled))
}

/// The NVSHMEM device modules in `sources_dir` (`*.cu`, moefuse-comm's `cuda/`), one unit
/// per arch.
pub fn nvshmem_modules(sources_dir: &Path, archs: &[Arch]) -> Result<Vec<Unit>, BuildError> {
    let sources = list(sources_dir, "cu")?;
    let mut out = Vec::new();
    for &arch in archs {
        for source in &sources {
            out.push(Unit {
                source: source.clone(),
                arch: Some(arch),
                kind: UnitKind::NvshmemModule,
                fat_archs: Vec::new(),
            });
        }
    }
    Ok(out)
}

fn list(dir: &Path, ext: &str) -> Result<Vec<PathBuf>, BuildError> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        if path.extension().is_some_and(|e| e == ext) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Parallel jobs: cores, capped so that each nvcc of a CUTLASS kernel has ~3.5 GB.
pub fn default_jobs() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mem_gb = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(8.0, |kb| kb as f64 / 1048576.0);
    cores.min((mem_gb / 3.5).floor().max(1.0) as usize).max(1)
}

/// Compiles `units` with up to `jobs` nvcc processes, reusing the cache; `on_event`
/// sees each start and finish. Returns objects in the order of `units`.
pub fn compile_all(
    tc: &Toolchain,
    kernels_dir: &Path,
    units: &[Unit],
    jobs: usize,
    cache: &Cache,
    on_event: impl Fn(Event) + Sync,
) -> Result<Vec<Object>, BuildError> {
    let kernels_dir = kernels_dir.canonicalize().map_err(io_err(kernels_dir))?;
    let queue = Mutex::new(units.iter().enumerate());
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1).min(units.len().max(1)) {
            let tx = tx.clone();
            let (queue, on_event, kernels_dir) = (&queue, &on_event, &kernels_dir);
            s.spawn(move || loop {
                let Some((i, unit)) = queue.lock().expect("queue poisoned").next() else {
                    break;
                };
                let result = compile_one(tc, kernels_dir, unit, cache, on_event);
                let failed = result.is_err();
                let _ = tx.send((i, result));
                if failed {
                    break;
                }
            });
        }
    });
    drop(tx);
    let mut done: Vec<(usize, Object)> = Vec::with_capacity(units.len());
    for (i, result) in rx {
        done.push((i, result?));
    }
    done.sort_by_key(|(i, _)| *i);
    Ok(done.into_iter().map(|(_, o)| o).collect())
}

/// nvcc's flags for `unit`, each path written as a root name and the path it stands for
/// (`("<kernels>/include", "/abs/.../include")`): the names go into the cache key, so the
/// key does not depend on where the checkout or the toolchain lives.
fn unit_flags(tc: &Toolchain, kernels_dir: &Path, unit: &Unit) -> Vec<(String, String)> {
    let plain = |f: &str| (f.to_string(), f.to_string());
    let include =
        |name: String, path: &Path| (format!("-I{name}"), format!("-I{}", path.display()));
    let mut flags: Vec<(String, String)> = NVCC_FLAGS.iter().map(|f| plain(f)).collect();
    flags.push(include(
        "<kernels>/include".into(),
        &kernels_dir.join("include"),
    ));
    for (i, inc) in tc.cutlass_include.iter().enumerate() {
        flags.push(include(format!("<cutlass:{i}>"), inc));
    }
    if let Some(arch) = unit.arch {
        flags.push(plain(arch.gencode()));
    }
    for arch in &unit.fat_archs {
        flags.push(plain(arch.gencode()));
    }
    if unit.kind == UnitKind::NvshmemModule {
        flags.push(plain("-rdc=true"));
        if let Some(root) = &tc.nvshmem_root {
            flags.push(include("<nvshmem>/include".into(), &root.join("include")));
        }
    }
    flags
}

/// What identifies the toolchain's content wherever it is installed and however it was
/// installed (pinned wheels, `CUDA_HOME`, `CUTLASS_DIR`, `NVSHMEM_HOME`): nvcc's version
/// line and the CUTLASS and NVSHMEM version headers. The pin list itself is not part of it,
/// so a change in how the pins are written (hashes, extra tools) rebuilds nothing.
fn toolchain_identity(tc: &Toolchain) -> String {
    let header = |p: PathBuf| crate::cache::hash_file(&p).unwrap_or_else(|_| "absent".into());
    let cutlass = tc.cutlass_include.first().map_or_else(
        || "absent".into(),
        |inc| header(inc.join("cutlass/version.h")),
    );
    let nvshmem = tc.nvshmem_root.as_ref().map_or_else(
        || "absent".into(),
        |root| header(root.join("include/non_abi/nvshmem_version.h")),
    );
    format!("{}; cutlass {cutlass}; nvshmem {nvshmem}", tc.nvcc_version)
}

fn compile_one(
    tc: &Toolchain,
    kernels_dir: &Path,
    unit: &Unit,
    cache: &Cache,
    on_event: &(impl Fn(Event) + Sync),
) -> Result<Object, BuildError> {
    let source_text = fs::read(&unit.source).map_err(io_err(&unit.source))?;
    let source_dir = unit
        .source
        .parent()
        .unwrap_or(Path::new("."))
        .canonicalize()
        .map_err(io_err(&unit.source))?;
    let roots = DepRoots {
        kernels: kernels_dir,
        source_dir: &source_dir,
    };
    let flags = unit_flags(tc, kernels_dir, unit);
    let portable: Vec<&str> = flags.iter().map(|(name, _)| name.as_str()).collect();
    let key = hash_bytes(&[
        CACHE_FORMAT.as_bytes(),
        &source_text,
        portable.join(" ").as_bytes(),
        toolchain_identity(tc).as_bytes(),
        unit.label().as_bytes(),
        format!("{:?}", unit.kind).as_bytes(),
    ]);
    let product = match unit.kind {
        UnitKind::Object | UnitKind::FatObject => "object.o",
        UnitKind::NvshmemModule => "module.fatbin",
    };
    if unit.kind == UnitKind::NvshmemModule && tc.nvshmem_root.is_none() {
        return Err(BuildError::Tool { tool: "nvshmem".into(), detail: "no NVSHMEM headers and libnvshmem_device in the toolchain (cargo xtask setup, or NVSHMEM_HOME)".into() });
    }
    if let Some(path) = cache.lookup(&key, product, &roots) {
        let obj = Object {
            unit: unit.clone(),
            path,
            cached: true,
            seconds: 0.0,
        };
        on_event(Event::Finished(obj.clone()));
        return Ok(obj);
    }
    on_event(Event::Started(unit.clone()));
    // Build in a private staging folder; publish renames it into place when complete.
    let staging = cache.staging(&key)?;
    let start = Instant::now();
    let result = build_entry(tc, unit, &flags, &staging, product, &roots, cache);
    let path = match result {
        Ok(()) => cache.publish(&staging, &key, product, &roots)?,
        Err(e) => {
            let _ = fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    let obj = Object {
        unit: unit.clone(),
        path,
        cached: false,
        seconds: start.elapsed().as_secs_f64(),
    };
    on_event(Event::Finished(obj.clone()));
    Ok(obj)
}

/// Runs nvcc (and the device link for modules) into `staging`, then records the deps.
fn build_entry(
    tc: &Toolchain,
    unit: &Unit,
    flags: &[(String, String)],
    staging: &Path,
    product: &str,
    roots: &DepRoots<'_>,
    cache: &Cache,
) -> Result<(), BuildError> {
    let (object, depfile) = (staging.join("object.o"), staging.join("object.d"));
    let out = Command::new(tc.nvcc())
        .args(flags.iter().map(|(_, real)| real))
        .arg("-MD")
        .arg("-MF")
        .arg(&depfile)
        .arg("-c")
        .arg(&unit.source)
        .arg("-o")
        .arg(&object)
        .output()
        .map_err(|e| BuildError::Tool {
            tool: tc.nvcc().display().to_string(),
            detail: e.to_string(),
        })?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let arch = match unit.kind {
        UnitKind::FatObject => unit
            .fat_archs
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join("+"),
        _ => unit.arch.map_or("host", Arch::name).to_string(),
    };
    if !out.status.success() {
        return Err(BuildError::Nvcc {
            source_file: unit.source.clone(),
            arch,
            stderr,
        });
    }
    check_spills(unit, &stderr)?;
    let deps_text = fs::read_to_string(&depfile).map_err(io_err(&depfile))?;
    let deps: Vec<PathBuf> = parse_depfile(&deps_text)
        .into_iter()
        .filter_map(|p| p.canonicalize().ok())
        .collect();
    if unit.kind == UnitKind::NvshmemModule {
        device_link(tc, unit, &object, &staging.join(product))?;
    }
    cache.record(staging, &deps, roots)
}

/// `nvcc -dlink -fatbin` of an `-rdc` object against `libnvshmem_device`.
fn device_link(
    tc: &Toolchain,
    unit: &Unit,
    object: &Path,
    fatbin: &Path,
) -> Result<PathBuf, BuildError> {
    let arch = unit.arch.expect("modules have an arch");
    let lib = tc
        .nvshmem_root
        .as_ref()
        .expect("checked before compiling")
        .join("lib");
    let out = Command::new(tc.nvcc())
        .args(["-dlink", "-fatbin", arch.gencode()])
        .arg(object)
        .arg(format!("-L{}", lib.display()))
        // The pip wheel has no lib64, where nvcc.profile looks for libcudadevrt.
        .arg(format!("-L{}", tc.cuda_lib_dir().display()))
        .arg("-lnvshmem_device")
        .arg("-o")
        .arg(fatbin)
        .output()
        .map_err(|e| BuildError::Tool {
            tool: tc.nvcc().display().to_string(),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(BuildError::Nvcc {
            source_file: unit.source.clone(),
            arch: format!("{} (device link)", arch.name()),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(fatbin.to_path_buf())
}

// NOTES: an NVSHMEM module also compiles NVSHMEM's own device functions (e.g.
// `nvshmemi_quiet` spills 8 bytes in 3.4.5), and its calls into them (the call ABI) give
// our kernels a small stack frame; there only register spills in our kernels (`moefuse_*`)
// fail the build. In object units every kernel is ours and any local memory fails.
fn check_spills(unit: &Unit, stderr: &str) -> Result<(), BuildError> {
    let report: Vec<&str> = stderr
        .lines()
        .filter(|l| match unit.kind {
            UnitKind::Object | UnitKind::FatObject => {
                l.contains("spill") || l.contains("Local memory") || l.contains("local memory")
            }
            UnitKind::NvshmemModule => l.contains("spill") && l.contains("moefuse"),
        })
        .collect();
    if report.is_empty() || std::env::var_os("MOEFUSE_ALLOW_SPILLS").is_some() {
        return Ok(());
    }
    Err(BuildError::Spill {
        source_file: unit.source.clone(),
        report: report.join("\n"),
    })
}

/// Packs `objects` into the static library `out` (replacing it), with member names taken
/// from the unit labels so two variants never collide.
pub fn archive(objects: &[Object], out: &Path) -> Result<(), BuildError> {
    let staging = out.with_extension("members");
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).map_err(io_err(&staging))?;
    let mut members = Vec::new();
    for obj in objects {
        let name = staging.join(format!("{}.o", obj.unit.label().replace('/', "_")));
        fs::copy(&obj.path, &name).map_err(io_err(&name))?;
        members.push(name);
    }
    let _ = fs::remove_file(out);
    let status = Command::new("ar")
        .arg("crs")
        .arg(out)
        .args(&members)
        .status()
        .map_err(|e| BuildError::Tool {
            tool: "ar".into(),
            detail: e.to_string(),
        })?;
    if !status.success() {
        return Err(BuildError::Tool {
            tool: "ar".into(),
            detail: format!("exit status {status}"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moe_sources_become_one_fat_unit_for_all_archs() {
        let dir = std::env::temp_dir().join(format!("moefuse-units-{}", std::process::id()));
        for (sub, file) in [
            ("abi", "abi.cpp"),
            ("instances/sm90a", "sm90a_x.cu"),
            ("instances/sm100a", "sm100a_x.cu"),
            ("moe", "router.cu"),
        ] {
            fs::create_dir_all(dir.join(sub)).unwrap();
            fs::write(dir.join(sub).join(file), "").unwrap();
        }
        let all = units(&dir, &Arch::ALL).unwrap();
        let labels: Vec<String> = all.iter().map(Unit::label).collect();
        assert_eq!(
            labels,
            ["host/abi", "sm90a/sm90a_x", "sm100a/sm100a_x", "fat/router"]
        );
        let fat = &all[3];
        assert_eq!((fat.kind, fat.arch), (UnitKind::FatObject, None));
        assert_eq!(fat.fat_archs, Arch::ALL.to_vec());
        assert!(all[..3].iter().all(|u| u.fat_archs.is_empty()));
        assert!(units(&dir, &[]).unwrap().is_empty());
        let label = |f: KernelFamilies| -> Vec<String> {
            let u = units_for(&dir, &[Arch::Sm90a], f).unwrap();
            u.iter().map(Unit::label).collect()
        };
        let gemm_only = KernelFamilies {
            gemm: true,
            moe: false,
        };
        let moe_only = KernelFamilies {
            gemm: false,
            moe: true,
        };
        let neither = KernelFamilies {
            gemm: false,
            moe: false,
        };
        assert_eq!(label(gemm_only), ["host/abi", "sm90a/sm90a_x"]);
        assert_eq!(label(moe_only), ["host/abi", "fat/router"]);
        assert!(label(neither).is_empty());
        let _ = fs::remove_dir_all(&dir);
    }
}
