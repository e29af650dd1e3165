// CuTe stride helper shared by the dense and grouped launchers.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"

namespace moefuse {

// Sets the one dynamic leading dimension of a CuTe stride whose other leading mode is the
// static unit stride; a dynamic batch mode (dense GEMMs) stays 0.
template <class Stride>
CUTE_HOST_DEVICE Stride leading_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<1>(s))>>::value) {
    cute::get<0>(s) = ld;  // (ld, _1, L): row-major rows, or B stored [n, k]
  } else {
    cute::get<1>(s) = ld;  // (_1, ld, L): column-major, or B stored [k, n]
  }
  return s;
}

}  // namespace moefuse
