//! `cargo xtask build-kernels` and `cargo xtask inspect`.

use crate::{root, Result};
use indicatif::{ProgressBar, ProgressStyle};
use moefuse_kernel_build::{
    compile_all, default_jobs, nvshmem_modules, parse_archs, units_for, Arch, Cache, Event,
    KernelFamilies, Object, Toolchain, UnitKind,
};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

/// Compiles every kernel (GEMM, MoE, NVSHMEM modules) for `sm` with a progress bar;
/// unchanged units come from the cache.
pub fn build_kernels(sm: &str, jobs: Option<usize>) -> Result<Vec<Object>> {
    let archs = parse_archs(sm).map_err(|e| e.to_string())?;
    build(&archs, KernelFamilies::ALL, true, jobs)
}

/// Compiles `families` (and the NVSHMEM modules when `comm`) for `archs`: a bar with units
/// done/total, the units nvcc is on, and an estimate of the time left from the units
/// compiled so far.
pub fn build(
    archs: &[Arch],
    families: KernelFamilies,
    comm: bool,
    jobs: Option<usize>,
) -> Result<Vec<Object>> {
    let tc = Toolchain::discover().map_err(|e| e.to_string())?;
    tc.check_archs(archs).map_err(|e| e.to_string())?;
    let kernels = root().join("crates/kernels/cuda");
    let mut units = units_for(&kernels, archs, families).map_err(|e| e.to_string())?;
    if comm {
        units.extend(
            nvshmem_modules(&root().join("crates/comm/cuda"), archs).map_err(|e| e.to_string())?,
        );
    }
    let jobs = jobs.unwrap_or_else(default_jobs);
    let cache = Cache::default_dir().map_err(|e| e.to_string())?;
    let names: Vec<&str> = archs.iter().map(|a| a.name()).collect();
    println!(
        "build-kernels: {} units for {} with {jobs} jobs ({}; {})",
        units.len(),
        names.join(","),
        tc.nvcc_version,
        tc.found.join(", ")
    );
    let bar = ProgressBar::new(units.len() as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} kernels [{elapsed_precise}] {bar:30} {pos}/{len} units {wide_msg}",
        )
        .expect("static template"),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    struct State {
        running: Vec<String>,
        compiled_secs: Vec<f64>,
        finished: usize,
    }
    let state = Mutex::new(State {
        running: Vec::new(),
        compiled_secs: Vec::new(),
        finished: 0,
    });
    let total = units.len();
    let objects = compile_all(&tc, &kernels, &units, jobs, &cache, |event| {
        let mut st = state.lock().expect("progress lock");
        match event {
            Event::Started(unit) => st.running.push(unit.label()),
            Event::Finished(obj) => {
                st.running.retain(|l| *l != obj.unit.label());
                st.finished += 1;
                let how = if obj.cached {
                    "cached".to_string()
                } else {
                    st.compiled_secs.push(obj.seconds);
                    format!("{:.1} s", obj.seconds)
                };
                let line = format!("  {:<70} {how}", obj.unit.label());
                if bar.is_hidden() {
                    println!("{line}");
                } else {
                    bar.println(line);
                }
                bar.inc(1);
            }
        }
        let eta = eta(&st.compiled_secs, total - st.finished, jobs);
        bar.set_message(format!("{eta} {}", st.running.join(", ")));
    })
    .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    let compiled = objects.iter().filter(|o| !o.cached).count();
    println!(
        "build-kernels: {compiled} compiled, {} from cache",
        objects.len() - compiled
    );
    Ok(objects)
}

/// `ETA ~3m10s` from the mean nvcc time of the units compiled so far, for the units left
/// (some of which may still come from the cache: an upper estimate), `jobs` at a time.
fn eta(compiled_secs: &[f64], left: usize, jobs: usize) -> String {
    if compiled_secs.is_empty() || left == 0 {
        return String::new();
    }
    let mean = compiled_secs.iter().sum::<f64>() / compiled_secs.len() as f64;
    let secs = (mean * left as f64 / jobs.max(1) as f64).round() as u64;
    format!("ETA ≤{}m{:02}s", secs / 60, secs % 60)
}

/// The fat MoE objects that hold tensor-core GEMM kernels, and the archs whose image must
/// carry that arch's tensor-core SASS (the other archs' images hold a trap the launcher's
/// capability check keeps from running: their twins are not written yet).
const FAT_TENSOR_CORE: &[(&str, &[Arch])] = &[
    ("gate_up_fused", &[Arch::Sm90a, Arch::Sm100a]),
    ("down_dgrad_fused", &[Arch::Sm90a, Arch::Sm100a]),
    ("down_scatter", &[Arch::Sm90a, Arch::Sm100a]),
];

/// The tensor-core SASS instructions of `arch`.
fn tensor_core_ops(arch: Arch) -> (&'static str, &'static [&'static str]) {
    match arch {
        Arch::Sm90a => ("sm_90a", &["HGMMA"]),
        Arch::Sm100a => ("sm_100a", &["UTCHMMA", "UTCQMMA"]),
    }
}

/// The SASS of one arch's ELF in a `cuobjdump --dump-sass` listing of a fat object.
fn sass_of_arch<'a>(sass: &'a str, elf: &str) -> &'a str {
    let marker = format!("arch = {elf}\n");
    let Some(start) = sass.find(&marker) else {
        return "";
    };
    let rest = &sass[start + marker.len()..];
    rest.find("arch = sm_").map_or(rest, |end| &rest[..end])
}

/// Checks every kernel object: an arch's object carries that arch's ELF and its SASS has the
/// tensor-core instruction of that arch (HGMMA on sm_90a, UTCHMMA/UTCQMMA on sm_100a); a fat
/// object (built for every selected arch) carries every selected arch's ELF and SASS, and
/// those in `FAT_TENSOR_CORE` their GEMM kernels' tensor-core SASS in each listed arch's image.
pub fn inspect(sm: &str) -> Result<()> {
    let objects = build_kernels(sm, None)?;
    let archs = parse_archs(sm).map_err(|e| e.to_string())?;
    let tc = Toolchain::discover().map_err(|e| e.to_string())?;
    let mut failures = Vec::new();
    // Fat units (the MoE data-movement, router, activation and decode kernels, built for every
    // selected arch): each arch's ELF must be in the object, with SASS for its functions.
    for obj in objects
        .iter()
        .filter(|o| o.unit.kind == UnitKind::FatObject)
    {
        let list = cuobjdump(&tc, "--list-elf", obj)?;
        let sass = cuobjdump(&tc, "--dump-sass", obj)?;
        let functions = sass.matches("Function : ").count();
        let missing: Vec<&str> = archs
            .iter()
            .map(|a| match a {
                Arch::Sm90a => "sm_90a",
                Arch::Sm100a => "sm_100a",
            })
            .filter(|elf| !list.contains(elf))
            .collect();
        println!(
            "  {:<70} fat: {} ELF(s), {functions} functions{}",
            obj.unit.label(),
            archs.len() - missing.len(),
            if missing.is_empty() {
                String::new()
            } else {
                format!(", missing {}", missing.join(", "))
            }
        );
        if !missing.is_empty() || functions == 0 {
            failures.push(obj.unit.label());
        }
        let stem = obj
            .unit
            .source
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy();
        if let Some((_, twins)) = FAT_TENSOR_CORE.iter().find(|(name, _)| *name == stem) {
            for &arch in archs.iter() {
                let (elf, mma) = tensor_core_ops(arch);
                let count: usize = mma
                    .iter()
                    .map(|m| sass_of_arch(&sass, elf).matches(m).count())
                    .sum();
                let required = twins.contains(&arch);
                println!(
                    "  {:<70} {elf} {}: {count}{}",
                    "",
                    mma.join("/"),
                    if required {
                        ""
                    } else {
                        " (no twin for this arch yet)"
                    }
                );
                if required && count == 0 {
                    failures.push(format!("{} ({elf} tensor-core SASS)", obj.unit.label()));
                }
            }
        }
    }
    for obj in objects.iter().filter(|o| o.unit.arch.is_some()) {
        let arch = obj.unit.arch.expect("filtered");
        let (elf, mma) = tensor_core_ops(arch);
        let list = cuobjdump(&tc, "--list-elf", obj)?;
        if obj.unit.kind == UnitKind::NvshmemModule {
            // Communication kernels: no tensor cores to look for, only the arch's ELF.
            println!(
                "  {:<70} {elf}: {} (NVSHMEM module)",
                obj.unit.label(),
                list.contains(elf)
            );
            if !list.contains(elf) {
                failures.push(obj.unit.label());
            }
            continue;
        }
        let sass = cuobjdump(&tc, "--dump-sass", obj)?;
        let count: usize = mma.iter().map(|m| sass.matches(m).count()).sum();
        let ok = list.contains(elf) && count > 0;
        println!(
            "  {:<70} {elf}: {} {}: {count}",
            obj.unit.label(),
            list.contains(elf),
            mma.join("/")
        );
        if !ok {
            failures.push(obj.unit.label());
        }
    }
    if failures.is_empty() {
        println!(
            "inspect: every kernel object has its arch's ELF and tensor-core SASS, every fat \
             object each selected arch's ELF"
        );
        Ok(())
    } else {
        Err(format!("inspect failed for: {}", failures.join(", ")))
    }
}

fn cuobjdump(tc: &Toolchain, flag: &str, obj: &Object) -> Result<String> {
    let out = Command::new(tc.cuobjdump())
        .arg(flag)
        .arg(&obj.path)
        .output()
        .map_err(|e| format!("{}: {e}", tc.cuobjdump().display()))?;
    if !out.status.success() {
        return Err(format!(
            "cuobjdump {flag} {}: {}",
            obj.path.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_arch_of_a_fat_listing() {
        let sass = "Fatbin elf code:\narch = sm_90a\n  HGMMA.64x256x16\nFatbin elf code:\narch = sm_100a\n  UTCHMMA\n  TRAP\n";
        assert!(sass_of_arch(sass, "sm_90a").contains("HGMMA"));
        assert!(!sass_of_arch(sass, "sm_90a").contains("UTCHMMA"));
        assert!(sass_of_arch(sass, "sm_100a").contains("UTCHMMA"));
        assert!(!sass_of_arch(sass, "sm_100a").contains("HGMMA"));
        assert_eq!(sass_of_arch(sass, "sm_120a"), "");
    }
}
