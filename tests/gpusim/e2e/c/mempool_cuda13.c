/* CUDA 13.0's location-based memory-pool calls (cuMemGetDefaultMemPool, cuMemGetMemPool,
 * cuMemSetMemPool) on gpusim, reached as cudart 13 reaches them: dlopen("libcuda.so.1"),
 * dlsym only cuGetProcAddress_v2, and ask it for each base name at CUDA version 13000.
 * Built against the CUDA 13.x cuda.h / cudaTypedefs.h (nvidia/cu13/include), so every call
 * goes through the header's own PFN_..._v13000 type.
 *
 * Needs two visible devices (gpusim's default config). Prints "key=value" lines (pool
 * handles as numbers, return codes as numbers) and exits 0 once it has run everything; the
 * test judges the values. Exits 1 only when a call it needs for setup fails. */
#define _GNU_SOURCE
#define GPUSIM_DLOPEN
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include "common.h"

static void *lib;
static PFN_cuGetProcAddress_v12000 gpa;

/* cuGetProcAddress_v2(name, version, 0): the pointer, and its status in *st. */
static void *get(const char *name, int version, CUdriverProcAddressQueryResult *st) {
    void *p = (void *)0x1;
    CUresult rc = gpa(name, &p, version, 0, st);
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "cuGetProcAddress_v2(%s, %d) returned %d\n", name, version, (int)rc);
        exit(1);
    }
    return p;
}

/* The pointer for name at version, which must be found. */
static void *need(const char *name, int version) {
    CUdriverProcAddressQueryResult st;
    void *p = get(name, version, &st);
    if (!p || st != CU_GET_PROC_ADDRESS_SUCCESS) {
        fprintf(stderr, "cuGetProcAddress_v2(%s, %d): NULL, status %d\n", name, version, (int)st);
        exit(1);
    }
    return p;
}

#define H(pool) ((unsigned long long)(uintptr_t)(pool))

int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
    gpa = (PFN_cuGetProcAddress_v12000)dlsym(lib, "cuGetProcAddress_v2");
    if (!gpa) { fprintf(stderr, "no cuGetProcAddress_v2\n"); return 1; }

    /* The three are 13.0 entry points: found at 13000 (the exported symbol of that name),
     * "version not sufficient" for a 12.x caller. Asked before cuInit, as cudart does. */
    const char *names[] = {"cuMemGetDefaultMemPool", "cuMemGetMemPool", "cuMemSetMemPool"};
    for (int i = 0; i < 3; i++) {
        CUdriverProcAddressQueryResult st13 = 99, st12 = 99;
        void *p13 = get(names[i], 13000, &st13);
        void *p12 = get(names[i], 12090, &st12);
        printf("%s_13000=%d %d\n", names[i], (int)st13, p13 != NULL && p13 == dlsym(lib, names[i]));
        printf("%s_12090=%d %d\n", names[i], (int)st12, p12 == NULL);
    }
    PFN_cuMemGetDefaultMemPool_v13000 get_default = need("cuMemGetDefaultMemPool", 13000);
    PFN_cuMemGetMemPool_v13000 get_current = need("cuMemGetMemPool", 13000);
    PFN_cuMemSetMemPool_v13000 set_current = need("cuMemSetMemPool", 13000);

    CUmemLocation dev0 = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0};
    CUmemLocation dev1 = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 1};
    CUmemoryPool pool = NULL;
    printf("before_init=%d\n", (int)get_current(&pool, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));

    PFN_cuInit_v2000 init = need("cuInit", 2000);
    PFN_cuDevicePrimaryCtxRetain_v7000 retain = need("cuDevicePrimaryCtxRetain", 7000);
    PFN_cuCtxSetCurrent_v4000 set_ctx = need("cuCtxSetCurrent", 4000);
    PFN_cuDeviceGetDefaultMemPool_v11020 dev_get_default = need("cuDeviceGetDefaultMemPool", 11020);
    PFN_cuDeviceGetMemPool_v11020 dev_get_current = need("cuDeviceGetMemPool", 11020);
    PFN_cuDeviceSetMemPool_v11020 dev_set_current = need("cuDeviceSetMemPool", 11020);
    PFN_cuMemPoolCreate_v11020 pool_create = need("cuMemPoolCreate", 11020);
    PFN_cuMemPoolDestroy_v11020 pool_destroy = need("cuMemPoolDestroy", 11020);
    PFN_cuMemPoolGetAttribute_v11020 pool_attr = need("cuMemPoolGetAttribute", 11020);
    PFN_cuMemAllocAsync_v11020 alloc_async = need("cuMemAllocAsync", 11020);
    PFN_cuMemFreeAsync_v11020 free_async = need("cuMemFreeAsync", 11020);
    PFN_cuStreamSynchronize_v2000 stream_sync = need("cuStreamSynchronize", 2000);

    CHECK(init(0));
    CUcontext ctx;
    CHECK(retain(&ctx, 0));
    CHECK(set_ctx(ctx));

    /* A device location with PINNED: the pools the cuDevice* calls report. */
    CUmemoryPool def0 = NULL, def0_dev = NULL, def1 = NULL, cur = NULL, cur_dev = NULL;
    CHECK(get_default(&def0, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));
    CHECK(dev_get_default(&def0_dev, 0));
    CHECK(get_default(&def1, &dev1, CU_MEM_ALLOCATION_TYPE_PINNED));
    CHECK(get_current(&cur, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));
    printf("default_is_device_default=%d\n", def0 != NULL && def0 == def0_dev);
    printf("devices_have_own_defaults=%d\n", def1 != NULL && def1 != def0);
    printf("current_is_default=%d\n", cur == def0);

    /* A pool of device 0 made current with cuMemSetMemPool: cuDeviceGetMemPool and
     * cuMemGetMemPool report it, the default stays the default, and cuMemAllocAsync takes
     * from it. */
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location = dev0;
    CUmemoryPool mine = NULL, theirs = NULL;
    CHECK(pool_create(&mine, &props));
    props.location = dev1;
    CHECK(pool_create(&theirs, &props));
    printf("set_mem=%d\n", (int)set_current(&dev0, CU_MEM_ALLOCATION_TYPE_PINNED, mine));
    CHECK(dev_get_current(&cur_dev, 0));
    CHECK(get_current(&cur, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));
    CUmemoryPool def_after = NULL;
    CHECK(get_default(&def_after, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));
    printf("set_mem_seen_by_device_get=%d\n", cur_dev == mine);
    printf("set_mem_seen_by_mem_get=%d\n", cur == mine);
    printf("default_unchanged=%d\n", def_after == def0);
    CUmemoryPool cur1 = NULL;
    CHECK(get_current(&cur1, &dev1, CU_MEM_ALLOCATION_TYPE_PINNED));
    printf("other_device_unchanged=%d\n", cur1 == def1);

    CUdeviceptr p = 0;
    CHECK(alloc_async(&p, 4 << 20, NULL));
    cuuint64_t used_mine = 0, used_default = 0;
    CHECK(pool_attr(mine, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used_mine));
    CHECK(pool_attr(def0, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used_default));
    printf("alloc_async_used_mine=%llu\n", (unsigned long long)used_mine);
    printf("alloc_async_used_default=%llu\n", (unsigned long long)used_default);
    CHECK(free_async(p, NULL));
    CHECK(stream_sync(NULL));

    /* Back the other way: cuDeviceSetMemPool is seen by cuMemGetMemPool, and allocations
     * follow it. */
    CHECK(dev_set_current(0, def0));
    CHECK(get_current(&cur, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));
    printf("device_set_seen_by_mem_get=%d\n", cur == def0);
    CHECK(alloc_async(&p, 2 << 20, NULL));
    CHECK(pool_attr(mine, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used_mine));
    CHECK(pool_attr(def0, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used_default));
    printf("after_device_set_used_mine=%llu\n", (unsigned long long)used_mine);
    printf("after_device_set_used_default=%llu\n", (unsigned long long)used_default);
    CHECK(free_async(p, NULL));
    CHECK(stream_sync(NULL));

    /* Destroying the current pool makes the default current again. */
    CHECK(set_current(&dev0, CU_MEM_ALLOCATION_TYPE_PINNED, mine));
    CHECK(pool_destroy(mine));
    CHECK(get_current(&cur, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));
    printf("destroyed_current_falls_back=%d\n", cur == def0);
    printf("set_destroyed=%d\n", (int)set_current(&dev0, CU_MEM_ALLOCATION_TYPE_PINNED, mine));

    /* Errors, as cuda.h documents them. */
    printf("set_other_devices_pool=%d\n", (int)set_current(&dev0, CU_MEM_ALLOCATION_TYPE_PINNED, theirs));
    printf("set_own_devices_pool=%d\n", (int)set_current(&dev1, CU_MEM_ALLOCATION_TYPE_PINNED, theirs));
    CHECK(get_current(&cur, &dev1, CU_MEM_ALLOCATION_TYPE_PINNED));
    printf("set_dev1_seen=%d\n", cur == theirs);
    printf("set_null_pool=%d\n", (int)set_current(&dev0, CU_MEM_ALLOCATION_TYPE_PINNED, NULL));
    printf("null_pool_out=%d %d\n", (int)get_default(NULL, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)get_current(NULL, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));
    printf("null_location=%d %d %d\n", (int)get_default(&pool, NULL, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)get_current(&pool, NULL, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)set_current(NULL, CU_MEM_ALLOCATION_TYPE_PINNED, def0));
    CUmemLocation bad = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 7};
    printf("bad_device=%d %d %d\n", (int)get_default(&pool, &bad, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)get_current(&pool, &bad, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)set_current(&bad, CU_MEM_ALLOCATION_TYPE_PINNED, def0));
    bad.id = -1;
    printf("negative_device=%d %d %d\n", (int)get_default(&pool, &bad, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)get_current(&pool, &bad, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)set_current(&bad, CU_MEM_ALLOCATION_TYPE_PINNED, def0));
    printf("bad_alloc_type=%d %d %d\n", (int)get_default(&pool, &dev0, CU_MEM_ALLOCATION_TYPE_INVALID),
           (int)get_current(&pool, &dev0, (CUmemAllocationType)3),
           (int)set_current(&dev0, (CUmemAllocationType)0x7fffffff, def0));
    /* What gpusim does not model: host and host-NUMA pools, managed pools, locality domains. */
    CUmemLocation host = {.type = CU_MEM_LOCATION_TYPE_HOST, .id = 0};
    CUmemLocation numa = {.type = CU_MEM_LOCATION_TYPE_HOST_NUMA, .id = 0};
    CUmemLocation none = {.type = CU_MEM_LOCATION_TYPE_NONE, .id = 0};
    CUmemLocation domain = {.type = CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN};
    domain.localized.deviceId = 0;
    domain.localized.localityDomainId = 0;
    printf("host=%d %d %d\n", (int)get_default(&pool, &host, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)get_current(&pool, &host, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)set_current(&host, CU_MEM_ALLOCATION_TYPE_PINNED, def0));
    printf("host_numa=%d %d %d\n", (int)get_default(&pool, &numa, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)get_current(&pool, &numa, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)set_current(&numa, CU_MEM_ALLOCATION_TYPE_PINNED, def0));
    printf("managed=%d %d %d\n", (int)get_default(&pool, &dev0, CU_MEM_ALLOCATION_TYPE_MANAGED),
           (int)get_current(&pool, &none, CU_MEM_ALLOCATION_TYPE_MANAGED),
           (int)set_current(&dev0, CU_MEM_ALLOCATION_TYPE_MANAGED, def0));
    printf("locality_domain=%d\n", (int)get_default(&pool, &domain, CU_MEM_ALLOCATION_TYPE_PINNED));
    /* Location types cuda.h does not allow for these calls. */
    CUmemLocation numa_current = {.type = CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT, .id = 0};
    printf("not_allowed=%d %d %d\n", (int)get_default(&pool, &none, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)get_current(&pool, &numa_current, CU_MEM_ALLOCATION_TYPE_PINNED),
           (int)get_default(&pool, &domain, CU_MEM_ALLOCATION_TYPE_MANAGED));
    /* Nothing above changed the current pools. */
    CHECK(get_current(&cur, &dev0, CU_MEM_ALLOCATION_TYPE_PINNED));
    printf("still_default=%d\n", cur == def0);
    printf("done=1\n");
    return 0;
}
