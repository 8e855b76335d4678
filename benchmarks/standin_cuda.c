/* A stand-in for the CUDA driver library (libcuda.so.1): every entry point Triton's launcher
 * calls returns CUDA_SUCCESS and does nothing, with plausible H100 (sm_90) answers to the
 * queries. Loaded in place of the real driver, it lets everything the host does per kernel
 * launch run on a machine without a GPU (argument packing, Triton's launcher, fasttrans's
 * glue) so that host cost can be measured there. Nothing runs on any device.
 *
 * Only return codes and output parameters matter to the callers, so the prototypes use
 * plain C types of the same size as the driver's (handles are pointers, enums ints). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
#define OK 0

static char fake_handle[64];  /* the object every opaque handle points at */

CUresult cuInit(unsigned flags) { (void)flags; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return OK; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return OK; }
CUresult cuGetErrorString(int err, const char **s) { (void)err; *s = "stand-in CUDA driver"; return OK; }
CUresult cuGetErrorName(int err, const char **s) { (void)err; *s = "CUDA_STANDIN"; return OK; }

/* Attribute numbers from cuda.h (CUdevice_attribute). */
CUresult cuDeviceGetAttribute(int *value, int attribute, int dev) {
  (void)dev;
  switch (attribute) {
    case 1: *value = 1024; break;       /* MAX_THREADS_PER_BLOCK */
    case 8: *value = 49152; break;      /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 10: *value = 32; break;        /* WARP_SIZE */
    case 12: *value = 65536; break;     /* MAX_REGISTERS_PER_BLOCK */
    case 13: *value = 1980000; break;   /* CLOCK_RATE (kHz) */
    case 16: *value = 132; break;       /* MULTIPROCESSOR_COUNT */
    case 36: *value = 2619000; break;   /* MEMORY_CLOCK_RATE (kHz) */
    case 37: *value = 5120; break;      /* GLOBAL_MEMORY_BUS_WIDTH */
    case 75: *value = 9; break;         /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = 0; break;         /* COMPUTE_CAPABILITY_MINOR */
    case 81: *value = 233472; break;    /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 97: *value = 232448; break;    /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    default: *value = 0; break;
  }
  return OK;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { (void)dev; *ctx = fake_handle; return OK; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = fake_handle; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return OK; }
CUresult cuCtxGetDevice(int *dev) { *dev = 0; return OK; }
CUresult cuCtxGetLimit(size_t *value, int limit) { (void)limit; *value = 1 << 20; return OK; }
CUresult cuCtxSetLimit(int limit, size_t value) { (void)limit; (void)value; return OK; }

/* Each loaded module, and the function taken from it, gets a handle of its own, so that a
   recorded launch tells which compiled kernel it ran (tests/test_launch_plans.py). */
static char module_handles[4096];
static size_t modules_loaded;
CUresult cuModuleLoadData(void **mod, const void *image) {
  (void)image;
  *mod = module_handles + (modules_loaded++ % sizeof module_handles);
  return OK;
}
CUresult cuModuleUnload(void *mod) { (void)mod; return OK; }
CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
  (void)name; *fn = mod; return OK;
}

/* CUfunction_attribute: 0 MAX_THREADS_PER_BLOCK, others (registers, local, shared sizes) 0. */
CUresult cuFuncGetAttribute(int *value, int attribute, void *fn) {
  (void)fn; *value = attribute == 0 ? 1024 : 0; return OK;
}
CUresult cuFuncSetAttribute(void *fn, int attribute, int value) { (void)fn; (void)attribute; (void)value; return OK; }
CUresult cuFuncSetCacheConfig(void *fn, int config) { (void)fn; (void)config; return OK; }

/* Host pointers pass through as "device" pointers. */
CUresult cuPointerGetAttribute(void *data, int attribute, uint64_t ptr) {
  (void)attribute; *(uint64_t *)data = ptr; return OK;
}
CUresult cuPointerGetAttributes(unsigned n, int *attributes, void **data, uint64_t ptr) {
  (void)attributes;
  for (unsigned i = 0; i < n; ++i)
    if (data[i]) *(uint64_t *)data[i] = ptr;
  return OK;
}

CUresult cuStreamIsCapturing(void *stream, int *status) { (void)stream; *status = 0; return OK; }
CUresult cuOccupancyMaxActiveClusters(int *n, void *fn, const void *config) {
  (void)fn; (void)config; *n = 1; return OK;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
  (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz;
  (void)shared; (void)stream; (void)params; (void)extra;
  return OK;
}
CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) {
  (void)config; (void)f; (void)params; (void)extra; return OK;
}
CUresult cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned shared, void *stream, void **params) {
  (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)stream; (void)params;
  return OK;
}

/* A CUtensorMap is 128 opaque bytes: zero them. */
CUresult cuTensorMapEncodeTiled(void *map, ...) { memset(map, 0, 128); return OK; }
CUresult cuTensorMapEncodeIm2col(void *map, ...) { memset(map, 0, 128); return OK; }
