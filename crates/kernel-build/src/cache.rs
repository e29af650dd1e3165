//! Content-addressed object cache: an object is reused when its key (source text, flags,
//! toolchain pins, nvcc version, arch) matches and every header nvcc's depfile listed
//! inside the kernel tree still has the content it had when the object was built.
//! Headers outside the tree (CUTLASS, CUDA) are covered by the pins in the key.

use crate::{io_err, toolchain::cache_root, BuildError};
use sha2::{Digest, Sha256};
use std::fs;
use std::path::{Path, PathBuf};

/// A cache folder; entries are `<key>/object.o` plus `<key>/deps` (`sha256  path` lines).
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
}

impl Cache {
    /// A cache rooted at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Cache { dir: dir.into() }
    }

    /// `MOEFUSE_KERNEL_CACHE`, else `~/.cache/moefuse/kernels` (shared by build.rs and xtask,
    /// so `cargo xtask build-kernels` pre-warms `cargo build`).
    pub fn default_dir() -> Result<Self, BuildError> {
        let dir = std::env::var_os("MOEFUSE_KERNEL_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache_root().join("kernels"));
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        Ok(Cache { dir })
    }

    /// The folder of one entry.
    pub fn entry(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    /// The cached `product` (e.g. `object.o`) of `key` if its recorded dependencies are unchanged.
    pub fn lookup(&self, key: &str, product: &str) -> Option<PathBuf> {
        let entry = self.entry(key);
        let object = entry.join(product);
        let deps = fs::read_to_string(entry.join("deps")).ok()?;
        if !object.is_file() {
            return None;
        }
        for line in deps.lines() {
            let (hash, path) = line.split_once("  ")?;
            if hash_file(Path::new(path)).ok()? != hash {
                return None;
            }
        }
        Some(object)
    }

    /// Records `deps` (files whose content the object depends on) for `key`.
    pub fn record(&self, key: &str, deps: &[PathBuf]) -> Result<(), BuildError> {
        let mut text = String::new();
        for dep in deps {
            text.push_str(&format!("{}  {}\n", hash_file(dep)?, dep.display()));
        }
        let path = self.entry(key).join("deps");
        fs::write(&path, text).map_err(io_err(path))
    }
}

/// Hex SHA-256 of a byte string.
pub(crate) fn hash_bytes(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    format!("{:x}", h.finalize())
}

pub(crate) fn hash_file(path: &Path) -> Result<String, BuildError> {
    let bytes = fs::read(path).map_err(io_err(path))?;
    Ok(hash_bytes(&[&bytes]))
}

/// The files a Make-style depfile lists, in order, without the target.
pub(crate) fn parse_depfile(text: &str) -> Vec<PathBuf> {
    let joined = text.replace("\\\n", " ");
    let deps = joined.split_once(':').map(|(_, d)| d).unwrap_or("");
    deps.split_whitespace().map(PathBuf::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depfile_lists_every_continued_line() {
        let d = "out.o: a.cu \\\n /x/b.h c.hpp\n";
        let got = parse_depfile(d);
        assert_eq!(
            got,
            vec![
                PathBuf::from("a.cu"),
                PathBuf::from("/x/b.h"),
                PathBuf::from("c.hpp")
            ]
        );
    }

    #[test]
    fn lookup_misses_after_a_dependency_changes() {
        let dir = std::env::temp_dir().join(format!("moefuse-cache-test-{}", std::process::id()));
        let cache = Cache::new(&dir);
        let header = dir.join("h.cuh");
        fs::create_dir_all(cache.entry("k")).unwrap();
        fs::write(&header, "one").unwrap();
        fs::write(cache.entry("k").join("object.o"), "obj").unwrap();
        cache.record("k", std::slice::from_ref(&header)).unwrap();
        assert!(
            cache.lookup("k", "object.o").is_some(),
            "unchanged header must hit"
        );
        fs::write(&header, "two").unwrap();
        assert!(
            cache.lookup("k", "object.o").is_none(),
            "changed header must miss"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hash_separates_parts() {
        assert_ne!(hash_bytes(&[b"ab", b"c"]), hash_bytes(&[b"a", b"bc"]));
    }
}
