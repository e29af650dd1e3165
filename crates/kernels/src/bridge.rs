//! The raw half of the Python benchmark bridge (feature `c-bridge`, for `crates/bench-capi`):
//! the C entry points that take device addresses from a foreign framework, so that the
//! bridge crate itself holds no `unsafe`.
//!
//! 1. `moefuse-bench-capi` plans a grouped problem in safe Rust and [`register_grouped`]s
//!    the plan under its key `(pass, groups, rows, n, k)`.
//! 2. `moefuse_capi_grouped_run(pass, groups, rows, n, k, offsets, a, b, d, ws, ws_bytes,
//!    stream)` launches the registered plan through [`Kernels::launch_grouped_raw`] (every
//!    host check, plus the driver's word on each address); 0 or -1.
//! 3. `moefuse_capi_last_error(buf, len)` copies the last message ([`remember`] sets it).
//!
//! ```
//! moefuse_kernels::bridge::remember("hello".into());
//! assert_eq!(moefuse_kernels::bridge::last_message(), "hello");
//! ```

use crate::{CompiledVariant, GroupedShape, Kernels, RawGrouped};
use std::collections::HashMap;
use std::ffi::c_char;
use std::sync::Mutex;

/// A bridge problem: `(pass, groups, rows, n, k)`.
pub type GroupedKey = (i32, usize, usize, usize, usize);

struct Registered {
    kernels: Kernels,
    variant: &'static CompiledVariant,
    shape: GroupedShape,
}

static PLANS: Mutex<Option<HashMap<GroupedKey, Registered>>> = Mutex::new(None);
static LAST: Mutex<String> = Mutex::new(String::new());

/// Makes `variant` with `shape` on `kernels` the launch of `key`.
///
/// ```no_run
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// let kernels = moefuse_kernels::Kernels::new(&ctx)?;
/// let v = moefuse_kernels::compiled().iter().find(|v| v.spec.op.is_grouped()).unwrap();
/// let shape = moefuse_kernels::GroupedShape::new(8, 1024, 256, 256);
/// moefuse_kernels::bridge::register_grouped((0, 8, 1024, 256, 256), &kernels, v, shape);
/// # Ok::<(), moefuse_kernels::KernelError>(())
/// ```
pub fn register_grouped(
    key: GroupedKey,
    kernels: &Kernels,
    variant: &'static CompiledVariant,
    shape: GroupedShape,
) {
    let mut plans = PLANS.lock().unwrap_or_else(|e| e.into_inner());
    plans.get_or_insert_with(HashMap::new).insert(
        key,
        Registered {
            kernels: kernels.clone(),
            variant,
            shape,
        },
    );
}

/// Sets the message `moefuse_capi_last_error` returns.
pub fn remember(message: String) {
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = message;
}

/// The message `moefuse_capi_last_error` returns.
pub fn last_message() -> String {
    LAST.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

fn key(pass: i32, groups: i64, rows: i64, n: i64, k: i64) -> Result<GroupedKey, String> {
    let u = |v: i64, what: &str| usize::try_from(v).map_err(|_| format!("{what} = {v} < 0"));
    Ok((
        pass,
        u(groups, "groups")?,
        u(rows, "rows")?,
        u(n, "n")?,
        u(k, "k")?,
    ))
}

/// Launches the problem planned under `(pass, groups, rows, n, k)` on device addresses and a
/// stream owned by the caller; 0, or -1 with the reason in `moefuse_capi_last_error`.
///
/// # Safety
/// Each address must stay allocated and unwritten by others until the launch has finished
/// on `stream`, a live stream of device 0's primary context (0: the legacy stream). Extents,
/// alignment, device and allocation bounds are checked, not assumed.
///
/// ```no_run
/// // SAFETY: illustration only; the script passes torch tensors' data_ptr()s.
/// let rc = unsafe { moefuse_kernels::bridge::moefuse_capi_grouped_run(0, 8, 1024, 256, 256, 0, 0, 0, 0, 0, 0, 0) };
/// assert_eq!(rc, -1); // nothing planned, null addresses
/// ```
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn moefuse_capi_grouped_run(
    pass: i32,
    groups: i64,
    rows: i64,
    n: i64,
    k: i64,
    offsets: u64,
    a: u64,
    b: u64,
    d: u64,
    workspace: u64,
    workspace_bytes: u64,
    stream: u64,
) -> i32 {
    let run = || -> Result<(), String> {
        let key = key(pass, groups, rows, n, k)?;
        let plans = PLANS.lock().unwrap_or_else(|e| e.into_inner());
        let Some(plan) = plans.as_ref().and_then(|p| p.get(&key)) else {
            return Err(format!(
                "{key:?} is not planned: call moefuse_capi_grouped_plan first"
            ));
        };
        let raw = RawGrouped {
            offsets,
            a,
            b,
            d,
            workspace,
            workspace_bytes: usize::try_from(workspace_bytes).map_err(|e| e.to_string())?,
            stream,
        };
        // SAFETY: the addresses' lifetime and exclusive use until the kernel finishes on
        // `stream` are this function's contract with its caller; everything else is checked.
        unsafe {
            plan.kernels
                .launch_grouped_raw(plan.variant, &plan.shape, raw)
        }
        .map_err(|e| e.to_string())
    };
    // A panic must not unwind through the C boundary.
    let out = std::panic::catch_unwind(run).unwrap_or_else(|_| Err("panic in moefuse".into()));
    match out {
        Ok(()) => 0,
        Err(m) => {
            remember(m);
            -1
        }
    }
}

/// Copies the last message (NUL-terminated, truncated to `len`) into `buf`; returns its
/// full length.
///
/// # Safety
/// `buf` must be writable for `len` bytes (or null with `len` 0).
///
/// ```no_run
/// let mut buf = [0u8; 256];
/// // SAFETY: buf holds 256 bytes.
/// let n = unsafe { moefuse_kernels::bridge::moefuse_capi_last_error(buf.as_mut_ptr().cast(), buf.len()) };
/// ```
#[no_mangle]
pub unsafe extern "C" fn moefuse_capi_last_error(buf: *mut c_char, len: usize) -> usize {
    let m = last_message();
    if !buf.is_null() && len > 0 {
        let n = m.len().min(len - 1);
        // SAFETY: buf is writable for len > n bytes (the caller's contract).
        unsafe {
            std::ptr::copy_nonoverlapping(m.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    m.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unplanned_runs_fail_with_a_message() {
        // SAFETY: the problem is not planned, so no address is looked at.
        let rc = unsafe { moefuse_capi_grouped_run(2, 1, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0) };
        assert_eq!(rc, -1);
        assert!(last_message().contains("not planned"), "{}", last_message());
        let mut buf = [0u8; 8];
        // SAFETY: buf holds 8 bytes.
        let n = unsafe { moefuse_capi_last_error(buf.as_mut_ptr().cast(), buf.len()) };
        assert_eq!(n, last_message().len());
        assert_eq!(buf[7], 0);
        assert!(key(0, -1, 1, 8, 8).is_err());
    }
}
