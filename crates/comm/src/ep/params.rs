//! `EpParams`: the `#[repr(C)]` mirror of `moefuse_ep_params`
//! (kernels/include/moefuse/comm/ep_params.h), field for field.

/// Tokens per block of the count kernel (`MOEFUSE_EP_CHUNK`).
pub(crate) const CHUNK: usize = 256;
/// `status[1]` bits (`MOEFUSE_EP_*`).
pub(crate) const BAD_EXPERT_ID: u32 = 1;
pub(crate) const DUPLICATE_EXPERT: u32 = 2;
pub(crate) const RECV_OVERFLOW: u32 = 4;

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets as the C compiler lays out `moefuse_ep_params` on LP64 (8 ints, an int64,
    /// then 30 pointers).
    #[test]
    fn layout_matches_the_c_struct() {
        assert_eq!(offset_of!(EpParams, recv_rows_cap), 32);
        assert_eq!(offset_of!(EpParams, x), 40);
        assert_eq!(offset_of!(EpParams, meta), 64);
        assert_eq!(offset_of!(EpParams, epoch), 128);
        assert_eq!(offset_of!(EpParams, recv_x), 216);
        assert_eq!(offset_of!(EpParams, out), 256);
        assert_eq!(size_of::<EpParams>(), 264);
    }
}
