//! The grouped-GEMM benchmark cases of the grouped-gemm issue, shared with the PyTorch
//! baseline script through `bench_grouped --list-cases` (JSON), so both time identical
//! shapes and identical per-expert row counts.

use serde::Serialize;

/// Which product a case times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// `Y = X · W_eᵀ` with W `[E, N, K]`.
    Fwd,
    /// `dX = dY · W_e` (the forward's data gradient).
    Dgrad,
    /// `dW_e = dY_eᵀ · X_e`, `[E, N, K]`.
    Wgrad,
}

/// One benchmark case.
#[derive(Debug, Clone, Serialize)]
pub struct Case {
    /// e.g. `qwen3-30b-a3b-ep1-gate_up-fwd`.
    pub name: String,
    /// The pass.
    pub pass: Pass,
    /// Forward output columns (N) and input columns (K); W is `[E, N, K]`.
    pub n: usize,
    /// See `n`.
    pub k: usize,
    /// Rows routed to each expert.
    pub sizes: Vec<usize>,
}

impl Case {
    /// Useful FLOPs: `2·Σm·N·K` for every pass.
    pub fn flops(&self) -> f64 {
        2.0 * self.sizes.iter().sum::<usize>() as f64 * self.n as f64 * self.k as f64
    }
}

/// `rows` spread evenly over `experts` (the first `rows % experts` get one more).
pub fn balanced(experts: usize, rows: usize) -> Vec<usize> {
    (0..experts)
        .map(|e| rows / experts + usize::from(e < rows % experts))
        .collect()
}

/// Zipf-like imbalance: expert e gets a share ∝ 1/(e+1), rounded so the total is `rows`.
pub fn zipf(experts: usize, rows: usize) -> Vec<usize> {
    let weights: Vec<f64> = (0..experts).map(|e| 1.0 / (e as f64 + 1.0)).collect();
    let total: f64 = weights.iter().sum();
    let mut sizes: Vec<usize> = weights
        .iter()
        .map(|w| (w / total * rows as f64).floor() as usize)
        .collect();
    let short = rows - sizes.iter().sum::<usize>();
    sizes[0] += short;
    sizes
}

/// A router's counts: each of `tokens` tokens picks `top_k` distinct experts uniformly (fixed
/// seed), so every expert gets about `tokens · top_k / experts` rows with binomial spread.
pub fn routed(experts: usize, tokens: usize, top_k: usize) -> Vec<usize> {
    let mut rng = moefuse_testkit::Rng::new(0x5e_ed0f_70e5);
    let mut sizes = vec![0; experts];
    for _ in 0..tokens {
        for e in rng.distinct(experts, top_k) {
            sizes[e as usize] += 1;
        }
    }
    sizes
}

/// Every case: each model's gate_up and down forward; dgrad and wgrad for two models;
/// skewed, zero-row and decode-sized routing on Qwen3-30B-A3B.
pub fn all() -> Vec<Case> {
    // (model, experts, rows, gate_up N x K, down N x K)
    type Model = (&'static str, usize, usize, (usize, usize), (usize, usize));
    let models: &[Model] = &[
        ("qwen3-30b-a3b-ep1", 128, 65536, (1536, 2048), (2048, 768)),
        ("qwen3-30b-a3b-ep8", 16, 65536, (1536, 2048), (2048, 768)),
        ("deepseek-v3-ep8", 32, 65536, (4096, 7168), (7168, 2048)),
        ("mixtral-8x7b-ep1", 8, 16384, (28672, 4096), (4096, 14336)),
        ("gpt-oss-120b-ep8", 16, 32768, (5760, 2880), (2880, 2880)),
    ];
    let mut out = Vec::new();
    let case = |name: String, pass, (n, k): (usize, usize), sizes| Case {
        name,
        pass,
        n,
        k,
        sizes,
    };
    for &(model, e, rows, gate_up, down) in models {
        for (proj, nk) in [("gate_up", gate_up), ("down", down)] {
            out.push(case(
                format!("{model}-{proj}-fwd"),
                Pass::Fwd,
                nk,
                balanced(e, rows),
            ));
        }
    }
    for &(model, e, rows, gate_up, down) in &models[..3] {
        if model == "qwen3-30b-a3b-ep8" {
            continue;
        }
        for (proj, nk) in [("gate_up", gate_up), ("down", down)] {
            out.push(case(
                format!("{model}-{proj}-dgrad"),
                Pass::Dgrad,
                nk,
                balanced(e, rows),
            ));
            out.push(case(
                format!("{model}-{proj}-wgrad"),
                Pass::Wgrad,
                nk,
                balanced(e, rows),
            ));
        }
    }
    // Qwen3-30B-A3B at EP1 (the first model) for the routing variants.
    let (_, e, rows, gate_up, down) = models[0];
    out.push(case(
        "qwen3-30b-a3b-ep1-gate_up-fwd-skew".into(),
        Pass::Fwd,
        gate_up,
        zipf(e, rows),
    ));
    // Realistic routing (8192 tokens, top-8 of 128: ~512 ± 22 rows per expert), both
    // projections: the case the tile heuristic's ragged-group model is about.
    for (proj, nk) in [("gate_up", gate_up), ("down", down)] {
        out.push(case(
            format!("qwen3-30b-a3b-ep1-{proj}-fwd-routed"),
            Pass::Fwd,
            nk,
            routed(e, 8192, 8),
        ));
    }
    // GPT-OSS-120B at EP1 (8192 tokens, top-4 of 128: ~256 rows per expert), forward and
    // dgrad of both projections: the group size where the dgrads' 1x1 and 2x1 contiguous
    // tiles measured 2x apart inside the layer (H100, docs/perf-notes.md, session 20).
    let gpt_oss = routed(128, 8192, 4);
    let (_, _, _, oss_gate_up, oss_down) = models[4];
    for (proj, nk) in [("gate_up", oss_gate_up), ("down", oss_down)] {
        for (pass, name) in [(Pass::Fwd, "fwd"), (Pass::Dgrad, "dgrad")] {
            out.push(case(
                format!("gpt-oss-120b-ep1-{proj}-{name}-routed"),
                pass,
                nk,
                gpt_oss.clone(),
            ));
        }
    }
    let mut one = vec![0; e];
    one[7] = rows;
    out.push(case(
        "qwen3-30b-a3b-ep1-gate_up-fwd-one_expert".into(),
        Pass::Fwd,
        gate_up,
        one,
    ));
    let mut zero = balanced(e, rows);
    for ex in (0..e).step_by(4) {
        zero[ex] = 0;
    }
    let total: usize = zero.iter().sum();
    zero[1] += rows - total;
    out.push(case(
        "qwen3-30b-a3b-ep1-gate_up-fwd-zero".into(),
        Pass::Fwd,
        gate_up,
        zero,
    ));
    for m in [8, 64, 512] {
        out.push(case(
            format!("qwen3-30b-a3b-ep1-gate_up-fwd-decode{m}"),
            Pass::Fwd,
            gate_up,
            balanced(e, m),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routings_keep_their_row_totals() {
        assert_eq!(balanced(128, 65536).iter().sum::<usize>(), 65536);
        assert_eq!(balanced(128, 8).iter().filter(|&&s| s > 0).count(), 8);
        let z = zipf(128, 65536);
        assert_eq!(z.iter().sum::<usize>(), 65536);
        assert!(z[0] > 10 * z[127]);
        let r = routed(128, 8192, 8);
        assert_eq!(r.iter().sum::<usize>(), 65536);
        assert!(r.iter().all(|&s| (400..640).contains(&s)), "{r:?}");
        assert!(r.iter().any(|&s| s != 512));
        let oss = routed(128, 8192, 4);
        assert_eq!(oss.iter().sum::<usize>(), 32768);
        assert!(oss.iter().all(|&s| (180..340).contains(&s)), "{oss:?}");
        for c in all() {
            assert!(c.sizes.iter().sum::<usize>() > 0, "{}", c.name);
        }
    }
}
