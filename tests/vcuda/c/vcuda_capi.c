/* libvcuda's own C API (include/vcuda.h) from inside a container: the program does not
 * link libvcuda; it finds the functions the preloaded library exports with dlsym, typed by
 * the header. Prints key=value lines. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include "common.h"
#include "vcuda.h"

int main(void) {
    __typeof__(&vcuda_version) version = dlsym(RTLD_DEFAULT, "vcuda_version");
    __typeof__(&vcuda_device_count) count = dlsym(RTLD_DEFAULT, "vcuda_device_count");
    __typeof__(&vcuda_get_memory) get = dlsym(RTLD_DEFAULT, "vcuda_get_memory");
    if (!version || !count || !get) {
        printf("preloaded=0\n");
        return 0;
    }
    CUcontext ctx;
    CUdeviceptr p;
    CHECK(cuInit(0));
    CHECK(cuCtxCreate(&ctx, 0, 0));
    CHECK(cuMemAlloc(&p, 100 << 20));
    VcudaMemory m;
    int rc = get(0, &m);
    printf("preloaded=1\nversion=%s\ncount=%d\nrc=%d\nlimit=%llu\nused=%llu\nprocess=%llu\n", version(), count(), rc,
           (unsigned long long)m.limit_bytes, (unsigned long long)m.used_bytes, (unsigned long long)m.process_bytes);
    printf("bad_index=%d\nnull_out=%d\n", get(5, &m), get(0, NULL));
    return 0;
}
