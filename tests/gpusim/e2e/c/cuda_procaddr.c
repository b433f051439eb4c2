/* Reach gpusim the way cudart and cuda-python do: dlopen("libcuda.so.1"), dlsym only
 * cuGetProcAddress_v2, and resolve everything else through it by base name, CUDA version and
 * flags. Checks the variant each request gets against the library's own exported symbols. */
#define _GNU_SOURCE
#define GPUSIM_DLOPEN
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <string.h>
#include "common.h"

static void *lib;
static PFN_cuGetProcAddress_v12000 gpa;
static int failures;

static void *get(const char *name, int version, cuuint64_t flags, CUdriverProcAddressQueryResult *st) {
    void *p = (void *)0x1;
    CUresult rc = gpa(name, &p, version, flags, st);
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "cuGetProcAddress_v2(%s, %d) returned %d\n", name, version, (int)rc);
        exit(1);
    }
    return p;
}

static void expect(const char *name, int version, cuuint64_t flags, const char *symbol) {
    CUdriverProcAddressQueryResult st = 99;
    void *p = get(name, version, flags, &st);
    void *want = dlsym(lib, symbol);
    int ok = p != NULL && p == want && st == CU_GET_PROC_ADDRESS_SUCCESS;
    printf("%s %s@%d%s -> %s\n", ok ? "ok" : "FAIL", name, version,
           flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM ? "/ptds" : "", symbol);
    failures += !ok;
}

static void expect_null(const char *name, int version, CUdriverProcAddressQueryResult want) {
    CUdriverProcAddressQueryResult st = 99;
    void *p = get(name, version, 0, &st);
    int ok = p == NULL && st == want;
    printf("%s %s@%d -> NULL status %d\n", ok ? "ok" : "FAIL", name, version, (int)st);
    failures += !ok;
}

int main(void) {
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
    gpa = (PFN_cuGetProcAddress_v12000)dlsym(lib, "cuGetProcAddress_v2");
    if (!gpa) { fprintf(stderr, "no cuGetProcAddress_v2\n"); return 1; }

    /* Before cuInit, as runtimes do. */
    expect("cuInit", 2000, 0, "cuInit");
    expect("cuMemAlloc", 2000, 0, "cuMemAlloc");
    expect("cuMemAlloc", 3020, 0, "cuMemAlloc_v2");
    expect("cuMemAlloc", 12090, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuMemAlloc_v2");
    expect("cuMemFree", 3020, 0, "cuMemFree_v2");
    expect("cuCtxCreate", 12090, 0, "cuCtxCreate_v4");
    expect("cuCtxCreate", 11040, 0, "cuCtxCreate_v3");
    expect("cuLaunchKernel", 12000, 0, "cuLaunchKernel");
    expect("cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuLaunchKernel_ptsz");
    expect("cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, "cuLaunchKernel");
    expect("cuLaunchKernelEx", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuLaunchKernelEx_ptsz");
    expect("cuMemcpyHtoD", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuMemcpyHtoD_v2_ptds");
    expect("cuMemcpyHtoD", 12000, 0, "cuMemcpyHtoD_v2");
    expect("cuMemAllocAsync", 11020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuMemAllocAsync_ptsz");
    expect("cuGraphLaunch", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuGraphLaunch_ptsz");
    expect("cuGraphInstantiate", 12000, 0, "cuGraphInstantiateWithFlags");
    expect("cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2");
    expect("cuGetProcAddress", 11030, 0, "cuGetProcAddress");
    expect("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
    expect("cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2");
    expect_null("cuNoSuchFunction", 12000, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    expect_null("cuLaunchKernelEx", 11000, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    void *p;
    EXPECT(gpa("cuInit", &p, 99990, 0, NULL), CUDA_ERROR_INVALID_VALUE); /* newer than the driver */

    /* A whole workload through resolved pointers only. */
    CUdriverProcAddressQueryResult st;
    PFN_cuInit_v2000 init = get("cuInit", 2000, 0, &st);
    PFN_cuDevicePrimaryCtxRetain_v7000 retain = get("cuDevicePrimaryCtxRetain", 7000, 0, &st);
    PFN_cuCtxSetCurrent_v4000 setcur = get("cuCtxSetCurrent", 4000, 0, &st);
    PFN_cuMemAlloc_v3020 alloc = get("cuMemAlloc", 3020, 0, &st);
    PFN_cuMemFree_v3020 mfree = get("cuMemFree", 3020, 0, &st);
    PFN_cuModuleLoadData_v2000 load = get("cuModuleLoadData", 2000, 0, &st);
    PFN_cuModuleGetFunction_v2000 getf = get("cuModuleGetFunction", 2000, 0, &st);
    PFN_cuLaunchKernel_v7000_ptsz launch = get("cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st);
    PFN_cuStreamSynchronize_v7000_ptsz sync = get("cuStreamSynchronize", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st);
    CUcontext ctx;
    CUdeviceptr d;
    CUmodule mod;
    CUfunction f;
    CHECK(init(0));
    CHECK(retain(&ctx, 0));
    CHECK(setcur(ctx));
    CHECK(alloc(&d, 1 << 20));
    CHECK(load(&mod, PTX));
    CHECK(getf(&f, mod, "spin_1ms"));
    for (int i = 0; i < 5; i++) CHECK(launch(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    CHECK(sync(NULL));
    CHECK(mfree(d));
    printf("workload_ok=1\nfailures=%d\n", failures);
    return failures != 0;
}
