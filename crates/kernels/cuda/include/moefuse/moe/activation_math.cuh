// The five activations of the MoE layer (value and partials in fp32), as in the CPU
// reference's `reference::activation`: shared by the activation kernels (moe/activation.cu)
// and the fused gate_up epilogue (kernel/sm90_gate_up_fused.cuh), so both compute the same
// bits.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "moefuse/abi.h"

namespace moefuse::moe {

struct Point {
  float h, dg, du;
};

// NOTES: fast exp and division (2 ulp): the outputs are bf16, and the exact versions made
// the forward compute-bound at ~2 TB/s (measured: 150 us for Qwen3-30B-A3B at 8192 tokens).
// The denominator stays in [1, 2], where __fdividef is exact to 2 ulp: 1 / (1 + e^-x) for
// x >= 0, e^x / (1 + e^x) below, both as e = e^-|x| and a select, not a branch (a
// per-element branch serialised the fused gate_up epilogue's 64 independent pairs per
// thread: ncu, 2026-12-04). Same bits as the branching form.
__device__ __forceinline__ float sigmoidf_(float x) {
  const float e = __expf(-fabsf(x));
  return __fdividef(x >= 0.f ? 1.f : e, 1.f + e);
}

// One activation, chosen at compile time (`Act` a MOEFUSE_ACTIVATION_* value): the fused
// gate_up epilogue instantiates one straight-line body per activation, so its hot code stays
// small (a per-element switch there, fully unrolled over 128 accumulator pairs, made the
// kernel 18 k instructions and its epilogue instruction-fetch bound: ncu, 2026-12-04).
template <int Act>
__device__ __forceinline__ Point eval_as(float alpha, float limit, float g, float u) {
  if constexpr (Act == MOEFUSE_ACTIVATION_SWIGLU) {
    float s = sigmoidf_(g);
    float silu = g * s, dsilu = s * (1.f + g * (1.f - s));
    return {silu * u, dsilu * u, silu};
  } else if constexpr (Act == MOEFUSE_ACTIVATION_GEGLU) {
    constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;
    float t = tanhf(kSqrt2OverPi * (g + kCubic * g * g * g));
    float dinner = kSqrt2OverPi * (1.f + 3.f * kCubic * g * g);
    float gelu = 0.5f * g * (1.f + t);
    float dgelu = 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * dinner;
    return {gelu * u, dgelu * u, gelu};
  } else if constexpr (Act == MOEFUSE_ACTIVATION_SWIGLU_OAI) {
    bool g_clamped = g > limit, u_clamped = u > limit || u < -limit;
    float gc = g_clamped ? limit : g;
    float uc = u > limit ? limit : (u < -limit ? -limit : u);
    float s = sigmoidf_(alpha * gc);
    float glu = gc * s, dglu = s + gc * alpha * s * (1.f - s);
    return {glu * (uc + 1.f), g_clamped ? 0.f : dglu * (uc + 1.f), u_clamped ? 0.f : glu};
  } else if constexpr (Act == MOEFUSE_ACTIVATION_BOUNDED_SWIGLU) {
    bool g_clamped = g > limit, u_clamped = u > limit || u < -limit;
    float gc = g_clamped ? limit : g;
    float uc = u > limit ? limit : (u < -limit ? -limit : u);
    float s = sigmoidf_(gc);
    float silu = gc * s, dsilu = s * (1.f + gc * (1.f - s));
    return {silu * uc, g_clamped ? 0.f : dsilu * uc, u_clamped ? 0.f : silu};
  } else {
    static_assert(Act == MOEFUSE_ACTIVATION_RELU2, "eval_as: unknown activation");
    float r = g > 0.f ? g : 0.f;
    return {r * r, 2.f * r, 0.f};
  }
}

// Calls f(std::integral_constant<int, Act>{}) for the activation code `act` (an unknown code
// as RELU2: callers check codes first): the one place a run-time code becomes a
// compile-time one.
template <class F>
__device__ __forceinline__ decltype(auto) with_activation(int act, F&& f) {
  switch (act) {
    case MOEFUSE_ACTIVATION_SWIGLU:
      return f(std::integral_constant<int, MOEFUSE_ACTIVATION_SWIGLU>{});
    case MOEFUSE_ACTIVATION_GEGLU:
      return f(std::integral_constant<int, MOEFUSE_ACTIVATION_GEGLU>{});
    case MOEFUSE_ACTIVATION_SWIGLU_OAI:
      return f(std::integral_constant<int, MOEFUSE_ACTIVATION_SWIGLU_OAI>{});
    case MOEFUSE_ACTIVATION_BOUNDED_SWIGLU:
      return f(std::integral_constant<int, MOEFUSE_ACTIVATION_BOUNDED_SWIGLU>{});
    default:
      return f(std::integral_constant<int, MOEFUSE_ACTIVATION_RELU2>{});
  }
}

// The activation chosen at run time.
__device__ __forceinline__ Point eval(int act, float alpha, float limit, float g, float u) {
  return with_activation(act, [&](auto a) { return eval_as<decltype(a)::value>(alpha, limit, g, u); });
}

}  // namespace moefuse::moe
