// Register-direct epilogue for M-grouped tiles whose last rows may belong to another
// group: D[r, c] = alpha * acc + beta * D[r, c] for the tile's first `rows` rows and
// first `cols` columns only, as bf16 pairs straight from the WGMMA accumulators.
// NOTES: no shared memory and no TMA store: a TMA store clips at the tensor's end, not at
// the group's, and would overwrite the next group's rows. The stores are fire-and-forget,
// so the consumers return to the next tile's WGMMAs while they drain.
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"

namespace moefuse::epilogue {

template <class TileShape, class Accum, class TiledMma>
CUTE_DEVICE void store_masked_rows(Accum const& acc, TiledMma const& tiled_mma, int thread_idx,
                                   cutlass::bfloat16_t* d, int64_t ldd, int row0, int rows, int col0, int cols,
                                   float alpha, float beta) {
  using namespace cute;
  constexpr int kM = size<0>(TileShape{});
  constexpr int kN = size<1>(TileShape{});
  Tensor gD = make_tensor(make_gmem_ptr(d + int64_t(row0) * ldd + col0),
                          make_layout(make_shape(Int<kM>{}, Int<kN>{}), make_stride(ldd, _1{})));  // (BLK_M,BLK_N)
  Tensor cD = make_identity_tensor(make_shape(Int<kM>{}, Int<kN>{}));                             // (BLK_M,BLK_N) -> (m,n)
  auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
  Tensor tCgD = thr_mma.partition_C(gD);  // (MMA,MMA_M,MMA_N)
  Tensor tCcD = thr_mma.partition_C(cD);  // (MMA,MMA_M,MMA_N)
  static_assert(decltype(size(acc))::value == decltype(size(tCgD))::value, "accumulator and D partitions differ");
  // The GMMA accumulator layout holds two adjacent columns in values 2i and 2i+1.
  CUTE_STATIC_ASSERT_V((size<0, 0>(tCgD) == Int<2>{}));
  CUTE_STATIC_ASSERT_V((stride<0, 0>(tCgD) == Int<1>{}));
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const auto c = tCcD(i);
    if (get<0>(c) < rows && get<1>(c) < cols) {
      float2 v = make_float2(alpha * acc(i), alpha * acc(i + 1));
      auto* p = reinterpret_cast<__nv_bfloat162*>(&tCgD(i));
      if (beta != 0.f) {
        const float2 old = __bfloat1622float2(*p);
        v.x += beta * old.x;
        v.y += beta * old.y;
      }
      *p = __float22bfloat162_rn(v);
    }
  }
}

}  // namespace moefuse::epilogue
