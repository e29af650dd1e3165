//! NVSHMEM device modules compiled into this crate: each `kernels/comm/<name>.cu` as a fatbin
//! per built arch, ready for `cuModuleLoadData` + `nvshmemx_cumodule_init`.

/// One embedded module.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedModule {
    /// Target: `sm90a` or `sm100a`.
    pub arch: &'static str,
    /// The source's file stem, e.g. `nvshmem_selftest`.
    pub name: &'static str,
    /// The device-linked fatbin.
    pub fatbin: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/nvshmem_modules.rs"));

/// The embedded modules, one per (source, built arch).
///
/// ```
/// for m in moefuse_comm::embedded_modules() {
///     println!("{} {} ({} bytes)", m.arch, m.name, m.fatbin.len());
/// }
/// ```
pub fn embedded_modules() -> &'static [EmbeddedModule] {
    MODULES
}

/// The module `name` for `arch`, if it was built.
pub fn module(name: &str, arch: &str) -> Option<&'static EmbeddedModule> {
    MODULES.iter().find(|m| m.name == name && m.arch == arch)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The magic number that starts every CUDA fatbin (`fatbinary_section.h`).
    const FATBIN_MAGIC: u32 = 0xBA55_ED50;

    #[test]
    fn every_built_arch_has_each_module_as_a_fatbin() {
        for arch in env!("MOEFUSE_COMM_BUILT_ARCHS")
            .split(',')
            .filter(|a| !a.is_empty())
        {
            let m = module("nvshmem_selftest", arch)
                .unwrap_or_else(|| panic!("no nvshmem_selftest for {arch}"));
            let magic = u32::from_le_bytes(m.fatbin[..4].try_into().unwrap());
            assert_eq!(magic, FATBIN_MAGIC, "{arch}: not a fatbin");
        }
    }
}
