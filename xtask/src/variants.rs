//! `cargo xtask gen-variants`: one instance file per row of the variant table.

use crate::{root, Result};
use moefuse_spec::{Arch, VARIANTS};
use std::fs;

/// Writes (or with `check`, compares) `kernels/instances/<arch>/<name>.cu` for every
/// variant, and removes (or reports) instance files no variant claims.
pub fn run(check: bool) -> Result<()> {
    let mut problems = Vec::new();
    for arch in Arch::ALL {
        let dir = root()
            .join("crates/kernels/cuda/instances")
            .join(arch.name());
        fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let wanted: Vec<_> = VARIANTS.iter().filter(|v| v.arch == arch).collect();
        for v in &wanted {
            let path = dir.join(format!("{}.cu", v.name()));
            let text = v.instance_source();
            if fs::read_to_string(&path).ok().as_deref() == Some(text.as_str()) {
                continue;
            }
            if check {
                problems.push(format!("{} is missing or stale", path.display()));
            } else {
                fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
        for entry in fs::read_dir(&dir).map_err(|e| e.to_string())? {
            let path = entry.map_err(|e| e.to_string())?.path();
            let stem = path
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            if wanted.iter().any(|v| v.name() == stem) {
                continue;
            }
            if check {
                problems.push(format!("{} belongs to no variant", path.display()));
            } else {
                fs::remove_file(&path).map_err(|e| e.to_string())?;
                println!("removed {}", path.display());
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("instance files disagree with the variant table (run `cargo xtask gen-variants`):\n  {}", problems.join("\n  ")))
    }
}
