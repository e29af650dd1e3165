//! `cargo xtask device-pack`: release builds of every test, example and benchmark binary,
//! stripped, with a `run.sh`, in `.device-pack/` (ignored by git) for the device tool's
//! `carry` (64 MiB limit). See docs/development.md for the loop.

use crate::{build, cargo, root, setup, Result};
use std::fs;
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Command, Stdio};

const RUN_SH: &str = include_str!("run.sh");
const CARRY_LIMIT: u64 = 64 << 20;

/// Builds and gathers the binaries (those matching `only`, a comma list of name parts, when
/// given) and the Python bridge library; prints the pack's size against the carry limit.
pub fn run(sm: &str, only: &str) -> Result<()> {
    let wanted: Vec<&str> = only.split(',').filter(|s| !s.is_empty()).collect();
    let keep = |name: &str| wanted.is_empty() || wanted.iter().any(|w| name.contains(w));
    setup::run(false)?;
    build::build_kernels(sm, None)?;
    let pack = root().join(".device-pack");
    let _ = fs::remove_dir_all(&pack);
    fs::create_dir_all(pack.join("tests")).map_err(|e| e.to_string())?;
    fs::create_dir_all(pack.join("bin")).map_err(|e| e.to_string())?;
    fs::create_dir_all(pack.join("py")).map_err(|e| e.to_string())?;
    fs::create_dir_all(pack.join("lib")).map_err(|e| e.to_string())?;
    for entry in fs::read_dir(root().join("benches")).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.extension().is_some_and(|e| e == "py") {
            fs::copy(&path, pack.join("py").join(path.file_name().expect("file")))
                .map_err(|e| e.to_string())?;
        }
    }

    // Only the tests that need the GPU travel (each links the kernel library, ~5 MiB):
    // CPU tests run here and in CI.
    let tests: Vec<_> = artifacts(&["test", "--workspace", "--release", "--no-run"], true, sm)?
        .into_iter()
        .filter(|(name, _)| name.ends_with("_gpu-test") || name == "version-test")
        .filter(|(name, _)| keep(name))
        .collect();
    let mut bins = artifacts(
        &[
            "build",
            "--release",
            "-p",
            "moefuse-benches",
            "--bins",
            "-p",
            "moefuse-grouped-gemm",
            "-p",
            "moefuse",
            "--examples",
        ],
        false,
        sm,
    )?
    .into_iter()
    .filter(|(name, _)| keep(name))
    .collect::<Vec<_>>();
    // The ctypes bridge of benches/torch_grouped_mm.py (moefuse timed beside torch in one
    // process): travels with the grouped-GEMM bench.
    let mut libs = Vec::new();
    if keep("bench_grouped") {
        libs.push((
            "libmoefuse_bench_capi.so".to_string(),
            shared_library("moefuse-bench-capi", sm)?,
        ));
    }
    bins.extend(cuda_programs(sm, &keep)?);
    let mut size = 0;
    for (dir, list) in [("tests", &tests), ("bin", &bins), ("lib", &libs)] {
        for (name, exe) in list {
            let dest = pack.join(dir).join(name);
            fs::copy(exe, &dest).map_err(|e| format!("{}: {e}", exe.display()))?;
            let _ = Command::new("strip").arg(&dest).status();
            size += fs::metadata(&dest).map_err(|e| e.to_string())?.len();
        }
    }
    let commit = Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=10"])
        .current_dir(root())
        .output();
    let commit = commit
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    fs::write(pack.join("COMMIT"), &commit).map_err(|e| e.to_string())?;
    let run_sh = pack.join("run.sh");
    fs::write(&run_sh, RUN_SH).map_err(|e| e.to_string())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&run_sh, fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
    }
    println!(
        "device-pack: {} test binaries, {} programs, {:.1} MiB in {}",
        tests.len(),
        bins.len(),
        size as f64 / 1048576.0,
        pack.display(),
    );
    // The device tool's carry limit counts what travels: the pack compressed (xz shrinks
    // the binaries ~13x), so the whole pack fits where the folder itself would not.
    let archive = root().join(".device-pack.tar.xz");
    let status = Command::new("tar")
        .arg("-cJf")
        .arg(&archive)
        .arg(".device-pack")
        .current_dir(root())
        .status()
        .map_err(|e| format!("tar: {e}"))?;
    if !status.success() {
        return Err("tar -cJf .device-pack.tar.xz failed".into());
    }
    let packed = fs::metadata(&archive).map_err(|e| e.to_string())?.len();
    println!(
        "device-pack: {:.1} MiB compressed in {} (carry limit {} MiB, the working tree counts too)",
        packed as f64 / 1048576.0,
        archive.display(),
        CARRY_LIMIT >> 20
    );
    if packed > CARRY_LIMIT - (2 << 20) {
        return Err(
            "device-pack is over the carry limit even compressed: pick binaries with --only".into(),
        );
    }
    println!(
        "run on the H200 with: device run, carry [\".device-pack.tar.xz\"], command \
         \"tar -xJf .device-pack.tar.xz -C /tmp && /tmp/.device-pack/run.sh all\""
    );
    Ok(())
}

/// The standalone CUDA programs of `benches/cuda/` (measurements below the library, e.g.
/// `decode_floor`: launch and streaming floors; they may include the kernels' headers) that
/// `keep` accepts, each built by the toolchain's nvcc for the first target of `sm` into
/// `target/cuda-programs/<name>`: their `(name, path)`.
fn cuda_programs(sm: &str, keep: &dyn Fn(&str) -> bool) -> Result<Vec<(String, PathBuf)>> {
    let dir = root().join("benches/cuda");
    let Ok(entries) = fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let name_of = |p: &PathBuf| {
        p.file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string()
    };
    let mut sources: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu") && keep(&name_of(p)))
        .collect();
    if sources.is_empty() {
        return Ok(Vec::new());
    }
    sources.sort();
    let arch = sm.split(',').next().unwrap_or("90a").trim();
    let out_dir = root().join("target/cuda-programs");
    fs::create_dir_all(&out_dir).map_err(|e| e.to_string())?;
    let tc = moefuse_kernel_build::Toolchain::discover().map_err(|e| e.to_string())?;
    let mut built = Vec::new();
    for src in sources {
        let name = name_of(&src);
        let exe = out_dir.join(&name);
        let status = Command::new(tc.nvcc())
            .args(["-O3", "-std=c++17", &format!("-arch=sm_{arch}")])
            .arg(format!("-L{}", tc.cuda_lib_dir().display()))
            .arg(format!(
                "-I{}",
                root().join("crates/kernels/cuda/include").display()
            ))
            .arg(&src)
            .arg("-o")
            .arg(&exe)
            .status()
            .map_err(|e| format!("{}: {e}", tc.nvcc().display()))?;
        if !status.success() {
            return Err(format!("nvcc failed on {}", src.display()));
        }
        built.push((name, exe));
    }
    Ok(built)
}

/// Builds `package`'s cdylib in release mode and returns the `.so`'s path.
fn shared_library(package: &str, sm: &str) -> Result<PathBuf> {
    let out = cargo()
        .args([
            "build",
            "--release",
            "-p",
            package,
            "--message-format=json-render-diagnostics",
        ])
        .env("MOEFUSE_CUDA_ARCHS", sm)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("cargo build -p {package} failed"));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        // The package's own cdylib, not a proc-macro dependency's `.so` (those come first).
        .filter(|m| {
            m["target"]["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "cdylib"))
        })
        .flat_map(|m| {
            m["filenames"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(|f| f.as_str().map(PathBuf::from))
        })
        .find(|f| f.extension().is_some_and(|e| e == "so"))
        .ok_or_else(|| format!("{package}: no .so among the build's artifacts"))
}

/// Runs cargo with JSON messages and returns (name, executable) for each artifact; test
/// binaries are named `<target>-<kind>` so unit and integration tests do not collide.
fn artifacts(args: &[&str], tests: bool, sm: &str) -> Result<Vec<(String, PathBuf)>> {
    let mut child = cargo()
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .env("MOEFUSE_CUDA_ARCHS", sm)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let stdout = child.stdout.take().expect("piped");
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"].as_bool() != Some(tests) {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let target = msg["target"]["name"].as_str().unwrap_or("x");
        let kind = msg["target"]["kind"][0].as_str().unwrap_or("x");
        let name = if tests {
            format!("{target}-{kind}")
        } else {
            target.to_string()
        };
        out.push((name, PathBuf::from(exe)));
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("cargo {} failed", args.join(" ")));
    }
    Ok(out)
}
