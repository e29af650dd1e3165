//! `cargo xtask <task>`: every slow, networked or generating step of moefuse.
//!
//! | task | what it does |
//! |---|---|
//! | `setup` | installs the pinned CUDA toolchain, CUTLASS and NVSHMEM (PyPI wheels) |
//! | `gen-variants [--check]` | writes `kernels/instances/*/*.cu` from the variant table |
//! | `gen-spec [--check]` | writes `kernels/include/moefuse/spec.h` from `crates/spec` |
//! | `build-kernels --sm 90a,100a` | compiles the kernels (parallel, cached, progress bars) |
//! | `inspect` | checks the built objects hold sm_90a/sm_100a SASS with HGMMA/UTCHMMA |
//! | `test` | setup, gen-variants --check, gen-spec --check, bindgen --check, build-kernels, inspect, `cargo test --workspace`, check-consumer |
//! | `check-consumer` | `cargo package --list`, `DOCS_RS` docs without a toolchain, an outside crate on a second checkout (grouped-gemm; moefuse-candle with candle's `cuda`) |
//! | `demo` | the MoE-layer example: this GPU's arch only, or (no GPU) the CPU reference without kernels |
//! | `device-pack` | builds GPU test and bench binaries into `.device-pack/` for the H200 |
//! | `candle-pack` | builds `moefuse-candle`'s GPU test and example (`--features cuda`) into `.device-pack-candle/` |
//! | `bench-report` | renders `docs/benchmarks.md` tables from `benches/results/*.jsonl` |
//! | `bindgen [--check] [--install]` | regenerates the NVSHMEM host bindings of `nvshmem-sys` |

mod bench_report;
mod bindgen;
mod build;
mod candle_pack;
mod consumer;
mod device_pack;
mod gen_spec;
mod launch;
mod setup;
mod variants;

use clap::{Parser, Subcommand};
use moefuse_kernel_build::{parse_archs, Arch, KernelFamilies};
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
    /// Write the kernel instance files from the variant table (crates/spec/src/variants.rs).
    GenVariants {
        /// Fail if a file would change instead of writing it.
        #[arg(long)]
        check: bool,
    },
    /// Write crates/kernels/cuda/include/moefuse/spec.h (limits, grouped kinds, tile-order
    /// fields) from crates/spec.
    GenSpec {
        /// Fail if the file would change instead of writing it.
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
    /// Check moefuse as an ordinary dependency: packages carry their CUDA sources, docs
    /// build with DOCS_RS and no toolchain, a crate outside the workspace on a second
    /// checkout builds with plain `cargo build`, compiling no kernel and no MoE unit, and so
    /// does a library crate on moefuse-candle and candle-core (feature `cuda`, GEMM and MoE
    /// units of the one target).
    CheckConsumer {
        /// The one target the outside crates build (its GEMM units must be in the cache).
        #[arg(long, default_value = "90a")]
        sm: String,
        /// Only these checks (comma list of `package`, `docs-rs`, `consumer`,
        /// `candle-consumer`).
        #[arg(long, default_value = "package,docs-rs,consumer,candle-consumer")]
        only: String,
    },
    /// Run the MoE-layer example (Qwen3-30B-A3B-sized) on this machine's GPU, building only
    /// its arch; without a GPU, the CPU reference of a small layer, compiling no kernel.
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
    /// Build moefuse-candle's GPU test and example (--features cuda, linked against
    /// generated stubs of the CUDA libraries this machine lacks) into .device-pack-candle/.
    CandlePack,
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
        Task::GenSpec { check } => gen_spec::run(check),
        Task::BuildKernels { sm, jobs } => build::build_kernels(&sm, jobs).map(|_| ()),
        Task::Inspect { sm } => build::inspect(&sm),
        Task::Test { args } => test(&args),
        Task::CheckConsumer { sm, only } => one_arch(&sm).and_then(|arch| {
            let only: Vec<&str> = only.split(',').map(str::trim).collect();
            consumer::run_only(arch, &only)
        }),
        Task::Demo { args } => demo(&args),
        Task::DevicePack { sm, only } => device_pack::run(&sm, &only),
        Task::CandlePack => candle_pack::run(),
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
    gen_spec::run(true)?;
    bindgen::run(true, false)?;
    build::build_kernels("90a,100a", None)?;
    build::inspect("90a,100a")?;
    run_cmd(
        cargo()
            .args(["test", "--workspace"])
            .args(args)
            .env("MOEFUSE_CUDA_ARCHS", "90a,100a"),
    )?;
    // sm_90a only: its units are in the cache from build-kernels above, so the outside
    // crates compile none (CI has 2 cores; a second full build would not fit); the candle
    // crate's first checkout may compile the sm_90a-only MoE objects (consumer.rs says why).
    consumer::run(Arch::Sm90a)
}

fn one_arch(sm: &str) -> Result<Arch> {
    match parse_archs(sm).map_err(|e| e.to_string())?.as_slice() {
        [arch] => Ok(*arch),
        _ => Err(format!("--sm takes one target (90a or 100a), not `{sm}`")),
    }
}

/// What `nvidia-smi` says about GPU 0: its name and compute capability.
fn probe_gpu() -> std::result::Result<(String, u32, u32), String> {
    let has_device = std::fs::read_dir("/dev")
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("nvidia"))
        })
        .unwrap_or(false);
    if !has_device {
        return Err("no /dev/nvidia* device".into());
    }
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=name,compute_cap", "--format=csv,noheader"])
        .output()
        .map_err(|e| format!("nvidia-smi could not run ({e})"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().next().unwrap_or("").trim();
    if !out.status.success() || line.is_empty() {
        return Err(format!(
            "nvidia-smi found no GPU ({})",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let (name, cap) = line
        .rsplit_once(',')
        .ok_or_else(|| format!("unexpected nvidia-smi output `{line}`"))?;
    let (major, minor) = cap
        .trim()
        .split_once('.')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .ok_or_else(|| format!("unexpected compute capability `{cap}`"))?;
    Ok((name.trim().to_string(), major, minor))
}

fn demo(args: &[String]) -> Result<()> {
    let example = ["-p", "moefuse", "--example", "qwen3_moe", "--"];
    let supported = |(name, major, minor): (String, u32, u32)| {
        Arch::from_capability(major, minor)
            .map(|arch| (name.clone(), arch))
            .ok_or_else(|| {
                format!(
                    "{name} has compute capability {major}.{minor}; moefuse's kernels need 9.0 \
                     (Hopper) or 10.0 (Blackwell)"
                )
            })
    };
    let gpu = probe_gpu().and_then(supported);
    let (name, arch) = match gpu {
        Ok(found) => found,
        Err(why) => {
            println!(
                "demo: no GPU to run on here ({why}): running the CPU reference of a small MoE \
                 layer instead, without compiling any CUDA kernel"
            );
            // The dev profile: the small CPU layer runs in a blink, and a debug build of the
            // dependencies is much quicker than a release one.
            run_cmd(
                cargo()
                    .arg("run")
                    .args(example)
                    .args(args)
                    .env("MOEFUSE_CUDA_ARCHS", "none"),
            )?;
            println!(
                "\nnext: on a machine with an H100/H200 or a B200, `cargo xtask demo` builds that \
                 GPU's kernels and runs this layer there; `cargo xtask test` runs the tests here \
                 (GPU tests report SKIPPED); to call moefuse from your crate, see README.md, \
                 \"Using the MoE layer from Rust\"."
            );
            return Ok(());
        }
    };
    println!(
        "demo: {name} ({}): building the {} kernels the demo runs, nothing else",
        arch.info().family,
        arch.name()
    );
    setup::run(false)?;
    build::build(&[arch], KernelFamilies::ALL, false, None)?;
    run_cmd(
        cargo()
            .args(["run", "--release"])
            .args(example)
            .args(args)
            .env("MOEFUSE_CUDA_ARCHS", arch.info().short),
    )?;
    println!(
        "\nnext: `cargo xtask test` runs every test on this GPU; to call moefuse from your crate \
         (depend on `moefuse`, build with MOEFUSE_CUDA_ARCHS={}), see README.md, \"Using the MoE \
         layer from Rust\"; the example's source is crates/moe/examples/qwen3_moe.rs.",
        arch.info().short
    );
    Ok(())
}
