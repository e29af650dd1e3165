//! NVSHMEM teams: the world, and strided splits of a parent team.

use crate::{raw, CommError, Runtime};
use cudarc::driver::CudaStream;
use std::sync::Arc;

const TEAM_WORLD: i32 = 0;
const TEAM_INVALID: i32 = -1;

/// A set of PEs with its own numbering. The world team lives as long as the runtime; a
/// split team is destroyed on drop.
pub struct Team {
    runtime: Arc<Runtime>,
    handle: i32,
    owned: bool,
}

impl Team {
    /// Every PE, numbered as the runtime numbers them.
    ///
    /// ```no_run
    /// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>) {
    /// let world = moefuse_comm::Team::world(rt);
    /// assert_eq!(world.size(), rt.ranks());
    /// # }
    /// ```
    pub fn world(runtime: &Arc<Runtime>) -> Team {
        Team {
            runtime: runtime.clone(),
            handle: TEAM_WORLD,
            owned: false,
        }
    }

    /// PEs `start, start + stride, …` (`size` of them, numbered in this team) of `self`.
    /// Collective over `self`; PEs outside the new team get `Ok(None)`. Refused with
    /// [`CommError::Unsupported`] when several PEs share a GPU (NVSHMEM would abort).
    ///
    /// ```no_run
    /// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>) -> Result<(), moefuse_comm::CommError> {
    /// let world = moefuse_comm::Team::world(rt);
    /// let evens = world.split_strided(0, 2, rt.ranks().div_ceil(2))?;   // Some on even PEs
    /// # Ok(()) }
    /// ```
    pub fn split_strided(
        &self,
        start: usize,
        stride: usize,
        size: usize,
    ) -> Result<Option<Team>, CommError> {
        let n = self.size();
        if size == 0 || stride == 0 || start + (size - 1) * stride >= n {
            return Err(CommError::Config {
                what: "team split (start + (size - 1) * stride)",
                value: start + size.saturating_sub(1) * stride,
                rule: "below the parent team's size, with size and stride positive",
            });
        }
        let host = self.runtime.host();
        // NOTES: with several PEs on one GPU ("limited MPG", no MPS) NVSHMEM 3.4.5 aborts
        // the process inside team_split_strided (measured on the H200): refuse first.
        self.runtime.refuse_in_mpg("team split")?;
        let mut handle = TEAM_INVALID;
        let status = raw::team_split_strided(
            host,
            self.handle,
            start as i32,
            stride as i32,
            size as i32,
            &mut handle,
        );
        if status != 0 {
            return Err(CommError::Nvshmem {
                call: "nvshmem_team_split_strided",
                status,
            });
        }
        Ok((handle != TEAM_INVALID).then(|| Team {
            runtime: self.runtime.clone(),
            handle,
            owned: true,
        }))
    }

    /// This PE's number in the team.
    pub fn rank(&self) -> usize {
        raw::team_my_pe(self.runtime.host(), self.handle) as usize
    }

    /// PEs in the team.
    pub fn size(&self) -> usize {
        raw::team_n_pes(self.runtime.host(), self.handle) as usize
    }

    /// The world PE of team member `pe`.
    pub fn world_pe(&self, pe: usize) -> Result<usize, CommError> {
        let w = raw::team_translate_pe(self.runtime.host(), self.handle, pe as i32, TEAM_WORLD);
        if w < 0 {
            return Err(CommError::Rank {
                rank: pe,
                ranks: self.size(),
            });
        }
        Ok(w as usize)
    }

    /// A barrier-free synchronisation of the team's PEs, ordered on `stream`.
    pub fn sync_on_stream(&self, stream: &CudaStream) -> Result<(), CommError> {
        self.runtime.refuse_in_mpg("team sync on a stream")?;
        let status =
            raw::team_sync_on_stream(self.runtime.host(), self.handle, stream.cu_stream() as _);
        if status != 0 {
            return Err(CommError::Nvshmem {
                call: "nvshmemx_team_sync_on_stream",
                status,
            });
        }
        Ok(())
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        if self.owned {
            raw::team_destroy(self.runtime.host(), self.handle);
        }
    }
}
