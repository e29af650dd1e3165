//! `ExpertParallel::new`: the configuration handshake, then every buffer sized once.

use super::guard::{self, config_hash};
use super::params::{self, EpParams, FAULT_WORDS, HELLO_WORDS};
use super::{cuda, ptr, zeros, EpConfig, ExpertParallel, Kernels, Local, Symmetric};
use crate::device_module::{DeviceModule, HostWords};
use crate::{Capacity, CommError, Runtime, SymmetricBuffer};
use cudarc::driver::{result, sys, CudaStream};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Zeroes a symmetric buffer on `stream` (peers may only write it after a barrier).
fn zero<T>(buf: &SymmetricBuffer<T>, stream: &CudaStream) -> Result<(), CommError> {
    let bytes = buf.len() * std::mem::size_of::<T>();
    // SAFETY: the buffer is a live symmetric allocation of at least `bytes` bytes.
    unsafe {
        result::memset_d8_async(
            buf.device_ptr() as sys::CUdeviceptr,
            0,
            bytes,
            stream.cu_stream(),
        )
    }
    .map_err(cuda)
}

impl ExpertParallel {
    /// Checks `cfg`, compares it with every other rank's, agrees on a signal epoch base
    /// above any an earlier instance used, allocates every buffer and loads the kernels
    /// (collective: all ranks call it, in the same order). All later calls run on `stream`,
    /// which must belong to the runtime's device.
    ///
    /// Fails on every rank with [`CommError::ConfigMismatch`] when some rank passed other
    /// sizes (before any buffer sized from them exists); a rank whose `cfg` is invalid
    /// still takes part in the handshake (with a hash no valid configuration has), so its
    /// peers fail with that error instead of waiting for it, and it returns its own
    /// [`CommError::Config`]. NOTES: construction itself has no deadline: NVSHMEM's
    /// symmetric allocation and the handshake's barriers are NVSHMEM collectives, and a rank
    /// that never calls `new` holds the others there (the calls afterwards all have one).
    ///
    /// ```no_run
    /// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>,
    /// #         stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<(), moefuse_comm::CommError> {
    /// let cfg = moefuse_comm::EpConfig::new(128, 8, 2048, 4096);
    /// let ep = moefuse_comm::ExpertParallel::new(rt, stream, cfg)?;
    /// assert_eq!(ep.config(), cfg);
    /// # Ok(()) }
    /// ```
    pub fn new(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        cfg: EpConfig,
    ) -> Result<Self, CommError> {
        let (ranks, rank) = (runtime.ranks(), runtime.rank());
        let checked = cfg.check(ranks);
        let device = runtime.context().ordinal();
        if stream.context().ordinal() != device {
            return Err(CommError::WrongDevice {
                what: "stream",
                expected: device,
                found: stream.context().ordinal(),
            });
        }
        let module = DeviceModule::load(runtime, "ep")?;
        let kernels = Kernels {
            count: module.kernel("moefuse_ep_count")?,
            dispatch: module.kernel("moefuse_ep_dispatch")?,
            expand: module.kernel("moefuse_ep_expand")?,
            combine_send: module.kernel("moefuse_ep_combine_send")?,
            combine_reduce: module.kernel("moefuse_ep_combine_reduce")?,
            slots_signal: module.kernel("moefuse_ep_slots_signal")?,
            combine_slots: module.kernel("moefuse_ep_combine_slots")?,
            bwd_publish: module.kernel("moefuse_ep_bwd_publish")?,
            bwd_gather: module.kernel("moefuse_ep_bwd_gather")?,
            abort: module.kernel("moefuse_ep_abort")?,
        };
        let s = stream.as_ref();

        // Handshake: a table whose size depends only on the world (equal on every rank),
        // zeroed everywhere before anyone writes, one record from each rank, read after a
        // second barrier. Nothing sized from `cfg` is allocated before it agrees.
        let hash = match checked {
            Ok(_) => config_hash(&cfg),
            Err(_) => !config_hash(&cfg),
        };
        let hello = runtime.alloc::<u64>(ranks * HELLO_WORDS)?;
        zero(&hello, s)?;
        runtime.barrier_on_stream(s);
        let greet = EpParams {
            ranks: ranks as i32,
            rank: rank as i32,
            cfg_hash: hash,
            epoch_base: runtime.epoch_floor(),
            hello: hello.device_ptr(),
            ..EpParams::default()
        };
        let hello_kernel = module.kernel("moefuse_ep_hello")?;
        // SAFETY: `greet` mirrors `moefuse_ep_params`; the kernel reads only ranks, rank,
        // cfg_hash, epoch_base and writes `hello` (ranks x 4 words on every PE).
        unsafe { module.launch(hello_kernel, s, 1, 32, 0, &greet)? };
        runtime.barrier_on_stream(s);
        let mut table = vec![0u64; ranks * HELLO_WORDS];
        // SAFETY: `hello` holds `table.len()` words; the copy is synchronised below, before
        // `table` is read or `hello` dropped.
        unsafe { result::memcpy_dtoh_async(&mut table, hello.device_ptr(), stream.cu_stream()) }
            .map_err(cuda)?;
        stream.synchronize().map_err(cuda)?;
        let agreed = guard::agree(&table, rank, hash);
        let place = checked?;
        let epoch_base = agreed?;
        if cfg.pull_rows {
            // Every rank runs the same test on the same world (NVLink reachability is
            // symmetric), so all of them fail here together, before any sized allocation.
            for pe in 0..ranks {
                if hello.peer_ptr(pe)?.is_none() {
                    return Err(CommError::Unsupported(format!(
                        "pull_rows: rank {pe} is not reachable by load/store from rank {rank} (rows can only be read in place within one NVLink domain)"
                    )));
                }
            }
        }

        let (e, k, d, t) = (cfg.experts, cfg.top_k, cfg.hidden, cfg.max_tokens);
        let c = e + ranks;
        let cap = Capacity {
            max_tokens: t,
            top_k: k,
            place,
        };
        let staged = cap.staging_rows();
        let rows = cap.expert_rows();
        let comb_rows = t * k.min(ranks);
        // Rows pulled: no staged or expert-major row copies, each rank's own rows instead.
        let pull = cfg.pull_rows;
        let sym = Symmetric {
            meta: runtime.alloc(ranks * c)?,
            meta_sig: runtime.alloc(ranks)?,
            stage_x: runtime.alloc(if pull { 1 } else { staged * d })?,
            stage_info: runtime.alloc(staged * (k + 1))?,
            stage_w: runtime.alloc(staged * k)?,
            x_home: runtime.alloc(if pull { t * d } else { 1 })?,
            y_slots: runtime.alloc(if pull { t * k * d } else { 1 })?,
            dy_home: runtime.alloc(if pull { t * d } else { 1 })?,
            bwd_sig: runtime.alloc(ranks)?,
            bwd_comb_sig: runtime.alloc(ranks)?,
            disp_sig: runtime.alloc(ranks)?,
            // Pulled rows combine through y_slots instead of per-destination partials.
            comb_x: runtime.alloc(if pull { 1 } else { comb_rows * d })?,
            comb_sig: runtime.alloc(ranks)?,
            hello,
        };
        let peer_rows = if pull {
            let mut bases = Vec::with_capacity(ranks);
            for pe in 0..ranks {
                bases.push(sym.x_home.peer_ptr(pe)?.ok_or_else(|| {
                    CommError::Unsupported(format!(
                        "pull_rows: rank {pe} is not load/store reachable"
                    ))
                })?);
            }
            // SAFETY: each base is rank pe's `x_home`, `[t, d]` bf16, mapped for this device
            // by NVSHMEM; it is freed only in ExpertParallel's Drop, after the stream is idle,
            // and the PeerRows never leaves the instance (it is lent by `&` to launches on its
            // stream). A rank rewrites its x_home only in its next dispatch, after every
            // peer's combine of the previous call (the module's reuse rule).
            let rows = unsafe { moefuse_kernels::PeerRows::new(runtime.context(), &bases, t, d) };
            Some(rows.map_err(|e| CommError::Unsupported(format!("pull_rows: {e}")))?)
        } else {
            None
        };
        // Signals must start at zero on every rank before any peer can raise one.
        for sig in [
            &sym.meta_sig,
            &sym.disp_sig,
            &sym.comb_sig,
            &sym.bwd_sig,
            &sym.bwd_comb_sig,
        ] {
            zero(sig, s)?;
        }
        let local = Local {
            epoch: stream.clone_htod(&[epoch_base]).map_err(cuda)?,
            done: zeros(stream, 4)?,
            chunk_cnt: zeros(stream, t.div_ceil(params::CHUNK) * c)?,
            pos_local: zeros(stream, t * k)?,
            tokpos: zeros(stream, t * ranks)?,
            counts_all: zeros(stream, ranks * c)?,
            dest_row_base: zeros(stream, e)?,
            stage_base: zeros(stream, ranks)?,
            comb_base: zeros(stream, ranks)?,
            src_base: zeros(stream, ranks + 1)?,
            status: zeros(stream, 2)?,
            fault: zeros(stream, FAULT_WORDS)?,
            recv_x: zeros(stream, if pull { 1 } else { rows * d })?,
            recv_offsets: zeros(stream, place.per_rank())?,
            recv_w: zeros(stream, rows)?,
            recv_origin: zeros(stream, rows * 3)?,
            recv_src: zeros(stream, if pull { rows } else { 1 })?,
            recv_dst: zeros(stream, if pull { rows } else { 1 })?,
        };
        let fault_host = HostWords::new(runtime, FAULT_WORDS)?;
        runtime.barrier_on_stream(s);
        stream.synchronize().map_err(cuda)?;
        let base = EpParams {
            ranks: ranks as i32,
            rank: rank as i32,
            experts: e as i32,
            local_experts: place.per_rank() as i32,
            top_k: k as i32,
            hidden: d as i32,
            tokens: 0,
            max_tokens: t as i32,
            recv_rows_cap: rows as i64,
            meta: sym.meta.device_ptr(),
            meta_sig: sym.meta_sig.device_ptr(),
            stage_x: sym.stage_x.device_ptr(),
            stage_info: sym.stage_info.device_ptr(),
            stage_w: sym.stage_w.device_ptr(),
            disp_sig: sym.disp_sig.device_ptr(),
            comb_x: sym.comb_x.device_ptr(),
            comb_sig: sym.comb_sig.device_ptr(),
            epoch: ptr(&local.epoch, s),
            done: ptr(&local.done, s),
            chunk_cnt: ptr(&local.chunk_cnt, s),
            pos_local: ptr(&local.pos_local, s),
            tokpos: ptr(&local.tokpos, s),
            counts_all: ptr(&local.counts_all, s),
            dest_row_base: ptr(&local.dest_row_base, s),
            stage_base: ptr(&local.stage_base, s),
            comb_base: ptr(&local.comb_base, s),
            src_base: ptr(&local.src_base, s),
            status: ptr(&local.status, s),
            recv_x: ptr(&local.recv_x, s),
            recv_offsets: ptr(&local.recv_offsets, s),
            recv_w: ptr(&local.recv_w, s),
            recv_origin: ptr(&local.recv_origin, s),
            timeout_ns: cfg.timeout.as_nanos().min(u64::MAX as u128) as u64,
            cfg_hash: hash,
            epoch_base,
            fault: ptr(&local.fault, s),
            fault_host: fault_host.device_ptr(),
            hello: sym.hello.device_ptr(),
            pull: pull as i32,
            x_home: sym.x_home.device_ptr(),
            recv_src: ptr(&local.recv_src, s),
            y_slots: sym.y_slots.device_ptr(),
            recv_dst: ptr(&local.recv_dst, s),
            dy_home: sym.dy_home.device_ptr(),
            bwd_sig: sym.bwd_sig.device_ptr(),
            bwd_comb_sig: sym.bwd_comb_sig.device_ptr(),
            ..EpParams::default()
        };
        // Two 256-thread blocks per SM: 16 warps, each with 4 row loads per lane in flight.
        let grid = 2 * runtime
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda)? as u32;
        tracing::debug!(
            rank,
            ranks,
            ?cfg,
            staged,
            rows,
            epoch_base,
            "expert-parallel buffers ready"
        );
        Ok(ExpertParallel {
            cfg,
            place,
            rank,
            device,
            stream: stream.clone(),
            grid,
            base,
            kernels,
            broken: None,
            local,
            peer_rows,
            pulled: super::PulledState::Idle,
            sym: ManuallyDrop::new(sym),
            fault_host: ManuallyDrop::new(fault_host),
            module: ManuallyDrop::new(module),
            runtime: runtime.clone(),
        })
    }
}

/// Dynamic shared memory of a count block: a histogram row of `experts + ranks` counters
/// per warp and the chunk's routing.
pub(super) fn count_smem_bytes(cfg: &EpConfig, ranks: usize) -> usize {
    (params::COUNT_WARPS * (cfg.experts + ranks) + params::CHUNK * cfg.top_k) * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_shared_memory() {
        // Qwen3-30B-A3B at 8 ranks: 8 warps of 8 tokens, top-8.
        let cfg = EpConfig::new(128, 8, 2048, 4096);
        assert_eq!(count_smem_bytes(&cfg, 8), (8 * (128 + 8) + 64 * 8) * 4);
        // The largest expert count the spec allows still fits the default 48 KiB.
        let widest = EpConfig::new(super::super::MAX_EXPERTS, 16, 2048, 4096);
        assert!(count_smem_bytes(&widest, super::super::MAX_RANKS) <= 48 * 1024);
    }
}
