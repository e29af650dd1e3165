//! Where the CUDA compiler, CUTLASS headers and NVSHMEM live, and which versions we pin.

use crate::{io_err, BuildError};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The pinned package set `cargo xtask setup` installs (PyPI wheels).
#[derive(Debug, Clone, Copy)]
pub struct Pins {
    /// pip requirements installed into `<dir>/cuda` (nvcc 13.0.88, CCCL, disassemblers).
    pub cuda: &'static [&'static str],
    /// pip requirements installed with `--no-deps` into `<dir>/ext` (NVSHMEM, CUTLASS).
    pub ext: &'static [&'static str],
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
};

impl Pins {
    /// One line naming every pin: written as the install's stamp and hashed into cache keys.
    ///
    /// ```
    /// assert!(moefuse_kernel_build::PINS.stamp().contains("nvidia-cutlass==4.2.0.0"));
    /// ```
    pub fn stamp(&self) -> String {
        format!("cuda: {}; ext: {}", self.cuda.join(" "), self.ext.join(" "))
    }
}

/// The install folder of `cargo xtask setup`: `MOEFUSE_TOOLCHAIN_DIR`, else
/// `$XDG_CACHE_HOME/moefuse/toolchain`, else `~/.cache/moefuse/toolchain`.
pub fn toolchain_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MOEFUSE_TOOLCHAIN_DIR") {
        return PathBuf::from(dir);
    }
    cache_root().join("toolchain")
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

/// The environment variables discovery reads (for `cargo:rerun-if-env-changed`).
pub const TOOLCHAIN_ENV: &[&str] = &[
    "CUDA_HOME",
    "CUTLASS_DIR",
    "NVSHMEM_HOME",
    "MOEFUSE_TOOLCHAIN_DIR",
    "XDG_CACHE_HOME",
    "HOME",
];

/// A located toolchain.
#[derive(Debug, Clone)]
pub struct Toolchain {
    /// CUDA root: holds `bin/nvcc`, `include/`, `lib/` (with `libcudart_static.a`).
    pub cuda_root: PathBuf,
    /// CUTLASS include folders (`include`, `tools/util/include`).
    pub cutlass_include: Vec<PathBuf>,
    /// NVSHMEM root (`include/`, `lib/`), when present.
    pub nvshmem_root: Option<PathBuf>,
    /// `nvcc --version`'s release line, e.g. `Cuda compilation tools, release 13.0, V13.0.88`.
    pub nvcc_version: String,
}

impl Toolchain {
    /// Finds the toolchain: each of `CUDA_HOME`, `CUTLASS_DIR`, `NVSHMEM_HOME` wins when set;
    /// the rest comes from [`toolchain_dir`]. Fails with the places it looked.
    ///
    /// ```no_run
    /// let tc = moefuse_kernel_build::Toolchain::discover()?;
    /// println!("{}", tc.nvcc_version);
    /// # Ok::<(), moefuse_kernel_build::BuildError>(())
    /// ```
    pub fn discover() -> Result<Self, BuildError> {
        let dir = toolchain_dir();
        let pip_cuda = dir.join("cuda/nvidia/cu13");
        let pip_cutlass = dir.join("ext/cutlass_library/source");
        let pip_nvshmem = dir.join("ext/nvidia/nvshmem");
        let env_path = |k: &str| std::env::var_os(k).map(PathBuf::from);

        let cuda_root = env_path("CUDA_HOME").unwrap_or(pip_cuda);
        let cutlass = env_path("CUTLASS_DIR").unwrap_or(pip_cutlass);
        let nvshmem = env_path("NVSHMEM_HOME").unwrap_or(pip_nvshmem);
        let cutlass_header = cutlass.join("include/cutlass/cutlass.h");
        let nvcc = cuda_root.join("bin/nvcc");
        if !nvcc.is_file() || !cutlass_header.is_file() {
            return Err(BuildError::NoToolchain {
                looked: format!("{} and {}", nvcc.display(), cutlass_header.display()),
                default: dir.display().to_string(),
            });
        }
        ensure_lib64(&cuda_root)?;
        let nvcc_version = nvcc_version(&nvcc)?;
        Ok(Toolchain {
            cutlass_include: vec![cutlass.join("include"), cutlass.join("tools/util/include")],
            nvshmem_root: nvshmem
                .join("include/nvshmem.h")
                .is_file()
                .then_some(nvshmem),
            cuda_root,
            nvcc_version,
        })
    }

    /// Path of the nvcc driver.
    pub fn nvcc(&self) -> PathBuf {
        self.cuda_root.join("bin/nvcc")
    }

    /// Path of cuobjdump (shipped by the pinned `nvidia-cuda-cuobjdump` wheel).
    pub fn cuobjdump(&self) -> PathBuf {
        self.cuda_root.join("bin/cuobjdump")
    }

    /// Folder holding `libcudart_static.a`.
    pub fn cuda_lib_dir(&self) -> PathBuf {
        self.cuda_root.join("lib")
    }
}

// NOTES: nvcc.profile in the pip wheel looks for libraries in lib64, which the wheel
// does not ship; a relative link makes it find lib/.
fn ensure_lib64(cuda_root: &Path) -> Result<(), BuildError> {
    let lib64 = cuda_root.join("lib64");
    if lib64.exists() || !cuda_root.join("lib").is_dir() {
        return Ok(());
    }
    #[cfg(unix)]
    std::os::unix::fs::symlink("lib", &lib64).map_err(io_err(&lib64))?;
    Ok(())
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
