/* The ways a program reaches the driver without linking it, each checked to land in
 * libvcuda's wrappers: dlopen + dlsym(handle), dlsym(RTLD_DEFAULT), dlsym(RTLD_NEXT),
 * cuGetProcAddress (the 4-argument v1 name), cuGetProcAddress_v2 and the per-thread flag.
 * The container's quota (argv[1], MiB) is far below the simulated GPU's 40 GiB, so an
 * allocation of the whole quota is refused by the wrapper and never by the driver: that
 * refusal proves the wrapper was reached. Prints key=value lines for the test.
 *
 * argv[2], if given, is a shared library that exports its own cuMemAlloc_v2 (returning
 * 4242): dlsym on its handle must give its function, not libvcuda's. */
#define _GNU_SOURCE
#define GPUSIM_DLOPEN
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <string.h>
#include "common.h"

typedef CUresult (*alloc_v2_t)(CUdeviceptr *, size_t);
typedef CUresult (*alloc_v1_t)(unsigned int *, unsigned int);
typedef CUresult (*free_v2_t)(CUdeviceptr);
typedef CUresult (*async_t)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*gpa_v1_t)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa_v2_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static const char *lib_of(void *p) {
    Dl_info i;
    if (!p) return "NULL";
    if (!dladdr(p, &i) || !i.dli_fname) return "?";
    const char *s = strrchr(i.dli_fname, '/');
    return s ? s + 1 : i.dli_fname;
}

static size_t quota;
static free_v2_t mem_free;

/* Over the quota: refused by the wrapper (2 = CUDA_ERROR_OUT_OF_MEMORY). Then a small
 * allocation still works. Prints <tag>_lib, <tag>_over, <tag>_small. */
static void probe_v2(const char *tag, void *fn) {
    alloc_v2_t f = (alloc_v2_t)fn;
    printf("%s_lib=%s\n", tag, lib_of(fn));
    if (!f) return;
    CUdeviceptr p = 0;
    printf("%s_over=%d\n", tag, (int)f(&p, quota));
    CUresult rc = f(&p, 1 << 20);
    printf("%s_small=%d\n", tag, (int)rc);
    if (rc == CUDA_SUCCESS) CHECK(mem_free(p));
}

int main(int argc, char **argv) {
    quota = (size_t)atoll(argv[1]) << 20;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(h, "cuInit");
    CUresult (*ctx_create)(CUcontext *, unsigned, CUdevice) =
        (CUresult(*)(CUcontext *, unsigned, CUdevice))dlsym(h, "cuCtxCreate_v2");
    mem_free = (free_v2_t)dlsym(h, "cuMemFree_v2");
    printf("init_lib=%s\nfree_lib=%s\n", lib_of((void *)init), lib_of((void *)mem_free));
    CHECK(init(0));
    CUcontext ctx;
    CHECK(ctx_create(&ctx, 0, 0));

    /* dlsym on the driver's handle, globally, and "next after the program" */
    void *via_handle = dlsym(h, "cuMemAlloc_v2");
    void *via_default = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    void *via_next = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    probe_v2("handle", via_handle);
    probe_v2("default", via_default);
    probe_v2("next", via_next);
    printf("same_wrapper=%d\n", via_handle == via_default && via_default == via_next);

    /* an entry point libvcuda does not wrap passes through to the driver */
    printf("unwrapped_lib=%s\n", lib_of(dlsym(h, "cuDeviceGetName")));

    /* cuGetProcAddress, the 11.x name with 4 arguments */
    gpa_v1_t gpa1 = (gpa_v1_t)dlsym(h, "cuGetProcAddress");
    printf("gpa1_lib=%s\n", lib_of((void *)gpa1));
    void *p = NULL;
    CHECK(gpa1("cuMemAlloc", &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT));
    printf("gpa1_alloc_is_v2_wrapper=%d\n", p == via_default);
    probe_v2("gpa1_alloc", p);
    p = NULL;
    CHECK(gpa1("cuMemAlloc", &p, 2000, CU_GET_PROC_ADDRESS_DEFAULT));
    printf("gpa1_alloc2000_lib=%s\n", lib_of(p));
    printf("gpa1_alloc2000_is_v1_wrapper=%d\n", p != NULL && p == dlsym(RTLD_DEFAULT, "cuMemAlloc"));
    if (p) {
        unsigned int p32 = 0;
        /* the 32-bit entry point, over the quota (which is < 4 GiB) */
        printf("gpa1_v1_over=%d\n", (int)((alloc_v1_t)p)(&p32, (unsigned int)quota));
    }

    /* cuGetProcAddress_v2: the variant the driver picks, our wrapper of it, status kept */
    gpa_v2_t gpa2 = (gpa_v2_t)dlsym(h, "cuGetProcAddress_v2");
    printf("gpa2_lib=%s\n", lib_of((void *)gpa2));
    CUdriverProcAddressQueryResult st = 99;
    p = NULL;
    CHECK(gpa2("cuMemAlloc", &p, 12090, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    printf("gpa2_alloc_status=%d\ngpa2_alloc_is_v2_wrapper=%d\n", (int)st, p == via_default);
    probe_v2("gpa2_alloc", p);

    /* the per-thread default stream variant of cuMemAllocAsync is our _ptsz wrapper */
    st = 99;
    p = NULL;
    CHECK(gpa2("cuMemAllocAsync", &p, 12090, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
    void *ptsz = dlsym(RTLD_DEFAULT, "cuMemAllocAsync_ptsz");
    printf("ptsz_status=%d\nptsz_lib=%s\nptsz_is_ptsz_wrapper=%d\n", (int)st, lib_of(p), p != NULL && p == ptsz);
    if (p) {
        CUdeviceptr d = 0;
        printf("ptsz_over=%d\n", (int)((async_t)p)(&d, quota, CU_STREAM_PER_THREAD));
        CUresult rc = ((async_t)p)(&d, 64 << 20, CU_STREAM_PER_THREAD);
        printf("ptsz_small=%d\n", (int)rc);
        if (rc == CUDA_SUCCESS) CHECK(mem_free(d));
    }
    st = 99;
    p = NULL;
    CHECK(gpa2("cuMemAllocAsync", &p, 12090, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &st));
    printf("legacy_is_plain_wrapper=%d\n", p != NULL && p == dlsym(RTLD_DEFAULT, "cuMemAllocAsync") && p != ptsz);

    /* asking for cuGetProcAddress itself gives our wrapper, so nested lookups stay inside */
    st = 99;
    p = NULL;
    CHECK(gpa2("cuGetProcAddress", &p, 12090, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    printf("gpa_self_status=%d\ngpa_self_is_wrapper=%d\n", (int)st, p != NULL && p == (void *)gpa2);

    /* what the driver does not have: NULL and the driver's status, untouched */
    st = 99;
    p = (void *)0x1;
    CUresult rc = gpa2("cuNoSuchFunction", &p, 12090, CU_GET_PROC_ADDRESS_DEFAULT, &st);
    printf("unknown_rc=%d\nunknown_null=%d\nunknown_status=%d\n", (int)rc, p == NULL, (int)st);
    st = 99;
    p = (void *)0x1;
    rc = gpa2("cuMemAllocAsync", &p, 11000, CU_GET_PROC_ADDRESS_DEFAULT, &st);
    printf("too_new_rc=%d\ntoo_new_null=%d\ntoo_new_status=%d\n", (int)rc, p == NULL, (int)st);

    /* non-CUDA lookups behave as without libvcuda */
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void *next_puts = dlsym(RTLD_NEXT, "puts");
    printf("next_puts_is_libc=%d\n", next_puts != NULL && next_puts == dlsym(libc, "puts"));
    dlerror();
    void *none = dlsym(RTLD_DEFAULT, "vcuda_test_no_such_symbol");
    const char *err = dlerror();
    printf("missing_null=%d\nmissing_dlerror=%d\n", none == NULL, err != NULL);
    none = dlsym(h, "cuNoSuchFunction");
    err = dlerror();
    printf("missing_cu_null=%d\nmissing_cu_dlerror=%d\n", none == NULL, err != NULL);
    if (argc > 2) {
        void *other = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
        if (!other) { fprintf(stderr, "dlopen %s: %s\n", argv[2], dlerror()); return 1; }
        alloc_v2_t f = (alloc_v2_t)dlsym(other, "cuMemAlloc_v2");
        CUdeviceptr d;
        printf("other_lib=%s\nother_rc=%d\n", lib_of((void *)f), f ? (int)f(&d, 1) : -1);
    }
    printf("done=1\n");
    return 0;
}
