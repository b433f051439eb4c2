/* Broad check of gpusim's libcuda through the official cuda.h: devices, contexts, memory of
 * every kind, copies, modules, launches, streams, events, graphs. Prints key=value lines the
 * pytest side compares with the config and with `gpusim status`. */
#include <cuda.h>
#include <string.h>
#include <stdint.h>
#include "common.h"

int main(void) {
    int version = 0, count = 0;
    EXPECT(cuDeviceGetCount(&count), CUDA_ERROR_NOT_INITIALIZED);
    CHECK(cuDriverGetVersion(&version));
    CHECK(cuInit(0));
    CHECK(cuDeviceGetCount(&count));
    printf("driver_version=%d\ndevice_count=%d\n", version, count);
    for (int i = 0; i < count; i++) {
        CUdevice dev;
        char name[128], bus[32];
        size_t total;
        int sms, major, minor;
        CUuuid uuid;
        CHECK(cuDeviceGet(&dev, i));
        CHECK(cuDeviceGetName(name, sizeof name, dev));
        CHECK(cuDeviceTotalMem(&total, dev));
        CHECK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
        CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
        CHECK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
        CHECK(cuDeviceGetPCIBusId(bus, sizeof bus, dev));
        CHECK(cuDeviceGetUuid(&uuid, dev));
        printf("dev%d_name=%s\ndev%d_total=%zu\ndev%d_sms=%d\ndev%d_cc=%d.%d\ndev%d_bus=%s\n", i, name, i,
               total, i, sms, i, major, minor, i, bus);
        printf("dev%d_uuid=GPU-", i);
        for (int b = 0; b < 16; b++)
            printf("%02x%s", (unsigned char)uuid.bytes[b], (b == 3 || b == 5 || b == 7 || b == 9) ? "-" : "");
        printf("\n");
    }
    EXPECT(cuDeviceGetName(NULL, 10, 0), CUDA_ERROR_INVALID_VALUE);
    CUdevice bad;
    EXPECT(cuDeviceGet(&bad, count), CUDA_ERROR_INVALID_DEVICE);

    /* no context yet */
    CUdeviceptr p;
    EXPECT(cuMemAlloc(&p, 1024), CUDA_ERROR_INVALID_CONTEXT);

    CUcontext ctx;
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));
    size_t free0, total0;
    CHECK(cuMemGetInfo(&free0, &total0));
    printf("after_ctx_free=%zu\nafter_ctx_total=%zu\n", free0, total0);

    /* linear memory round trip */
    CHECK(cuMemAlloc(&p, 64 << 20));
    size_t free1;
    CHECK(cuMemGetInfo(&free1, &total0));
    printf("alloc_64mib_delta=%zu\n", free0 - free1);
    char host[4096], back[4096];
    for (int i = 0; i < 4096; i++) host[i] = (char)(i * 7);
    CHECK(cuMemcpyHtoD(p + 100, host, sizeof host));
    CHECK(cuMemsetD8(p, 0x5a, 100));
    CHECK(cuMemcpyDtoH(back, p + 100, sizeof back));
    printf("roundtrip_ok=%d\n", memcmp(host, back, sizeof host) == 0);
    CHECK(cuMemcpyDtoH(back, p, 1));
    printf("memset_ok=%d\n", back[0] == 0x5a);
    EXPECT(cuMemcpyDtoH(back, p + (64 << 20) - 10, 100), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr huge;
    EXPECT(cuMemAlloc(&huge, total0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemFree(p));
    EXPECT(cuMemFree(p), CUDA_ERROR_INVALID_VALUE);

    /* pitch, managed */
    CUdeviceptr pp, m;
    size_t pitch;
    CHECK(cuMemAllocPitch(&pp, &pitch, 1000, 100, 4));
    printf("pitch=%zu\n", pitch);
    CHECK(cuMemAllocManaged(&m, 1 << 20, CU_MEM_ATTACH_GLOBAL));
    CHECK(cuMemFree(pp));
    CHECK(cuMemFree(m));

    /* arrays */
    CUDA_ARRAY3D_DESCRIPTOR ad = {0};
    ad.Width = 1024; ad.Height = 1024; ad.Depth = 0; ad.Format = CU_AD_FORMAT_UNSIGNED_INT16; ad.NumChannels = 4;
    CUarray arr;
    CHECK(cuArray3DCreate(&arr, &ad));
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    CHECK(cuArrayGetMemoryRequirements(&req, arr, 0));
    printf("array_bytes=%zu\n", req.size);
    CHECK(cuArrayDestroy(arr));

    /* VMM */
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran;
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, 4 * gran, &prop, 0));
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, 4 * gran, 0, 0, 0));
    CHECK(cuMemMap(va, 4 * gran, 0, h, 0));
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK(cuMemSetAccess(va, 4 * gran, &acc, 1));
    CHECK(cuMemcpyHtoD(va, host, sizeof host));
    CHECK(cuMemRelease(h)); /* still mapped: memory stays until unmap */
    size_t free_mapped;
    CHECK(cuMemGetInfo(&free_mapped, &total0));
    CHECK(cuMemUnmap(va, 4 * gran));
    size_t free_unmapped;
    CHECK(cuMemGetInfo(&free_unmapped, &total0));
    printf("vmm_freed_on_unmap=%zu\n", free_unmapped - free_mapped);
    CHECK(cuMemAddressFree(va, 4 * gran));
    CUmemAllocationProp hostprop = prop;
    hostprop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CHECK(cuMemCreate(&h, gran, &hostprop, 0));
    CHECK(cuMemRelease(h));

    /* modules and launches */
    CUmodule mod;
    CUfunction f1, f50;
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuModuleGetFunction(&f1, mod, "spin_1ms"));
    CHECK(cuModuleGetFunction(&f50, mod, "spin_50us"));
    CUfunction nope;
    EXPECT(cuModuleGetFunction(&nope, mod, "missing"), CUDA_ERROR_NOT_FOUND);
    CUdeviceptr g;
    size_t gsize;
    CHECK(cuModuleGetGlobal(&g, &gsize, mod, "table"));
    printf("global_size=%zu\n", gsize);
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUevent e0, e1;
    CHECK(cuEventCreate(&e0, CU_EVENT_DEFAULT));
    CHECK(cuEventCreate(&e1, CU_EVENT_DEFAULT));
    CHECK(cuEventRecord(e0, s));
    for (int i = 0; i < 10; i++)
        CHECK(cuLaunchKernel(f1, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
    CHECK(cuEventRecord(e1, s));
    EXPECT(cuEventQuery(e1), CUDA_ERROR_NOT_READY);
    CHECK(cuEventSynchronize(e1));
    float ms;
    CHECK(cuEventElapsedTime(&ms, e0, e1));
    printf("ten_1ms_kernels_ms=%.3f\n", ms);
    EXPECT(cuLaunchKernel(f1, 0, 1, 1, 32, 1, 1, 0, s, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuLaunchKernel(f1, 1, 1, 1, 2048, 1, 1, 0, s, NULL, NULL), CUDA_ERROR_INVALID_VALUE);

    /* launch variants */
    CUlaunchConfig cfg = {0};
    cfg.gridDimX = 1; cfg.gridDimY = 1; cfg.gridDimZ = 1;
    cfg.blockDimX = 32; cfg.blockDimY = 1; cfg.blockDimZ = 1;
    cfg.hStream = s;
    CUlaunchAttribute coop = {0};
    coop.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    coop.value.cooperative = 1;
    cfg.attrs = &coop; cfg.numAttrs = 1;
    CHECK(cuLaunchKernelEx(&cfg, f50, NULL, NULL));
    CHECK(cuLaunchCooperativeKernel(f50, 1, 1, 1, 32, 1, 1, 0, s, NULL));
    EXPECT(cuLaunchCooperativeKernel(f50, 1000000, 1, 1, 1024, 1, 1, 0, s, NULL), CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
    CHECK(cuFuncSetBlockShape(f50, 32, 1, 1));
    CHECK(cuLaunch(f50));
    CHECK(cuLaunchGrid(f50, 2, 2));
    CHECK(cuLaunchGridAsync(f50, 2, 2, s));
    CHECK(cuStreamSynchronize(s));
    CHECK(cuCtxSynchronize());

    /* a captured graph, launched 5 times: 5 × 3 × 1 ms */
    CUgraph graph;
    CUgraphExec exec;
    CHECK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    for (int i = 0; i < 3; i++)
        CHECK(cuLaunchKernel(f1, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
    CHECK(cuStreamEndCapture(s, &graph));
    CHECK(cuGraphInstantiate(&exec, graph, 0));
    CHECK(cuEventRecord(e0, s));
    for (int i = 0; i < 5; i++) CHECK(cuGraphLaunch(exec, s));
    CHECK(cuEventRecord(e1, s));
    CHECK(cuEventSynchronize(e1));
    CHECK(cuEventElapsedTime(&ms, e0, e1));
    printf("graph_15ms_ms=%.3f\n", ms);

    /* stream-ordered allocation */
    CUdeviceptr ap;
    CHECK(cuMemAllocAsync(&ap, 8 << 20, s));
    CUmemoryPool pool;
    CHECK(cuDeviceGetDefaultMemPool(&pool, 0));
    cuuint64_t reserved = 0, used = 0;
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved));
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used));
    printf("pool_reserved=%llu\npool_used=%llu\n", (unsigned long long)reserved, (unsigned long long)used);
    CHECK(cuMemFreeAsync(ap, s));
    CHECK(cuStreamSynchronize(s));
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved));
    printf("pool_reserved_after_sync=%llu\n", (unsigned long long)reserved);

    CHECK(cuGraphExecDestroy(exec));
    CHECK(cuGraphDestroy(graph));

    /* a built graph: two 1 ms kernel nodes and a 3 MiB memory-allocation node */
    CHECK(cuGraphCreate(&graph, 0));
    CUDA_KERNEL_NODE_PARAMS kp = {0};
    kp.func = f1; kp.gridDimX = kp.gridDimY = kp.gridDimZ = 1; kp.blockDimX = 32; kp.blockDimY = kp.blockDimZ = 1;
    CUgraphNode k1, k2, an;
    CHECK(cuGraphAddKernelNode(&k1, graph, NULL, 0, &kp));
    CHECK(cuGraphAddKernelNode(&k2, graph, &k1, 1, &kp));
    CUDA_MEM_ALLOC_NODE_PARAMS mp = {0};
    mp.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    mp.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    mp.poolProps.location.id = 0;
    mp.bytesize = 3 << 20;
    CHECK(cuGraphAddMemAllocNode(&an, graph, &k2, 1, &mp));
    CHECK(cuGraphInstantiate(&exec, graph, 0));
    CHECK(cuEventRecord(e0, s));
    CHECK(cuGraphLaunch(exec, s));
    CHECK(cuEventRecord(e1, s));
    CHECK(cuEventSynchronize(e1));
    CHECK(cuEventElapsedTime(&ms, e0, e1));
    printf("built_graph_ms=%.3f\n", ms);
    cuuint64_t gres = 0, gused = 0;
    CHECK(cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &gres));
    CHECK(cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &gused));
    printf("graph_mem_reserved=%llu\ngraph_mem_used=%llu\n", (unsigned long long)gres, (unsigned long long)gused);
    CHECK(cuMemcpyHtoD(mp.dptr, host, sizeof host)); /* the node's memory is usable */
    CHECK(cuMemFree(mp.dptr));
    CHECK(cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &gused));
    CHECK(cuDeviceGraphMemTrim(0));
    CHECK(cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &gres));
    printf("graph_mem_used_after_free=%llu\ngraph_mem_reserved_after_trim=%llu\n", (unsigned long long)gused,
           (unsigned long long)gres);
    CHECK(cuGraphExecDestroy(exec));
    CHECK(cuGraphDestroy(graph));

    /* an event's device timestamp survives more launches than the queue remembers */
    CUfunction tick;
    CHECK(cuModuleGetFunction(&tick, mod, "spin_50us"));
    CHECK(cuEventRecord(e0, s));
    CHECK(cuLaunchKernel(f1, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
    CHECK(cuEventRecord(e1, s));
    for (int i = 0; i < 1500; i++) CHECK(cuLaunchKernel(tick, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
    CHECK(cuStreamSynchronize(s));
    CHECK(cuEventElapsedTime(&ms, e0, e1));
    printf("event_after_1500_launches_ms=%.3f\n", ms);

    /* mipmapped array: levels 256², 128², … 1² of float, summed and rounded up to 64 KiB */
    CUDA_ARRAY3D_DESCRIPTOR md = {0};
    md.Width = 256; md.Height = 256; md.Format = CU_AD_FORMAT_FLOAT; md.NumChannels = 1;
    CUmipmappedArray mm;
    CHECK(cuMipmappedArrayCreate(&mm, &md, 9));
    CHECK(cuMipmappedArrayGetMemoryRequirements(&req, mm, 0));
    printf("mipmap_bytes=%zu\n", req.size);
    CUarray level;
    CHECK(cuMipmappedArrayGetLevel(&level, mm, 8));
    CHECK(cuMipmappedArrayDestroy(mm));

    /* invalid arguments get the driver's errors */
    EXPECT(cuMemGetInfo(NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuCtxSetCurrent((CUcontext)0x1234), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT(cuStreamSynchronize((CUstream)0x1234), CUDA_ERROR_INVALID_HANDLE);
    EXPECT(cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL), CUDA_ERROR_INVALID_HANDLE);
    CUevent never;
    CHECK(cuEventCreate(&never, 0));
    EXPECT(cuEventElapsedTime(&ms, never, e1), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuEventDestroy(never));
    EXPECT(cuModuleGetFunction(&nope, mod, NULL), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemcpyHtoD(0, host, 16), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemCreate(&h, gran + 1, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    const char *es = NULL;
    CHECK(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &es));
    printf("oom_string=%s\n", es);
    EXPECT(cuGetErrorString((CUresult)12345, &es), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuEventDestroy(e0));
    CHECK(cuEventDestroy(e1));
    CHECK(cuStreamDestroy(s));
    CHECK(cuModuleUnload(mod));
    CHECK(cuDevicePrimaryCtxRelease(0));
    printf("done=1\n");
    return 0;
}
