/* The NVSHMEM host API moefuse binds: both public headers; bindgen keeps the allowlist. */
#include <nvshmem.h>
#include <nvshmemx.h>
