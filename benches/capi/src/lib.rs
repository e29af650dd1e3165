//! C entry points to moefuse's grouped GEMM for `benches/torch_grouped_mm.py`: the script
//! loads `libmoefuse_bench_capi.so` with ctypes and times moefuse, `torch._grouped_mm` and
//! dense cuBLAS interleaved, on the same torch tensors and stream.
//!
//! 1. `moefuse_capi_grouped_plan(pass, groups, rows, n, k)` validates the problem, picks the
//!    variant (the same heuristic as the Rust API) and returns the workspace bytes, or -1.
//! 2. `moefuse_capi_grouped_run(pass, groups, rows, n, k, offsets, a, b, d, ws, ws_bytes,
//!    stream)` launches it on the caller's device addresses and stream; 0 or -1.
//! 3. `moefuse_capi_last_error(buf, len)` copies the last failure's message (also the chosen
//!    variant after a successful plan).
//!
//! `pass`: 0 forward (`Y = X · W_eᵀ`, W `[E, N, K]`), 1 dgrad (`dX = dY · W_e`), 2 wgrad
//! (`dW_e [N, K] = dY_eᵀ · X_e`) — the layouts of `bench_grouped`'s cases. Plans are kept
//! per problem, so a timed loop pays one hash lookup per call.
//!
//! ```no_run
//! // From Rust (the script does the same through ctypes): plan, then read the variant.
//! let bytes = moefuse_bench_capi::moefuse_capi_grouped_plan(0, 8, 1024, 256, 256);
//! assert!(bytes >= 0);
//! ```

use cudarc::driver::CudaContext;
use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedGemm, GroupedPlan};
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::{Arc, Mutex};

type Key = (i32, usize, usize, usize, usize);

struct Bridge {
    ctx: Arc<CudaContext>,
    gemm: GroupedGemm,
    plans: HashMap<Key, GroupedPlan>,
}

static BRIDGE: Mutex<Option<Bridge>> = Mutex::new(None);
static LAST: Mutex<String> = Mutex::new(String::new());

fn remember(message: String) {
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = message;
}

/// The grouped problem of one benchmark pass (0 fwd, 1 dgrad, 2 wgrad) on weights
/// `[E, N, K]`, with the rows-per-group hint of balanced routing: the one mapping both
/// `bench_grouped` and this bridge run, so the Python timings are of the same problem.
///
/// ```
/// let d = moefuse_bench_capi::grouped_desc(1, 8, 1024, 256, 512).unwrap();
/// assert_eq!(d.rows_per_group_hint, Some(128));
/// assert!(moefuse_bench_capi::grouped_desc(3, 8, 1024, 256, 512).is_err());
/// ```
pub fn grouped_desc(
    pass: i32,
    groups: usize,
    rows: usize,
    n: usize,
    k: usize,
) -> Result<GroupedDesc, String> {
    let d = match pass {
        0 => GroupedDesc::forward(groups, rows, n, k, BLayout::Nk),
        1 => GroupedDesc::dgrad(groups, rows, n, k, BLayout::Nk),
        2 => GroupedDesc::wgrad_for(groups, rows, n, k, BLayout::Nk).0,
        _ => return Err(format!("pass {pass}: 0 fwd, 1 dgrad, 2 wgrad")),
    };
    Ok(GroupedDesc {
        rows_per_group_hint: Some(rows / groups.max(1)),
        ..d
    })
}

fn with_plan<T>(
    key: Key,
    f: impl FnOnce(&Bridge, &GroupedPlan) -> Result<T, String>,
) -> Result<T, String> {
    let (pass, groups, rows, n, k) = key;
    let problem = grouped_desc(pass, groups, rows, n, k)?; // checked before any CUDA call
    let mut guard = BRIDGE.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        let ctx = CudaContext::new(0).map_err(|e| e.to_string())?;
        let gemm = GroupedGemm::new(&ctx).map_err(|e| e.to_string())?;
        *guard = Some(Bridge {
            ctx,
            gemm,
            plans: HashMap::new(),
        });
    }
    let bridge = guard.as_mut().expect("set above");
    if !bridge.plans.contains_key(&key) {
        let plan = bridge.gemm.plan(&problem).map_err(|e| e.to_string())?;
        bridge.plans.insert(key, plan);
    }
    let plan = &bridge.plans[&key];
    f(bridge, plan)
}

/// Runs `f`, turning a panic (cudarc panics when no CUDA driver can be loaded) into an
/// error: a panic must not unwind through the C boundary.
fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(format!("panic: {what}"))
    })
}

fn key(pass: i32, groups: i64, rows: i64, n: i64, k: i64) -> Result<Key, String> {
    let u = |v: i64, what: &str| usize::try_from(v).map_err(|_| format!("{what} = {v} < 0"));
    Ok((
        pass,
        u(groups, "groups")?,
        u(rows, "rows")?,
        u(n, "n")?,
        u(k, "k")?,
    ))
}

/// Plans the problem; returns its workspace bytes, or -1 (message in
/// [`moefuse_capi_last_error`]). After success the message names the variant.
///
/// ```no_run
/// let bytes = moefuse_bench_capi::moefuse_capi_grouped_plan(0, 128, 65536, 1536, 2048);
/// ```
#[no_mangle]
pub extern "C" fn moefuse_capi_grouped_plan(
    pass: i32,
    groups: i64,
    rows: i64,
    n: i64,
    k: i64,
) -> i64 {
    let out = guarded(|| {
        key(pass, groups, rows, n, k).and_then(|key| {
            // The plan's own variant: a cached plan must not report the last new one's.
            with_plan(key, |_, plan| Ok((plan.workspace_bytes(), plan.variant())))
        })
    });
    match out {
        Ok((bytes, variant)) => {
            remember(variant);
            bytes as i64
        }
        Err(m) => {
            remember(m);
            -1
        }
    }
}

/// Launches the planned problem on device addresses owned by the caller; 0 or -1.
///
/// # Safety
/// `offsets` must address `groups` int32 prefix-sum ends, and `a`, `b`, `d` device memory of
/// device 0's primary context with the extents of the pass (as `bench_grouped`'s cases:
/// forward A `[rows, k]`, W `[groups, n, k]`, D `[rows, n]`; dgrad A `[rows, n]`, W
/// `[groups, n, k]`, D `[rows, k]`; wgrad A `[rows, n]`, B `[rows, k]`, D `[groups, n, k]`),
/// valid until the launch has finished on `stream`, a live stream of that context;
/// `workspace` at least the planned bytes, 256-byte aligned.
///
/// ```no_run
/// // SAFETY: illustration only; the script passes torch tensors' data_ptr()s.
/// let rc = unsafe { moefuse_bench_capi::moefuse_capi_grouped_run(0, 8, 1024, 256, 256, 0, 0, 0, 0, 0, 0, 0) };
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
    let out = guarded(|| key(pass, groups, rows, n, k)).and_then(|key| guarded(|| {
        with_plan(key, |bridge, plan| {
            if (workspace_bytes as usize) < plan.workspace_bytes() || workspace % 256 != 0 {
                return Err(format!(
                    "workspace {workspace:#x} of {workspace_bytes} bytes: needs {} bytes, 256-aligned",
                    plan.workspace_bytes()
                ));
            }
            if [offsets, a, b, d].contains(&0) {
                return Err("null device address".into());
            }
            bridge.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let args = plan.abi_args(offsets, a, b, d);
            // SAFETY: the addresses, extents, workspace and stream are this function's
            // contract with its caller; the context is bound to this thread above.
            unsafe {
                moefuse_kernels::launch_grouped(
                    plan.compiled_variant(),
                    &args,
                    workspace as *mut c_void,
                    workspace_bytes as usize,
                    stream as *mut c_void,
                )
            }
            .map_err(|e| e.to_string())
        })
    }));
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
/// let n = unsafe { moefuse_bench_capi::moefuse_capi_last_error(buf.as_mut_ptr().cast(), buf.len()) };
/// ```
#[no_mangle]
pub unsafe extern "C" fn moefuse_capi_last_error(buf: *mut c_char, len: usize) -> usize {
    let m = LAST.lock().unwrap_or_else(|e| e.into_inner()).clone();
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
    fn bad_passes_and_sizes_are_refused_with_a_message() {
        assert!(grouped_desc(3, 1, 1, 8, 8).is_err());
        assert!(key(0, -1, 1, 8, 8).is_err());
        assert_eq!(moefuse_capi_grouped_plan(7, 1, 1, 8, 8), -1);
        let mut buf = [0u8; 64];
        // SAFETY: buf holds 64 bytes.
        let n = unsafe { moefuse_capi_last_error(buf.as_mut_ptr().cast(), buf.len()) };
        let text = std::str::from_utf8(&buf[..n.min(63)]).unwrap();
        assert!(text.starts_with("pass 7: 0 fwd"), "{text}");
        assert_eq!(n, text.len());
    }
}
