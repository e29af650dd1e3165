//! Where the CUDA compiler, CUTLASS headers and NVSHMEM live, and which versions we pin.
//!
//! Discovery looks where cudarc and candle users already keep CUDA, and writes nothing: a
//! build script that uses it creates files only in its `OUT_DIR` and the kernel cache.

use crate::{Arch, BuildError};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The pinned package set (PyPI wheels).
#[derive(Debug, Clone, Copy)]
pub struct Pins {
    /// The toolkit pins (nvcc 13.0.88, CCCL, disassemblers); [`Pins::requirements`] lists
    /// their whole closure.
    pub cuda: &'static [&'static str],
    /// NVSHMEM and CUTLASS.
    pub ext: &'static [&'static str],
    /// The install's requirements file: every wheel by version and sha256 (Linux x86_64),
    /// installed with `--no-deps --require-hashes --only-binary=:all:`.
    pub requirements: &'static str,
}

/// The pins. nvcc 13.0 matches the H200's driver 580 (newer minors emit code it cannot
/// load); NVSHMEM 3.4.5 matches the device machine's host library.
pub const PINS: Pins = Pins {
    cuda: &[
        "cuda-toolkit[nvcc,cccl]==13.0.3.0",
        "nvidia-cuda-cuobjdump==13.2.51",
        "nvidia-cuda-nvdisasm==13.2.51",
    ],
    ext: &["nvidia-nvshmem-cu13==3.4.5", "nvidia-cutlass==4.2.0.0"],
    requirements: include_str!("../toolchain/requirements-linux-x86_64.txt"),
};

/// The platform the pinned wheels are built for.
pub const PINNED_PLATFORM: &str = "Linux x86_64";

impl Pins {
    /// One line naming every pin: hashed into cache keys.
    ///
    /// ```
    /// assert!(moefuse_kernel_build::PINS.stamp().contains("nvidia-cutlass==4.2.0.0"));
    /// ```
    pub fn stamp(&self) -> String {
        format!("cuda: {}; ext: {}", self.cuda.join(" "), self.ext.join(" "))
    }

    /// What `cargo xtask setup` writes as the install's stamp: the pins plus the sha256 of
    /// the requirements file, so a new hash or a new install layout reinstalls.
    ///
    /// ```
    /// let s = moefuse_kernel_build::PINS.install_stamp();
    /// assert!(s.starts_with(&moefuse_kernel_build::PINS.stamp()));
    /// ```
    pub fn install_stamp(&self) -> String {
        let digest = Sha256::digest(self.requirements.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        format!("{}; requirements sha256 {hex}", self.stamp())
    }

    /// The wheels of the requirements file: (file name, size in bytes), for progress bars.
    ///
    /// ```
    /// let wheels = moefuse_kernel_build::PINS.wheels();
    /// assert!(wheels.iter().any(|(name, _)| name.starts_with("nvidia_cuda_nvcc-13.0.88")));
    /// ```
    pub fn wheels(&self) -> Vec<(&'static str, u64)> {
        self.requirements
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| {
                let (_, comment) = l.split_once("  # ")?;
                let (size, name) = comment.trim().split_once(' ')?;
                Some((name.trim(), size.parse().ok()?))
            })
            .collect()
    }
}

/// The requirements file inside this crate's sources (it travels with `cargo package`), for
/// the install command a person runs by hand.
///
/// ```
/// assert!(moefuse_kernel_build::requirements_path().is_file());
/// ```
pub fn requirements_path() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/toolchain/requirements-linux-x86_64.txt"
    ))
}

/// The one command that installs the pinned toolchain's wheels into the pip target `dir`
/// ([`site_dir`] is where discovery looks) with pip alone, no xtask: every wheel checked
/// against its sha256, binaries only, nothing resolved beyond the listed wheels.
///
/// ```
/// let cmd = moefuse_kernel_build::install_command(std::path::Path::new("/opt/tc"));
/// assert!(cmd.contains("--require-hashes") && cmd.contains("--target /opt/tc"));
/// ```
pub fn install_command(dir: &Path) -> String {
    format!(
        "python3 -m pip install --no-deps --require-hashes --only-binary=:all: --upgrade \
         --target {} -r {}",
        shell_word(&dir.display().to_string()),
        shell_word(&requirements_path().display().to_string())
    )
}

fn shell_word(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+:=,@~".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The install folder of the pinned toolchain: `MOEFUSE_TOOLCHAIN_DIR`, else
/// `$XDG_CACHE_HOME/moefuse/toolchain`, else `~/.cache/moefuse/toolchain`. The wheels'
/// files are in its [`site_dir`].
///
/// ```
/// assert!(moefuse_kernel_build::toolchain_dir().ends_with("toolchain")
///     || std::env::var_os("MOEFUSE_TOOLCHAIN_DIR").is_some());
/// ```
pub fn toolchain_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MOEFUSE_TOOLCHAIN_DIR") {
        return PathBuf::from(dir);
    }
    cache_root().join("toolchain")
}

/// The folder pip installs the wheels into (`--target`): `<toolchain_dir>/ext`, laid out
/// as `nvidia/cu13` (nvcc, CUDA headers and static runtime), `nvidia/nvshmem`,
/// `cutlass_library/source` (CUTLASS). nvshmem-sys finds NVSHMEM's host library there.
///
/// ```
/// assert!(moefuse_kernel_build::site_dir().starts_with(moefuse_kernel_build::toolchain_dir()));
/// ```
pub fn site_dir() -> PathBuf {
    site(&toolchain_dir())
}

fn site(toolchain: &Path) -> PathBuf {
    toolchain.join("ext")
}

pub(crate) fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("moefuse");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("moefuse")
}

/// The variables that name a CUDA install, in the order cudarc's build script reads them.
pub const CUDA_ROOT_ENV: &[&str] = &[
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_ROOT",
    "CUDA_TOOLKIT_ROOT_DIR",
];

/// Where a CUDA install usually is when no variable names one (after `nvcc` on `PATH`).
pub const CUDA_TYPICAL_ROOTS: &[&str] = &["/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda"];

/// The environment variables discovery reads (for `cargo:rerun-if-env-changed`). `PATH` is
/// left out on purpose, as cudarc does: it differs between shells and editors, and each
/// difference would rerun the build script.
pub const TOOLCHAIN_ENV: &[&str] = &[
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_ROOT",
    "CUDA_TOOLKIT_ROOT_DIR",
    "CUTLASS_DIR",
    "NVSHMEM_HOME",
    "MOEFUSE_TOOLCHAIN_DIR",
    "XDG_CACHE_HOME",
    "HOME",
];

/// A located toolchain.
#[derive(Debug, Clone)]
pub struct Toolchain {
    /// CUDA root: holds `bin/nvcc`, `include/`, and `libcudart_static.a` in
    /// [`Toolchain::cuda_lib_dir`].
    pub cuda_root: PathBuf,
    /// CUTLASS include folders (`include`, `tools/util/include`).
    pub cutlass_include: Vec<PathBuf>,
    /// NVSHMEM root (`include/`, `lib/`), when present.
    pub nvshmem_root: Option<PathBuf>,
    /// `nvcc --version`'s release line, e.g. `Cuda compilation tools, release 13.0, V13.0.88`.
    pub nvcc_version: String,
    /// The release parsed from that line, e.g. `(13, 0)`.
    pub cuda_release: (u32, u32),
    /// How each part was found, for messages: e.g. `nvcc: CUDA_HOME=/usr/local/cuda`.
    pub found: Vec<String>,
}

impl Toolchain {
    /// Finds the toolchain the way cudarc and candle users expect:
    ///
    /// * nvcc: the first of `CUDA_HOME`, `CUDA_PATH`, `CUDA_ROOT`, `CUDA_TOOLKIT_ROOT_DIR`
    ///   that is set (it must hold `bin/nvcc`); else the pinned install in
    ///   [`toolchain_dir`]; else `nvcc` on `PATH`; else `/usr/local/cuda`, `/opt/cuda`,
    ///   `/usr/lib/cuda`.
    /// * CUTLASS: `CUTLASS_DIR`; else the pinned install; else the `nvidia-cutlass` wheel
    ///   in python3's environment.
    /// * NVSHMEM (only the communication modules need it): `NVSHMEM_HOME`; else the pinned
    ///   install; else the `nvidia-nvshmem-cu13` wheel in python3's environment.
    ///
    /// Fails with the places it looked and the one command that installs the pinned
    /// toolchain. Writes nothing.
    ///
    /// ```no_run
    /// let tc = moefuse_kernel_build::Toolchain::discover()?;
    /// println!("{} ({})", tc.nvcc_version, tc.found.join(", "));
    /// # Ok::<(), moefuse_kernel_build::BuildError>(())
    /// ```
    pub fn discover() -> Result<Self, BuildError> {
        let dir = toolchain_dir();
        let mut looked = Vec::new();
        let mut found = Vec::new();
        let (cuda_root, how) =
            find_cuda(&dir, &mut looked).ok_or_else(|| no_toolchain(&looked, &site(&dir)))?;
        found.push(format!("nvcc: {how}"));
        let (cutlass, how) =
            find_cutlass(&dir, &mut looked).ok_or_else(|| no_toolchain(&looked, &site(&dir)))?;
        found.push(format!("CUTLASS: {how}"));
        let nvshmem_root = find_nvshmem(&dir).map(|(root, how)| {
            found.push(format!("NVSHMEM: {how}"));
            root
        });
        let nvcc_version = nvcc_version(&cuda_root.join("bin/nvcc"))?;
        let cuda_release = parse_release(&nvcc_version).ok_or_else(|| BuildError::Tool {
            tool: cuda_root.join("bin/nvcc").display().to_string(),
            detail: format!("no `release X.Y` in its version line `{nvcc_version}`"),
        })?;
        Ok(Toolchain {
            cutlass_include: vec![cutlass.join("include"), cutlass.join("tools/util/include")],
            nvshmem_root,
            cuda_root,
            nvcc_version,
            cuda_release,
            found,
        })
    }

    /// Fails with a sentence when this nvcc is too old for one of `archs` (sm_90a needs
    /// 12.3, sm_100a 12.8: [`moefuse_spec::ArchInfo::min_nvcc`]).
    ///
    /// ```no_run
    /// use moefuse_kernel_build::{Arch, Toolchain};
    /// Toolchain::discover()?.check_archs(&[Arch::Sm100a])?;
    /// # Ok::<(), moefuse_kernel_build::BuildError>(())
    /// ```
    pub fn check_archs(&self, archs: &[Arch]) -> Result<(), BuildError> {
        for arch in archs {
            let min = arch.info().min_nvcc;
            if self.cuda_release < min {
                return Err(BuildError::NvccTooOld {
                    nvcc: self.nvcc().display().to_string(),
                    release: format!("{}.{}", self.cuda_release.0, self.cuda_release.1),
                    arch: arch.name().to_string(),
                    needs: format!("{}.{}", min.0, min.1),
                    install: install_command(&site_dir()),
                });
            }
        }
        Ok(())
    }

    /// Path of the nvcc driver.
    pub fn nvcc(&self) -> PathBuf {
        self.cuda_root.join("bin/nvcc")
    }

    /// Path of cuobjdump (shipped by the pinned `nvidia-cuda-cuobjdump` wheel).
    pub fn cuobjdump(&self) -> PathBuf {
        self.cuda_root.join("bin/cuobjdump")
    }

    /// Folder holding `libcudart_static.a` (and `libcudadevrt.a`): `lib64` in a system
    /// install, `lib` in the pip wheel (which has no `lib64`), `targets/x86_64-linux/lib`
    /// in some distributions.
    pub fn cuda_lib_dir(&self) -> PathBuf {
        ["lib64", "lib", "targets/x86_64-linux/lib", "lib/x64"]
            .iter()
            .map(|sub| self.cuda_root.join(sub))
            .find(|d| d.join("libcudart_static.a").is_file())
            .unwrap_or_else(|| self.cuda_root.join("lib"))
    }
}

fn no_toolchain(looked: &[String], dir: &Path) -> BuildError {
    BuildError::NoToolchain {
        looked: looked.join("; "),
        install: if cfg!(all(target_os = "linux", target_arch = "x86_64")) {
            install_command(dir)
        } else {
            format!(
                "(the pinned wheels are for {PINNED_PLATFORM} only: install CUDA 12.8 or newer \
                 and CUTLASS 4.2, then set CUDA_HOME and CUTLASS_DIR)"
            )
        },
    }
}

fn has_nvcc(root: &Path) -> bool {
    root.join("bin/nvcc").is_file()
}

fn find_cuda(dir: &Path, looked: &mut Vec<String>) -> Option<(PathBuf, String)> {
    for var in CUDA_ROOT_ENV {
        if let Some(value) = std::env::var_os(var) {
            let root = PathBuf::from(&value);
            // An explicit variable is the user's choice: never silently skip it.
            looked.push(format!(
                "{var}={} (it wins over the other places; unset it if it has no bin/nvcc)",
                root.display()
            ));
            return has_nvcc(&root).then(|| {
                let how = format!("{var}={}", root.display());
                (root, how)
            });
        }
    }
    let pinned = site(dir).join("nvidia/cu13");
    looked.push(format!("{}", pinned.join("bin/nvcc").display()));
    if has_nvcc(&pinned) {
        return Some((pinned, format!("pinned install {}", dir.display())));
    }
    looked.push("nvcc on PATH".into());
    if let Some(nvcc) = on_path("nvcc") {
        let real = nvcc.canonicalize().unwrap_or(nvcc.clone());
        if let Some(root) = real.parent().and_then(Path::parent) {
            if has_nvcc(root) {
                return Some((root.to_path_buf(), format!("PATH ({})", nvcc.display())));
            }
        }
    }
    for root in CUDA_TYPICAL_ROOTS {
        looked.push(format!("{root}/bin/nvcc"));
        if has_nvcc(Path::new(root)) {
            return Some((PathBuf::from(root), (*root).to_string()));
        }
    }
    None
}

fn find_cutlass(dir: &Path, looked: &mut Vec<String>) -> Option<(PathBuf, String)> {
    let has_header = |root: &Path| root.join("include/cutlass/cutlass.h").is_file();
    if let Some(value) = std::env::var_os("CUTLASS_DIR") {
        let root = PathBuf::from(value);
        looked.push(format!(
            "CUTLASS_DIR={} (it wins over the other places; unset it if it has no \
             include/cutlass/cutlass.h)",
            root.display()
        ));
        return has_header(&root).then(|| {
            let how = format!("CUTLASS_DIR={}", root.display());
            (root, how)
        });
    }
    let pinned = site(dir).join("cutlass_library/source");
    looked.push(format!(
        "{}",
        pinned.join("include/cutlass/cutlass.h").display()
    ));
    if has_header(&pinned) {
        return Some((pinned, format!("pinned install {}", dir.display())));
    }
    looked.push("python3's nvidia-cutlass wheel".into());
    let root = python_package_dir("cutlass_library")?.join("source");
    has_header(&root).then(|| {
        let how = format!("python3's nvidia-cutlass ({})", root.display());
        (root, how)
    })
}

fn find_nvshmem(dir: &Path) -> Option<(PathBuf, String)> {
    let has_header = |root: &Path| root.join("include/nvshmem.h").is_file();
    if let Some(value) = std::env::var_os("NVSHMEM_HOME") {
        let root = PathBuf::from(value);
        let how = format!("NVSHMEM_HOME={}", root.display());
        return has_header(&root).then_some((root, how));
    }
    let pinned = site(dir).join("nvidia/nvshmem");
    if has_header(&pinned) {
        return Some((pinned, format!("pinned install {}", dir.display())));
    }
    let root = python_package_dir("nvidia.nvshmem")?;
    let how = format!("python3's nvidia-nvshmem ({})", root.display());
    has_header(&root).then_some((root, how))
}

/// The folder of a python package in python3's environment, or `None` without python3 or
/// the package. The current folder is taken off `sys.path` first (what `-I` would do,
/// without also hiding packages installed with `pip install --user`), and `-B` keeps the
/// import from writing `__pycache__` files.
fn python_package_dir(module: &str) -> Option<PathBuf> {
    let script = format!(
        "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; \
         import {module} as m; print(list(m.__path__)[0])"
    );
    let out = Command::new("python3")
        .args(["-B", "-c", &script])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let path = String::from_utf8(out.stdout).ok()?;
    let path = PathBuf::from(path.trim());
    path.is_dir().then_some(path)
}

fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// `(13, 0)` from `Cuda compilation tools, release 13.0, V13.0.88`.
fn parse_release(line: &str) -> Option<(u32, u32)> {
    let rest = line.split("release ").nth(1)?;
    let version = rest.split(',').next()?.trim();
    let (major, minor) = version.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

fn nvcc_version(nvcc: &Path) -> Result<String, BuildError> {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .map_err(|e| BuildError::Tool {
            tool: nvcc.display().to_string(),
            detail: e.to_string(),
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.contains("release"))
        .map(|l| l.trim().to_string())
        .ok_or_else(|| BuildError::Tool {
            tool: nvcc.display().to_string(),
            detail: format!("unexpected --version output: {text}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_line_parses() {
        assert_eq!(
            parse_release("Cuda compilation tools, release 13.0, V13.0.88"),
            Some((13, 0))
        );
        assert_eq!(
            parse_release("Cuda compilation tools, release 12.8, V12.8.61"),
            Some((12, 8))
        );
        assert_eq!(parse_release("nvcc"), None);
    }

    #[test]
    fn requirements_pin_every_wheel_by_hash() {
        let reqs: Vec<&str> = PINS
            .requirements
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
            .collect();
        assert!(!reqs.is_empty());
        for line in &reqs {
            assert!(
                line.contains("==") && line.contains("--hash=sha256:"),
                "{line}"
            );
            let hash = line.split("--hash=sha256:").nth(1).unwrap();
            assert_eq!(hash.split_whitespace().next().unwrap().len(), 64, "{line}");
        }
        assert_eq!(PINS.wheels().len(), reqs.len());
        // Every top-level pin other than the meta package appears with its version.
        for pin in PINS
            .cuda
            .iter()
            .chain(PINS.ext)
            .filter(|p| !p.starts_with("cuda-toolkit"))
        {
            assert!(
                reqs.iter().any(|l| l.starts_with(&format!("{pin} "))),
                "{pin}"
            );
        }
        assert!(PINS
            .requirements
            .contains("cuda-toolkit[nvcc,cccl]==13.0.3.0"));
    }

    #[test]
    fn install_command_quotes_odd_paths() {
        let cmd = install_command(Path::new("/tmp/a b"));
        assert!(cmd.contains("--target '/tmp/a b'"), "{cmd}");
        assert!(cmd.ends_with("requirements-linux-x86_64.txt"));
    }
}
