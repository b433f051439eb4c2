/* A CUDA "shell" for libvcuda's quota tests: reads one command per line on stdin, runs it
 * through the driver API (every allocation entry point, linked -lcuda against gpusim, with
 * libvcuda preloaded by the test) and answers with exactly one line on stdout:
 *
 *     rc=<CUresult> [id=<n>] [key=value ...]
 *
 * so a test can step a process through allocations and look at gpusim's ground truth in
 * between. Objects are named by the id the command that made them printed.
 *
 *   init | ctx [ord] | primary [ord] | module | pid | info | totalmem [ord] | sync | quit
 *   alloc N | alloc1 N (32-bit v1) | managed N | pitch W H E | pitch1 W H E
 *   array W H FMT CH | array1 W H FMT CH | array3d W H D FMT CH | array3d1 W H D FMT CH
 *   mipmap W H D FMT CH LEVELS | reqs ID
 *   vmm N dev|host | map ID | unmap ID | release ID
 *   async N | pool N | freeasync ID | poolreserved (the pool's reserved and used bytes)
 *   graph N (build + instantiate + launch a graph with one N-byte memory-alloc node)
 *   graphreserved | graphfree ID | trim
 *   privmodule: load a module through the runtime's private table (CUDART_INTERFACE [1], the
 *     fatbin-wrapper loader cudart's module registration may use): no hooked call sees it
 *   ctxsync13 | graph13 N: as `sync` (of the context) and `graph`, through the CUDA 13 ABIs
 *     cudart 13 is handed by cuGetProcAddress_v2: cuCtxSynchronize at 13000 (its _v2,
 *     `(CUcontext)`) and cuGraphAddNode at 13040 (its _v3); they reply `lib=` the file the
 *     function pointer lies in (libvcuda.so when it is libvcuda's wrapper) and `fn=` the
 *     symbol it is
 *   free ID | freeall (every live "alloc") | destroy ID | many N SIZE (N cuMemAlloc_v2 of SIZE)
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "common.h"

/* The 32-bit (v1) entry points: the header maps their names to _v2 unless
 * __CUDA_API_VERSION_INTERNAL is defined, so declare them here with the v1 ABI. */
#undef cuMemAlloc
#undef cuMemAllocPitch
#undef cuMemFree
#undef cuArrayCreate
#undef cuArray3DCreate
typedef unsigned int CUdeviceptr_v1;
typedef struct {
    unsigned int Width, Height;
    CUarray_format Format;
    unsigned int NumChannels;
} ARRAY_DESC_v1;
typedef struct {
    unsigned int Width, Height, Depth;
    CUarray_format Format;
    unsigned int NumChannels, Flags;
} ARRAY3D_DESC_v1;
CUresult CUDAAPI cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize);
CUresult CUDAAPI cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int w, unsigned int h,
                                 unsigned int elem);
CUresult CUDAAPI cuMemFree(CUdeviceptr_v1 dptr);
CUresult CUDAAPI cuArrayCreate(CUarray *h, const ARRAY_DESC_v1 *d);
CUresult CUDAAPI cuArray3DCreate(CUarray *h, const ARRAY3D_DESC_v1 *d);

enum kind { K_NONE, K_LINEAR, K_LINEAR_V1, K_ARRAY, K_MIPMAP, K_VMM, K_ASYNC, K_GRAPH };

struct obj {
    enum kind kind;
    CUdeviceptr ptr;
    CUarray arr;
    CUmipmappedArray mip;
    CUmemGenericAllocationHandle handle;
    size_t size;
    CUdeviceptr va; /* VMM: reserved address range, 0 until mapped */
};

#define MAXOBJ 65536
static struct obj objs[MAXOBJ];
static int nobj = 1;
static CUcontext ctx;
static CUstream stream;
static CUmemoryPool pool;
static int dev_ord;

static int add(struct obj o) {
    if (nobj >= MAXOBJ) { fprintf(stderr, "too many objects\n"); exit(2); }
    objs[nobj] = o;
    return nobj++;
}

static struct obj *get(int id) {
    if (id <= 0 || id >= nobj) { fprintf(stderr, "bad id %d\n", id); exit(2); }
    return &objs[id];
}

static void reply(CUresult rc, int id, const char *extra) {
    printf("rc=%d", (int)rc);
    if (id > 0) printf(" id=%d", id);
    if (extra && *extra) printf(" %s", extra);
    printf("\n");
    fflush(stdout);
}

/* The CUDA 13 ABIs (not in the 12.9 cuda.h this is built with). */
typedef CUresult (*ctx_sync_v2_t)(CUcontext);
typedef CUresult (*graph_add_node_t)(CUgraphNode *, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t,
                                     CUgraphNodeParams *);

/* cuGetProcAddress_v2(name, version) as cudart of that version asks; "lib=<file>" into extra. */
static CUresult proc13(const char *name, int version, void **pfn, char *extra, size_t n) {
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = cuGetProcAddress_v2(name, pfn, version, CU_GET_PROC_ADDRESS_DEFAULT, &st);
    if (rc == CUDA_SUCCESS && (st != CU_GET_PROC_ADDRESS_SUCCESS || !*pfn)) rc = CUDA_ERROR_NOT_FOUND;
    if (rc != CUDA_SUCCESS) return rc;
    Dl_info info;
    int found = dladdr(*pfn, &info);
    const char *file = found && info.dli_fname ? info.dli_fname : "?";
    const char *sym = found && info.dli_sname ? info.dli_sname : "?";
    const char *base = strrchr(file, '/');
    snprintf(extra, n, "lib=%s fn=%s", base ? base + 1 : file, sym);
    return CUDA_SUCCESS;
}

/* CUDART_INTERFACE: cuGetExportTable's table of the runtime's private driver calls. */
static const CUuuid CUDART_INTERFACE = {{(char)0x6b, (char)0xd5, (char)0xfb, (char)0x6c, (char)0x5b, (char)0xf4,
                                         (char)0xe7, (char)0x4a, (char)0x89, (char)0x87, (char)0xd9, (char)0x39,
                                         (char)0x12, (char)0xfd, (char)0x9d, (char)0xf9}};
typedef CUresult (*module_from_wrapper_t)(CUmodule *, const void *);

static CUstream the_stream(void) {
    if (!stream) CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    return stream;
}

int main(void) {
    char line[512], extra[256];
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin)) {
        char cmd[32] = "";
        unsigned long long a = 0, b = 0, c = 0, d = 0, e = 0, f = 0;
        char word[32] = "";
        int n = sscanf(line, "%31s %llu %llu %llu %llu %llu %llu", cmd, &a, &b, &c, &d, &e, &f);
        if (n < 1) continue;
        extra[0] = 0;
        CUresult rc = CUDA_SUCCESS;
        int id = 0;
        if (!strcmp(cmd, "quit")) {
            reply(CUDA_SUCCESS, 0, "");
            return 0;
        } else if (!strcmp(cmd, "pid")) {
            snprintf(extra, sizeof extra, "pid=%d", (int)getpid());
        } else if (!strcmp(cmd, "init")) {
            rc = cuInit(0);
        } else if (!strcmp(cmd, "ctx")) {
            dev_ord = (int)a;
            rc = cuCtxCreate_v2(&ctx, 0, dev_ord);
        } else if (!strcmp(cmd, "primary")) {
            dev_ord = (int)a;
            rc = cuDevicePrimaryCtxRetain(&ctx, dev_ord);
            if (rc == CUDA_SUCCESS) rc = cuCtxSetCurrent(ctx);
        } else if (!strcmp(cmd, "ctxdestroy")) {
            /* the driver frees what the context held, with no cuMemFree */
            rc = cuCtxDestroy_v2(ctx);
            ctx = NULL;
        } else if (!strcmp(cmd, "primaryreset")) {
            rc = cuDevicePrimaryCtxReset_v2((int)a);
        } else if (!strcmp(cmd, "module")) {
            CUmodule m;
            rc = cuModuleLoadData(&m, PTX);
        } else if (!strcmp(cmd, "info")) {
            size_t fr = 0, tot = 0;
            rc = cuMemGetInfo_v2(&fr, &tot);
            snprintf(extra, sizeof extra, "free=%zu total=%zu", fr, tot);
        } else if (!strcmp(cmd, "totalmem")) {
            size_t tot = 0;
            rc = cuDeviceTotalMem_v2(&tot, (CUdevice)a);
            snprintf(extra, sizeof extra, "total=%zu", tot);
        } else if (!strcmp(cmd, "sync")) {
            rc = cuStreamSynchronize(the_stream());
        } else if (!strcmp(cmd, "alloc") || !strcmp(cmd, "managed")) {
            struct obj o = {.kind = K_LINEAR, .size = a};
            rc = cmd[0] == 'a' ? cuMemAlloc_v2(&o.ptr, a) : cuMemAllocManaged(&o.ptr, a, CU_MEM_ATTACH_GLOBAL);
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "many")) {
            /* a CUDA_SUCCESS reply means all a allocations of b bytes succeeded; the count that
             * did is reported either way */
            unsigned long long ok = 0;
            for (unsigned long long i = 0; i < a; i++) {
                struct obj o = {.kind = K_LINEAR, .size = b};
                CUresult r = cuMemAlloc_v2(&o.ptr, b);
                if (r != CUDA_SUCCESS) { rc = r; break; }
                add(o);
                ok++;
            }
            snprintf(extra, sizeof extra, "done=%llu", ok);
        } else if (!strcmp(cmd, "alloc1")) {
            CUdeviceptr_v1 p = 0;
            rc = cuMemAlloc(&p, (unsigned int)a);
            if (rc == CUDA_SUCCESS) {
                struct obj o = {.kind = K_LINEAR_V1, .ptr = p, .size = a};
                id = add(o);
                snprintf(extra, sizeof extra, "ptr=%u", p);
            }
        } else if (!strcmp(cmd, "pitch")) {
            struct obj o = {.kind = K_LINEAR};
            size_t pitch = 0;
            rc = cuMemAllocPitch_v2(&o.ptr, &pitch, a, b, (unsigned int)c);
            if (rc == CUDA_SUCCESS) {
                o.size = pitch * b;
                id = add(o);
                snprintf(extra, sizeof extra, "pitch=%zu", pitch);
            }
        } else if (!strcmp(cmd, "pitch1")) {
            CUdeviceptr_v1 p = 0;
            unsigned int pitch = 0;
            rc = cuMemAllocPitch(&p, &pitch, (unsigned int)a, (unsigned int)b, (unsigned int)c);
            if (rc == CUDA_SUCCESS) {
                struct obj o = {.kind = K_LINEAR_V1, .ptr = p, .size = (size_t)pitch * b};
                id = add(o);
                snprintf(extra, sizeof extra, "pitch=%u", pitch);
            }
        } else if (!strcmp(cmd, "array")) {
            CUDA_ARRAY_DESCRIPTOR ad = {.Width = a, .Height = b, .Format = (CUarray_format)c, .NumChannels = (unsigned)d};
            struct obj o = {.kind = K_ARRAY};
            rc = cuArrayCreate_v2(&o.arr, &ad);
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "array1")) {
            ARRAY_DESC_v1 ad = {.Width = (unsigned)a, .Height = (unsigned)b, .Format = (CUarray_format)c,
                                .NumChannels = (unsigned)d};
            struct obj o = {.kind = K_ARRAY};
            rc = cuArrayCreate(&o.arr, &ad);
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "array3d")) {
            CUDA_ARRAY3D_DESCRIPTOR ad = {.Width = a, .Height = b, .Depth = c, .Format = (CUarray_format)d,
                                          .NumChannels = (unsigned)e};
            struct obj o = {.kind = K_ARRAY};
            rc = cuArray3DCreate_v2(&o.arr, &ad);
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "array3d1")) {
            ARRAY3D_DESC_v1 ad = {.Width = (unsigned)a, .Height = (unsigned)b, .Depth = (unsigned)c,
                                  .Format = (CUarray_format)d, .NumChannels = (unsigned)e};
            struct obj o = {.kind = K_ARRAY};
            rc = cuArray3DCreate(&o.arr, &ad);
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "mipmap")) {
            CUDA_ARRAY3D_DESCRIPTOR ad = {.Width = a, .Height = b, .Depth = c, .Format = (CUarray_format)d,
                                          .NumChannels = (unsigned)e};
            struct obj o = {.kind = K_MIPMAP};
            rc = cuMipmappedArrayCreate(&o.mip, &ad, (unsigned)f);
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "reqs")) {
            struct obj *o = get((int)a);
            CUDA_ARRAY_MEMORY_REQUIREMENTS req = {0};
            rc = o->kind == K_MIPMAP ? cuMipmappedArrayGetMemoryRequirements(&req, o->mip, dev_ord)
                                     : cuArrayGetMemoryRequirements(&req, o->arr, dev_ord);
            snprintf(extra, sizeof extra, "size=%zu", req.size);
        } else if (!strcmp(cmd, "vmm")) {
            sscanf(line, "%*s %*u %31s", word);
            CUmemAllocationProp prop = {0};
            prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type = strcmp(word, "host") ? CU_MEM_LOCATION_TYPE_DEVICE : CU_MEM_LOCATION_TYPE_HOST;
            prop.location.id = strcmp(word, "host") ? dev_ord : 0;
            struct obj o = {.kind = K_VMM, .size = a};
            rc = cuMemCreate(&o.handle, a, &prop, 0);
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "map")) {
            struct obj *o = get((int)a);
            rc = cuMemAddressReserve(&o->va, o->size, 0, 0, 0);
            if (rc == CUDA_SUCCESS) rc = cuMemMap(o->va, o->size, 0, o->handle, 0);
            CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, dev_ord}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
            if (rc == CUDA_SUCCESS) rc = cuMemSetAccess(o->va, o->size, &acc, 1);
        } else if (!strcmp(cmd, "unmap")) {
            struct obj *o = get((int)a);
            rc = cuMemUnmap(o->va, o->size);
            if (rc == CUDA_SUCCESS) rc = cuMemAddressFree(o->va, o->size);
        } else if (!strcmp(cmd, "release")) {
            rc = cuMemRelease(get((int)a)->handle);
        } else if (!strcmp(cmd, "async")) {
            struct obj o = {.kind = K_ASYNC, .size = a};
            rc = cuMemAllocAsync(&o.ptr, a, the_stream());
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "pool")) {
            if (!pool) {
                CUmemPoolProps pp = {0};
                pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
                pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                pp.location.id = dev_ord;
                CHECK(cuMemPoolCreate(&pool, &pp));
            }
            struct obj o = {.kind = K_ASYNC, .size = a};
            rc = cuMemAllocFromPoolAsync(&o.ptr, a, pool, the_stream());
            if (rc == CUDA_SUCCESS) id = add(o);
        } else if (!strcmp(cmd, "poolreserved")) {
            CUmemoryPool p = pool;
            if (!p) CHECK(cuDeviceGetDefaultMemPool(&p, dev_ord));
            cuuint64_t r = 0, u = 0;
            CHECK(cuMemPoolGetAttribute(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r));
            CHECK(cuMemPoolGetAttribute(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &u));
            snprintf(extra, sizeof extra, "reserved=%llu used=%llu", (unsigned long long)r, (unsigned long long)u);
        } else if (!strcmp(cmd, "freeasync")) {
            rc = cuMemFreeAsync(get((int)a)->ptr, the_stream());
        } else if (!strcmp(cmd, "graph")) {
            CUgraph g;
            CUgraphExec ex;
            CUgraphNode node;
            CUDA_MEM_ALLOC_NODE_PARAMS mp = {0};
            mp.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
            mp.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            mp.poolProps.location.id = dev_ord;
            mp.bytesize = a;
            CHECK(cuGraphCreate(&g, 0));
            rc = cuGraphAddMemAllocNode(&node, g, NULL, 0, &mp);
            if (rc == CUDA_SUCCESS) rc = cuGraphInstantiate(&ex, g, 0);
            if (rc == CUDA_SUCCESS) rc = cuGraphLaunch(ex, the_stream());
            if (rc == CUDA_SUCCESS) rc = cuStreamSynchronize(the_stream());
            if (rc == CUDA_SUCCESS) {
                struct obj o = {.kind = K_GRAPH, .ptr = mp.dptr, .size = a};
                id = add(o);
            }
        } else if (!strcmp(cmd, "privmodule")) {
            const void *table = NULL;
            rc = cuGetExportTable(&table, &CUDART_INTERFACE);
            if (rc == CUDA_SUCCESS) {
                struct { unsigned int magic, version; const void *data, *filename; } w = {0x466243B1, 1, PTX, NULL};
                CUmodule m;
                rc = ((module_from_wrapper_t)((void *const *)table)[1])(&m, &w);
            }
        } else if (!strcmp(cmd, "ctxsync13")) {
            void *p = NULL;
            rc = proc13("cuCtxSynchronize", 13000, &p, extra, sizeof extra);
            if (rc == CUDA_SUCCESS) rc = ((ctx_sync_v2_t)p)(NULL);
        } else if (!strcmp(cmd, "graph13")) {
            void *p = NULL;
            CUgraph g;
            CUgraphExec ex;
            CUgraphNode node;
            CUgraphNodeParams np;
            memset(&np, 0, sizeof np);
            np.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
            np.alloc.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
            np.alloc.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            np.alloc.poolProps.location.id = dev_ord;
            np.alloc.bytesize = a;
            rc = proc13("cuGraphAddNode", 13040, &p, extra, sizeof extra);
            if (rc == CUDA_SUCCESS) {
                CHECK(cuGraphCreate(&g, 0));
                rc = ((graph_add_node_t)p)(&node, g, NULL, NULL, 0, &np);
            }
            if (rc == CUDA_SUCCESS) rc = cuGraphInstantiate(&ex, g, 0);
            if (rc == CUDA_SUCCESS) rc = cuGraphLaunch(ex, the_stream());
            if (rc == CUDA_SUCCESS) rc = cuStreamSynchronize(the_stream());
            if (rc == CUDA_SUCCESS) {
                struct obj o = {.kind = K_GRAPH, .ptr = np.alloc.dptr, .size = a};
                id = add(o);
            }
        } else if (!strcmp(cmd, "graphreserved")) {
            cuuint64_t r = 0;
            CHECK(cuDeviceGetGraphMemAttribute(dev_ord, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &r));
            snprintf(extra, sizeof extra, "reserved=%llu", (unsigned long long)r);
        } else if (!strcmp(cmd, "trim")) {
            rc = cuDeviceGraphMemTrim(dev_ord);
        } else if (!strcmp(cmd, "free") || !strcmp(cmd, "graphfree")) {
            struct obj *o = get((int)a);
            rc = o->kind == K_LINEAR_V1 ? cuMemFree((CUdeviceptr_v1)o->ptr) : cuMemFree_v2(o->ptr);
        } else if (!strcmp(cmd, "freeall")) {
            /* free every live linear allocation made by "alloc"/"many" */
            for (int i = 1; i < nobj; i++)
                if (objs[i].kind == K_LINEAR && objs[i].ptr) {
                    CUresult r = cuMemFree_v2(objs[i].ptr);
                    if (r != CUDA_SUCCESS) rc = r;
                    objs[i].ptr = 0;
                }
        } else if (!strcmp(cmd, "destroy")) {
            struct obj *o = get((int)a);
            rc = o->kind == K_MIPMAP ? cuMipmappedArrayDestroy(o->mip) : cuArrayDestroy(o->arr);
        } else {
            fprintf(stderr, "unknown command %s\n", cmd);
            return 2;
        }
        reply(rc, id, extra);
    }
    return 0;
}
