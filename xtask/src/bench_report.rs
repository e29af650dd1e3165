//! `cargo xtask bench-report`: renders each `benches/results/<suite>.jsonl` into the
//! table between `<!-- bench:<suite> -->` and `<!-- /bench:<suite> -->` in
//! docs/benchmarks.md. Rows are grouped by case; every backend of a case sits side by side.

use crate::{root, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;

#[derive(Deserialize, Clone)]
struct Row {
    case: String,
    backend: String,
    gpu: String,
    median_us: f64,
    iqr_us: f64,
    tflops: Option<f64>,
    gbps: Option<f64>,
    rel_err: Option<f64>,
    date: String,
    commit: String,
}

/// Rewrites the marked tables of docs/benchmarks.md from the committed JSON lines.
pub fn run() -> Result<()> {
    let doc_path = root().join("docs/benchmarks.md");
    let mut doc =
        fs::read_to_string(&doc_path).map_err(|e| format!("{}: {e}", doc_path.display()))?;
    let dir = root().join("benches/results");
    let mut entries: Vec<_> = fs::read_dir(&dir)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "jsonl") {
            continue;
        }
        let suite = path
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let text = fs::read_to_string(&path).map_err(|e| e.to_string())?;
        let rows: Vec<Row> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).map_err(|e| format!("{}: {e}: {l}", path.display())))
            .collect::<Result<_>>()?;
        let (open, close) = (
            format!("<!-- bench:{suite} -->"),
            format!("<!-- /bench:{suite} -->"),
        );
        let (Some(a), Some(b)) = (doc.find(&open), doc.find(&close)) else {
            println!("bench-report: no markers for suite {suite} in docs/benchmarks.md; skipped");
            continue;
        };
        let mut table = String::new();
        let groups = by_gpu(&rows);
        for (gpu, rows) in &groups {
            if groups.len() > 1 {
                let _ = writeln!(
                    table,
                    "{}**{gpu}**\n",
                    if table.is_empty() { "" } else { "\n" }
                );
            }
            table.push_str(&render(rows));
            if suite == "grouped_gemm" {
                table.push_str(&grouped_targets(rows));
            }
        }
        doc.replace_range(a + open.len()..b, &format!("\n{table}"));
        println!("bench-report: {suite}: {} rows", rows.len());
    }
    fs::write(&doc_path, doc).map_err(|e| e.to_string())
}

/// The rows of each GPU, in order of the GPUs' first appearance: a table never sets one
/// card's figures beside another's (ratios are meaningful only within one card).
fn by_gpu(rows: &[Row]) -> Vec<(String, Vec<Row>)> {
    let mut groups: Vec<(String, Vec<Row>)> = Vec::new();
    for r in rows {
        match groups.iter_mut().find(|(g, _)| *g == r.gpu) {
            Some((_, v)) => v.push(r.clone()),
            None => groups.push((r.gpu.clone(), vec![r.clone()])),
        }
    }
    groups
}

/// One row per case, one column per backend (in order of first appearance), then the
/// ratio of each baseline's median to moefuse's (above 1: moefuse is faster). Each table
/// shows only the latest run of each (case, backend).
fn render(rows: &[Row]) -> String {
    let mut backends: Vec<&str> = Vec::new();
    let mut cases: Vec<&str> = Vec::new();
    let mut latest: BTreeMap<(&str, &str), &Row> = BTreeMap::new();
    for r in rows {
        if !backends.contains(&r.backend.as_str()) {
            backends.push(&r.backend);
        }
        if !cases.contains(&r.case.as_str()) {
            cases.push(&r.case);
        }
        latest.insert((&r.case, &r.backend), r);
    }
    let baselines: Vec<&str> = backends
        .iter()
        .copied()
        .filter(|b| *b != "moefuse")
        .collect();
    let mut s = String::from("| case |");
    for b in &backends {
        let _ = write!(s, " {b} µs [IQR] | {b} rate |");
    }
    for b in &baselines {
        let _ = write!(s, " {b} / moefuse |");
    }
    s.push_str(" max rel. err |\n|---|");
    s.push_str(&"---:|".repeat(2 * backends.len() + baselines.len() + 1));
    s.push('\n');
    let mut meta = BTreeMap::new();
    for case in cases {
        let _ = write!(s, "| {case} |");
        let mut err = 0f64;
        for b in &backends {
            match latest.get(&(case, *b)) {
                Some(r) => {
                    let rate = match (r.tflops, r.gbps) {
                        (Some(t), _) => format!("{t:.0} TFLOP/s"),
                        (None, Some(g)) => format!("{g:.0} GB/s"),
                        _ => "-".into(),
                    };
                    let _ = write!(s, " {:.1} [{:.1}] | {rate} |", r.median_us, r.iqr_us);
                    err = err.max(r.rel_err.unwrap_or(0.0));
                    meta.insert((r.gpu.as_str(), r.date.as_str(), r.commit.as_str()), ());
                }
                None => s.push_str(" - | - |"),
            }
        }
        let ours = latest.get(&(case, "moefuse")).map(|r| r.median_us);
        for b in &baselines {
            match (ours, latest.get(&(case, *b))) {
                (Some(o), Some(r)) => {
                    let _ = write!(s, " {:.2}× |", r.median_us / o);
                }
                _ => s.push_str(" - |"),
            }
        }
        let _ = writeln!(s, " {err:.1e} |");
    }
    for (gpu, date, commit) in meta.keys() {
        let _ = writeln!(s, "\nMeasured on {gpu}, {date}, commit {commit}.");
    }
    s
}

/// The grouped-GEMM issue's targets, computed from the latest rows: on the model forward
/// cases (names ending in `-fwd`), the geometric mean and the minimum of torch / moefuse,
/// the same of dense cuBLAS / moefuse, the ceiling torch / dense cuBLAS (what a grouped GEMM
/// exactly as fast as dense cuBLAS on the same FLOPs would score against torch), and the
/// skewed case against its balanced twin.
/// A ratio whose two rows come from different runs (commit or date) is marked.
fn grouped_targets(rows: &[Row]) -> String {
    let mut latest: BTreeMap<(&str, &str), &Row> = BTreeMap::new();
    for r in rows {
        latest.insert((&r.case, &r.backend), r);
    }
    let fwd: Vec<&str> = {
        let mut v: Vec<&str> = rows
            .iter()
            .map(|r| r.case.as_str())
            .filter(|c| c.ends_with("-fwd"))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let ratio = |case: &str, base: &str, ours: &str| -> Option<(f64, bool)> {
        let ours = latest.get(&(case, ours))?;
        let other = latest.get(&(case, base))?;
        let same_run = ours.commit == other.commit && ours.date == other.date;
        Some((other.median_us / ours.median_us, same_run))
    };
    let mut s =
        String::from("\nTargets (computed by `cargo xtask bench-report` from the rows above):\n");
    for (base, ours, what) in [
        ("torch_grouped_mm", "moefuse", "torch._grouped_mm / moefuse"),
        ("cublas_dense", "moefuse", "dense cuBLAS / moefuse"),
        (
            "torch_grouped_mm",
            "cublas_dense",
            "ceiling: torch._grouped_mm / dense cuBLAS",
        ),
    ] {
        let got: Vec<(&str, f64, bool)> = fwd
            .iter()
            .filter_map(|c| ratio(c, base, ours).map(|(r, same)| (*c, r, same)))
            .collect();
        if got.is_empty() {
            continue;
        }
        let geo = (got.iter().map(|g| g.1.ln()).sum::<f64>() / got.len() as f64).exp();
        let (min_case, min, _) = got
            .iter()
            .copied()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("not empty");
        let mixed = got.iter().filter(|g| !g.2).count();
        let _ = writeln!(
            s,
            "- {what} on the {} model forward cases: geomean {geo:.3}×, minimum {min:.3}× ({min_case}){}",
            got.len(),
            if mixed > 0 {
                format!("; {mixed} of these ratios compare rows of different runs")
            } else {
                String::new()
            }
        );
    }
    for case in rows
        .iter()
        .map(|r| r.case.as_str())
        .filter(|c| c.ends_with("-fwd-skew"))
    {
        let base = case.trim_end_matches("-skew");
        if let (Some(sk), Some(b)) = (
            latest.get(&(case, "moefuse")),
            latest.get(&(base, "moefuse")),
        ) {
            let _ = writeln!(
                s,
                "- skewed routing against balanced ({base}): {:+.1}%",
                (sk.median_us / b.median_us - 1.0) * 100.0
            );
            break;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(case: &str, backend: &str, us: f64, commit: &str) -> Row {
        Row {
            case: case.into(),
            backend: backend.into(),
            gpu: "H200".into(),
            median_us: us,
            iqr_us: 1.0,
            tflops: None,
            gbps: None,
            rel_err: None,
            date: "2026-12-03".into(),
            commit: commit.into(),
        }
    }

    #[test]
    fn each_gpu_gets_its_own_rows() {
        let mut rows = vec![
            row("a-fwd", "moefuse", 100.0, "new"),
            row("a-fwd", "torch_moe", 150.0, "new"),
        ];
        let mut h100 = row("a-fwd", "moefuse", 120.0, "newer");
        h100.gpu = "H100".into();
        rows.push(h100);
        let groups = by_gpu(&rows);
        assert_eq!(groups.len(), 2);
        assert_eq!((groups[0].0.as_str(), groups[0].1.len()), ("H200", 2));
        assert_eq!((groups[1].0.as_str(), groups[1].1.len()), ("H100", 1));
        // The H200 table's ratio is its own rows' (150 / 100), not against the H100 row.
        assert!(render(&groups[0].1).contains("1.50×"));
        assert!(!render(&groups[1].1).contains('×'));
    }

    #[test]
    fn targets_take_the_latest_rows_and_flag_mixed_runs() {
        let rows = vec![
            row("a-fwd", "moefuse", 200.0, "old"),
            row("a-fwd", "moefuse", 100.0, "new"),
            row("a-fwd", "torch_grouped_mm", 121.0, "new"),
            row("b-fwd", "moefuse", 100.0, "new"),
            row("b-fwd", "torch_grouped_mm", 100.0, "old"),
            row("a-fwd-skew", "moefuse", 110.0, "new"),
            row("a-dgrad", "moefuse", 1.0, "new"),
            row("a-dgrad", "torch_grouped_mm", 100.0, "new"),
        ];
        let t = grouped_targets(&rows);
        assert!(t.contains("geomean 1.100×"), "{t}");
        assert!(t.contains("minimum 1.000× (b-fwd)"), "{t}");
        assert!(
            t.contains("1 of these ratios compare rows of different runs"),
            "{t}"
        );
        assert!(t.contains("(a-fwd): +10.0%"), "{t}");
        assert!(!t.contains("dense cuBLAS"), "{t}");
        let mut with_dense = rows.clone();
        with_dense.push(row("a-fwd", "cublas_dense", 110.0, "new"));
        let t = grouped_targets(&with_dense);
        assert!(t.contains("ceiling: torch._grouped_mm / dense cuBLAS on the 1 model forward cases: geomean 1.100×"), "{t}");
    }
}
