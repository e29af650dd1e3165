//! Configuration rules: each one rejected with its own error.

#![forbid(unsafe_code)]

use moefuse::{Activation, GateUpLayout, MoeConfig, MoeError, RouterKind};

fn grouped(n_group: usize, topk_group: usize) -> RouterKind {
    RouterKind::SigmoidGrouped {
        n_group,
        topk_group,
        routed_scaling_factor: 1.0,
        renormalize: true,
    }
}

#[test]
fn every_rule_has_its_error() {
    let ok = MoeConfig::new(128, 256, 16, 4);
    assert_eq!(ok.validate(), Ok(()));
    let cases: Vec<(MoeConfig, MoeError)> = vec![
        (
            MoeConfig::new(0, 64, 4, 1),
            MoeError::DimNotMultiple {
                what: "hidden",
                value: 0,
                multiple: 64,
            },
        ),
        (
            MoeConfig::new(96, 64, 4, 1),
            MoeError::DimNotMultiple {
                what: "hidden",
                value: 96,
                multiple: 64,
            },
        ),
        (
            MoeConfig::new(64, 0, 4, 1),
            MoeError::DimNotMultiple {
                what: "intermediate",
                value: 0,
                multiple: 64,
            },
        ),
        (
            MoeConfig::new(64, 100, 4, 1),
            MoeError::DimNotMultiple {
                what: "intermediate",
                value: 100,
                multiple: 64,
            },
        ),
        (
            MoeConfig::new(64, 64, 0, 1),
            MoeError::ExpertsOutOfRange {
                experts: 0,
                max: 512,
            },
        ),
        (
            MoeConfig::new(64, 64, 513, 1),
            MoeError::ExpertsOutOfRange {
                experts: 513,
                max: 512,
            },
        ),
        (
            MoeConfig::new(64, 64, 8, 0),
            MoeError::TopKOutOfRange {
                top_k: 0,
                experts: 8,
                max: 16,
            },
        ),
        (
            MoeConfig::new(64, 64, 64, 17),
            MoeError::TopKOutOfRange {
                top_k: 17,
                experts: 64,
                max: 16,
            },
        ),
        (
            MoeConfig::new(64, 64, 3, 4),
            MoeError::TopKOutOfRange {
                top_k: 4,
                experts: 3,
                max: 16,
            },
        ),
        (
            ok.with_router(grouped(0, 1)),
            MoeError::InvalidGroupCount {
                n_group: 0,
                experts: 16,
            },
        ),
        (
            ok.with_router(grouped(3, 1)),
            MoeError::InvalidGroupCount {
                n_group: 3,
                experts: 16,
            },
        ),
        (
            ok.with_router(grouped(16, 4)),
            MoeError::GroupTooSmall {
                experts: 16,
                n_group: 16,
                per_group: 1,
            },
        ),
        (
            ok.with_router(grouped(4, 0)),
            MoeError::TopkGroupOutOfRange {
                topk_group: 0,
                n_group: 4,
            },
        ),
        (
            ok.with_router(grouped(4, 5)),
            MoeError::TopkGroupOutOfRange {
                topk_group: 5,
                n_group: 4,
            },
        ),
        (
            MoeConfig::new(64, 64, 16, 5).with_router(grouped(8, 2)),
            MoeError::TopKExceedsKeptGroups {
                top_k: 5,
                topk_group: 2,
                per_group: 2,
            },
        ),
        (
            ok.with_router(RouterKind::SigmoidGrouped {
                n_group: 4,
                topk_group: 2,
                routed_scaling_factor: 0.0,
                renormalize: false,
            }),
            MoeError::InvalidParameter {
                what: "routed_scaling_factor",
                value: 0.0,
                rule: "must be finite and > 0",
            },
        ),
        (
            ok.with_activation(Activation::BoundedSwiGlu { limit: -1.0 }),
            MoeError::InvalidParameter {
                what: "activation limit",
                value: -1.0,
                rule: "must be finite and > 0",
            },
        ),
        (
            ok.with_activation(Activation::SwiGluOai {
                alpha: f32::INFINITY,
                limit: 7.0,
            }),
            MoeError::InvalidParameter {
                what: "activation alpha",
                value: f32::INFINITY,
                rule: "must be finite",
            },
        ),
    ];
    for (cfg, want) in cases {
        assert_eq!(cfg.validate(), Err(want.clone()), "{cfg:?}");
        assert!(!want.to_string().is_empty());
    }
    // Boundaries that pass.
    assert!(MoeConfig::new(64, 64, 512, 16).validate().is_ok());
    assert!(MoeConfig::new(64, 64, 1, 1).validate().is_ok());
    assert!(MoeConfig::new(64, 64, 16, 4)
        .with_router(grouped(8, 2))
        .validate()
        .is_ok());
    assert!(MoeConfig::new(64, 64, 16, 16)
        .with_router(grouped(8, 8))
        .validate()
        .is_ok());
}

#[test]
fn token_counts_are_checked_per_call() {
    let cfg = MoeConfig::new(64, 64, 4, 2);
    assert_eq!(
        cfg.check_tokens(0),
        Err(MoeError::TokensOutOfRange {
            tokens: 0,
            max: 65536
        })
    );
    assert_eq!(
        cfg.check_tokens(65537),
        Err(MoeError::TokensOutOfRange {
            tokens: 65537,
            max: 65536
        })
    );
    assert!(cfg.check_tokens(1).is_ok() && cfg.check_tokens(65536).is_ok());
}

#[test]
fn widths_and_serde_round_trip() {
    let cfg = MoeConfig::new(64, 192, 8, 2)
        .with_activation(Activation::swiglu_oai())
        .with_gate_up_layout(GateUpLayout::Interleaved)
        .with_router(grouped(4, 2));
    assert_eq!(cfg.gate_up_width(), 384);
    assert_eq!(cfg.with_activation(Activation::Relu2).gate_up_width(), 192);
    let json = serde_json::to_string(&cfg).unwrap();
    let back: MoeConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, cfg);
}

/// `hidden` and `intermediate` are bounded, so every size the layer derives from a valid
/// config fits `usize` and the kernels' int32.
#[test]
fn dims_above_max_dim_are_rejected() {
    use moefuse::MAX_DIM;
    assert_eq!(
        MoeConfig::new(MAX_DIM + 64, 64, 8, 2).validate(),
        Err(MoeError::TooLarge {
            what: "hidden",
            value: MAX_DIM + 64,
            max: MAX_DIM
        })
    );
    assert_eq!(
        MoeConfig::new(64, 1 << 62, 8, 2).validate(),
        Err(MoeError::TooLarge {
            what: "intermediate",
            value: 1 << 62,
            max: MAX_DIM
        })
    );
    assert!(MoeConfig::new(MAX_DIM, MAX_DIM, 8, 2).validate().is_ok());
}
