/* A stand-in libcuda.so.1 for CPU tests: built and loaded by gemmgen/testing/stub_driver.py.

   It exports the driver entry points gemmgen calls, so that gemmgen's driver layer runs end to end
   through the real cuda.bindings and ctypes calls on a machine without a GPU. Every value arrives
   here through the C ABI, as it would at the real driver. Each entry point checks what cuda.h
   documents about the call itself (a 64-byte aligned tensor map, a cubin image, an entry that the
   image defines, with the parameters its .nv.info section declares (a launch copies the first one's
   declared size, as the driver does), dynamic shared memory within the function's limit, a context current on the
   calling thread where the call acts on it) and records what it received, in the stub_* globals
   and, for what is per thread in the driver (current context, capture mode, the last launch),
   behind the stub_* hook functions; the tests read both back with ctypes. A tensor map is filled
   with the arguments of its encode (struct StubMap), so that a Params block can be traced back to
   tensors.

   It leaves out cuInit on purpose: NVRTC looks for cuInit and cuGetExportTable in a loaded
   libcuda, and treats the driver as absent (as on a machine without one) only if cuInit is missing. */

#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STUB_MAP_MAGIC 0x4d544747u /* "GGTM" */
#define STUB_MAX_PARAMS 4096
#define SM90_MAX_DYNAMIC_SMEM 232448

typedef struct {
  uint32_t magic;
  uint8_t dtype, rank, interleave, swizzle, l2, oob;
  uint8_t elem_strides[5];
  uint8_t pad;
  uint64_t addr;
  uint64_t dims[5];
  uint64_t strides[4];
  uint32_t box[5];
  uint32_t serial; /* 1 for the first encode of the process */
} StubMap;

typedef struct {
  uint32_t grid[3], block[3], cluster[3];
  uint32_t smem, num_attrs, params_size; /* params: the bytes of the kernel's first parameter */
  int32_t device;                        /* of the context current on the launching thread */
  int32_t param_count;                   /* the kernel's parameters, as its cubin declares them */
  uint64_t stream, function;
  uint8_t params[STUB_MAX_PARAMS];
} StubLaunch;

typedef struct {
  size_t size;
  unsigned char *image;
} StubModule;

typedef struct {
  uint32_t magic;
  StubModule *module;
  int max_dynamic_smem;
  int param_count;       /* EIATTR_KPARAM_INFO entries in the entry's .nv.info section */
  uint32_t first_param;  /* the first parameter's size in bytes */
} StubFunction;

#define STUB_FUNCTION_MAGIC 0x464e4747u /* "GGNF" */
#define STUB_DEVICES 2

/* Each device's primary context; a thread has none current until one is bound, as in the driver. */
static struct StubContext {
  int device;
} primary_contexts[STUB_DEVICES] = {{0}, {1}};
static __thread CUcontext current_context;

/* What the tests set. */
CUresult stub_fail_next = CUDA_SUCCESS; /* the next entry point called returns this instead */
int stub_max_active_clusters = 66;      /* cuOccupancyMaxActiveClusters' answer; < 0: it fails */

/* What the tests read. */
uint32_t stub_encodes = 0; /* counters are atomic: cuda.bindings calls in without the GIL */
uint32_t stub_primary_retains = 0;
uint32_t stub_launches = 0;
static __thread StubLaunch last_launch; /* per thread: read with stub_read_last_launch */
StubLaunch stub_last_occupancy; /* the config of the last occupancy query (no params) */
char stub_last_entry[256];
static __thread int capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL; /* per thread, as in the driver */
int stub_capture_mode_at_load = -1;   /* the loading thread's mode during the last cuModuleLoadData */
int stub_capture_mode_at_retain = -1; /* the thread's mode during the last cuDevicePrimaryCtxRetain */
int stub_last_smem_attribute = -1;

static CUresult take_failure(void) {
  CUresult err = stub_fail_next;
  stub_fail_next = CUDA_SUCCESS;
  return err;
}

static const struct {
  CUresult code;
  const char *name, *message;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_INVALID_CLUSTER_SIZE, "CUDA_ERROR_INVALID_CLUSTER_SIZE", "invalid cluster size"},
};

static CUresult describe(CUresult error, const char **str, int message) {
  for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); ++i) {
    if (errors[i].code == error) {
      *str = message ? errors[i].message : errors[i].name;
      return CUDA_SUCCESS;
    }
  }
  *str = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **str) { return describe(error, str, 0); }

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **str) { return describe(error, str, 1); }

/* cuda.bindings resolves every entry point through this one when the library exports it. Names
   come without their version suffix, as in the real driver ("cuGetProcAddress" is served by the
   _v2 export). */
CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                     CUdriverProcAddressQueryResult *status) {
  (void)version;
  (void)flags;
  Dl_info self;
  void *handle = NULL;
  char versioned[256];
  if (dladdr((void *)&cuGetProcAddress_v2, &self) && self.dli_fname)
    handle = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  *pfn = handle ? dlsym(handle, symbol) : NULL;
  if (handle && !*pfn && strlen(symbol) + 4 <= sizeof(versioned)) {
    strcpy(versioned, symbol);
    strcat(versioned, "_v2");
    *pfn = dlsym(handle, versioned);
  }
  if (handle) dlclose(handle);
  if (status) *status = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult CUDAAPI cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
  CUresult err = take_failure();
  if (err) return err;
  int previous = capture_mode;
  capture_mode = (int)*mode;
  *mode = (CUstreamCaptureMode)previous;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
  CUresult err = take_failure();
  if (err) return err;
  if (ordinal < 0 || ordinal >= STUB_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
  CUresult err = take_failure();
  if (err) return err;
  if (device < 0 || device >= STUB_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  *context = (CUcontext)&primary_contexts[device];
  stub_capture_mode_at_retain = capture_mode;
  __atomic_add_fetch(&stub_primary_retains, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *context) {
  CUresult err = take_failure();
  if (err) return err;
  *context = current_context;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext context) {
  CUresult err = take_failure();
  if (err) return err;
  current_context = context;
  return CUDA_SUCCESS;
}

/* The calling thread's stream capture mode (a test hook). */
int stub_capture_mode(void) { return capture_mode; }

/* The device of the calling thread's current context, or -1 for none (a test hook). */
int stub_current_device(void) {
  return current_context ? ((struct StubContext *)current_context)->device : -1;
}

/* The size of an ELF64 image, from its header: cubins end with their section headers. */
static size_t elf_size(const unsigned char *image) {
  uint64_t shoff;
  uint16_t shentsize, shnum;
  memcpy(&shoff, image + 0x28, 8);
  memcpy(&shentsize, image + 0x3a, 2);
  memcpy(&shnum, image + 0x3c, 2);
  return (size_t)(shoff + (uint64_t)shentsize * shnum);
}

/* The section called `name` in an ELF64 image, and its size; NULL if there is none. */
static const unsigned char *elf_section(const unsigned char *image, const char *name, uint64_t *size) {
  uint64_t shoff, names;
  uint16_t shentsize, shnum, shstrndx;
  memcpy(&shoff, image + 0x28, 8);
  memcpy(&shentsize, image + 0x3a, 2);
  memcpy(&shnum, image + 0x3c, 2);
  memcpy(&shstrndx, image + 0x3e, 2);
  memcpy(&names, image + shoff + (uint64_t)shentsize * shstrndx + 0x18, 8);
  for (uint16_t i = 0; i < shnum; ++i) {
    const unsigned char *header = image + shoff + (uint64_t)shentsize * i;
    uint32_t at;
    uint64_t offset;
    memcpy(&at, header, 4);
    if (strcmp((const char *)image + names + at, name) != 0) continue;
    memcpy(&offset, header + 0x18, 8);
    memcpy(size, header + 0x20, 8);
    return image + offset;
  }
  return NULL;
}

/* The entry's parameters, from its .nv.info section, as the driver reads them to copy kernelParams:
   attributes of 4-byte headers (format, attribute, 16-bit value or payload size); each
   EIATTR_KPARAM_INFO (0x17, a 12-byte payload) is one parameter, its size in bits 18-31 of the last
   word. */
static void read_params(const unsigned char *info, uint64_t size, StubFunction *f) {
  enum { EIFMT_SVAL = 4, EIATTR_KPARAM_INFO = 0x17 };
  for (uint64_t at = 0; at + 4 <= size;) {
    uint8_t format = info[at], attribute = info[at + 1];
    uint16_t value;
    memcpy(&value, info + at + 2, 2);
    if (format == EIFMT_SVAL) {
      if (attribute == EIATTR_KPARAM_INFO && value >= 12) {
        uint16_t ordinal;
        uint32_t word;
        memcpy(&ordinal, info + at + 8, 2);
        memcpy(&word, info + at + 12, 4);
        if (ordinal == 0) f->first_param = (word >> 18) & 0x3fff;
        ++f->param_count;
      }
      at += 4 + value;
    } else {
      at += 4;
    }
  }
}

CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
  CUresult err = take_failure();
  if (err) return err;
  if (!current_context) return CUDA_ERROR_INVALID_CONTEXT; /* it loads into the current context */
  stub_capture_mode_at_load = capture_mode;
  const unsigned char *bytes = (const unsigned char *)image;
  if (!bytes || memcmp(bytes, "\x7f" "ELF", 4) != 0 || bytes[4] != 2) return CUDA_ERROR_INVALID_IMAGE;
  StubModule *m = calloc(1, sizeof(StubModule));
  m->size = elf_size(bytes);
  m->image = malloc(m->size);
  memcpy(m->image, bytes, m->size);
  *module = (CUmodule)m;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
  CUresult err = take_failure();
  if (err) return err;
  StubModule *m = (StubModule *)module;
  size_t n = strlen(name);
  if (!m || n + 16 > sizeof(stub_last_entry)) return CUDA_ERROR_INVALID_VALUE;
  char section[sizeof(stub_last_entry)];
  uint64_t size;
  snprintf(section, sizeof(section), ".text.%s", name); /* a kernel's code section */
  if (!elf_section(m->image, section, &size)) return CUDA_ERROR_NOT_FOUND;
  memcpy(stub_last_entry, name, n + 1);
  StubFunction *f = calloc(1, sizeof(StubFunction));
  f->magic = STUB_FUNCTION_MAGIC;
  f->module = m;
  f->max_dynamic_smem = 48 * 1024;
  snprintf(section, sizeof(section), ".nv.info.%s", name);
  const unsigned char *info = elf_section(m->image, section, &size);
  if (info) read_params(info, size, f);
  *function = (CUfunction)f;
  return CUDA_SUCCESS;
}

/* Where a module's __device__ variables seem to live: this base plus the symbol's value (its offset
   in its section). Nothing reads or writes there; the tests compare the addresses. */
#define STUB_GLOBAL_BASE 0x7e0000000000ull

/* The symbol called `name` in an ELF64 image's .symtab (24-byte Elf64_Sym entries, names in
   .strtab): its value and size; 0 if there is none. */
static int elf_symbol(const unsigned char *image, const char *name, uint64_t *value, uint64_t *size) {
  uint64_t symtab_size, strtab_size;
  const unsigned char *symtab = elf_section(image, ".symtab", &symtab_size);
  const char *strtab = (const char *)elf_section(image, ".strtab", &strtab_size);
  if (!symtab || !strtab) return 0;
  for (uint64_t at = 0; at + 24 <= symtab_size; at += 24) {
    uint32_t name_at;
    memcpy(&name_at, symtab + at, 4);
    if (name_at >= strtab_size || strcmp(strtab + name_at, name) != 0) continue;
    memcpy(value, symtab + at + 8, 8);
    memcpy(size, symtab + at + 16, 8);
    return 1;
  }
  return 0;
}

CUresult CUDAAPI cuModuleGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUmodule module, const char *name) {
  CUresult err = take_failure();
  if (err) return err;
  StubModule *m = (StubModule *)module;
  uint64_t value, size;
  if (!m || !name) return CUDA_ERROR_INVALID_VALUE;
  if (!elf_symbol(m->image, name, &value, &size)) return CUDA_ERROR_NOT_FOUND;
  if (dptr) *dptr = (CUdeviceptr)(STUB_GLOBAL_BASE + value);
  if (bytes) *bytes = (size_t)size;
  return CUDA_SUCCESS;
}

static StubFunction *as_function(CUfunction function) {
  StubFunction *f = (StubFunction *)function;
  return f && f->magic == STUB_FUNCTION_MAGIC ? f : NULL;
}

CUresult CUDAAPI cuFuncSetAttribute(CUfunction function, CUfunction_attribute attribute, int value) {
  CUresult err = take_failure();
  if (err) return err;
  StubFunction *f = as_function(function);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (attribute != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) return CUDA_ERROR_NOT_SUPPORTED;
  if (value < 0 || value > SM90_MAX_DYNAMIC_SMEM) return CUDA_ERROR_INVALID_VALUE;
  f->max_dynamic_smem = value;
  stub_last_smem_attribute = value;
  return CUDA_SUCCESS;
}

/* Copies a launch config; CUDA_ERROR_INVALID_VALUE if its shared memory exceeds the function's limit. */
static CUresult record_config(StubLaunch *out, const CUlaunchConfig *config, StubFunction *f) {
  if (!config || !f) return CUDA_ERROR_INVALID_VALUE;
  if ((int)config->sharedMemBytes > f->max_dynamic_smem) return CUDA_ERROR_INVALID_VALUE;
  memset(out, 0, sizeof(*out));
  out->grid[0] = config->gridDimX, out->grid[1] = config->gridDimY, out->grid[2] = config->gridDimZ;
  out->block[0] = config->blockDimX, out->block[1] = config->blockDimY, out->block[2] = config->blockDimZ;
  out->smem = config->sharedMemBytes;
  out->stream = (uint64_t)(uintptr_t)config->hStream;
  out->function = (uint64_t)(uintptr_t)f;
  out->num_attrs = config->numAttrs;
  out->device = -1;
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) {
      out->cluster[0] = config->attrs[i].value.clusterDim.x;
      out->cluster[1] = config->attrs[i].value.clusterDim.y;
      out->cluster[2] = config->attrs[i].value.clusterDim.z;
    }
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuOccupancyMaxActiveClusters(int *clusters, CUfunction function, const CUlaunchConfig *config) {
  CUresult err = take_failure();
  if (err) return err;
  err = record_config(&stub_last_occupancy, config, as_function(function));
  if (err) return err;
  if (stub_max_active_clusters < 0) return CUDA_ERROR_INVALID_CLUSTER_SIZE;
  *clusters = stub_max_active_clusters;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction function, void **params, void **extra) {
  CUresult err = take_failure();
  if (err) return err;
  if (!current_context) return CUDA_ERROR_INVALID_CONTEXT;
  StubFunction *f = as_function(function);
  if (!f || f->param_count < 1 || f->first_param > STUB_MAX_PARAMS) return CUDA_ERROR_INVALID_VALUE;
  if (!params || !params[0] || extra) return CUDA_ERROR_INVALID_VALUE;
  err = record_config(&last_launch, config, f);
  if (err) return err;
  last_launch.param_count = f->param_count;
  last_launch.params_size = f->first_param; /* as the driver copies it: the size the cubin declares */
  memcpy(last_launch.params, params[0], f->first_param);
  last_launch.device = stub_current_device();
  __atomic_add_fetch(&stub_launches, 1, __ATOMIC_SEQ_CST);
  return CUDA_SUCCESS;
}

/* The calling thread's last launch (a test hook). */
void stub_read_last_launch(StubLaunch *out) { memcpy(out, &last_launch, sizeof(*out)); }

CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap *map, CUtensorMapDataType dtype, cuuint32_t rank, void *addr,
                                        const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
                                        const cuuint32_t *elem_strides, CUtensorMapInterleave interleave,
                                        CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                        CUtensorMapFloatOOBfill oob) {
  CUresult err = take_failure();
  if (err) return err;
  if (!current_context) return CUDA_ERROR_INVALID_CONTEXT;
  if (!map || ((uintptr_t)map & 63) || rank < 1 || rank > 5) return CUDA_ERROR_INVALID_VALUE;
  StubMap m;
  memset(&m, 0, sizeof(m));
  m.magic = STUB_MAP_MAGIC;
  m.dtype = (uint8_t)dtype, m.rank = (uint8_t)rank, m.interleave = (uint8_t)interleave;
  m.swizzle = (uint8_t)swizzle, m.l2 = (uint8_t)l2, m.oob = (uint8_t)oob;
  m.addr = (uint64_t)(uintptr_t)addr;
  for (cuuint32_t i = 0; i < rank; ++i) {
    m.dims[i] = dims[i];
    m.box[i] = box[i];
    m.elem_strides[i] = elem_strides[i] > 255 ? 255 : (uint8_t)elem_strides[i];
    if (i + 1 < rank) m.strides[i] = strides[i];
  }
  m.serial = __atomic_add_fetch(&stub_encodes, 1, __ATOMIC_SEQ_CST);
  memset(map, 0, sizeof(CUtensorMap));
  memcpy(map, &m, sizeof(m));
  return CUDA_SUCCESS;
}
