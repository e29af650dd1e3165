//! A ring check of the NVSHMEM runtime on real devices: every rank puts a pattern with a
//! signal into the next rank's symmetric buffer, waits for its own, then gets back what the
//! next rank received. With one PE the ring is put/get/signal to itself.

use crate::device_module::DeviceModule;
use crate::{CommError, Runtime};
use cudarc::driver::{result, sys, CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::c_void;
use std::sync::Arc;

fn cuda(e: result::DriverError) -> CommError {
    CommError::Cuda(e.to_string())
}

/// The pattern rank `r` sends: distinct per rank and element.
fn pattern(rank: usize, n: usize) -> Vec<i32> {
    (0..n)
        .map(|i| (rank * 1_000_003 + i * 7 + 1) as i32)
        .collect()
}

impl Runtime {
    /// Runs the ring check with `n` ints per rank (collective) and returns an error naming
    /// the first wrong element. Synchronises `stream`.
    ///
    /// ```no_run
    /// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>,
    /// #         stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<(), moefuse_comm::CommError> {
    /// rt.ring_check(stream, 4096)?;
    /// # Ok(()) }
    /// ```
    pub fn ring_check(
        self: &Arc<Self>,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<(), CommError> {
        let (rank, ranks) = (self.rank(), self.ranks());
        let (next, prev) = ((rank + 1) % ranks, (rank + ranks - 1) % ranks);
        let module = DeviceModule::load(self, "nvshmem_selftest")?;
        let put = module.kernel("moefuse_nvshmem_put_signal")?;
        let wait = module.kernel("moefuse_nvshmem_wait_copy")?;
        let get = module.kernel("moefuse_nvshmem_get")?;
        let buf = self.alloc::<i32>(n)?;
        let sig = self.alloc::<u64>(1)?;
        // SAFETY: `sig` is a live symmetric allocation of 8 bytes.
        unsafe {
            result::memset_d8_async(
                sig.device_ptr() as sys::CUdeviceptr,
                0,
                8,
                stream.cu_stream(),
            )
        }
        .map_err(cuda)?;
        self.barrier_on_stream(stream);
        let src = stream.clone_htod(&pattern(rank, n)).map_err(cuda)?;
        let mut got = stream.alloc_zeros::<i32>(n).map_err(cuda)?;
        let mut back = stream.alloc_zeros::<i32>(n).map_err(cuda)?;
        {
            let (src_p, _g1) = src.device_ptr(stream);
            let (got_p, _g2) = got.device_ptr_mut(stream);
            let (mut dst, mut sig_p, mut len) = (buf.device_ptr(), sig.device_ptr(), n as i32);
            let (mut src_p, mut got_p, mut one, mut pe) = (src_p, got_p, 1u64, next as i32);
            let mut put_args: [*mut c_void; 6] = [
                &mut dst as *mut u64 as *mut c_void,
                &mut src_p as *mut u64 as *mut c_void,
                &mut len as *mut i32 as *mut c_void,
                &mut sig_p as *mut u64 as *mut c_void,
                &mut one as *mut u64 as *mut c_void,
                &mut pe as *mut i32 as *mut c_void,
            ];
            let mut wait_args: [*mut c_void; 5] = [
                &mut sig_p as *mut u64 as *mut c_void,
                &mut one as *mut u64 as *mut c_void,
                &mut dst as *mut u64 as *mut c_void,
                &mut got_p as *mut u64 as *mut c_void,
                &mut len as *mut i32 as *mut c_void,
            ];
            // SAFETY: the argument lists match the kernels' C declarations in
            // kernels/comm/nvshmem_selftest.cu (int*, const int*, int, uint64_t*, uint64_t,
            // int) and (const uint64_t*, uint64_t, const int*, int*, int); every buffer holds
            // `n` elements and outlives the synchronize below.
            unsafe {
                module.launch_params(put, stream, 1, 128, 0, &mut put_args)?;
                module.launch_params(wait, stream, 1, 1, 0, &mut wait_args)?;
            }
        }
        self.barrier_on_stream(stream);
        {
            let (back_p, _g) = back.device_ptr_mut(stream);
            let (mut back_p, mut src_sym, mut len, mut pe) =
                (back_p, buf.device_ptr(), n as i32, next as i32);
            let mut get_args: [*mut c_void; 4] = [
                &mut back_p as *mut u64 as *mut c_void,
                &mut src_sym as *mut u64 as *mut c_void,
                &mut len as *mut i32 as *mut c_void,
                &mut pe as *mut i32 as *mut c_void,
            ];
            // SAFETY: matches (int*, const int*, int, int); `back` and `buf` hold `n` ints.
            unsafe { module.launch_params(get, stream, 1, 128, 0, &mut get_args)? };
        }
        self.barrier_on_stream(stream);
        let got = stream.clone_dtoh(&got).map_err(cuda)?;
        let back = stream.clone_dtoh(&back).map_err(cuda)?;
        stream.synchronize().map_err(cuda)?;
        let check = |what: &str, have: &[i32], want: Vec<i32>| match have
            .iter()
            .zip(&want)
            .position(|(a, b)| a != b)
        {
            None => Ok(()),
            Some(i) => Err(CommError::SelfTest(format!(
                "rank {rank}: {what}[{i}] = {}, expected {}",
                have[i], want[i]
            ))),
        };
        check("received from the previous rank", &got, pattern(prev, n))?;
        check("read back from the next rank", &back, pattern(rank, n))?;
        tracing::debug!(rank, ranks, n, "nvshmem ring check passed");
        Ok(())
    }
}
