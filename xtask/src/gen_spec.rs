//! `cargo xtask gen-spec`: writes `spec.h`, moefuse-spec's facts for the C side.

use crate::{root, Result};
use moefuse_spec::{c_header, C_HEADER_PATH};
use std::fs;

/// Writes (or with `check`, compares) `crates/kernels/cuda/include/moefuse/spec.h`.
pub fn run(check: bool) -> Result<()> {
    let path = root().join(C_HEADER_PATH);
    let text = c_header();
    if fs::read_to_string(&path).ok().as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    if check {
        return Err(format!(
            "{} is missing or differs from crates/spec (run `cargo xtask gen-spec`)",
            path.display()
        ));
    }
    fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}
