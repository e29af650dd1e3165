//! The expert-major permutation: counts, offsets, stability, inverse, empty experts.

#![forbid(unsafe_code)]

mod common;

use common::Rng;
use moefuse::reference::permutation;
use moefuse::MoeError;

#[test]
fn random_routings_permute_correctly() {
    let mut rng = Rng::new(4);
    for case in 0..40 {
        let t = 1 + rng.below(60);
        let e = 1 + rng.below(12);
        let k = 1 + rng.below(e);
        // Route only to a random subset of experts so that some are empty.
        let used = (k + rng.below(e - k + 1)).max(k);
        let pool = rng.distinct(used, e);
        let ids: Vec<i32> = (0..t)
            .flat_map(|_| {
                rng.distinct(k, used)
                    .into_iter()
                    .map(|i| pool[i] as i32)
                    .collect::<Vec<_>>()
            })
            .collect();
        let p = permutation(&ids, k, e).unwrap();
        let what = format!("case {case}: T={t} E={e} k={k}");
        assert_eq!(p.rows(), t * k, "{what}");
        assert_eq!(p.counts.len(), e, "{what}");
        let mut end = 0;
        for ex in 0..e {
            let want = ids.iter().filter(|&&i| i == ex as i32).count() as i32;
            assert_eq!(p.counts[ex], want, "{what}: count of expert {ex}");
            end += want;
            assert_eq!(p.offsets[ex], end, "{what}: offsets are prefix-sum ends");
            let rows = p.expert_rows(ex);
            assert_eq!(rows.len() as i32, want, "{what}");
            if !pool.contains(&ex) {
                assert!(rows.is_empty(), "{what}: unused expert {ex} has rows");
            }
            for r in rows.clone() {
                assert_eq!(
                    ids[p.source_of[r] as usize], ex as i32,
                    "{what}: row {r} in expert {ex}"
                );
            }
            // Stable: ascending (token, slot), hence ascending token.
            let toks: Vec<i32> = rows.map(|r| p.source_of[r] / k as i32).collect();
            assert!(
                toks.windows(2).all(|w| w[0] < w[1]),
                "{what}: expert {ex} rows not in token order"
            );
        }
        assert_eq!(*p.offsets.last().unwrap() as usize, t * k);
        for pair in 0..t * k {
            assert_eq!(
                p.source_of[p.row_of[pair] as usize] as usize, pair,
                "{what}: inverse"
            );
        }
        for r in 0..t * k {
            assert_eq!(
                p.row_of[p.source_of[r] as usize] as usize, r,
                "{what}: inverse"
            );
        }
        let expert_of = p.expert_of_rows();
        assert!(
            expert_of.windows(2).all(|w| w[0] <= w[1]),
            "{what}: expert-major"
        );
    }
}

#[test]
fn zero_token_experts_and_errors() {
    let p = permutation(&[3, 3, 3], 1, 5).unwrap();
    assert_eq!(p.counts, vec![0, 0, 0, 3, 0]);
    assert_eq!(p.offsets, vec![0, 0, 0, 3, 3]);
    assert_eq!(p.source_of, vec![0, 1, 2]);
    assert!(p.expert_rows(0).is_empty() && p.expert_rows(4).is_empty());
    assert_eq!(
        permutation(&[0, -1], 2, 4),
        Err(MoeError::ExpertIdOutOfRange {
            token: 0,
            slot: 1,
            id: -1,
            experts: 4
        })
    );
    assert_eq!(
        permutation(&[0, 1, 2, 3, 1, 3], 3, 4),
        Err(MoeError::DuplicateExpert {
            token: 1,
            first_slot: 0,
            slot: 2,
            id: 3
        })
    );
    assert!(matches!(
        permutation(&[0, 1, 2], 2, 4),
        Err(MoeError::NotAMultiple {
            len: 3,
            multiple: 2,
            ..
        })
    ));
}
