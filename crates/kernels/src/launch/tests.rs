//! Unit tests of the launch layer's shared checks (`launch.rs`).

use super::*;
use crate::bind::*;
use crate::handle::require_built;
use crate::{arch_of, VariantArch};

#[test]
fn arch_is_checked_once_with_the_found_capability() {
    assert_eq!(arch_of(10, 0).unwrap(), VariantArch::Sm100a);
    match arch_of(8, 0) {
        Err(KernelError::UnsupportedArch { major: 8, minor: 0 }) => {}
        other => panic!("{other:?}"),
    }
    match require_built(VariantArch::Sm100a, &["sm90a"]) {
        Err(KernelError::ArchNotBuilt {
            arch: "sm100a",
            built,
        }) => assert_eq!(built, "sm90a"),
        other => panic!("{other:?}"),
    }
    assert!(require_built(VariantArch::Sm90a, &["sm90a", "sm100a"]).is_ok());
}

#[test]
fn sizes_convert_once_with_the_offending_value() {
    assert_eq!(to_i32("k", "m", 7).unwrap(), 7);
    match to_i32("k", "m", 1 << 31) {
        Err(KernelError::OutOfRange {
            what: "m",
            value,
            max,
            ..
        }) => {
            assert_eq!((value, max), (1 << 31, i32::MAX as i128))
        }
        other => panic!("{other:?}"),
    }
    assert!(extent("k", "a", &[usize::MAX, 2]).is_err());
    assert_eq!(extent("k", "a", &[3, 4, 5]).unwrap(), 60);
    assert!(matches!(
        check_align("k", "a", 0x1008, 16),
        Err(KernelError::Misaligned {
            address: 0x1008,
            required: 16,
            ..
        })
    ));
    assert!(matches!(
        check_len("k", "d", 10, 9),
        Err(KernelError::BufferTooSmall {
            needed: 10,
            got: 9,
            ..
        })
    ));
}
