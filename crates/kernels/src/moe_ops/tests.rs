//! Unit tests of the MoE operations' host checks (`moe_ops.rs`).

use super::*;

#[test]
fn routing_limits_are_the_kernels() {
    assert!(check_routing("r", 4, 512, 16).is_ok());
    match check_routing("r", 4, 513, 2) {
        Err(KernelError::OutOfRange {
            what: "experts",
            value: 513,
            max: 512,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(check_routing("r", 4, 8, 9).is_err());
    assert!(check_routing("r", 4, 64, 17).is_err());
    assert!(check_routing("r", 1 << 28, 64, 2).is_err());
}

#[test]
fn sigmoid_grouping_is_checked() {
    let s = |n_group, topk_group| RouterScoring::SigmoidGrouped {
        n_group,
        topk_group,
        routed_scaling_factor: 1.0,
    };
    assert!(s(8, 4).raw("r", 256, 8).is_ok());
    assert!(matches!(
        s(7, 4).raw("r", 256, 8),
        Err(KernelError::NotMultiple { .. })
    ));
    assert!(s(8, 9).raw("r", 256, 8).is_err());
    // One group of 2 experts kept cannot supply 4 experts.
    assert!(s(128, 1).raw("r", 256, 4).is_err());
    assert!(
        s(256, 1).raw("r", 256, 1).is_err(),
        "groups need >= 2 experts"
    );
}
