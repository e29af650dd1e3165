//! `cargo xtask setup`: the pinned toolchain from PyPI into a cache folder outside the repo.

use crate::{run_cmd, Result};
use moefuse_kernel_build::{toolchain_dir, PINS};
use std::fs;
use std::process::Command;
use std::time::Instant;

/// Installs the pins into [`toolchain_dir`] unless its stamp already names them.
/// Installs into a fresh sibling folder and renames it into place, because a second
/// `pip install --target` into an existing folder silently keeps the old files.
pub fn run(force: bool) -> Result<()> {
    let dir = toolchain_dir();
    let stamp = dir.join("moefuse-pins.stamp");
    if !force && fs::read_to_string(&stamp).ok().as_deref() == Some(PINS.stamp().as_str()) {
        println!("toolchain up to date at {}", dir.display());
        return Ok(());
    }
    if std::env::var_os("CUDA_HOME").is_some() && std::env::var_os("CUTLASS_DIR").is_some() {
        println!("CUDA_HOME and CUTLASS_DIR are set: they win over the cache; installing the cache anyway");
    }
    let start = Instant::now();
    let staging = dir.with_extension("installing");
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).map_err(|e| format!("{}: {e}", staging.display()))?;
    println!("installing the pinned toolchain into {} ...", dir.display());
    let pip = || {
        let mut c = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()));
        c.args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--root-user-action=ignore",
            "--no-cache-dir",
            "--target",
        ]);
        c
    };
    run_cmd(pip().arg(staging.join("cuda")).args(PINS.cuda))?;
    run_cmd(
        pip()
            .arg(staging.join("ext"))
            .arg("--no-deps")
            .args(PINS.ext),
    )?;
    // nvcc.profile looks for libraries in lib64, which the wheel does not ship.
    #[cfg(unix)]
    std::os::unix::fs::symlink("lib", staging.join("cuda/nvidia/cu13/lib64"))
        .map_err(|e| e.to_string())?;
    fs::write(staging.join("moefuse-pins.stamp"), PINS.stamp()).map_err(|e| e.to_string())?;
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&staging, &dir)
        .map_err(|e| format!("{} -> {}: {e}", staging.display(), dir.display()))?;
    println!(
        "toolchain installed in {:.0} s: {}",
        start.elapsed().as_secs_f64(),
        PINS.stamp()
    );
    Ok(())
}
