//! The crate's build metadata, the header constants the bindings were generated from, and
//! the loaded library must all name the same NVSHMEM version.

#[test]
fn build_metadata_matches_header_constants() {
    let (major, minor, patch) = nvshmem_sys::bound_version();
    assert_eq!(
        (major, minor, patch),
        (
            nvshmem_sys::NVSHMEM_VENDOR_MAJOR_VERSION,
            nvshmem_sys::NVSHMEM_VENDOR_MINOR_VERSION,
            nvshmem_sys::NVSHMEM_VENDOR_PATCH_VERSION
        ),
        "Cargo.toml's +nvshmem.X.Y.Z and src/bindings.rs disagree: run `cargo xtask bindgen`"
    );
}

#[test]
fn loaded_library_matches_bindings() {
    // The library is part of the pinned toolchain (`cargo xtask setup`), so not finding it
    // is a setup error, not a reason to skip.
    let lib = nvshmem_sys::load(None).unwrap_or_else(|e| panic!("{e}"));
    let (mut major, mut minor, mut patch) = (0, 0, 0);
    // SAFETY: a host getter that writes three ints; needs no initialised NVSHMEM.
    unsafe { lib.nvshmemx_vendor_get_version_info(&mut major, &mut minor, &mut patch) };
    let (bm, bn, bp) = nvshmem_sys::bound_version();
    assert_eq!(
        (major as u32, minor as u32),
        (bm, bn),
        "library {major}.{minor}.{patch}, bindings {bm}.{bn}.{bp}"
    );
    assert_eq!(
        patch as u32, bp,
        "library patch {patch} differs from the bound {bp}"
    );
}

#[test]
fn a_missing_library_names_every_place_it_looked() {
    let err = nvshmem_sys::load_first(vec![
        "/nowhere/libnvshmem_host.so.3".into(),
        "/etc/hostname".into(), // exists, is not a library
    ])
    .err()
    .expect("no candidate can load");
    let text = err.to_string();
    assert!(text.contains("/nowhere/libnvshmem_host.so.3"), "{text}");
    assert!(text.contains("no such file"), "{text}");
    assert!(text.contains("/etc/hostname"), "{text}");
}
