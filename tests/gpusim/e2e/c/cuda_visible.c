/* What a process sees of the GPUs under CUDA_VISIBLE_DEVICES (gpusim's libcuda reads it at
 * cuInit, as the driver does).
 *   cuda_visible [--bus BUS_ID] [--ctx ORDINAL]
 * Prints key=value lines: init (cuInit's result; nothing else when it fails), count, and per
 * ordinal i dev<i>_name / _uuid / _bus / _total; past_end (cuDeviceGet(count)'s result).
 * --bus: bus_rc and bus_dev from cuDeviceGetByPCIBusId(BUS_ID).
 * --ctx: makes a context on ORDINAL, allocates 64 MiB in it and prints ctx_dev
 * (cuCtxGetDevice), stream_dev (cuStreamGetDevice), ptr_dev (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
 * via cuPointerGetAttribute) and ptrs_dev (the same via cuPointerGetAttributes); holds 2 MiB
 * from cuMemCreate on location ORDINAL and prints vmm_past_end (cuMemCreate on location
 * `count`'s result); then
 * "ready" and waits for a line on stdin before exiting, so the caller can look at the ground
 * truth while the context lives. */
#include <cuda.h>
#include <string.h>
#include "common.h"

int main(int argc, char **argv) {
    const char *bus_id = NULL;
    int ctx_ord = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bus") && i + 1 < argc) bus_id = argv[++i];
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) ctx_ord = atoi(argv[++i]);
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    CUresult rc = cuInit(0);
    printf("init=%d\n", (int)rc);
    if (rc != CUDA_SUCCESS) {
        int n = -1;
        printf("count_rc=%d\n", (int)cuDeviceGetCount(&n));
        return 0;
    }
    int count = 0;
    CHECK(cuDeviceGetCount(&count));
    printf("count=%d\n", count);
    for (int i = 0; i < count; i++) {
        CUdevice dev;
        char name[128], bus[32];
        size_t total;
        CUuuid uuid;
        CHECK(cuDeviceGet(&dev, i));
        CHECK(cuDeviceGetName(name, sizeof name, dev));
        CHECK(cuDeviceGetPCIBusId(bus, sizeof bus, dev));
        CHECK(cuDeviceTotalMem(&total, dev));
        CHECK(cuDeviceGetUuid(&uuid, dev));
        printf("dev%d_name=%s\ndev%d_bus=%s\ndev%d_total=%zu\ndev%d_uuid=GPU-", i, name, i, bus, i, total, i);
        for (int b = 0; b < 16; b++)
            printf("%02x%s", (unsigned char)uuid.bytes[b], (b == 3 || b == 5 || b == 7 || b == 9) ? "-" : "");
        printf("\n");
    }
    CUdevice past;
    printf("past_end=%d\n", (int)cuDeviceGet(&past, count));
    if (bus_id) {
        CUdevice dev = -1;
        rc = cuDeviceGetByPCIBusId(&dev, bus_id);
        printf("bus_rc=%d\nbus_dev=%d\n", (int)rc, rc == CUDA_SUCCESS ? (int)dev : -1);
    }
    if (ctx_ord >= 0) {
        CUdevice dev, got;
        CUcontext ctx;
        CUstream s;
        CUdeviceptr p;
        int ord = -1, ord2 = -1;
        CHECK(cuDeviceGet(&dev, ctx_ord));
        CHECK(cuCtxCreate(&ctx, 0, dev));
        CHECK(cuCtxGetDevice(&got));
        printf("ctx_dev=%d\n", (int)got);
        CHECK(cuStreamCreate(&s, 0));
        CHECK(cuStreamGetDevice(s, &got));
        printf("stream_dev=%d\n", (int)got);
        CHECK(cuMemAlloc(&p, 64 << 20));
        CHECK(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p));
        CUpointer_attribute attrs[1] = {CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
        void *data[1] = {&ord2};
        CHECK(cuPointerGetAttributes(1, attrs, data, p));
        /* 2 MiB of VMM memory on the same device, named by its ordinal in the location */
        CUmemAllocationProp prop;
        CUmemGenericAllocationHandle h, h2;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ctx_ord;
        CHECK(cuMemCreate(&h, 2 << 20, &prop, 0));
        prop.location.id = count;
        printf("vmm_past_end=%d\n", (int)cuMemCreate(&h2, 2 << 20, &prop, 0));
        printf("ptr_dev=%d\nptrs_dev=%d\nready\n", ord, ord2);
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof line, stdin)) { /* EOF: exit as well */ }
        CHECK(cuMemRelease(h));
        CHECK(cuMemFree(p));
        CHECK(cuCtxDestroy(ctx));
    }
    printf("done=1\n");
    return 0;
}
