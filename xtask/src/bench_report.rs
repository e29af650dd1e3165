//! `cargo xtask bench-report`: renders each `benches/results/<suite>.jsonl` into the
//! table between `<!-- bench:<suite> -->` and `<!-- /bench:<suite> -->` in
//! docs/benchmarks.md. Rows are grouped by case; every backend of a case sits side by side.

use crate::{root, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;

#[derive(Deserialize)]
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
        let table = render(&rows);
        doc.replace_range(a + open.len()..b, &format!("\n{table}"));
        println!("bench-report: {suite}: {} rows", rows.len());
    }
    fs::write(&doc_path, doc).map_err(|e| e.to_string())
}

fn render(rows: &[Row]) -> String {
    let mut by_case: BTreeMap<&str, Vec<&Row>> = BTreeMap::new();
    for r in rows {
        by_case.entry(&r.case).or_default().push(r);
    }
    let mut s = String::from("| case | backend | median µs [IQR] | rate | rel. err | GPU | date | commit |\n|---|---|---:|---:|---:|---|---|---|\n");
    for (case, rs) in by_case {
        for r in rs {
            let rate = match (r.tflops, r.gbps) {
                (Some(t), _) => format!("{t:.0} TFLOP/s"),
                (None, Some(g)) => format!("{g:.0} GB/s"),
                _ => "-".into(),
            };
            let err = r.rel_err.map_or("-".into(), |e| format!("{e:.1e}"));
            let _ = writeln!(
                s,
                "| {case} | {} | {:.1} [{:.1}] | {rate} | {err} | {} | {} | {} |",
                r.backend, r.median_us, r.iqr_us, r.gpu, r.date, r.commit
            );
        }
    }
    s
}
