//! Shared test helpers: a SplitMix64 generator and finite-difference comparison.
#![allow(dead_code)]

/// SplitMix64: small, seedable, good enough for test inputs.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [-scale, scale).
    pub fn sym(&mut self, scale: f64) -> f32 {
        ((self.unit() * 2.0 - 1.0) * scale) as f32
    }

    pub fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| self.sym(scale)).collect()
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `k` distinct values of 0..n, in random order.
    pub fn distinct(&mut self, k: usize, n: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = i + self.below(n - i);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

/// `|a − b| ≤ rel·max(|a|, |b|) + abs`.
pub fn close(a: f64, b: f64, rel: f64, abs: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()) + abs
}

/// `Σ r·y` in f64.
pub fn weighted_sum(r: &[f32], y: &[f32]) -> f64 {
    r.iter()
        .zip(y)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum()
}
