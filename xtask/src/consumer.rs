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
//! * `candle-consumer`: the same for a library crate that depends on `moefuse-candle` (feature
//!   `cuda`) and `candle-core` (feature `cuda`), built with plain `cargo build` on two fresh
//!   checkouts in turn. It builds the GEMM and MoE kernels of the one arch asked for (no unit
//!   of another arch); the first checkout compiles no GEMM or host unit (the checkout that ran
//!   this built them), and the second compiles no unit at all. candle's crates (candle-kernels
//!   compiles its PTX with nvcc) build once into `target/candle-consumer/`, reused by the next
//!   run.

use crate::{cargo, root, run_cmd, Result};
use moefuse_kernel_build::Arch;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The checks of this module, in the order they run.
pub const CHECKS: &[&str] = &["package", "docs-rs", "consumer", "candle-consumer"];

/// Every check of this module, for `arch` (CI: `sm90a` only, already in the cache).
pub fn run(arch: Arch) -> Result<()> {
    run_only(arch, CHECKS)
}

/// The checks named in `only` (names from [`CHECKS`]), in that order.
pub fn run_only(arch: Arch, only: &[&str]) -> Result<()> {
    if let Some(unknown) = only.iter().find(|c| !CHECKS.contains(c)) {
        return Err(format!(
            "unknown check `{unknown}`: expected {}",
            CHECKS.join(", ")
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
    if only.contains(&"candle-consumer") {
        candle_consumer(arch)?;
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
    note_uncommitted("consumer");
    clone_head(&checkout)?;
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
    let labels = unit_labels(&log);
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

/// The outside candle crate on two fresh checkouts of this commit in turn: plain `cargo
/// build`, GEMM and MoE units of `arch` only; the first compiles no GEMM or host unit, the
/// second no unit at all.
///
/// NOTES: the MoE kernels (`moe/*.cu`) are fat objects whose cache key names every arch they
/// carry, and the checkout that ran this (CI's `build-kernels 90a,100a`, `cargo test` with
/// both archs) built them for sm_90a and sm_100a together: an sm_90a-only build needs other
/// objects, which a cold cache lacks (four units, about 30 s). So the first checkout may
/// compile those, and the second, the one the acceptance is about, must compile none.
pub fn candle_consumer(arch: Arch) -> Result<()> {
    let tc = moefuse_kernel_build::Toolchain::discover().map_err(|e| e.to_string())?;
    // Fixed paths, not per process: the path dependencies' artifacts in the reused target
    // folder are keyed by their path, so per-run paths would pile up there.
    let dir = std::env::temp_dir().join("moefuse-candle-consumer");
    let _ = fs::remove_dir_all(&dir);
    let target = root().join("target/candle-consumer");
    let short = arch.info().short;
    let (major, minor) = arch.capability();
    let cap = format!("{major}{minor}");
    let path = format!(
        "{}:{}",
        tc.cuda_root.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    println!(
        "candle-consumer: `cargo build` of a library crate outside the workspace (moefuse-candle \
         and candle-core, feature cuda) on two fresh checkouts in {}, MOEFUSE_CUDA_ARCHS={short}, \
         CUDA_COMPUTE_CAP={cap}, CUDA_HOME={}, target folder {}",
        dir.display(),
        tc.cuda_root.display(),
        target.display()
    );
    note_uncommitted("candle-consumer");
    let mut summary = Vec::new();
    for (i, which) in ["first", "second"].into_iter().enumerate() {
        let checkout = dir.join(which).join("moefuse");
        clone_head(&checkout)?;
        // The checkout's Cargo.lock pins the workspace's versions (one cudarc for candle and
        // moefuse); cargo drops what the crate does not use. candle-core is asked for at the
        // version moefuse-candle locks, as a user matches the candle they already use.
        let workspace_lock = fs::read_to_string(checkout.join("Cargo.lock"))
            .map_err(|e| format!("the checkout's Cargo.lock: {e}"))?;
        let candle = match locked_versions(&workspace_lock, "candle-core").as_slice() {
            [one] => one.clone(),
            other => return Err(format!("the workspace locks candle-core {other:?}")),
        };
        let app = dir.join(which).join("app");
        fs::create_dir_all(app.join("src")).map_err(|e| e.to_string())?;
        fs::write(
            app.join("Cargo.toml"),
            format!(
                "[package]\nname = \"moefuse-candle-consumer\"\nversion = \"0.0.0\"\n\
                 edition = \"2021\"\npublish = false\n\n[dependencies]\n\
                 moefuse-candle = {{ path = {:?}, features = [\"cuda\"] }}\n\
                 candle-core = {{ version = \"={candle}\", features = [\"cuda\"] }}\n\n\
                 [workspace]\n",
                checkout.join("crates/candle").display().to_string()
            ),
        )
        .map_err(|e| e.to_string())?;
        fs::write(app.join("src/lib.rs"), CANDLE_CONSUMER_LIB).map_err(|e| e.to_string())?;
        fs::write(app.join("Cargo.lock"), &workspace_lock).map_err(|e| e.to_string())?;
        let cargo_in_app = || {
            let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            cmd.arg("build")
                .current_dir(&app)
                .env("CARGO_TARGET_DIR", &target)
                .env("CUDA_HOME", &tc.cuda_root)
                .env("CUDA_PATH", &tc.cuda_root)
                .env("PATH", &path)
                .env("CUDA_COMPUTE_CAP", &cap)
                .env("MOEFUSE_CUDA_ARCHS", short);
            cmd
        };
        let start = std::time::Instant::now();
        run_cmd(&mut cargo_in_app())?;
        let seconds = start.elapsed().as_secs_f64();
        // NOTES: the shared target folder holds one kernels build per checkout path, so the
        // record is found through cargo's own report of this build's OUT_DIR: a second
        // `cargo build`, which has nothing left to do, with JSON messages.
        let out = cargo_in_app()
            .args(["--quiet", "--message-format=json"])
            .output()
            .map_err(|e| format!("cargo build --message-format=json: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "candle-consumer: the repeated cargo build failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let out_dir = kernels_out_dir(&String::from_utf8_lossy(&out.stdout))?;
        let record = out_dir.join("kernel-units.txt");
        let log = fs::read_to_string(&record).map_err(|e| format!("{}: {e}", record.display()))?;
        let labels = unit_labels(&log);
        let of_arch = |l: &str| l.starts_with(&format!("{}/", arch.name()));
        let compiled: Vec<&str> = labels
            .iter()
            .filter(|(how, _)| *how == "compiled")
            .map(|(_, l)| *l)
            .collect();
        let gemm = labels.iter().filter(|(_, l)| of_arch(l)).count();
        let moe = labels.iter().filter(|(_, l)| l.starts_with("fat/")).count();
        let foreign: Vec<&str> = labels
            .iter()
            .filter(|(_, l)| l.starts_with("sm") && !of_arch(l))
            .map(|(_, l)| *l)
            .collect();
        let mut problems = Vec::new();
        if gemm == 0 {
            problems.push(format!("no {} GEMM unit was built", arch.name()));
        }
        if moe == 0 {
            problems.push("no MoE unit (fat/*) was built: moefuse-candle needs them".into());
        }
        if !foreign.is_empty() {
            problems.push(format!("units of another arch were built: {foreign:?}"));
        }
        let allowed = |l: &&str| i == 0 && l.starts_with("fat/");
        let unexpected: Vec<&str> = compiled.iter().copied().filter(|l| !allowed(l)).collect();
        if !unexpected.is_empty() {
            problems.push(format!(
                "the {which} checkout compiled {} units the cache should have supplied: \
                 {unexpected:?}",
                unexpected.len()
            ));
        }
        let app_lock = fs::read_to_string(app.join("Cargo.lock")).map_err(|e| e.to_string())?;
        for name in ["cudarc", "candle-core"] {
            let ours = locked_versions(&app_lock, name);
            let workspace = locked_versions(&workspace_lock, name);
            if ours.len() != 1 || ours != workspace {
                problems.push(format!(
                    "{name} resolved to {ours:?}, the workspace locks {workspace:?}"
                ));
            }
        }
        if !problems.is_empty() {
            return Err(format!(
                "candle-consumer check ({which} checkout, {}): {}",
                record.display(),
                problems.join("; ")
            ));
        }
        println!(
            "candle-consumer: {which} checkout built in {seconds:.0} s: {gemm} {} GEMM and {moe} \
             MoE units, {} compiled{}",
            arch.name(),
            compiled.len(),
            if compiled.is_empty() {
                String::new()
            } else {
                format!(" ({})", compiled.join(", "))
            }
        );
        summary.push((seconds, gemm, moe, compiled.len()));
    }
    let (first, second) = (summary[0], summary[1]);
    println!(
        "candle-consumer: a crate on moefuse-candle + candle-core (cuda) builds with plain cargo \
         build: {} {} GEMM + {} MoE units, no other arch; first checkout {:.0} s ({} MoE units \
         compiled), second checkout {:.0} s with no unit compiled",
        second.1,
        arch.name(),
        second.2,
        first.0,
        first.3,
        second.0
    );
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

/// The outside candle crate: compiled, never run (a library links nothing, so it needs none
/// of the CUDA libraries this machine lacks). It reaches candle's CUDA backend and moefuse's
/// op through the block's forward.
const CANDLE_CONSUMER_LIB: &str = r#"//! moefuse-candle's MoE block on candle's CUDA device.

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{DType, Device, Module, Tensor, Var};
use moefuse_candle::{qwen3_moe_config, FlatLayout, MoeBlock};
use std::sync::Arc;

/// Errors of this crate.
pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

const HIDDEN: usize = 256;

/// A small Qwen3-MoE block on `dev`: an f32 router and bf16 experts (what CUDA runs).
pub fn block_on(dev: &Device) -> Res<MoeBlock> {
    let cfg = qwen3_moe_config(HIDDEN, 128, 16, 4, true)?;
    let router = Var::randn(0f32, 0.1, (16, HIDDEN), dev)?;
    let experts = Tensor::randn(0f32, 0.05, FlatLayout::new(&cfg).len(), dev)?;
    let experts = Var::from_tensor(&experts.to_dtype(DType::BF16)?)?;
    Ok(MoeBlock::new(cfg, router, experts)?)
}

/// One forward of `tokens` rows on CUDA device `ordinal`: moefuse's fused layer on the
/// stream candle's device owns, which this returns beside the output.
pub fn forward_on_gpu(ordinal: usize, tokens: usize) -> Res<(Tensor, Arc<CudaStream>)> {
    let dev = Device::new_cuda(ordinal)?;
    let stream = dev.as_cuda_device()?.cuda_stream();
    let block = block_on(&dev)?;
    let x = Tensor::randn(0f32, 1.0, (tokens, HIDDEN), &dev)?.to_dtype(DType::BF16)?;
    Ok((block.forward(&x)?, stream))
}
"#;

/// Says so when the working tree has changes a clone of HEAD will not have.
fn note_uncommitted(check: &str) {
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .current_dir(root())
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    if dirty {
        println!(
            "{check}: note: uncommitted changes are not in the second checkout (it clones HEAD)"
        );
    }
}

/// `git clone` of this repository's HEAD into `dest` (a second checkout of this commit).
fn clone_head(dest: &Path) -> Result<()> {
    run_cmd(
        Command::new("git")
            .args(["clone", "--quiet", "--no-hardlinks"])
            .arg(root())
            .arg(dest),
    )
}

/// (`compiled` or `cached`, label) of each line of a `kernel-units.txt`.
fn unit_labels(log: &str) -> Vec<(&str, &str)> {
    log.lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            Some((words.next()?, words.next()?))
        })
        .collect()
}

/// The `OUT_DIR` of moefuse-kernels' build script in the JSON messages of a `cargo build`.
fn kernels_out_dir(messages: &str) -> Result<PathBuf> {
    let mut found = Vec::new();
    for line in messages.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "build-script-executed" {
            continue;
        }
        // `path+file:///…/crates/kernels#moefuse-kernels@0.1.0` (older cargo: `moefuse-kernels
        // 0.1.0 (path+file://…)`).
        let id = msg["package_id"].as_str().unwrap_or_default();
        let ours = id.starts_with("moefuse-kernels ")
            || id
                .rsplit_once('#')
                .is_some_and(|(_, n)| n.starts_with("moefuse-kernels@"));
        if let (true, Some(dir)) = (ours, msg["out_dir"].as_str()) {
            found.push(PathBuf::from(dir));
        }
    }
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err("cargo reported no build script run of moefuse-kernels".into()),
        many => Err(format!(
            "several moefuse-kernels build script runs: {many:?}"
        )),
    }
}

/// The versions of package `name` in a Cargo.lock.
fn locked_versions(lock: &str, name: &str) -> Vec<String> {
    let wanted = format!("name = \"{name}\"");
    lock.split("[[package]]")
        .filter(|block| block.lines().any(|l| l.trim() == wanted))
        .filter_map(|block| {
            block
                .lines()
                .find_map(|l| l.trim().strip_prefix("version = "))
                .map(|v| v.trim_matches('"').to_string())
        })
        .collect()
}

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
