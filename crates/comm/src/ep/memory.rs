//! [`EpMemory`]: the device memory one [`ExpertParallel`](super::ExpertParallel) holds,
//! read off its buffers.

use super::{ExpertParallel, Local, Symmetric};
use std::fmt;
use std::mem::size_of;

/// Bytes of device memory one [`ExpertParallel`](super::ExpertParallel) holds, all allocated
/// once at construction from `max_tokens · top_k` (worst case, no capacity factor: every
/// rank's tokens may all come here).
///
/// ```
/// let m = moefuse_comm::EpMemory { symmetric: 3 << 20, local: 1 << 20, staging_rows: 64, recv_rows: 512 };
/// assert_eq!(m.total(), 4 << 20);
/// assert!(m.to_string().contains("3.0 MiB symmetric"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpMemory {
    /// On the NVSHMEM symmetric heap (every rank holds the same): the staging rows (none
    /// when rows are pulled: then each rank's own rows instead), their info and weights,
    /// the combine partials, the count rows, the signals and the construction handshake's
    /// table.
    pub symmetric: usize,
    /// Ordinary device memory: the received expert-major rows (none when rows are pulled),
    /// their weights and origins, and the count and offset state.
    pub local: usize,
    /// Staging rows (`ranks · max_tokens`): one per (source rank, token).
    pub staging_rows: usize,
    /// Expert-major rows this rank can receive (`staging_rows · min(top_k, experts per rank)`).
    pub recv_rows: usize,
}

impl EpMemory {
    /// `symmetric + local`.
    ///
    /// ```
    /// let m = moefuse_comm::EpMemory { symmetric: 1, local: 2, staging_rows: 0, recv_rows: 0 };
    /// assert_eq!(m.total(), 3);
    /// ```
    pub fn total(&self) -> usize {
        self.symmetric + self.local
    }
}

impl fmt::Display for EpMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "{:.1} MiB symmetric + {:.1} MiB local ({} staging rows, {} receive rows)",
            mib(self.symmetric),
            mib(self.local),
            self.staging_rows,
            self.recv_rows
        )
    }
}

fn bytes<T>(len: usize) -> usize {
    len * size_of::<T>()
}

impl Symmetric {
    fn bytes(&self) -> usize {
        bytes::<i32>(self.meta.len())
            + bytes::<u64>(self.meta_sig.len())
            + bytes::<u16>(self.stage_x.len())
            + bytes::<i32>(self.stage_info.len())
            + bytes::<f32>(self.stage_w.len())
            + bytes::<u16>(self.x_home.len() + self.y_slots.len() + self.dy_home.len())
            + bytes::<u64>(self.bwd_sig.len() + self.bwd_comb_sig.len())
            + bytes::<u64>(self.disp_sig.len())
            + bytes::<u16>(self.comb_x.len())
            + bytes::<u64>(self.comb_sig.len())
            + bytes::<u64>(self.hello.len())
    }
}

impl Local {
    fn bytes(&self) -> usize {
        let i32s = self.chunk_cnt.len()
            + self.pos_local.len()
            + self.tokpos.len()
            + self.counts_all.len()
            + self.dest_row_base.len()
            + self.stage_base.len()
            + self.comb_base.len()
            + self.src_base.len()
            + self.recv_offsets.len()
            + self.recv_origin.len()
            + self.recv_src.len();
        bytes::<i32>(i32s)
            + bytes::<u64>(self.epoch.len() + self.fault.len() + self.recv_dst.len())
            + bytes::<u32>(self.done.len() + self.status.len())
            + bytes::<u16>(self.recv_x.len())
            + bytes::<f32>(self.recv_w.len())
    }
}

impl ExpertParallel {
    /// The device memory this rank's instance holds ([`EpMemory`]).
    ///
    /// ```no_run
    /// # fn demo(ep: &moefuse_comm::ExpertParallel) {
    /// println!("{}", ep.memory()); // e.g. "1121.3 MiB symmetric + 1074.2 MiB local (...)"
    /// # }
    /// ```
    pub fn memory(&self) -> EpMemory {
        EpMemory {
            symmetric: self.sym.bytes(),
            local: self.local.bytes(),
            staging_rows: self.sym.stage_info.len() / (self.cfg.top_k + 1),
            recv_rows: self.local.recv_w.len(),
        }
    }
}
