//! Stream-ordered one-sided operations on symmetric buffers: put (with an optional
//! signal), get, wait on a signal, quiet. Every call checks ranges, PEs, and that the
//! caller's buffer is device memory of the runtime's device, first.

use crate::{raw, CommError, SymmetricBuffer};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// How a signal word is updated after the data of a put lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalOp {
    /// `sig = value`.
    Set,
    /// `sig += value`.
    Add,
}

/// A signal to raise with a put: word `index` of `buffer` on the destination PE.
pub struct Signal<'a> {
    /// The symmetric signal words.
    pub buffer: &'a SymmetricBuffer<u64>,
    /// Which word.
    pub index: usize,
    /// Operand.
    pub value: u64,
    /// Update.
    pub op: SignalOp,
}

/// The caller's side of a transfer (`len` elements; none: not looked at) must be device
/// memory on the runtime's device.
fn on_runtime_device(
    rt: &crate::Runtime,
    what: &'static str,
    addr: u64,
    len: usize,
) -> Result<(), CommError> {
    if len == 0 {
        return Ok(());
    }
    crate::ep::guard::check_operand(
        what,
        addr,
        1,
        crate::device_module::device_of(addr),
        rt.context().ordinal(),
    )
}

fn range<T>(buf: &SymmetricBuffer<T>, offset: usize, len: usize) -> Result<(), CommError> {
    if offset.checked_add(len).is_none_or(|end| end > buf.len()) {
        return Err(CommError::BufferTooSmall {
            what: "symmetric buffer (offset + len)",
            needed: offset.saturating_add(len),
            got: buf.len(),
        });
    }
    Ok(())
}

impl<T: Copy> SymmetricBuffer<T> {
    fn check_pe(&self, pe: usize) -> Result<(), CommError> {
        let ranks = self.runtime().ranks();
        if pe >= ranks {
            return Err(CommError::Rank { rank: pe, ranks });
        }
        Ok(())
    }

    /// On `stream`: copies `src` (all of it) into elements `offset..` of this buffer on
    /// `pe`, then raises `signal` there (after the data) if given.
    ///
    /// ```no_run
    /// # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>, s: &std::sync::Arc<cudarc::driver::CudaStream>)
    /// # -> Result<(), moefuse_comm::CommError> {
    /// use moefuse_comm::{Signal, SignalOp};
    /// let buf = rt.alloc::<f32>(1024)?;
    /// let sig = rt.alloc::<u64>(1)?;
    /// let src = s.clone_htod(&[1.0f32; 256]).unwrap();
    /// let peer = (rt.rank() + 1) % rt.ranks();
    /// buf.put_on_stream(s, &src, 0, peer, Some(Signal { buffer: &sig, index: 0, value: 1, op: SignalOp::Add }))?;
    /// # Ok(()) }
    /// ```
    pub fn put_on_stream<S: DevicePtr<T>>(
        &self,
        stream: &CudaStream,
        src: &S,
        offset: usize,
        pe: usize,
        signal: Option<Signal<'_>>,
    ) -> Result<(), CommError> {
        self.runtime().refuse_in_mpg("put_on_stream")?;
        self.check_pe(pe)?;
        range(self, offset, src.len())?;
        let (sig_ptr, value, op) = match &signal {
            Some(s) => {
                range(s.buffer, s.index, 1)?;
                let op = match s.op {
                    SignalOp::Set => raw::SIGNAL_SET,
                    SignalOp::Add => raw::SIGNAL_ADD,
                };
                (
                    (s.buffer.device_ptr() + 8 * s.index as u64) as *mut u64,
                    s.value,
                    op,
                )
            }
            None => (std::ptr::null_mut(), 0, 0),
        };
        let (src_ptr, _guard) = src.device_ptr(stream);
        on_runtime_device(self.runtime(), "put_on_stream source", src_ptr, src.len())?;
        let bytes = src.len() * std::mem::size_of::<T>();
        let dst = (self.device_ptr() + (offset * std::mem::size_of::<T>()) as u64) as *mut c_void;
        // SAFETY: the ranges and the PE were checked; src is device memory of `bytes` kept
        // ordered on `stream` by its guard; the symmetric buffers outlive the call (they
        // hold the runtime) and stream order covers their later use.
        unsafe {
            raw::put_signal_on_stream(
                self.runtime().host(),
                dst,
                src_ptr as *const c_void,
                bytes,
                sig_ptr,
                value,
                op,
                pe as i32,
                stream.cu_stream() as *mut c_void,
            )
        };
        Ok(())
    }

    /// On `stream`: copies elements `offset..offset + dst.len()` of this buffer on `pe`
    /// into `dst`.
    pub fn get_on_stream<D: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        dst: &mut D,
        offset: usize,
        pe: usize,
    ) -> Result<(), CommError> {
        self.runtime().refuse_in_mpg("get_on_stream")?;
        self.check_pe(pe)?;
        range(self, offset, dst.len())?;
        let bytes = dst.len() * std::mem::size_of::<T>();
        let (dst_ptr, _guard) = dst.device_ptr_mut(stream);
        on_runtime_device(self.runtime(), "get_on_stream destination", dst_ptr, bytes)?;
        let src = (self.device_ptr() + (offset * std::mem::size_of::<T>()) as u64) as *const c_void;
        // SAFETY: as for put_on_stream, with the roles swapped.
        unsafe {
            raw::get_on_stream(
                self.runtime().host(),
                dst_ptr as *mut c_void,
                src,
                bytes,
                pe as i32,
                stream.cu_stream() as *mut c_void,
            )
        };
        Ok(())
    }
}

impl SymmetricBuffer<u64> {
    /// `stream` waits until this PE's word `index` is at least `value`.
    pub fn wait_ge_on_stream(
        &self,
        stream: &CudaStream,
        index: usize,
        value: u64,
    ) -> Result<(), CommError> {
        range(self, index, 1)?;
        // SAFETY: the word is inside this live symmetric buffer; `stream` is live.
        unsafe {
            raw::wait_ge_on_stream(
                self.runtime().host(),
                (self.device_ptr() + 8 * index as u64) as *mut u64,
                value,
                stream.cu_stream() as *mut c_void,
            )
        };
        Ok(())
    }
}

/// Completes every stream-ordered put this PE issued before, in `stream`'s order.
pub fn quiet_on_stream(runtime: &crate::Runtime, stream: &CudaStream) -> Result<(), CommError> {
    runtime.refuse_in_mpg("quiet_on_stream")?;
    // SAFETY: `stream` is a live stream; the runtime is initialised.
    unsafe { raw::quiet_on_stream(runtime.host(), stream.cu_stream() as *mut c_void) };
    Ok(())
}
