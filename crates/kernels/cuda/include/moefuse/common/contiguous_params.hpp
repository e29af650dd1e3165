// The contiguous grouped GEMM kernels' parameters besides their collective's (the Hopper and
// Blackwell launchers, sm90/ and sm100/contiguous_grouped_gemm.cuh, fill the same fields).
#pragma once

#include "cutlass/numeric_types.h"
#include "moefuse/abi.h"

namespace moefuse {

// Everything of `p` but the collective's maps, into `out` (a kernel's Params); `default_band`
// when the tile order names none.
template <class P>
void fill_contiguous_params(P& out, const moefuse_grouped_gemm_args& p, int default_band) {
  const int band = (p.tile_order >> 8) & 0xff;
  out.offsets = p.offsets;
  out.d = static_cast<cutlass::bfloat16_t*>(p.d);
  out.groups = p.num_groups;
  out.total_rows = p.total_rows;
  out.n = p.n;
  out.k = p.k;
  out.alpha = p.alpha;
  out.beta = p.beta;
  out.band = band > 0 ? band : default_band;
  out.n_fast = (p.tile_order & 3) == 1 ? 0 : 1;
  out.interleave = (p.tile_order >> 24) & 1;
  out.prefetch = (p.tile_order >> 16) & 0xff;
  out.a_rows = p.a_rows;
  out.a = static_cast<const cutlass::bfloat16_t*>(p.a);
  out.a_rows_div = p.a_rows != nullptr ? p.a_rows_div : 1;
  out.a_source_rows = p.a_rows != nullptr ? p.a_source_rows : p.total_rows;
}

}  // namespace moefuse
