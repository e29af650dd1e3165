// The row-dot pair of the decode forward (moe/decode_rows.cu), launched by
// moefuse_moe_decode_forward (moe/decode.cu) once the arguments are checked.
#pragma once

#include <cuda_runtime.h>

#include "moefuse/moe_abi.h"

namespace moefuse::moe {

// Launches the row-dot gate_up and down kernels for checked arguments `a` on `stream`;
// `name` prefixes the error text. Rejects more than MOEFUSE_DECODE_ROW_DOT_MAX_SLOTS slots.
moefuse_status decode_rows_launch(const moefuse_decode_args& a, cudaStream_t stream, const char* name);

}  // namespace moefuse::moe
