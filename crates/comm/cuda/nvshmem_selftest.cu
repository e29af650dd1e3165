// NVSHMEM device self-test kernels: one block puts `n` ints into a symmetric buffer of
// PE `pe` and raises a signal there; another waits for the signal. The comm crate's GPU
// tests run them with one PE (put/get/signal to self) and, where it runs, several PEs.
// Built with -rdc and device-linked against libnvshmem_device into a module that the
// driver API loads and nvshmemx_cumodule_init binds (kernel-build's NVSHMEM path).
#include <cstdint>

#include <nvshmem.h>
#include <nvshmemx.h>

#if !defined(__CUDA_ARCH__) || (__CUDA_ARCH__ >= 900)

// One block: dst_sym[0..n) on `pe` = src[0..n), then sig_sym on `pe` = value.
extern "C" __global__ void moefuse_nvshmem_put_signal(int* dst_sym, const int* src, int n, uint64_t* sig_sym,
                                                      uint64_t value, int pe) {
  nvshmemx_putmem_signal_block(dst_sym, src, sizeof(int) * size_t(n), sig_sym, value, NVSHMEM_SIGNAL_SET, pe);
}

// One thread: wait until the local sig_sym equals `value`, then copy dst_sym to out.
extern "C" __global__ void moefuse_nvshmem_wait_copy(const uint64_t* sig_sym, uint64_t value, const int* dst_sym,
                                                     int* out, int n) {
  nvshmem_signal_wait_until(const_cast<uint64_t*>(sig_sym), NVSHMEM_CMP_EQ, value);
  for (int i = 0; i < n; ++i) out[i] = dst_sym[i];
}

// One block: out[0..n) = src_sym[0..n) of PE `pe`.
extern "C" __global__ void moefuse_nvshmem_get(int* out, const int* src_sym, int n, int pe) {
  nvshmemx_getmem_block(out, src_sym, sizeof(int) * size_t(n), pe);
}

#endif
