//! Content-addressed object cache, independent of where a checkout lives.
//!
//! An object is reused when its key matches and every header nvcc's depfile listed inside
//! the kernel tree still has the content it had when the object was built. The key holds
//! the source text, the flags with every path replaced by a root name (`<kernels>`,
//! `<cutlass>`, ...), the toolchain's identity (nvcc's version line, the CUTLASS and NVSHMEM
//! version headers), the unit's label and kind: never an absolute path, so a second
//! checkout of the same commit, in any folder, reuses every object.
//!
//! Dependencies are recorded relative to a named root (`kernels:`, the kernel tree; `src:`,
//! the unit's own folder) and resolved against the current checkout at lookup.
//!
//! Writes are atomic: an entry is built in a private staging folder and renamed into place,
//! so a killed build never leaves a torn object that a later build reuses, and two builds of
//! the same key at once both end with one complete entry.
//!
//! A key keeps up to [`HEADER_SETS_PER_KEY`] entries, one per set of recorded header
//! contents (`<key>/v-<hash of deps>/`): checkouts of commits whose shared headers differ
//! (two branches, or a CI run beside a newer build) each find their own objects instead of
//! replacing each other's. Entries of the older flat layout (`<key>/<product>`) are still
//! read.

use crate::{io_err, BuildError};
use sha2::{Digest, Sha256};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Entries kept per key, one per set of header contents; past this the oldest is removed.
pub const HEADER_SETS_PER_KEY: usize = 4;

/// Bumped when the entry format or key recipe changes: older entries are never looked up.
pub(crate) const CACHE_FORMAT: &str = "moefuse-kernel-cache-v2";

/// A cache folder; entries are `<key>/<product>` plus `<key>/deps` (`sha256  root:path` lines).
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
}

/// The folders a recorded dependency path may be relative to, both canonical (as the
/// canonical paths nvcc's depfile entries are turned into; `compile_all` canonicalises them
/// once per build), so a dependency is matched by a plain prefix test.
#[derive(Debug, Clone, Copy)]
pub struct DepRoots<'a> {
    /// The kernel tree (`crates/kernels/cuda`): recorded as `kernels:<relative path>`.
    pub kernels: &'a Path,
    /// The folder of the unit's source file: recorded as `src:<relative path>`.
    pub source_dir: &'a Path,
}

impl DepRoots<'_> {
    fn portable(&self, path: &Path) -> Option<String> {
        let rel = |root: &Path, tag: &str| {
            let rest = path.strip_prefix(root).ok()?;
            Some(format!("{tag}:{}", rest.to_str()?))
        };
        rel(self.kernels, "kernels").or_else(|| rel(self.source_dir, "src"))
    }

    fn resolve(&self, recorded: &str) -> Option<PathBuf> {
        let (tag, rest) = recorded.split_once(':')?;
        match tag {
            "kernels" => Some(self.kernels.join(rest)),
            "src" => Some(self.source_dir.join(rest)),
            _ => None,
        }
    }
}

impl Cache {
    /// A cache rooted at `dir` (used as given: no ownership checks; for tests and tools
    /// that manage their own folder).
    ///
    /// ```
    /// let cache = moefuse_kernel_build::Cache::new(std::env::temp_dir().join("my-cache"));
    /// assert!(cache.entry("abc").ends_with("abc"));
    /// ```
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Cache { dir: dir.into() }
    }

    /// `MOEFUSE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/moefuse/kernels`, else
    /// `$HOME/.cache/moefuse/kernels` (shared by build.rs and xtask, so `cargo xtask
    /// build-kernels` pre-warms `cargo build`). With none of the three set it refuses
    /// rather than fall back to a world-writable folder. The folder is created private
    /// (0700) and refused when another user owns it or when group or others may write it:
    /// a writer there could plant objects that get linked into our binaries.
    ///
    /// ```no_run
    /// let cache = moefuse_kernel_build::Cache::default_dir()?;
    /// # Ok::<(), moefuse_kernel_build::BuildError>(())
    /// ```
    pub fn default_dir() -> Result<Self, BuildError> {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let dir = var("MOEFUSE_KERNEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("moefuse/kernels")))
            .or_else(|| var("HOME").map(|d| d.join(".cache/moefuse/kernels")))
            .ok_or_else(|| BuildError::CacheDir {
                path: PathBuf::new(),
                reason: "none of MOEFUSE_KERNEL_CACHE, XDG_CACHE_HOME, HOME is set; set \
                         MOEFUSE_KERNEL_CACHE to a folder only you can write"
                    .into(),
            })?;
        Self::private_dir(dir)
    }

    /// Creates `dir` (mode 0700) if needed and checks it is ours and not writable by others.
    ///
    /// ```no_run
    /// let cache = moefuse_kernel_build::Cache::private_dir(std::env::temp_dir().join("k"))?;
    /// # Ok::<(), moefuse_kernel_build::BuildError>(())
    /// ```
    pub fn private_dir(dir: impl Into<PathBuf>) -> Result<Self, BuildError> {
        let dir = dir.into();
        create_private(&dir)?;
        check_private(&dir)?;
        Ok(Cache { dir })
    }

    /// The folder of one entry.
    pub fn entry(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    /// A fresh staging folder for building `key`'s entry, private to this process.
    pub fn staging(&self, key: &str) -> Result<PathBuf, BuildError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = self
            .dir
            .join(format!(".staging-{key}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).map_err(io_err(&path))?;
        Ok(path)
    }

    /// The cached `product` (e.g. `object.o`) of `key` whose recorded dependencies, resolved
    /// against `roots`, are unchanged (any of the key's header sets).
    pub fn lookup(&self, key: &str, product: &str, roots: &DepRoots<'_>) -> Option<PathBuf> {
        let entry = self.entry(key);
        Self::lookup_in(&entry, product, roots).or_else(|| {
            Self::header_sets(&entry)
                .iter()
                .find_map(|d| Self::lookup_in(d, product, roots))
        })
    }

    /// The header-set folders of an entry (`v-*`), oldest first.
    fn header_sets(entry: &Path) -> Vec<PathBuf> {
        let Ok(dir) = fs::read_dir(entry) else {
            return Vec::new();
        };
        let mut sets: Vec<(std::time::SystemTime, PathBuf)> = dir
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("v-"))
            .map(|e| {
                let when = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                (when, e.path())
            })
            .collect();
        sets.sort();
        sets.into_iter().map(|(_, p)| p).collect()
    }

    /// `product` in one folder if its `deps` match the checkout.
    fn lookup_in(dir: &Path, product: &str, roots: &DepRoots<'_>) -> Option<PathBuf> {
        let object = dir.join(product);
        let deps = fs::read_to_string(dir.join("deps")).ok()?;
        if !object.is_file() || deps.trim().is_empty() {
            return None;
        }
        for line in deps.lines() {
            let (hash, recorded) = line.split_once("  ")?;
            let path = roots.resolve(recorded)?;
            if hash_file(&path).ok()? != hash {
                return None;
            }
        }
        Some(object)
    }

    /// Writes the `deps` file of a staging folder: each of `deps` (files inside `roots`) as
    /// its hash and portable path. Fails on an empty list: nvcc always names the source, so
    /// an empty depfile means a broken build, and an entry without deps would always hit.
    pub fn record(
        &self,
        staging: &Path,
        deps: &[PathBuf],
        roots: &DepRoots<'_>,
    ) -> Result<(), BuildError> {
        let mut text = String::new();
        for dep in deps {
            let Some(portable) = roots.portable(dep) else {
                continue;
            };
            text.push_str(&format!("{}  {portable}\n", hash_file(dep)?));
        }
        if text.is_empty() {
            return Err(BuildError::CacheDir {
                path: staging.to_path_buf(),
                reason: "nvcc's depfile named no file inside the kernel tree".into(),
            });
        }
        let path = staging.join("deps");
        fs::write(&path, text).map_err(io_err(path))
    }

    /// Moves a complete staging folder into place as the entry of `key` for its recorded
    /// header set and returns its `product`; the key's oldest header sets beyond
    /// [`HEADER_SETS_PER_KEY`] are removed. When another build published the same key and
    /// header set first, its entry is kept if it is valid (ours is discarded), else replaced.
    pub fn publish(
        &self,
        staging: &Path,
        key: &str,
        product: &str,
        roots: &DepRoots<'_>,
    ) -> Result<PathBuf, BuildError> {
        let entry = self.entry(key);
        fs::create_dir_all(&entry).map_err(io_err(&entry))?;
        let deps_path = staging.join("deps");
        let deps = fs::read(&deps_path).map_err(io_err(&deps_path))?;
        let set = entry.join(format!("v-{}", &hash_bytes(&[&deps])[..16]));
        for _ in 0..3 {
            match fs::rename(staging, &set) {
                Ok(()) => {
                    let sets = Self::header_sets(&entry);
                    for old in sets
                        .iter()
                        .take(sets.len().saturating_sub(HEADER_SETS_PER_KEY))
                    {
                        if *old != set {
                            let _ = fs::remove_dir_all(old);
                        }
                    }
                    return Ok(set.join(product));
                }
                Err(_) if set.exists() => {
                    if let Some(existing) = Self::lookup_in(&set, product, roots) {
                        let _ = fs::remove_dir_all(staging);
                        return Ok(existing);
                    }
                    // A torn set (should not happen: sets are renamed in whole): replace it.
                    let _ = fs::remove_dir_all(&set);
                }
                Err(e) => return Err(io_err(&set)(e)),
            }
        }
        Err(BuildError::CacheDir {
            path: set,
            reason: "could not publish the entry (another build keeps replacing it)".into(),
        })
    }
}

#[cfg(unix)]
fn create_private(dir: &Path) -> Result<(), BuildError> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(io_err(dir)(e)),
        _ => Ok(()),
    }
}

#[cfg(not(unix))]
fn create_private(dir: &Path) -> Result<(), BuildError> {
    fs::create_dir_all(dir).map_err(io_err(dir))
}

// NOTES: our own uid is read off a file we just created (portable across unix, no libc):
// the folder must have the same owner, and no group/other write bit.
#[cfg(unix)]
fn check_private(dir: &Path) -> Result<(), BuildError> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(dir).map_err(io_err(dir))?;
    let probe = dir.join(format!(".owner-probe-{}", std::process::id()));
    fs::write(&probe, b"").map_err(io_err(&probe))?;
    let me = fs::metadata(&probe).map_err(io_err(&probe))?.uid();
    let _ = fs::remove_file(&probe);
    let refuse = |reason: String| {
        Err(BuildError::CacheDir {
            path: dir.to_path_buf(),
            reason,
        })
    };
    if meta.uid() != me {
        return refuse(format!(
            "owned by uid {}, not by this user (uid {me}); use a folder of your own \
             (MOEFUSE_KERNEL_CACHE)",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "mode {:o} lets group or others write it; `chmod go-w` it or use another folder",
            meta.mode() & 0o777
        ));
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_private(_dir: &Path) -> Result<(), BuildError> {
    Ok(())
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

/// The files a Make-style depfile lists, in order, without the target. Understands line
/// continuations and Make's escapes (`\ ` for a space in a path, `\#`, `$$`).
pub(crate) fn parse_depfile(text: &str) -> Vec<PathBuf> {
    let joined = text.replace("\\\r\n", " ").replace("\\\n", " ");
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = joined.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if matches!(chars.peek(), Some(' ') | Some('#') | Some('\\')) => {
                word.push(chars.next().expect("peeked"));
            }
            '$' if chars.peek() == Some(&'$') => {
                chars.next();
                word.push('$');
            }
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    // The target ends with ':' (possibly as its own word).
    let first_dep = words
        .iter()
        .position(|w| w.ends_with(':'))
        .map_or(words.len(), |i| i + 1);
    words[first_dep..].iter().map(PathBuf::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("moefuse-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn depfile_lists_every_continued_line() {
        let d = "out.o: a.cu \\\n /x/b.h c.hpp\n";
        assert_eq!(
            parse_depfile(d),
            vec![
                PathBuf::from("a.cu"),
                PathBuf::from("/x/b.h"),
                PathBuf::from("c.hpp")
            ]
        );
    }

    #[test]
    fn depfile_keeps_escaped_spaces_in_one_path() {
        let d = "/my\\ repo/o.o: /my\\ repo/a.cu \\\n /my\\ repo/in\\ c/b.h\n";
        assert_eq!(
            parse_depfile(d),
            vec![
                PathBuf::from("/my repo/a.cu"),
                PathBuf::from("/my repo/in c/b.h")
            ]
        );
    }

    /// A checkout with one header under `kernels/include` and a source in `src/`.
    fn checkout(root: &Path, header: &str) -> (PathBuf, PathBuf) {
        let kernels = root.join("kernels");
        let src = root.join("src");
        fs::create_dir_all(kernels.join("include")).unwrap();
        fs::create_dir_all(&src).unwrap();
        fs::write(kernels.join("include/h.cuh"), header).unwrap();
        fs::write(src.join("a.cu"), "source").unwrap();
        (kernels.canonicalize().unwrap(), src.canonicalize().unwrap())
    }

    fn build(cache: &Cache, key: &str, kernels: &Path, src: &Path) -> PathBuf {
        let roots = DepRoots {
            kernels,
            source_dir: src,
        };
        let staging = cache.staging(key).unwrap();
        fs::write(staging.join("object.o"), "obj").unwrap();
        let deps = [src.join("a.cu"), kernels.join("include/h.cuh")];
        cache.record(&staging, &deps, &roots).unwrap();
        cache.publish(&staging, key, "object.o", &roots).unwrap()
    }

    #[test]
    fn lookup_misses_after_a_dependency_changes() {
        let dir = temp("cache-dep");
        let (kernels, src) = checkout(&dir.join("a"), "one");
        let cache = Cache::new(dir.join("cache"));
        build(&cache, "k", &kernels, &src);
        let roots = DepRoots {
            kernels: &kernels,
            source_dir: &src,
        };
        assert!(
            cache.lookup("k", "object.o", &roots).is_some(),
            "unchanged header must hit"
        );
        fs::write(kernels.join("include/h.cuh"), "two").unwrap();
        assert!(
            cache.lookup("k", "object.o", &roots).is_none(),
            "changed header must miss"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_second_checkout_elsewhere_hits_and_a_different_one_misses() {
        let dir = temp("cache-move");
        let (k1, s1) = checkout(&dir.join("first"), "same");
        let (k2, s2) = checkout(&dir.join("second place/with space"), "same");
        let (k3, s3) = checkout(&dir.join("third"), "other");
        let cache = Cache::new(dir.join("cache"));
        build(&cache, "k", &k1, &s1);
        fs::remove_dir_all(dir.join("first")).unwrap();
        let hit = |k: &Path, s: &Path| {
            let roots = DepRoots {
                kernels: k,
                source_dir: s,
            };
            cache.lookup("k", "object.o", &roots).is_some()
        };
        assert!(hit(&k2, &s2), "same content in another folder must hit");
        assert!(!hit(&k3, &s3), "other header content must miss");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn checkouts_with_other_headers_keep_their_own_objects() {
        let dir = temp("cache-sets");
        let (k1, s1) = checkout(&dir.join("older"), "old header");
        let (k2, s2) = checkout(&dir.join("newer"), "new header");
        let cache = Cache::new(dir.join("cache"));
        let hit = |k: &Path, s: &Path| {
            let roots = DepRoots {
                kernels: k,
                source_dir: s,
            };
            cache.lookup("k", "object.o", &roots).is_some()
        };
        build(&cache, "k", &k1, &s1);
        build(&cache, "k", &k2, &s2);
        assert!(
            hit(&k1, &s1),
            "the older checkout's object must survive the newer build"
        );
        assert!(hit(&k2, &s2), "the newer checkout's object must be found");
        // Past HEADER_SETS_PER_KEY sets, the oldest goes.
        for i in 0..HEADER_SETS_PER_KEY {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let (k, s) = checkout(&dir.join(format!("more{i}")), &format!("header {i}"));
            build(&cache, "k", &k, &s);
        }
        assert!(!hit(&k1, &s1), "the oldest set must have been removed");
        assert_eq!(
            Cache::header_sets(&cache.entry("k")).len(),
            HEADER_SETS_PER_KEY
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn torn_or_empty_entries_are_never_reused() {
        let dir = temp("cache-torn");
        let (kernels, src) = checkout(&dir.join("c"), "h");
        let roots = DepRoots {
            kernels: &kernels,
            source_dir: &src,
        };
        let cache = Cache::new(dir.join("cache"));
        // What a killed in-place build left: an object, no deps.
        fs::create_dir_all(cache.entry("k")).unwrap();
        fs::write(cache.entry("k").join("object.o"), "torn").unwrap();
        assert!(cache.lookup("k", "object.o", &roots).is_none());
        // An empty deps file (an empty depfile accepted) is a miss too.
        fs::write(cache.entry("k").join("deps"), "").unwrap();
        assert!(cache.lookup("k", "object.o", &roots).is_none());
        // Recording no dependency is refused.
        let staging = cache.staging("k").unwrap();
        assert!(cache.record(&staging, &[], &roots).is_err());
        // Publishing over the torn entry replaces it.
        let obj = build(&cache, "k", &kernels, &src);
        assert_eq!(fs::read_to_string(obj).unwrap(), "obj");
        assert!(cache.lookup("k", "object.o", &roots).is_some());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn concurrent_publishers_end_with_one_complete_entry() {
        let dir = temp("cache-race");
        let (kernels, src) = checkout(&dir.join("c"), "h");
        let cache = Cache::new(dir.join("cache"));
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| build(&cache, "k", &kernels, &src));
            }
        });
        let roots = DepRoots {
            kernels: &kernels,
            source_dir: &src,
        };
        assert!(cache.lookup("k", "object.o", &roots).is_some());
        let left: Vec<_> = fs::read_dir(dir.join("cache"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left,
            vec![std::ffi::OsString::from("k")],
            "no staging left behind"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn group_writable_cache_dirs_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp("cache-perm");
        let shared = dir.join("shared");
        fs::create_dir_all(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o777)).unwrap();
        let err = Cache::private_dir(&shared).unwrap_err().to_string();
        assert!(err.contains("group or others"), "{err}");
        // A folder another user owns (we can only make one when we are root).
        let foreign = dir.join("foreign");
        fs::create_dir_all(&foreign).unwrap();
        fs::set_permissions(&foreign, fs::Permissions::from_mode(0o700)).unwrap();
        if std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).is_ok() {
            let err = Cache::private_dir(&foreign).unwrap_err().to_string();
            assert!(err.contains("not by this user"), "{err}");
        }
        let fresh = dir.join("fresh");
        Cache::private_dir(&fresh).unwrap();
        let mode = fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hash_separates_parts() {
        assert_ne!(hash_bytes(&[b"ab", b"c"]), hash_bytes(&[b"a", b"bc"]));
    }
}
