//! [`EpLayerMemory`]: what an [`EpMoeLayer`](crate::EpMoeLayer) holds on its device.

use moefuse_comm::EpMemory;
use std::fmt;

/// Bytes of device memory one rank's [`EpMoeLayer`](crate::EpMoeLayer) holds, all allocated
/// at construction.
///
/// ```
/// use moefuse_comm::EpMemory;
/// let fwd = EpMemory { symmetric: 2 << 20, local: 1 << 20, staging_rows: 8, recv_rows: 64 };
/// let mut m = moefuse_ep::EpLayerMemory::default();
/// m.add_exchange(fwd);
/// m.layer = 1 << 20;
/// assert_eq!((m.exchanges, m.total()), (1, 4 << 20));
/// assert!(m.to_string().starts_with("1 exchange(s): 2.0 MiB symmetric"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EpLayerMemory {
    /// Exchanges held: none at one rank (the single-GPU layer exchanges nothing), the
    /// forward's from two ranks on, and in Training also the backward's two (dy out and
    /// dx back; `d_topk_weights` back).
    pub exchanges: usize,
    /// The exchanges' NVSHMEM symmetric heap bytes (the same on every rank), summed.
    pub symmetric: usize,
    /// The exchanges' ordinary device bytes (received rows, counts), summed.
    pub exchange_local: usize,
    /// Staging rows of the forward exchange (`ranks · max_tokens`; 0 at one rank): the
    /// sizing is `max_tokens · top_k`-bound, with no capacity factor.
    pub staging_rows: usize,
    /// Expert-major rows the forward exchange can deliver to this rank (0 at one rank).
    pub recv_rows: usize,
    /// The layer's own buffers besides the exchanges: at one rank the single-GPU layer's
    /// `MoeLayer::memory()` total and its workspace; from two ranks the routing, the
    /// expert-major intermediates, the GEMM workspace and (Training) the backward's rows.
    pub layer: usize,
}

impl EpLayerMemory {
    /// Counts one exchange in (the first is taken as the forward's for the row counts).
    ///
    /// ```
    /// let e = moefuse_comm::EpMemory { symmetric: 1, local: 2, staging_rows: 3, recv_rows: 4 };
    /// let mut m = moefuse_ep::EpLayerMemory::default();
    /// m.add_exchange(e);
    /// m.add_exchange(e);
    /// assert_eq!((m.exchanges, m.symmetric, m.recv_rows), (2, 2, 4));
    /// ```
    pub fn add_exchange(&mut self, e: EpMemory) {
        if self.exchanges == 0 {
            self.staging_rows = e.staging_rows;
            self.recv_rows = e.recv_rows;
        }
        self.exchanges += 1;
        self.symmetric += e.symmetric;
        self.exchange_local += e.local;
    }

    /// Everything: `symmetric + exchange_local + layer`.
    ///
    /// ```
    /// let m = moefuse_ep::EpLayerMemory { layer: 5, ..Default::default() };
    /// assert_eq!(m.total(), 5);
    /// ```
    pub fn total(&self) -> usize {
        self.symmetric + self.exchange_local + self.layer
    }
}

impl fmt::Display for EpLayerMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "{} exchange(s): {:.1} MiB symmetric + {:.1} MiB local ({} staging rows, {} receive rows); layer {:.1} MiB; total {:.1} MiB",
            self.exchanges,
            mib(self.symmetric),
            mib(self.exchange_local),
            self.staging_rows,
            self.recv_rows,
            mib(self.layer),
            mib(self.total())
        )
    }
}
