//! The host model of expert-parallel dispatch and combine (see the crate docs).

use crate::CommError;

/// Which rank owns which expert: rank r owns experts `r·E/R .. (r+1)·E/R`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    experts: usize,
    ranks: usize,
}

impl Placement {
    /// `experts` over `ranks`; experts must be a positive multiple of ranks.
    ///
    /// ```
    /// assert!(moefuse_comm::Placement::new(128, 8).is_ok());
    /// assert!(moefuse_comm::Placement::new(10, 4).is_err());
    /// ```
    pub fn new(experts: usize, ranks: usize) -> Result<Self, CommError> {
        if ranks == 0 || experts == 0 || experts % ranks != 0 {
            return Err(CommError::Placement { experts, ranks });
        }
        Ok(Placement { experts, ranks })
    }

    /// Experts in total.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// World size.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Experts each rank owns.
    pub fn per_rank(&self) -> usize {
        self.experts / self.ranks
    }

    /// The rank that owns expert `e`.
    pub fn owner(&self, e: usize) -> usize {
        e / self.per_rank()
    }

    /// Expert `e`'s index among its owner's experts.
    pub fn local(&self, e: usize) -> usize {
        e % self.per_rank()
    }

    fn check_rank(&self, rank: usize) -> Result<(), CommError> {
        if rank >= self.ranks {
            return Err(CommError::Rank {
                rank,
                ranks: self.ranks,
            });
        }
        Ok(())
    }
}

/// One token sent to one destination: the top-k slots (and so the local experts) it feeds
/// there, ascending by slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Send {
    /// Token index at the source.
    pub token: usize,
    /// Top-k slots of the token routed to this destination.
    pub slots: Vec<usize>,
}

/// What one rank sends: for each destination rank, its routed tokens in token order,
/// each once however many of the destination's experts it feeds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendPlan {
    /// The sending rank.
    pub rank: usize,
    /// Tokens on this rank.
    pub tokens: usize,
    /// Top-k of the routing.
    pub top_k: usize,
    /// Expert of each (token, slot), `tokens × top_k`.
    pub topk_ids: Vec<usize>,
    /// `to[d]`: what goes to rank d.
    pub to: Vec<Vec<Send>>,
}

impl SendPlan {
    /// The plan of `rank` for its `topk_ids` (`tokens × top_k`, row-major).
    pub fn build(
        place: &Placement,
        rank: usize,
        topk_ids: &[i64],
        top_k: usize,
    ) -> Result<Self, CommError> {
        place.check_rank(rank)?;
        if top_k == 0 || topk_ids.len() % top_k != 0 {
            return Err(CommError::Shape {
                len: topk_ids.len(),
                top_k,
            });
        }
        let tokens = topk_ids.len() / top_k;
        let mut ids = Vec::with_capacity(topk_ids.len());
        for (i, &id) in topk_ids.iter().enumerate() {
            if id < 0 || id as usize >= place.experts() {
                return Err(CommError::ExpertId {
                    token: i / top_k,
                    slot: i % top_k,
                    id,
                    experts: place.experts(),
                });
            }
            ids.push(id as usize);
        }
        let mut to: Vec<Vec<Send>> = vec![Vec::new(); place.ranks()];
        for token in 0..tokens {
            for slot in 0..top_k {
                let dest = place.owner(ids[token * top_k + slot]);
                match to[dest].last_mut() {
                    Some(last) if last.token == token => last.slots.push(slot),
                    _ => to[dest].push(Send {
                        token,
                        slots: vec![slot],
                    }),
                }
            }
        }
        Ok(SendPlan {
            rank,
            tokens,
            top_k,
            topk_ids: ids,
            to,
        })
    }

    /// Rows sent to `dest` (each token once).
    pub fn sent_to(&self, dest: usize) -> usize {
        self.to[dest].len()
    }
}

/// One row of a receive buffer: a (source rank, token, slot) routed to a local expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvRow {
    /// Sending rank.
    pub src: usize,
    /// Token index at the source.
    pub token: usize,
    /// Top-k slot at the source (selects the routing weight in combine).
    pub slot: usize,
    /// Index of the token's copy in the staging area (one per (src, token)).
    pub staged: usize,
}

/// One rank's receive side: the staging area (each received token once, by source rank
/// then token) and the expert-major rows the grouped GEMM reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiveLayout {
    /// The receiving rank.
    pub rank: usize,
    /// (source rank, token) of each staged row.
    pub staging: Vec<(usize, usize)>,
    /// Rows grouped by local expert, stable in (source rank, token, slot) order.
    pub rows: Vec<RecvRow>,
    /// Prefix-sum ends of each local expert's rows (the grouped GEMM's offsets).
    pub offsets: Vec<i32>,
}

impl ReceiveLayout {
    /// The layout of `rank` given every rank's send plan (indexed by source rank).
    pub fn build(place: &Placement, rank: usize, plans: &[SendPlan]) -> Result<Self, CommError> {
        place.check_rank(rank)?;
        if plans.len() != place.ranks() {
            return Err(CommError::Rank {
                rank: plans.len(),
                ranks: place.ranks(),
            });
        }
        let mut staging = Vec::new();
        let mut per_expert: Vec<Vec<RecvRow>> = vec![Vec::new(); place.per_rank()];
        for plan in plans {
            for send in &plan.to[rank] {
                let staged = staging.len();
                staging.push((plan.rank, send.token));
                for &slot in &send.slots {
                    let e = plan.topk_ids[send.token * plan.top_k + slot];
                    per_expert[place.local(e)].push(RecvRow {
                        src: plan.rank,
                        token: send.token,
                        slot,
                        staged,
                    });
                }
            }
        }
        let mut offsets = Vec::with_capacity(per_expert.len());
        let mut rows = Vec::new();
        for group in per_expert {
            rows.extend(group);
            offsets.push(rows.len() as i32);
        }
        Ok(ReceiveLayout {
            rank,
            staging,
            rows,
            offsets,
        })
    }
}

/// Combine for source rank `rank`: `out[t] = Σ_slot w[t, slot] · y_row(t, slot)`, where
/// `outputs[d]` holds rank d's expert outputs in its receive layout's row order
/// (`rows × hidden`). Weights are applied in fp32 and summed in slot order (deterministic);
/// the result is f32 `[tokens, hidden]`.
pub fn combine(
    plan: &SendPlan,
    weights: &[f32],
    layouts: &[ReceiveLayout],
    outputs: &[&[f32]],
    hidden: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; plan.tokens * hidden];
    // Where each (token, slot) of this rank landed: (destination, row).
    let mut landed = vec![(usize::MAX, usize::MAX); plan.tokens * plan.top_k];
    for (d, layout) in layouts.iter().enumerate() {
        for (r, row) in layout.rows.iter().enumerate() {
            if row.src == plan.rank {
                landed[row.token * plan.top_k + row.slot] = (d, r);
            }
        }
    }
    for t in 0..plan.tokens {
        for slot in 0..plan.top_k {
            let (d, r) = landed[t * plan.top_k + slot];
            let w = weights[t * plan.top_k + slot];
            let y = &outputs[d][r * hidden..(r + 1) * hidden];
            for (o, &v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(y) {
                *o += w * v;
            }
        }
    }
    out
}

/// Buffer sizes fixed once from a token capacity: no per-expert capacity, no dropped tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Most tokens any rank dispatches in one call.
    pub max_tokens: usize,
    /// Top-k of the routing.
    pub top_k: usize,
    /// The placement.
    pub place: Placement,
}

impl Capacity {
    /// Staged rows a rank can receive: every token of every rank, once.
    ///
    /// ```
    /// let place = moefuse_comm::Placement::new(128, 8)?;
    /// let cap = moefuse_comm::Capacity { max_tokens: 4096, top_k: 8, place };
    /// assert_eq!(cap.staging_rows(), 8 * 4096);
    /// assert_eq!(cap.expert_rows(), 8 * 4096 * 8);
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn staging_rows(&self) -> usize {
        self.place.ranks() * self.max_tokens
    }

    /// Expert-major rows a rank can receive: every token of every rank times the slots
    /// that can land on one rank (`min(top_k, experts per rank)`).
    pub fn expert_rows(&self) -> usize {
        self.staging_rows() * self.top_k.min(self.place.per_rank())
    }

    /// Rejects a dispatch of `tokens` tokens with `top_k` slots before any launch.
    pub fn check_dispatch(&self, tokens: usize, top_k: usize) -> Result<(), CommError> {
        let err = |what, needed, capacity| CommError::Capacity {
            what,
            needed,
            capacity,
            max_tokens: self.max_tokens,
            top_k: self.top_k,
        };
        if tokens > self.max_tokens {
            return Err(err("tokens per rank", tokens, self.max_tokens));
        }
        if top_k > self.top_k {
            return Err(err("top_k", top_k, self.top_k));
        }
        Ok(())
    }

    /// Checks a receive layout fits the buffers (always true after `check_dispatch` on
    /// every rank; a guard for hand-made layouts).
    pub fn check_layout(&self, layout: &ReceiveLayout) -> Result<(), CommError> {
        let err = |what, needed, capacity| CommError::Capacity {
            what,
            needed,
            capacity,
            max_tokens: self.max_tokens,
            top_k: self.top_k,
        };
        if layout.staging.len() > self.staging_rows() {
            return Err(err(
                "staged rows",
                layout.staging.len(),
                self.staging_rows(),
            ));
        }
        if layout.rows.len() > self.expert_rows() {
            return Err(err("expert rows", layout.rows.len(), self.expert_rows()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64 for reproducible random routings.
    fn rng(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut s = seed;
        move |n| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) % n
        }
    }

    /// Distinct experts per token, as routers produce; some ranks send nothing.
    fn routing(
        place: &Placement,
        tokens: usize,
        top_k: usize,
        next: &mut impl FnMut(u64) -> u64,
    ) -> Vec<i64> {
        let mut ids = Vec::new();
        for _ in 0..tokens {
            let mut chosen: Vec<i64> = Vec::new();
            while chosen.len() < top_k {
                let e = next(place.experts() as u64) as i64;
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            ids.extend(chosen);
        }
        ids
    }

    #[test]
    fn every_routed_slot_lands_once_at_its_owner_in_stable_order() {
        for (ranks, experts, top_k) in [(1, 8, 2), (2, 16, 4), (4, 128, 8), (8, 256, 8), (8, 8, 1)]
        {
            let place = Placement::new(experts, ranks).unwrap();
            let mut next = rng(ranks as u64 * 1000 + experts as u64);
            let tokens: Vec<usize> = (0..ranks)
                .map(|r| if r == 1 { 0 } else { 1 + next(300) as usize })
                .collect();
            let ids: Vec<Vec<i64>> = tokens
                .iter()
                .map(|&t| routing(&place, t, top_k, &mut next))
                .collect();
            let plans: Vec<SendPlan> = (0..ranks)
                .map(|r| SendPlan::build(&place, r, &ids[r], top_k).unwrap())
                .collect();
            let layouts: Vec<ReceiveLayout> = (0..ranks)
                .map(|r| ReceiveLayout::build(&place, r, &plans).unwrap())
                .collect();
            let mut seen = std::collections::HashSet::new();
            for (d, layout) in layouts.iter().enumerate() {
                let mut start = 0usize;
                for (le, &end) in layout.offsets.iter().enumerate() {
                    let group = &layout.rows[start..end as usize];
                    for row in group {
                        let e = plans[row.src].topk_ids[row.token * top_k + row.slot];
                        assert_eq!(
                            (place.owner(e), place.local(e)),
                            (d, le),
                            "row at the wrong expert"
                        );
                        assert!(
                            seen.insert((row.src, row.token, row.slot)),
                            "slot delivered twice"
                        );
                        assert_eq!(layout.staging[row.staged], (row.src, row.token));
                    }
                    assert!(
                        group.windows(2).all(|w| (w[0].src, w[0].token, w[0].slot)
                            < (w[1].src, w[1].token, w[1].slot)),
                        "order not stable"
                    );
                    start = end as usize;
                }
                // Each (src, token) is staged once per destination.
                let mut staged = layout.staging.clone();
                staged.dedup();
                assert_eq!(staged.len(), layout.staging.len());
                for (s, plan) in plans.iter().enumerate() {
                    let staged_from_s = layout.staging.iter().filter(|x| x.0 == s).count();
                    assert_eq!(staged_from_s, plan.sent_to(d));
                }
            }
            assert_eq!(
                seen.len(),
                tokens.iter().sum::<usize>() * top_k,
                "ranks={ranks} experts={experts}"
            );
        }
    }

    #[test]
    fn combine_equals_direct_weighted_sum() {
        let (ranks, experts, top_k, hidden) = (4, 32, 4, 3);
        let place = Placement::new(experts, ranks).unwrap();
        let mut next = rng(7);
        let ids: Vec<Vec<i64>> = (0..ranks)
            .map(|_| routing(&place, 50, top_k, &mut next))
            .collect();
        let plans: Vec<SendPlan> = (0..ranks)
            .map(|r| SendPlan::build(&place, r, &ids[r], top_k).unwrap())
            .collect();
        let layouts: Vec<ReceiveLayout> = (0..ranks)
            .map(|r| ReceiveLayout::build(&place, r, &plans).unwrap())
            .collect();
        // Expert e maps token (s, t) to x(s, t) · (e + 1), x(s, t)[h] = s + t/100 + h.
        let x = |s: usize, t: usize, h: usize| s as f32 + t as f32 / 100.0 + h as f32;
        let outputs: Vec<Vec<f32>> = layouts
            .iter()
            .map(|l| {
                l.rows
                    .iter()
                    .flat_map(|r| {
                        let e = plans[r.src].topk_ids[r.token * top_k + r.slot];
                        (0..hidden).map(move |h| x(r.src, r.token, h) * (e + 1) as f32)
                    })
                    .collect()
            })
            .collect();
        let outs: Vec<&[f32]> = outputs.iter().map(|v| v.as_slice()).collect();
        for (s, plan) in plans.iter().enumerate() {
            let weights: Vec<f32> = (0..50 * top_k)
                .map(|i| 0.1 + (i % 7) as f32 / 10.0)
                .collect();
            let got = combine(plan, &weights, &layouts, &outs, hidden);
            for t in 0..50 {
                for h in 0..hidden {
                    let want: f32 = (0..top_k)
                        .map(|k| {
                            weights[t * top_k + k]
                                * x(s, t, h)
                                * (plans[s].topk_ids[t * top_k + k] + 1) as f32
                        })
                        .sum();
                    assert!(
                        (got[t * hidden + h] - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "rank {s} token {t}"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_input_is_rejected_with_its_values() {
        let place = Placement::new(8, 2).unwrap();
        assert_eq!(
            SendPlan::build(&place, 2, &[0], 1).unwrap_err(),
            CommError::Rank { rank: 2, ranks: 2 }
        );
        assert_eq!(
            SendPlan::build(&place, 0, &[0, 1, 2], 2).unwrap_err(),
            CommError::Shape { len: 3, top_k: 2 }
        );
        assert_eq!(
            SendPlan::build(&place, 0, &[0, 9], 2).unwrap_err(),
            CommError::ExpertId {
                token: 0,
                slot: 1,
                id: 9,
                experts: 8
            }
        );
        let cap = Capacity {
            max_tokens: 16,
            top_k: 2,
            place,
        };
        assert!(matches!(
            cap.check_dispatch(17, 2),
            Err(CommError::Capacity {
                needed: 17,
                capacity: 16,
                ..
            })
        ));
        assert!(matches!(
            cap.check_dispatch(16, 3),
            Err(CommError::Capacity { what: "top_k", .. })
        ));
    }

    #[test]
    fn worst_case_routing_fills_capacity_exactly() {
        // Every token of every rank picks top_k experts of rank 0.
        let place = Placement::new(16, 4).unwrap();
        let cap = Capacity {
            max_tokens: 10,
            top_k: 4,
            place,
        };
        let ids: Vec<i64> = (0..10).flat_map(|_| [0, 1, 2, 3]).collect();
        let plans: Vec<SendPlan> = (0..4)
            .map(|r| SendPlan::build(&place, r, &ids, 4).unwrap())
            .collect();
        let layout = ReceiveLayout::build(&place, 0, &plans).unwrap();
        assert_eq!(layout.rows.len(), cap.expert_rows());
        assert_eq!(layout.staging.len(), cap.staging_rows());
        cap.check_layout(&layout).unwrap();
    }
}
