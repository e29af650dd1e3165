// Releasing a tile's pipeline stages without reading them: a consumer with nothing to
// compute for a tile (a warp group past a group's last rows, a pair's CTA past the last
// m-block) must still wait for and release every stage the producers fill for that tile, in
// step, or the producers (and, in a cluster, the peer CTA's multicasts) would wait forever.
// Shared by the contiguous grouped GEMM, the contiguous wgrad and the fused gate_up.
#pragma once

#include "cute/config.hpp"

namespace moefuse {

// Waits for and releases `k_tiles` stages from `read` (a copy: the caller advances its own
// state by `k_tiles` after, as after a mainloop).
template <class Pipeline, class PipelineState>
CUTE_DEVICE void drain_stages(Pipeline& pipeline, PipelineState read, int k_tiles) {
  for (; k_tiles > 0; --k_tiles) {
    pipeline.consumer_wait(read);
    pipeline.consumer_release(read);
    ++read;
  }
}

}  // namespace moefuse
