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
//! The two entry points that take foreign device addresses or a C buffer (`_run`,
//! `_last_error`) live in `moefuse_kernels::bridge` (feature `c-bridge`) and are re-exported
//! here, so this crate handles no raw pointer itself: a plan registers its variant and shape
//! there, and the run launches through the kernel layer's checked raw entry.
//!
//! ```no_run
//! // From Rust (the script does the same through ctypes): plan, then read the variant.
//! let bytes = moefuse_bench_capi::moefuse_capi_grouped_plan(0, 8, 1024, 256, 256);
//! assert!(bytes >= 0);
//! ```

// NOTES: this crate is an FFI layer (a C ABI exported to ctypes), so it lives beside the
// other FFI layers in crates/, not in benches/, whose programs forbid unsafe code.
// `deny`, not `forbid`: rustc counts `#[no_mangle]` as unsafe code (a symbol can
// override another library's), and the plan entry needs it; it is the crate's one
// exception, on a function of integers only. Everything that touches a raw pointer lives in
// `moefuse_kernels::bridge`.
#![deny(unsafe_code)]

use cudarc::driver::CudaContext;
use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedGemm, GroupedPlan};
use moefuse_kernels::bridge::{register_grouped, remember, GroupedKey as Key};
use std::collections::HashMap;
use std::sync::Mutex;

pub use moefuse_kernels::bridge::{moefuse_capi_grouped_run, moefuse_capi_last_error};

struct Bridge {
    gemm: GroupedGemm,
    plans: HashMap<Key, GroupedPlan>,
}

static BRIDGE: Mutex<Option<Bridge>> = Mutex::new(None);

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
            gemm,
            plans: HashMap::new(),
        });
    }
    let bridge = guard.as_mut().expect("set above");
    if !bridge.plans.contains_key(&key) {
        let plan = bridge.gemm.plan(&problem).map_err(|e| e.to_string())?;
        register_grouped(
            key,
            bridge.gemm.kernels(),
            plan.compiled_variant(),
            plan.shape(),
        );
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
#[allow(unsafe_code)] // `#[no_mangle]` only: see the crate's NOTES.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_passes_and_sizes_are_refused_with_a_message() {
        assert!(grouped_desc(3, 1, 1, 8, 8).is_err());
        assert!(key(0, -1, 1, 8, 8).is_err());
        assert_eq!(moefuse_capi_grouped_plan(7, 1, 1, 8, 8), -1);
        let text = moefuse_kernels::bridge::last_message();
        assert!(text.starts_with("pass 7: 0 fwd"), "{text}");
    }
}
