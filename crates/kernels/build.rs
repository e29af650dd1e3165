//! Compiles `cuda/` (which travels inside this crate) for the targets the environment
//! chooses (`MOEFUSE_CUDA_ARCHS`, else `CUDA_COMPUTE_CAP`, else `90a,100a`; `none` and
//! `DOCS_RS` build no kernels) and the kernel families the cargo features ask for (`gemm`:
//! the GEMM variants, `moe`: the MoE layer's kernels), with the same library and cache as
//! `cargo xtask build-kernels`. It archives them, links them with the static CUDA runtime,
//! and writes `registry.rs`, the launchers of the compiled variants. No GPU probing, no
//! network; it writes only into `OUT_DIR` and the kernel cache.
//!
//! Links metadata for dependents' build scripts: `DEP_MOEFUSE_KERNELS_INCLUDE` (the C ABI
//! headers) and `DEP_MOEFUSE_KERNELS_CUDA` (the kernel tree).

use moefuse_kernel_build::{
    archive, archs_from_env, compile_all, default_jobs, units_for, write_unit_log, Cache,
    KernelFamilies, Toolchain, ARCH_ENV,
};
use moefuse_spec::{VariantSpec, VARIANTS};
use std::path::{Path, PathBuf};
use std::{env, fmt::Write as _, fs};

fn main() {
    if let Err(msg) = run() {
        eprintln!("\nmoefuse-kernels: {msg}\n");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let kernels = manifest
        .join("cuda")
        .canonicalize()
        .map_err(|e| format!("cuda/: {e}"))?;
    let mut vars = vec![
        "MOEFUSE_KERNEL_CACHE",
        "MOEFUSE_ALLOW_SPILLS",
        "MOEFUSE_JOBS",
    ];
    vars.extend(ARCH_ENV);
    moefuse_kernel_build::cargo_rerun_if_changed(&kernels, &vars).map_err(|e| e.to_string())?;
    println!(
        "cargo::metadata=include={}",
        kernels.join("include").display()
    );
    println!("cargo::metadata=cuda={}", kernels.display());

    let families = KernelFamilies {
        gemm: env::var_os("CARGO_FEATURE_GEMM").is_some(),
        moe: env::var_os("CARGO_FEATURE_MOE").is_some(),
    };
    let selection = archs_from_env().map_err(|e| e.to_string())?;
    let archs = if families.any() {
        selection.archs.clone()
    } else {
        Vec::new()
    };
    let built: Vec<&VariantSpec> = VARIANTS
        .iter()
        .filter(|v| families.gemm && archs.contains(&v.arch))
        .collect();
    for v in &built {
        check_instance(&kernels, v)?;
    }
    let names: Vec<&str> = archs.iter().map(|a| a.name()).collect();
    println!("cargo:rustc-env=MOEFUSE_BUILT_ARCHS={}", names.join(","));
    fs::write(out.join("registry.rs"), registry(&built)).map_err(|e| e.to_string())?;
    println!("cargo:rustc-check-cfg=cfg(moefuse_kernels_linked)");
    println!("cargo:rustc-check-cfg=cfg(moefuse_moe_linked)");
    let log = out.join("kernel-units.txt");
    if archs.is_empty() {
        // Nothing compiled: an empty record, so a check never reads a stale one.
        fs::write(&log, "").map_err(|e| format!("{}: {e}", log.display()))?;
        return Ok(());
    }
    println!("cargo:rustc-cfg=moefuse_kernels_linked");
    if families.moe {
        println!("cargo:rustc-cfg=moefuse_moe_linked");
    }

    let tc = Toolchain::discover().map_err(|e| e.to_string())?;
    tc.check_archs(&archs).map_err(|e| e.to_string())?;
    let jobs = env::var("MOEFUSE_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or_else(default_jobs);
    let cache = Cache::default_dir().map_err(|e| e.to_string())?;
    let units = units_for(&kernels, &archs, families).map_err(|e| e.to_string())?;
    let objects =
        compile_all(&tc, &kernels, &units, jobs, &cache, |_| {}).map_err(|e| e.to_string())?;
    let (compiled, cached) = write_unit_log(&objects, &log).map_err(|e| e.to_string())?;
    if compiled > 0 {
        // Shown for path dependencies (cargo hides registry crates' warnings): says why the
        // build took minutes, and that the next one will not.
        println!(
            "cargo:warning=moefuse-kernels: compiled {compiled} CUDA units for {} ({}; {cached} \
             more from the kernel cache); later builds reuse them",
            names.join(","),
            selection.reason,
        );
    }
    archive(&objects, &out.join("libmoefuse_kernels.a")).map_err(|e| e.to_string())?;

    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=moefuse_kernels");
    println!(
        "cargo:rustc-link-search=native={}",
        tc.cuda_lib_dir().display()
    );
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    Ok(())
}

/// The committed instance file must be exactly what the table generates.
fn check_instance(kernels: &Path, v: &VariantSpec) -> Result<(), String> {
    let path = kernels
        .join("instances")
        .join(v.arch.name())
        .join(format!("{}.cu", v.name()));
    match fs::read_to_string(&path) {
        Ok(text) if text == v.instance_source() => Ok(()),
        _ => Err(format!(
            "{} is missing or differs from moefuse-spec's variant table (crates/spec/src/variants.rs): run `cargo xtask gen-variants`",
            path.display()
        )),
    }
}

fn registry(built: &[&VariantSpec]) -> String {
    let mut s = String::from("// generated by crates/kernels/build.rs\n");
    if !built.is_empty() {
        s.push_str("extern \"C\" {\n");
        for v in built {
            let n = v.name();
            let args = if v.op.is_grouped() {
                "MoefuseGroupedGemmArgs"
            } else {
                "MoefuseGemmArgs"
            };
            let _ = writeln!(s, "    fn moefuse_{n}(args: *const {args}, workspace: *mut c_void, workspace_bytes: usize, stream: *mut c_void) -> MoefuseStatus;");
            let _ = writeln!(
                s,
                "    fn moefuse_{n}_workspace(args: *const {args}) -> usize;"
            );
        }
        s.push_str("}\n");
    }
    s.push_str("pub(crate) static COMPILED: &[CompiledVariant] = &[\n");
    for v in built {
        let index = VARIANTS
            .iter()
            .position(|x| x == *v)
            .expect("variant from the table");
        let n = v.name();
        let entry = if v.op.is_grouped() { "Grouped" } else { "Gemm" };
        let _ = writeln!(s, "    CompiledVariant {{ spec: &VARIANTS[{index}], entry: Entry::{entry} {{ run: moefuse_{n}, workspace: moefuse_{n}_workspace }} }},");
    }
    s.push_str("];\n");
    s
}
