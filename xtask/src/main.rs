//! `cargo xtask <task>`: every slow, networked or generating step of moefuse.
//!
//! | task | what it does |
//! |---|---|
//! | `setup` | installs the pinned CUDA toolchain, CUTLASS and NVSHMEM (PyPI wheels) |
//! | `gen-variants [--check]` | writes `kernels/instances/*/*.cu` from the variant table |
//! | `build-kernels --sm 90a,100a` | compiles the kernels (parallel, cached, progress bars) |
//! | `inspect` | checks the built objects hold sm_90a/sm_100a SASS with HGMMA/UTCHMMA |
//! | `test` | setup, gen-variants --check, bindgen --check, build-kernels, inspect, `cargo test --workspace` |
//! | `demo` | setup, build, run the GEMM demo (GPU if present, CPU reference otherwise) |
//! | `device-pack` | builds GPU test and bench binaries into `.device-pack/` for the H200 |
//! | `bench-report` | renders `docs/benchmarks.md` tables from `benches/results/*.jsonl` |
//! | `bindgen [--check] [--install]` | regenerates the NVSHMEM host bindings of `nvshmem-sys` |

mod bench_report;
mod bindgen;
mod build;
mod device_pack;
mod launch;
mod setup;
mod variants;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::{Command, ExitCode};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "moefuse developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the pinned toolchain (idempotent; a pin change reinstalls).
    Setup {
        /// Reinstall even if the stamp matches.
        #[arg(long)]
        force: bool,
    },
    /// Write the kernel instance files from crates/kernels/src/variant_table.rs.
    GenVariants {
        /// Fail if a file would change instead of writing it.
        #[arg(long)]
        check: bool,
    },
    /// Compile the kernels for the given SM targets.
    BuildKernels {
        /// Comma list of targets.
        #[arg(long, default_value = "90a,100a")]
        sm: String,
        /// Parallel nvcc jobs (default: cores, capped by memory).
        #[arg(long)]
        jobs: Option<usize>,
    },
    /// Check the built objects: sm_90a/sm_100a ELF, HGMMA/UTCHMMA in SASS.
    Inspect {
        /// Comma list of targets.
        #[arg(long, default_value = "90a,100a")]
        sm: String,
    },
    /// Everything CI runs: setup, build, checks, workspace tests.
    Test {
        /// Extra arguments for `cargo test`.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Run the MoE-layer example (Qwen3-30B-A3B-sized, on the GPU when present, else the
    /// CPU reference of a small layer).
    Demo {
        /// Arguments for the demo binary.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Build the GPU test and benchmark binaries into .device-pack/ with a run.sh.
    DevicePack {
        /// Targets to compile (a Hopper-only pack builds faster; the arch-mismatch test
        /// then reports that no foreign variant was compiled).
        #[arg(long, default_value = "90a,100a")]
        sm: String,
        /// Only the tests and programs whose name contains one of these (comma list): the
        /// carry limit counts the pack and the working tree, and every binary links the
        /// kernel library (~5.6 MiB), so a full pack no longer fits.
        #[arg(long, default_value = "")]
        only: String,
    },
    /// Render docs/benchmarks.md from benches/results/*.jsonl.
    BenchReport,
    /// Regenerate crates/nvshmem-sys/src/bindings.rs from the pinned NVSHMEM headers.
    Bindgen {
        /// Fail if the checked-in file differs (SKIPPED without a bindgen CLI).
        #[arg(long)]
        check: bool,
        /// Install libclang-dev and bindgen-cli first.
        #[arg(long)]
        install: bool,
    },
    /// Run N processes of a program as one job (ranks, rendezvous for the NVSHMEM unique id).
    Launch(launch::LaunchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Setup { force } => setup::run(force),
        Task::GenVariants { check } => variants::run(check),
        Task::BuildKernels { sm, jobs } => build::build_kernels(&sm, jobs).map(|_| ()),
        Task::Inspect { sm } => build::inspect(&sm),
        Task::Test { args } => test(&args),
        Task::Demo { args } => demo(&args),
        Task::DevicePack { sm, only } => device_pack::run(&sm, &only),
        Task::BenchReport => bench_report::run(),
        Task::Bindgen { check, install } => bindgen::run(check, install),
        Task::Launch(args) => launch::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Errors are sentences for a person at a terminal.
pub type Result<T> = std::result::Result<T, String>;

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_path_buf()
}

/// Runs `cmd`, failing with its name when it does not exit 0.
pub fn run_cmd(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {status}"))
    }
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

fn test(args: &[String]) -> Result<()> {
    setup::run(false)?;
    variants::run(true)?;
    bindgen::run(true, false)?;
    build::build_kernels("90a,100a", None)?;
    build::inspect("90a,100a")?;
    run_cmd(
        cargo()
            .args(["test", "--workspace"])
            .args(args)
            .env("MOEFUSE_CUDA_ARCHS", "90a,100a"),
    )
}

fn demo(args: &[String]) -> Result<()> {
    setup::run(false)?;
    build::build_kernels("90a,100a", None)?;
    run_cmd(
        cargo()
            .args([
                "run",
                "--release",
                "--quiet",
                "-p",
                "moefuse",
                "--example",
                "qwen3_moe",
                "--",
            ])
            .args(args)
            .env("MOEFUSE_CUDA_ARCHS", "90a,100a"),
    )
}
