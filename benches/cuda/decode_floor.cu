// What a decode step costs before any MoE arithmetic: the graph-replayed time of (a) empty
// kernels in the decode pair's launch shapes (programmatic dependent launch between them, as
// moefuse_moe_decode_forward launches them) and (b) plain read-only streams of the bytes
// Qwen3-30B-A3B T = 1 touches (8 experts: 50.3 MB of gate_up weights, 25.2 MB of down
// weights), in one kernel and split over a PDL pair. The gap between (b) and the decode
// forward is what the MoE kernels add; (a) is what any two-kernel design pays.
//
// Timing as bench_moe's `-graph` rows: 8 captured graphs (each reading a different slice of
// a pool larger than L2) launched back to back per event pair, median [IQR] of the per-graph
// time over the samples.
//
// Built by `cargo xtask device-pack` (every benches/cuda/*.cu, with the toolchain's nvcc,
// for the first SM target; `--only decode_floor` for it alone), run on the GPU machine as
//   .device-pack/run.sh decode_floor [samples]   # one line per case: median µs, IQR, TB/s
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "moefuse/moe/decode_mma.cuh"

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// The decode kernels' own weight load (ld.global.nc, no L1 allocation, 256-byte L2 fetch).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  return moefuse::moe::decode::load_stream(reinterpret_cast<const uint16_t*>(p));
}

// kWait: griddepcontrol.wait before anything (the dependent kernel of a pair).
template <bool kWait>
__global__ void empty_kernel(unsigned* sink) {
  if (kWait) pdl_wait();
  pdl_trigger();
  if (sink != nullptr && threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(sink, 1u);
}

// Every thread streams 16-byte vectors of [p, p + n) in a grid-stride loop, kUnroll loads in
// flight before the first use. The xor of everything read goes to sink only on an impossible
// value, so nothing is optimised away and nothing is written.
template <int kUnroll, bool kWait>
__global__ void stream_kernel(const uint4* __restrict__ p, size_t n, unsigned* sink) {
  if (kWait) pdl_wait();
  pdl_trigger();
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_stream(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = load_stream(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// Each warp streams contiguous 8 KiB pieces (a decode unit's share), the pieces dealt out
// round-robin over the grid's warps: the decode kernels' access pattern without the MMAs.
template <bool kWait>
__global__ void stream_pieces_kernel(const uint4* __restrict__ p, size_t n, unsigned* sink) {
  if (kWait) pdl_wait();
  pdl_trigger();
  constexpr int kPiece = 8192 / 16;  // vectors per piece: 16 per lane
  const int lane = threadIdx.x & 31;
  const size_t warps = size_t(gridDim.x) * (blockDim.x / 32);
  const size_t pieces = n / kPiece;
  uint32_t acc = 0;
  for (size_t w = size_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w < pieces; w += warps) {
    const uint4* q = p + w * kPiece + lane;
    uint4 v[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) v[u] = load_stream(q + u * 32);
#pragma unroll
    for (int u = 0; u < 16; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// The decode gate_up's access pattern without its MMAs: units of 16 rows of 4 KB (hidden
// 2048, bf16) dealt round-robin over the blocks; each of a block's 8 warps reads its eighth of
// K (512 B) of the unit's 16 rows, lane (g, t) 16 bytes at row g (and g + 8), column 64 B c +
// 16 B t, all 16 loads before the first use: 8 rows x 64 B per load instruction.
template <bool kWait>
__global__ void stream_units_kernel(const uint4* __restrict__ p, size_t n, unsigned* sink) {
  if (kWait) pdl_wait();
  pdl_trigger();
  constexpr int kRowVectors = 4096 / 16, kUnitVectors = 16 * kRowVectors;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const size_t units = n / kUnitVectors;
  uint32_t acc = 0;
  for (size_t u = blockIdx.x; u < units; u += gridDim.x) {
    const uint4* lo = p + u * kUnitVectors + size_t(g) * kRowVectors + warp * 32 + t;
    const uint4* hi = lo + 8 * kRowVectors;
    uint4 v[16];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      v[2 * c] = load_stream(lo + 4 * c);
      v[2 * c + 1] = load_stream(hi + 4 * c);
    }
#pragma unroll
    for (int c = 0; c < 16; ++c) acc ^= v[c].x ^ v[c].y ^ v[c].z ^ v[c].w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

struct Launch {
  const void* fn;
  int grid, block;
  size_t smem;
  bool pdl;
  size_t offset, bytes;  // the slice of the graph's pool region this kernel reads
};

// One graph per pool region r (0..7): each launch reads region r's slice.
static cudaGraphExec_t capture(cudaStream_t s, const std::vector<Launch>& ls, const char* pool, size_t region,
                               unsigned* sink) {
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (const Launch& l : ls) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t c = {};
    c.gridDim = dim3(l.grid);
    c.blockDim = dim3(l.block);
    c.dynamicSmemBytes = l.smem;
    c.stream = s;
    c.attrs = attr;
    c.numAttrs = l.pdl ? 1 : 0;
    const uint4* p = reinterpret_cast<const uint4*>(pool + region + l.offset);
    size_t n = l.bytes / 16;
    void* args_stream[] = {&p, &n, &sink};
    void* args_empty[] = {&sink};
    CHECK(cudaLaunchKernelExC(&c, l.fn, l.bytes ? args_stream : args_empty));
  }
  CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t e;
  CHECK(cudaGraphInstantiate(&e, g, 0));
  CHECK(cudaGraphDestroy(g));
  return e;
}

static void run_case(const char* name, cudaStream_t s, const std::vector<Launch>& ls, const char* pool,
                     size_t region_bytes, unsigned* sink, int samples) {
  constexpr int kGraphs = 8;
  cudaGraphExec_t g[kGraphs];
  size_t bytes = 0;
  for (const Launch& l : ls) bytes += l.bytes;
  for (int r = 0; r < kGraphs; ++r) g[r] = capture(s, ls, pool, size_t(r) * region_bytes, sink);
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int w = 0; w < 5; ++w)
    for (int r = 0; r < kGraphs; ++r) CHECK(cudaGraphLaunch(g[r], s));
  std::vector<float> us;
  for (int i = 0; i < samples; ++i) {
    CHECK(cudaEventRecord(a, s));
    for (int r = 0; r < kGraphs; ++r) CHECK(cudaGraphLaunch(g[r], s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1000.f / kGraphs);
  }
  std::sort(us.begin(), us.end());
  const float med = us[us.size() / 2], iqr = us[us.size() * 3 / 4] - us[us.size() / 4];
  std::printf("%-44s %8.2f us [IQR %5.2f]  %s%.2f TB/s\n", name, med, iqr, bytes ? "" : "(no bytes) ",
              bytes ? double(bytes) / (med * 1e-6) / 1e12 : 0.0);
  std::fflush(stdout);
  for (int r = 0; r < kGraphs; ++r) CHECK(cudaGraphExecDestroy(g[r]));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
}

int main(int argc, char** argv) {
  const int samples = argc > 1 ? std::atoi(argv[1]) : 200;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("# %s, %d SMs, L2 %d MiB\n", prop.name, sms, prop.l2CacheSize >> 20);
  // Qwen3-30B-A3B T = 1: 8 experts of gate_up [1536, 2048] and down [2048, 768], bf16.
  const size_t gate_up = size_t(8) * 1536 * 2048 * 2, down = size_t(8) * 2048 * 768 * 2;
  const size_t region = gate_up + down;  // 75.5 MB per graph; 8 regions = 604 MB, far past L2
  char* pool;
  CHECK(cudaMalloc(&pool, 8 * region));
  // Fresh non-zero bytes (never time on zeros).
  std::vector<uint32_t> h(region / 4);
  for (size_t i = 0; i < h.size(); ++i) h[i] = uint32_t(i * 2654435761u) | 1u;
  for (int r = 0; r < 8; ++r) CHECK(cudaMemcpy(pool + r * region, h.data(), region, cudaMemcpyHostToDevice));
  unsigned* sink;
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(sink, 0, 4));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  constexpr size_t kDownSmem = 80 * 1024;  // the decode down kernel's partials
  CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(empty_kernel<true>),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(kDownSmem)));
  CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(stream_kernel<8, true>),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(kDownSmem)));
  CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(stream_kernel<8, false>),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(kDownSmem)));
  auto f = [](auto k) { return reinterpret_cast<const void*>(k); };
  const void* e0 = f(empty_kernel<false>);
  const void* e1 = f(empty_kernel<true>);
  // Launch overheads: the decode pair's shapes (gate_up 2 x SMs blocks of 256 threads, down
  // one block of 512 threads with 80 KiB per SM), with and without data.
  run_case("empty: one kernel 2xSMs x 256", s, {{e0, 2 * sms, 256, 0, true, 0, 0}}, pool, region, sink, samples);
  run_case("empty: pair (PDL) as the decode pair", s,
           {{e0, 2 * sms, 256, 0, true, 0, 0}, {e1, std::min(sms, 128), 512, kDownSmem, true, 0, 0}}, pool, region,
           sink, samples);
  run_case("empty: pair without PDL", s,
           {{e0, 2 * sms, 256, 0, false, 0, 0}, {e1, std::min(sms, 128), 512, kDownSmem, false, 0, 0}}, pool,
           region, sink, samples);
  // Streams of the 75.5 MB.
  for (int per_sm : {1, 2, 4}) {
    char name[64];
    std::snprintf(name, sizeof name, "stream 75.5 MB: one kernel %dxSMs x 256", per_sm);
    run_case(name, s, {{f(stream_kernel<8, false>), per_sm * sms, 256, 0, true, 0, region}}, pool, region, sink,
             samples);
  }
  run_case("stream 75.5 MB: one kernel, 8 KiB warp pieces", s,
           {{f(stream_pieces_kernel<false>), 2 * sms, 256, 0, true, 0, region}}, pool, region, sink, samples);
  run_case("stream 50.3 MB: the gate_up's unit pattern, 2xSMs x 256", s,
           {{f(stream_units_kernel<false>), 2 * sms, 256, 0, true, 0, gate_up}}, pool, region, sink, samples);
  run_case("stream 50.3 MB: gate_up share alone", s,
           {{f(stream_kernel<8, false>), 2 * sms, 256, 0, true, 0, gate_up}}, pool, region, sink, samples);
  run_case("stream 25.2 MB: down share alone", s,
           {{f(stream_kernel<8, false>), std::min(sms, 128), 512, kDownSmem, true, gate_up, down}}, pool, region,
           sink, samples);
  run_case("stream pair (PDL) 50.3 + 25.2 MB, as the decode pair", s,
           {{f(stream_kernel<8, false>), 2 * sms, 256, 0, true, 0, gate_up},
            {f(stream_kernel<8, true>), std::min(sms, 128), 512, kDownSmem, true, gate_up, down}},
           pool, region, sink, samples);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaFree(pool));
  return 0;
}
