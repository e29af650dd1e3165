//! The checks that moefuse works as an ordinary dependency, which `cargo xtask test` runs
//! after the workspace tests (and `cargo xtask check-consumer` alone):
//!
//! * `package`: `cargo package --list` of each crate that compiles CUDA holds the sources
//!   its build script compiles (the crates build from the registry, not from this repo),
//!   and `cargo package` builds the GEMM stack from its `.crate` files (kernels off).
//! * `docs-rs`: with `DOCS_RS` set and no toolchain anywhere, the libraries document.
//! * `consumer`: a second checkout (a `git clone` of this commit into a temp folder) and a
//!   new crate beside it, outside any workspace, that depends on `moefuse-grouped-gemm` by
//!   path (and on cudarc, as users do) builds with plain `cargo build`. Its build compiles
//!   only the GEMM kernels of the one arch asked for (no MoE kernels), and compiles no unit
//!   at all: the kernel cache is keyed by content, and the checkout that ran this already
//!   built them. The kernels build script's record (`OUT_DIR/kernel-units.txt`) says which
//!   units were compiled and which came from the cache.

use crate::{cargo, root, run_cmd, Result};
use moefuse_kernel_build::Arch;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every check of this module, for `arch` (CI: `sm90a` only, already in the cache).
pub fn run(arch: Arch) -> Result<()> {
    run_only(arch, &["package", "docs-rs", "consumer"])
}

/// The checks named in `only` (`package`, `docs-rs`, `consumer`), in that order.
pub fn run_only(arch: Arch, only: &[&str]) -> Result<()> {
    if let Some(unknown) = only
        .iter()
        .find(|c| !["package", "docs-rs", "consumer"].contains(c))
    {
        return Err(format!(
            "unknown check `{unknown}`: expected package, docs-rs, consumer"
        ));
    }
    if only.contains(&"package") {
        package()?;
    }
    if only.contains(&"docs-rs") {
        docs_rs()?;
    }
    if only.contains(&"consumer") {
        consumer(arch)?;
    }
    Ok(())
}

/// `cargo package --list` carries the CUDA sources and the toolchain's requirements file.
pub fn package() -> Result<()> {
    let wanted: &[(&str, &[&str])] = &[
        (
            "moefuse-kernels",
            &[
                "build.rs",
                "cuda/abi/abi.cpp",
                "cuda/include/moefuse/abi.h",
                "cuda/moe/router.cu",
                "cuda/instances/sm90a/sm90a_gemm_bnk_bf16_f32_128x256x64_c2x1_coop.cu",
            ],
        ),
        ("moefuse-comm", &["build.rs", "cuda/ep.cu"]),
        (
            "moefuse-kernel-build",
            &[
                "toolchain/requirements-linux-x86_64.txt",
                "src/toolchain.rs",
            ],
        ),
        ("moefuse-spec", &["src/variants.rs"]),
    ];
    for (package, files) in wanted {
        let out = cargo()
            .args(["package", "--list", "--allow-dirty", "-p", package])
            .output()
            .map_err(|e| format!("cargo package --list -p {package}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "cargo package --list -p {package} failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let list = String::from_utf8_lossy(&out.stdout);
        let missing: Vec<&&str> = files
            .iter()
            .filter(|f| !list.lines().any(|l| l.trim() == **f))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "the {package} package lacks {missing:?}: its build script could not run from crates.io"
            ));
        }
        println!(
            "package: {package} carries {} files, including {}",
            list.lines().count(),
            files.join(", ")
        );
    }
    // Build the packaged crates from their .crate files (cargo's verify step), kernels off:
    // proves every file their build scripts and `include!`s read is inside the package.
    // A target folder of its own: cargo fingerprints registry crates by name and version, so
    // a shared one would reuse the objects of an earlier run's packages.
    forget_packaged_sources(&[
        "moefuse-spec",
        "moefuse-kernel-build",
        "moefuse-kernels",
        "moefuse-grouped-gemm",
    ])?;
    let target = scratch("package")?;
    run_cmd(
        cargo()
            .args(["package", "--allow-dirty"])
            .args(["-p", "moefuse-spec", "-p", "moefuse-kernel-build"])
            .args(["-p", "moefuse-kernels", "-p", "moefuse-grouped-gemm"])
            .env("CARGO_TARGET_DIR", &target)
            .env("MOEFUSE_CUDA_ARCHS", "none"),
    )?;
    let _ = fs::remove_dir_all(&target);
    println!("package: moefuse-spec, -kernel-build, -kernels and -grouped-gemm build from their packages");
    Ok(())
}

// NOTES: cargo verifies a multi-package `cargo package` through a temporary local registry
// whose crates it extracts under `$CARGO_HOME/registry/src/-<hash>/`, and it reuses an
// extraction left by an earlier run of the same version (cargo 1.95): without this, a second
// run verifies the first run's sources (seen on 2026-12-03). Only those folders (registry name starting with `-`,
// our package names) are removed.
fn forget_packaged_sources(packages: &[&str]) -> Result<()> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let Some(src) = home.map(|h| h.join("registry/src")) else {
        return Ok(());
    };
    let Ok(registries) = fs::read_dir(&src) else {
        return Ok(());
    };
    for registry in registries.flatten() {
        if !registry.file_name().to_string_lossy().starts_with('-') {
            continue;
        }
        for entry in fs::read_dir(registry.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            let ours = packages.iter().any(|p| {
                name.strip_prefix(p)
                    .and_then(|rest| rest.strip_prefix('-'))
                    .is_some_and(|v| v.starts_with(|c: char| c.is_ascii_digit()))
            });
            if ours {
                fs::remove_dir_all(entry.path())
                    .map_err(|e| format!("{}: {e}", entry.path().display()))?;
            }
        }
    }
    Ok(())
}

/// `DOCS_RS=1 cargo doc` of the libraries with no toolchain anywhere to be found.
pub fn docs_rs() -> Result<()> {
    let nowhere = scratch("docs-rs")?;
    let mut cmd = cargo();
    cmd.args([
        "doc",
        "--no-deps",
        "-p",
        "moefuse-kernels",
        "-p",
        "moefuse-grouped-gemm",
        "-p",
        "moefuse",
    ])
    .env("DOCS_RS", "1")
    .env("MOEFUSE_TOOLCHAIN_DIR", nowhere.join("no-toolchain"))
    .env("MOEFUSE_KERNEL_CACHE", nowhere.join("no-cache"));
    for var in moefuse_kernel_build::CUDA_ROOT_ENV.iter().chain(&[
        "CUTLASS_DIR",
        "NVSHMEM_HOME",
        "MOEFUSE_CUDA_ARCHS",
        "CUDA_COMPUTE_CAP",
    ]) {
        cmd.env_remove(var);
    }
    run_cmd(&mut cmd)?;
    let _ = fs::remove_dir_all(&nowhere);
    println!("docs-rs: documented with DOCS_RS=1 and no CUDA toolchain");
    Ok(())
}

/// The outside crate on a second checkout: plain `cargo build`, GEMM units of `arch` only,
/// none compiled.
pub fn consumer(arch: Arch) -> Result<()> {
    let dir = scratch("consumer")?;
    let checkout = dir.join("moefuse");
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .current_dir(root())
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    if dirty {
        println!(
            "consumer: note: uncommitted changes are not in the second checkout (it clones HEAD)"
        );
    }
    run_cmd(
        Command::new("git")
            .args(["clone", "--quiet", "--no-hardlinks"])
            .arg(root())
            .arg(&checkout),
    )?;
    let app = dir.join("app");
    fs::create_dir_all(app.join("src")).map_err(|e| e.to_string())?;
    fs::write(
        app.join("Cargo.toml"),
        format!(
            "[package]\nname = \"moefuse-consumer\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
             publish = false\n\n[dependencies]\nmoefuse-grouped-gemm = {{ path = {:?} }}\n\
             cudarc = {{ version = \"0.19.10\", default-features = false, features = [\"std\", \"driver\"] }}\n\
             half = \"2\"\n\n[workspace]\n",
            checkout.join("crates/grouped-gemm").display().to_string()
        ),
    )
    .map_err(|e| e.to_string())?;
    fs::write(app.join("src/main.rs"), CONSUMER_MAIN).map_err(|e| e.to_string())?;
    // Cargo.lock pins the same dependency versions as the workspace.
    let _ = fs::copy(root().join("Cargo.lock"), app.join("Cargo.lock"));
    let short = arch.info().short;
    println!(
        "consumer: `cargo build` of a crate outside the workspace on a second checkout ({}), MOEFUSE_CUDA_ARCHS={short}",
        checkout.display()
    );
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build
        .arg("build")
        .current_dir(&app)
        .env("MOEFUSE_CUDA_ARCHS", short)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CUDA_COMPUTE_CAP");
    run_cmd(&mut build)?;
    let log = unit_log(&app.join("target/debug/build"), "moefuse-kernels-")?;
    let labels: Vec<(&str, &str)> = log
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            Some((words.next()?, words.next()?))
        })
        .collect();
    let compiled: Vec<&str> = labels
        .iter()
        .filter(|(how, _)| *how == "compiled")
        .map(|(_, l)| *l)
        .collect();
    let moe: Vec<&str> = labels
        .iter()
        .filter(|(_, l)| l.starts_with("fat/"))
        .map(|(_, l)| *l)
        .collect();
    let foreign: Vec<&str> = labels
        .iter()
        .filter(|(_, l)| l.starts_with("sm") && !l.starts_with(&format!("{}/", arch.name())))
        .map(|(_, l)| *l)
        .collect();
    let gemm = labels
        .iter()
        .filter(|(_, l)| l.starts_with(&format!("{}/", arch.name())))
        .count();
    let mut problems = Vec::new();
    if gemm == 0 {
        problems.push(format!("no {} GEMM unit was built", arch.name()));
    }
    if !moe.is_empty() {
        problems.push(format!("a GEMM-only build built MoE units: {moe:?}"));
    }
    if !foreign.is_empty() {
        problems.push(format!("units of another arch were built: {foreign:?}"));
    }
    if !compiled.is_empty() {
        problems.push(format!(
            "a second checkout of the same commit recompiled {} units the cache should have \
             supplied: {compiled:?}",
            compiled.len()
        ));
    }
    if !problems.is_empty() {
        return Err(format!("consumer check: {}", problems.join("; ")));
    }
    run_cmd(&mut Command::new(app.join("target/debug/moefuse-consumer")))?;
    println!(
        "consumer: built {gemm} {} GEMM units, all from the cache, no MoE unit",
        arch.name()
    );
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

/// The outside crate's program: GPU-free at run time, but it links every compiled variant
/// (`Gemm::new` reaches the registry of launchers), so a missing kernel symbol fails the
/// build.
const CONSUMER_MAIN: &str = r#"use moefuse_grouped_gemm::{Gemm, GemmDesc};

fn gemm_on_gpu() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let (m, n, k) = (256, 256, 256);
    let a = stream.clone_htod(&vec![half::bf16::ONE; m * k])?;
    let b = stream.clone_htod(&vec![half::bf16::ONE; n * k])?;
    let mut d = stream.alloc_zeros::<half::bf16>(m * n)?;
    let gemm = Gemm::new(&ctx)?;
    let plan = gemm.plan(&GemmDesc::new(m, n, k))?;
    gemm.run(&plan, &stream, &a, &b, &mut d, None)?;
    Ok(())
}

fn main() {
    if std::env::var_os("MOEFUSE_CONSUMER_GPU").is_some() {
        gemm_on_gpu().expect("GEMM on the GPU");
    }
    println!("moefuse-consumer: linked");
}
"#;

/// The text of `kernel-units.txt` in the one `OUT_DIR` of a package under `build_dir`.
fn unit_log(build_dir: &Path, prefix: &str) -> Result<String> {
    let mut found = Vec::new();
    for entry in fs::read_dir(build_dir).map_err(|e| format!("{}: {e}", build_dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let log = path.join("out/kernel-units.txt");
        if name.starts_with(prefix) && log.is_file() {
            found.push(log);
        }
    }
    match found.as_slice() {
        [one] => fs::read_to_string(one).map_err(|e| format!("{}: {e}", one.display())),
        [] => Err(format!(
            "no {prefix}*/out/kernel-units.txt under {}",
            build_dir.display()
        )),
        many => Err(format!("several kernel unit records: {many:?}")),
    }
}

/// A fresh folder for one check under the system temp folder.
fn scratch(name: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("moefuse-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}
