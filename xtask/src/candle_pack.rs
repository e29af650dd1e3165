//! `cargo xtask candle-pack`: the GPU binaries of `moefuse-candle` (its `candle_gpu` test, the
//! `train_moe_block` example and the `bench_candle_block` benchmark, built with
//! `--features cuda`) for the H200, in `.device-pack-candle/` (ignored by git),
//! xz-compressed for the device tool's carry.
//!
//! NOTES: candle's `cuda` feature makes cudarc link `libcuda`, `libcublas`, `libcublasLt`,
//! `libcurand`, `libnvrtc` and `libcudart` dynamically, and this build machine has none of
//! them (no driver; the pinned toolkit carries only the static runtime). The H200 has them
//! all (the driver, and torch's `nvidia` python packages). So the binaries are linked against
//! stub libraries that carry the real libraries' sonames and the symbols the binaries call:
//! pass 1 links with unresolved symbols allowed and reads the binaries' undefined symbols;
//! the stubs are generated from that list (one empty function per symbol, sorted into the
//! library its prefix names); pass 2 relinks, so each binary's `NEEDED` list names the real
//! libraries, which the loader finds on the H200 (`run.sh` puts python's `nvidia/*/lib` on
//! `LD_LIBRARY_PATH`). The stubs never travel.

use crate::{root, Result};
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Library soname and the symbol prefix that belongs to it, most specific first.
const STUBS: &[(&str, &str)] = &[
    ("libcublasLt.so.13", "cublasLt"),
    ("libcublas.so.13", "cublas"),
    ("libcurand.so.10", "curand"),
    ("libnvrtc.so.13", "nvrtc"),
    ("libcudart.so.13", "cuda"),
    ("libcuda.so.1", "cu"),
];

/// Builds the pack. `cuda_home` is the toolkit whose nvcc builds candle-kernels.
pub fn run() -> Result<()> {
    let target = root().join("target-candle");
    let stubs = target.join("link-stubs");
    let pack = root().join(".device-pack-candle");
    let tc = moefuse_kernel_build::Toolchain::discover().map_err(|e| e.to_string())?;
    write_stubs(&stubs, &BTreeSet::new())?;
    let first = build(&target, &stubs, &tc.cuda_root)?;
    let mut undefined = BTreeSet::new();
    for (_, exe) in &first {
        undefined.extend(undefined_symbols(exe)?);
        remove_linked(exe)?;
    }
    println!(
        "candle-pack: {} CUDA symbols called; writing stubs",
        undefined.len()
    );
    write_stubs(&stubs, &undefined)?;
    let second = build(&target, &stubs, &tc.cuda_root)?;
    let _ = fs::remove_dir_all(&pack);
    fs::create_dir_all(&pack).map_err(|e| e.to_string())?;
    for (name, exe) in &second {
        let dest = pack.join(name);
        fs::copy(exe, &dest).map_err(|e| format!("{}: {e}", exe.display()))?;
        let _ = Command::new("strip").arg(&dest).status();
        println!("candle-pack: {name} needs {}", needed(&dest)?.join(", "));
    }
    crate::run_cmd(
        Command::new("tar")
            .arg("-cJf")
            .arg(pack.join("candle.tar.xz"))
            .arg("-C")
            .arg(&pack)
            .args(second.iter().map(|(n, _)| n)),
    )?;
    for (name, _) in &second {
        fs::remove_file(pack.join(name)).map_err(|e| e.to_string())?;
    }
    let size = fs::metadata(pack.join("candle.tar.xz"))
        .map_err(|e| e.to_string())?
        .len();
    println!(
        "candle-pack: {:.1} MiB in {}; on the H200 (carry [\".device-pack-candle\"]): \
         tar -xJf .device-pack-candle/candle.tar.xz -C /tmp, put python's nvidia/*/lib on \
         LD_LIBRARY_PATH, run /tmp/candle_gpu-test, /tmp/train_moe_block and \
         /tmp/bench_candle_block --out \"$OUT\"",
        size as f64 / 1048576.0,
        pack.display()
    );
    Ok(())
}

/// `cargo build --release -p moefuse-candle --features cuda` of the GPU test, the example and
/// the benchmark, linked against `stubs`; returns (name, executable).
fn build(target: &Path, stubs: &Path, cuda_root: &Path) -> Result<Vec<(String, PathBuf)>> {
    let path = format!(
        "{}:{}",
        cuda_root.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root())
        .args([
            "build",
            "--release",
            "-p",
            "moefuse-candle",
            "--features",
            "cuda",
            "--test",
            "candle_gpu",
            "--example",
            "train_moe_block",
            "--example",
            "bench_candle_block",
            "--message-format=json-render-diagnostics",
        ])
        .env("CARGO_TARGET_DIR", target)
        .env("CUDA_HOME", cuda_root)
        .env("PATH", path)
        .env("CUDA_COMPUTE_CAP", "90")
        .env("MOEFUSE_CUDA_ARCHS", "90a")
        .env(
            "RUSTFLAGS",
            format!(
                "-L {} -C link-arg=-Wl,--unresolved-symbols=ignore-all",
                stubs.display()
            ),
        )
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err("cargo build of moefuse-candle --features cuda failed".into());
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        if let Some(exe) = msg["executable"].as_str() {
            let name = match msg["target"]["name"].as_str() {
                Some("candle_gpu") => "candle_gpu-test",
                Some(other) => other,
                None => continue,
            };
            exes.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    Ok(exes)
}

/// Removes `exe` and the hashed file cargo copies it from (`examples/NAME-HASH`), so the
/// next build links it again instead of copying the old link.
fn remove_linked(exe: &Path) -> Result<()> {
    let stem = exe.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let prefix = format!("{}-", stem.split('-').next().unwrap_or(stem));
    let dir = exe.parent().unwrap_or(Path::new("."));
    for entry in fs::read_dir(dir).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let linked = name == stem || (name.starts_with(&prefix) && path.extension().is_none());
        if linked {
            fs::remove_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    Ok(())
}

/// The undefined dynamic symbols of `exe` that a CUDA library provides.
fn undefined_symbols(exe: &Path) -> Result<Vec<String>> {
    let out = Command::new("nm")
        .args(["-u", "--dynamic"])
        .arg(exe)
        .output()
        .map_err(|e| format!("nm: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(|s| s.split('@').next().unwrap_or(s).to_string())
        .filter(|s| library_of(s).is_some())
        .collect())
}

/// The stub library a symbol belongs to (`cuInit` → libcuda, `cudaMalloc` → libcudart, ...).
fn library_of(symbol: &str) -> Option<&'static str> {
    STUBS.iter().find_map(|(lib, prefix)| {
        let rest = symbol.strip_prefix(prefix)?;
        // `cu` must be followed by a capital (cuInit), `cuda` too (cudaMalloc), so that
        // `curand`/`cublas` symbols never fall through to the driver.
        let next_is_upper = rest.chars().next().is_some_and(|c| c.is_ascii_uppercase());
        (next_is_upper || !matches!(*prefix, "cu" | "cuda")).then_some(*lib)
    })
}

/// One shared library per soname with an empty function for each of its `symbols`, and the
/// unversioned `.so` link the linker's `-l` looks for.
fn write_stubs(dir: &Path, symbols: &BTreeSet<String>) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    for (soname, _) in STUBS {
        let mut c = String::from("/* generated by cargo xtask candle-pack: a link-time stub */\n");
        for s in symbols.iter().filter(|s| library_of(s) == Some(soname)) {
            c.push_str(&format!("void {s}(void) {{}}\n"));
        }
        let src = dir.join(format!("{soname}.c"));
        fs::write(&src, c).map_err(|e| e.to_string())?;
        crate::run_cmd(
            Command::new("gcc")
                .args(["-shared", "-fPIC", "-o"])
                .arg(dir.join(soname))
                .arg(format!("-Wl,-soname,{soname}"))
                .arg(&src),
        )?;
        let link = dir.join(format!(
            "{}.so",
            soname.split(".so").next().unwrap_or(soname)
        ));
        let _ = fs::remove_file(&link);
        #[cfg(unix)]
        std::os::unix::fs::symlink(soname, &link).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The `NEEDED` entries of an ELF file.
fn needed(exe: &Path) -> Result<Vec<String>> {
    let out = Command::new("readelf")
        .arg("-d")
        .arg(exe)
        .output()
        .map_err(|e| format!("readelf: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split('[').nth(1))
        .map(|s| s.trim_end_matches(']').to_string())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::library_of;

    #[test]
    fn symbols_go_to_the_library_their_prefix_names() {
        assert_eq!(library_of("cuInit"), Some("libcuda.so.1"));
        assert_eq!(library_of("cuMemAlloc_v2"), Some("libcuda.so.1"));
        assert_eq!(library_of("cudaMalloc"), Some("libcudart.so.13"));
        assert_eq!(library_of("cublasGemmEx"), Some("libcublas.so.13"));
        assert_eq!(library_of("cublasLtMatmul"), Some("libcublasLt.so.13"));
        assert_eq!(library_of("curandGenerateNormal"), Some("libcurand.so.10"));
        assert_eq!(library_of("nvrtcCompileProgram"), Some("libnvrtc.so.13"));
        assert_eq!(library_of("cutlass_thing"), None);
        assert_eq!(library_of("memcpy"), None);
    }
}
