//! Unit tests of the GEMM operations' host checks (`ops.rs`).

use super::*;
use crate::{VariantArch, VARIANTS};

fn spec(op: Op, schedule: Schedule) -> VariantSpec {
    VariantSpec {
        arch: VariantArch::Sm90a,
        op,
        tile: [128, 256, 64],
        cluster: [2, 1],
        schedule,
    }
}

fn out_of_range(r: Result<(), KernelError>) -> (&'static str, i128, i128) {
    match r {
        Err(KernelError::OutOfRange {
            what, value, max, ..
        }) => (what, value, max),
        other => panic!("expected OutOfRange, got {other:?}"),
    }
}

#[test]
fn grouped_rows_near_i32_max_are_refused_before_launch() {
    let contig = spec(Op::GroupedFwdBnk, Schedule::Contiguous);
    let near = GroupedShape::new(8, i32::MAX as usize - 100, 256, 256);
    let (what, value, _) = out_of_range(check_grouped("v", &contig, &near, 132));
    assert_eq!(what, "rows + 2 * cluster tile rows");
    assert_eq!(value, i32::MAX as i128 - 100 + 512);
    let fine = GroupedShape::new(8, 1 << 20, 256, 256);
    assert!(check_grouped("v", &contig, &fine, 132).is_ok());
}

#[test]
fn grouped_tile_count_must_fit_int32() {
    let contig = spec(Op::GroupedFwdBnk, Schedule::Contiguous);
    // 2^30 rows over 256-row units, times 2^22 / 256 n-blocks: far past int32.
    let wide = GroupedShape::new(8, 1 << 30, 1 << 22, 8);
    let (what, _, _) = out_of_range(check_grouped("v", &contig, &wide, 132));
    assert_eq!(what, "tiles + SMs");
}

#[test]
fn contiguous_kernel_takes_at_most_its_table_of_groups() {
    let contig = spec(Op::GroupedFwdBnk, Schedule::Contiguous);
    let many = GroupedShape::new(513, 4096, 256, 256);
    let (what, value, max) = out_of_range(check_grouped("v", &contig, &many, 132));
    assert_eq!(
        (what, value, max),
        ("groups (contiguous kernel's table)", 513, 512)
    );
    let coop = spec(Op::GroupedFwdBnk, Schedule::Cooperative);
    assert!(check_grouped("v", &coop, &many, 132).is_ok());
}

#[test]
fn wgrad_zeroing_grid_caps_groups_at_65535() {
    let wgrad = spec(Op::GroupedWgrad, Schedule::Cooperative);
    let many = GroupedShape::new(65_536, 65_536, 8, 8);
    let (what, value, max) = out_of_range(check_grouped("v", &wgrad, &many, 132));
    assert_eq!(
        (what, value, max),
        ("groups (zero_empty_groups grid.y)", 65_536, 65_535)
    );
    // Accumulating (beta = 1) launches no zeroing grid.
    let acc = GroupedShape { beta: 1.0, ..many };
    assert!(check_grouped("v", &wgrad, &acc, 132).is_ok());
}

#[test]
fn tile_order_follows_the_schedule() {
    let coop = spec(Op::GroupedFwdBnk, Schedule::Cooperative);
    let contig = spec(Op::GroupedFwdBnk, Schedule::Contiguous);
    let with = |t| GroupedShape {
        tile_order: t,
        ..GroupedShape::new(4, 64, 8, 8)
    };
    assert!(check_grouped("v", &coop, &with(2 | (8 << 8)), 1).is_ok());
    assert!(check_grouped("v", &coop, &with(16 << 8), 1).is_err());
    assert!(check_grouped("v", &coop, &with(1 << 24), 1).is_err());
    assert!(check_grouped("v", &coop, &with(3), 1).is_err());
    assert!(check_grouped("v", &coop, &with(3 << 8), 1).is_err());
    assert!(check_grouped("v", &contig, &with((128 << 8) | (4 << 16) | (1 << 24)), 1).is_ok());
    assert!(check_grouped("v", &contig, &with(1 << 25), 1).is_err());
}

#[test]
fn grouped_sizes_need_16_byte_rows() {
    let coop = spec(Op::GroupedFwdBnk, Schedule::Cooperative);
    match check_grouped("v", &coop, &GroupedShape::new(4, 64, 12, 8), 1) {
        Err(KernelError::NotMultiple {
            what: "n",
            value: 12,
            multiple: 8,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(check_grouped("v", &coop, &GroupedShape::new(4, 64, 0, 8), 1).is_err());
}

#[test]
fn dense_checks_name_the_size() {
    let s = spec(Op::GemmBnk, Schedule::Cooperative);
    assert!(check_gemm("v", &s, &GemmShape::new(0, 8, 8)).is_ok());
    assert!(check_gemm("v", &s, &GemmShape::new(8, 8, 12)).is_err());
    let (what, _, _) = out_of_range(check_gemm("v", &s, &GemmShape::new(1 << 31, 8, 8)));
    assert_eq!(what, "m");
}

#[test]
fn extents_and_abi_structs_follow_the_variant() {
    let s = GroupedShape::new(4, 100, 16, 8);
    assert_eq!(
        grouped_extents("v", Op::GroupedFwdBnk, &s).unwrap(),
        [800, 512, 1600]
    );
    assert_eq!(
        grouped_extents("v", Op::GroupedWgrad, &s).unwrap(),
        [800, 1600, 512]
    );
    let args = grouped_args(Op::GroupedFwdBkn, &s, "v", 4, [16, 32, 48]).unwrap();
    assert_eq!(
        (args.num_groups, args.b_layout),
        (4, ffi::MOEFUSE_B_LAYOUT_KN)
    );
    let d = dense_args(Op::GemmBkn, &GemmShape::new(3, 16, 8), "v", [16, 32, 0, 48]).unwrap();
    assert_eq!((d.lda, d.ldb, d.ldd), (8, 16, 16));
    // Every table variant's tile passes its own smallest problem.
    for v in VARIANTS.iter().filter(|v| v.op.is_grouped()) {
        assert!(
            check_grouped("v", v, &GroupedShape::new(1, 8, 8, 8), 132).is_ok(),
            "{}",
            v.name()
        );
    }
}
