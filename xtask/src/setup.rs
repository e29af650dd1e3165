//! `cargo xtask setup`: the hash-pinned toolchain from PyPI into a cache folder outside the
//! repo, with a progress bar for the download.
//!
//! The same wheels install without xtask by the one pip command in
//! `crates/kernel-build/toolchain/requirements-linux-x86_64.txt` (which build scripts
//! print when no toolchain is found); this task adds the progress bar, a stamp, and an
//! atomic swap of the folder.

use crate::Result;
use indicatif::{ProgressBar, ProgressStyle};
use moefuse_kernel_build::{requirements_path, toolchain_dir, PINNED_PLATFORM, PINS};
use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Installs the pins into [`toolchain_dir`] unless its stamp already names them (the pins
/// and the requirements file's hash). Downloads into a fresh sibling folder, installs from
/// there with pip offline, and renames it into place, because a second
/// `pip install --target` into an existing folder silently keeps the old files.
pub fn run(force: bool) -> Result<()> {
    let dir = toolchain_dir();
    let stamp = dir.join("moefuse-pins.stamp");
    let want = PINS.install_stamp();
    if !force && fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        println!("toolchain up to date at {}", dir.display());
        return Ok(());
    }
    if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        return Err(format!(
            "the pinned toolchain's wheels are for {PINNED_PLATFORM} only: install CUDA 12.8 or \
             newer and CUTLASS 4.2, and set CUDA_HOME and CUTLASS_DIR"
        ));
    }
    if std::env::var_os("CUDA_HOME").is_some() && std::env::var_os("CUTLASS_DIR").is_some() {
        println!("CUDA_HOME and CUTLASS_DIR are set: they win over the cache; installing the cache anyway");
    }
    let start = Instant::now();
    let staging = dir.with_extension("installing");
    let _ = fs::remove_dir_all(&staging);
    let (wheels, tmp, site) = (
        staging.join("wheels"),
        staging.join("tmp"),
        staging.join("ext"),
    );
    for d in [&wheels, &tmp] {
        fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let reqs = requirements_path();
    println!(
        "installing the pinned toolchain into {} ({PINNED_PLATFORM} wheels, each checked by sha256)",
        dir.display()
    );
    download(reqs, &wheels, &tmp)?;
    install(reqs, &wheels, &site, &tmp)?;
    fs::remove_dir_all(&wheels).map_err(|e| format!("{}: {e}", wheels.display()))?;
    fs::remove_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    fs::write(staging.join("moefuse-pins.stamp"), &want).map_err(|e| e.to_string())?;
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

fn pip() -> Command {
    let mut c = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()));
    c.args(["-m", "pip", "--disable-pip-version-check", "--no-input"]);
    c
}

/// `pip download` of every pinned wheel into `dest`, with a byte progress bar: pip writes
/// each wheel under `TMPDIR` (here `tmp`) while it downloads, then copies it to `dest`.
fn download(reqs: &Path, dest: &Path, tmp: &Path) -> Result<()> {
    let expected: HashMap<&str, u64> = PINS.wheels().into_iter().collect();
    let total: u64 = expected.values().sum();
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} download [{elapsed_precise}] {bar:30} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {wide_msg}",
        )
        .expect("static template"),
    );
    let mut cmd = pip();
    cmd.args([
        "download",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--progress-bar=off",
        "--dest",
    ])
    .arg(dest)
    .arg("-r")
    .arg(reqs)
    .env("TMPDIR", tmp);
    let done = AtomicBool::new(false);
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                bar.set_position(downloaded(&[dest, tmp], &expected).min(total));
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let r = stream(cmd, &bar, "Downloading");
        done.store(true, Ordering::Relaxed);
        r
    });
    bar.finish_and_clear();
    result?;
    println!(
        "downloaded {} wheels, {:.0} MB",
        expected.len(),
        total as f64 / 1e6
    );
    Ok(())
}

/// Bytes of the expected wheels present under `dirs` (each wheel counted once, at its
/// largest copy).
fn downloaded(dirs: &[&Path], expected: &HashMap<&str, u64>) -> u64 {
    let mut sizes: HashMap<String, u64> = HashMap::new();
    let mut stack: Vec<PathBuf> = dirs.iter().map(|d| d.to_path_buf()).collect();
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                stack.push(path);
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            if expected.contains_key(name.as_str()) {
                let size = sizes.entry(name).or_insert(0);
                *size = (*size).max(meta.len());
            }
        }
    }
    sizes.values().sum()
}

/// `pip install` from the downloaded wheels only (`--no-index`), hashes checked again.
fn install(reqs: &Path, wheels: &Path, site: &Path, tmp: &Path) -> Result<()> {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} install [{elapsed_precise}] {wide_msg}")
            .expect("static template"),
    );
    bar.set_message("unpacking the wheels");
    bar.enable_steady_tick(Duration::from_millis(200));
    let mut cmd = pip();
    cmd.args([
        "install",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "--no-index",
        "--no-cache-dir",
        "--root-user-action=ignore",
        "--progress-bar=off",
        "--find-links",
    ])
    .arg(wheels)
    .arg("--target")
    .arg(site)
    .arg("-r")
    .arg(reqs)
    .env("TMPDIR", tmp);
    let result = stream(cmd, &bar, "Processing");
    bar.finish_and_clear();
    result
}

/// Runs pip, showing the lines that start with `show` as the bar's message (or printing
/// them when the bar is hidden, as in CI logs); on failure returns pip's output.
fn stream(mut cmd: Command, bar: &ProgressBar, show: &str) -> Result<()> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    let stderr = child.stderr.take().expect("piped");
    let err_reader = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let mut log = String::new();
    for line in BufReader::new(child.stdout.take().expect("piped"))
        .lines()
        .map_while(|l| l.ok())
    {
        let trimmed = line.trim();
        if trimmed.starts_with(show) {
            // `Processing /long/path/x.whl (from -r ...)`: the wheel's name is enough.
            let trimmed = match trimmed.split_once(" (from") {
                Some((head, _)) => head.rsplit_once('/').map_or(head, |(_, name)| name),
                None => trimmed,
            };
            if bar.is_hidden() {
                println!("  {trimmed}");
            } else {
                bar.set_message(trimmed.to_string());
            }
        }
        log.push_str(&line);
        log.push('\n');
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let err = err_reader.join().unwrap_or_default();
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {status}:\n{log}{err}"))
    }
}
