/* Memory pools through the CUDA 13 runtime (libcudart.so.13) on gpusim: the CUDA 13.0
 * location-based calls (cudaMemGetDefaultMemPool / cudaMemGetMemPool / cudaMemSetMemPool)
 * next to the per-device ones, and cudaMallocAsync taking from the pool either set.
 *
 * cuda_runtime_api.h needs crt/host_defines.h (from the crt/nvcc wheels), so the runtime
 * prototypes used are declared by hand over the CUDA 13.x cuda.h's types, which the runtime's
 * share (cudaMemPool_t is CUmemoryPool, cudaStream_t CUstream, struct cudaMemLocation has
 * CUmemLocation's layout, struct cudaMemPoolProps CUmemPoolProps').
 *
 * Prints "key=value" lines and exits 0; exits 1 if a setup call fails. */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
enum { cudaMemPoolAttrUsedMemCurrent = 7, cudaMemAllocationTypePinned = 1 };

extern cudaError_t cudaRuntimeGetVersion(int *version);
extern cudaError_t cudaSetDevice(int device);
extern cudaError_t cudaDeviceGetDefaultMemPool(CUmemoryPool *pool, int device);
extern cudaError_t cudaDeviceGetMemPool(CUmemoryPool *pool, int device);
extern cudaError_t cudaDeviceSetMemPool(int device, CUmemoryPool pool);
extern cudaError_t cudaMemGetDefaultMemPool(CUmemoryPool *pool, CUmemLocation *location, int type);
extern cudaError_t cudaMemGetMemPool(CUmemoryPool *pool, CUmemLocation *location, int type);
extern cudaError_t cudaMemSetMemPool(CUmemLocation *location, int type, CUmemoryPool pool);
extern cudaError_t cudaMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
extern cudaError_t cudaMemPoolDestroy(CUmemoryPool pool);
extern cudaError_t cudaMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
extern cudaError_t cudaMallocAsync(void **ptr, size_t size, CUstream stream);
extern cudaError_t cudaFreeAsync(void *ptr, CUstream stream);
extern cudaError_t cudaStreamSynchronize(CUstream stream);
extern const char *cudaGetErrorName(cudaError_t err);

#define CHECK(call)                                                                      \
    do {                                                                                 \
        cudaError_t rc_ = (call);                                                        \
        if (rc_ != 0) {                                                                  \
            fprintf(stderr, "%s:%d: %s failed: %s (%d)\n", __FILE__, __LINE__, #call,     \
                    cudaGetErrorName(rc_), rc_);                                         \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

static unsigned long long used(CUmemoryPool pool) {
    cuuint64_t v = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &v));
    return (unsigned long long)v;
}

int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    int v = 0;
    CHECK(cudaRuntimeGetVersion(&v));
    printf("runtime=%d\n", v);
    CHECK(cudaSetDevice(0));

    CUmemLocation dev0 = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0};
    CUmemoryPool def = NULL, def_dev = NULL, cur = NULL;
    printf("mem_get_default=%d\n", cudaMemGetDefaultMemPool(&def, &dev0, cudaMemAllocationTypePinned));
    CHECK(cudaDeviceGetDefaultMemPool(&def_dev, 0));
    printf("same_default=%d\n", def != NULL && def == def_dev);

    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location = dev0;
    CUmemoryPool mine = NULL;
    CHECK(cudaMemPoolCreate(&mine, &props));

    /* cudaMemSetMemPool → cudaDeviceGetMemPool and cudaMallocAsync */
    printf("mem_set=%d\n", cudaMemSetMemPool(&dev0, cudaMemAllocationTypePinned, mine));
    CHECK(cudaDeviceGetMemPool(&cur, 0));
    printf("mem_set_seen_by_device_get=%d\n", cur == mine);
    void *p = NULL;
    CHECK(cudaMallocAsync(&p, 4 << 20, NULL));
    printf("mem_set_alloc_used=%llu %llu\n", used(mine), used(def));
    CHECK(cudaFreeAsync(p, NULL));
    CHECK(cudaStreamSynchronize(NULL));

    /* cudaDeviceSetMemPool → cudaMemGetMemPool and cudaMallocAsync */
    CHECK(cudaDeviceSetMemPool(0, def));
    cur = NULL;
    printf("mem_get=%d\n", cudaMemGetMemPool(&cur, &dev0, cudaMemAllocationTypePinned));
    printf("device_set_seen_by_mem_get=%d\n", cur == def);
    CHECK(cudaMallocAsync(&p, 2 << 20, NULL));
    printf("device_set_alloc_used=%llu %llu\n", used(mine), used(def));
    CHECK(cudaFreeAsync(p, NULL));
    CHECK(cudaStreamSynchronize(NULL));
    CHECK(cudaMemPoolDestroy(mine));
    printf("done=1\n");
    return 0;
}
