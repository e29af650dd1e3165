//! `EpParams`: the `#[repr(C)]` mirror of `moefuse_ep_params`
//! (crates/kernels/cuda/include/moefuse/comm/ep_params.h), field for field, and the
//! header's constants.

/// Tokens per block of the count kernel (`MOEFUSE_EP_CHUNK`).
pub(crate) const CHUNK: usize = 64;
/// Warps per block of the count kernel (`kWarps` in ep.cu), `CHUNK / COUNT_WARPS` tokens each.
pub(crate) const COUNT_WARPS: usize = 8;
/// `status[1]` bits (`MOEFUSE_EP_*`).
pub(crate) const BAD_EXPERT_ID: u32 = 1;
pub(crate) const DUPLICATE_EXPERT: u32 = 2;
pub(crate) const RECV_OVERFLOW: u32 = 4;

/// Fault kinds (`fault[0] & 0xff`, `MOEFUSE_EP_FAULT_*`).
pub(crate) const TIMEOUT: u64 = 1;
pub(crate) const ABORTED: u64 = 2;
pub(crate) const LOCAL_ABORT: u64 = 3;
/// The wait that faulted (`(fault[0] >> 8) & 0xff`, `MOEFUSE_EP_OP_*`).
pub(crate) const OP_NOTIFY: u64 = 1;
pub(crate) const OP_EXPAND: u64 = 2;
pub(crate) const OP_COMBINE: u64 = 3;
pub(crate) const OP_BACKWARD: u64 = 4;
/// Words of `fault` and of one handshake record.
pub(crate) const FAULT_WORDS: usize = 4;
pub(crate) const HELLO_WORDS: usize = 4;
/// `MOEFUSE_EP_HELLO_MAGIC`: marks a handshake record that arrived.
pub(crate) const HELLO_MAGIC: u64 = 0x6d6f_6566_7573_6501;
/// `abort_stage`: peers wait for the next epoch (dispatch) or the current one (combine).
pub(crate) const ABORT_DISPATCH: i32 = 0;
pub(crate) const ABORT_COMBINE: i32 = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct EpParams {
    pub ranks: i32,
    pub rank: i32,
    pub experts: i32,
    pub local_experts: i32,
    pub top_k: i32,
    pub hidden: i32,
    pub tokens: i32,
    pub max_tokens: i32,
    pub recv_rows_cap: i64,

    pub x: u64,
    pub topk_ids: u64,
    pub topk_weights: u64,

    pub meta: u64,
    pub meta_sig: u64,
    pub stage_x: u64,
    pub stage_info: u64,
    pub stage_w: u64,
    pub disp_sig: u64,
    pub comb_x: u64,
    pub comb_sig: u64,

    pub epoch: u64,
    pub done: u64,
    pub chunk_cnt: u64,
    pub pos_local: u64,
    pub tokpos: u64,
    pub counts_all: u64,
    pub dest_row_base: u64,
    pub stage_base: u64,
    pub comb_base: u64,
    pub src_base: u64,
    pub status: u64,

    pub recv_x: u64,
    pub recv_offsets: u64,
    pub recv_w: u64,
    pub recv_origin: u64,

    pub y: u64,
    pub out: u64,

    pub timeout_ns: u64,
    pub cfg_hash: u64,
    pub epoch_base: u64,
    pub fault: u64,
    pub fault_host: u64,
    pub hello: u64,
    pub abort_stage: i32,
    pub pull: i32,
    pub x_home: u64,
    pub recv_src: u64,
    pub y_slots: u64,
    pub recv_dst: u64,
    pub dy_home: u64,
    pub bwd_sig: u64,
    pub bwd_comb_sig: u64,
    pub d_weights: u64,
    pub dy_rows: u64,
    pub x_rows: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets as the C compiler lays out `moefuse_ep_params` on LP64 (8 ints, an int64,
    /// 30 pointers, then the guard block: 3 u64, 3 pointers, 2 ints; then the pull block's
    /// four pointers, and the pulled backward's six).
    #[test]
    fn layout_matches_the_c_struct() {
        assert_eq!(offset_of!(EpParams, recv_rows_cap), 32);
        assert_eq!(offset_of!(EpParams, x), 40);
        assert_eq!(offset_of!(EpParams, meta), 64);
        assert_eq!(offset_of!(EpParams, epoch), 128);
        assert_eq!(offset_of!(EpParams, recv_x), 216);
        assert_eq!(offset_of!(EpParams, out), 256);
        assert_eq!(offset_of!(EpParams, timeout_ns), 264);
        assert_eq!(offset_of!(EpParams, fault), 288);
        assert_eq!(offset_of!(EpParams, hello), 304);
        assert_eq!(offset_of!(EpParams, abort_stage), 312);
        assert_eq!(offset_of!(EpParams, pull), 316);
        assert_eq!(offset_of!(EpParams, x_home), 320);
        assert_eq!(offset_of!(EpParams, recv_src), 328);
        assert_eq!(offset_of!(EpParams, y_slots), 336);
        assert_eq!(offset_of!(EpParams, recv_dst), 344);
        assert_eq!(offset_of!(EpParams, dy_home), 352);
        assert_eq!(offset_of!(EpParams, x_rows), 392);
        assert_eq!(size_of::<EpParams>(), 400);
    }
}
