/* A saturating (or bursty) kernel workload for the compute limiter's tests.
 *   vcuda_load [--kernel NAME] [--seconds S] [--api API] [--on-ms A --off-ms B] [--device N]
 * Launches NAME (a kernel of known duration under gpusim's cost model, e.g. spin_50us)
 * back to back for S seconds through API: kernel (cuLaunchKernel, default), kernel_ptsz,
 * ex (cuLaunchKernelEx), coop (cuLaunchCooperativeKernel), multi
 * (cuLaunchCooperativeKernelMultiDevice), grid (cuLaunchGrid), grid_async
 * (cuLaunchGridAsync), legacy (cuLaunch) or graph (cuGraphLaunch of a captured one-kernel
 * graph). With --on-ms/--off-ms it alternates A ms of launching with B ms idle (after
 * waiting for the queue to drain). --device N runs on CUDA ordinal N. Prints "ready pid=<pid>" once its context exists and
 * "kernels=<n>" at the end. */
#define _GNU_SOURCE
#include <cuda.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "common.h"

CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                     unsigned, unsigned, CUstream, void **, void **);

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    const char *kernel = "spin_1ms", *api = "kernel";
    double seconds = 5, on_ms = 0, off_ms = 0;
    int device = 0; /* the CUDA ordinal, as the process sees its GPUs */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kernel")) kernel = argv[++i];
        else if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--api")) api = argv[++i];
        else if (!strcmp(argv[i], "--on-ms")) on_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--off-ms")) off_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--device")) device = atoi(argv[++i]);
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    CUcontext ctx;
    CUmodule mod;
    CUfunction f;
    CUstream s;
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, device));
    CHECK(cuCtxCreate(&ctx, 0, dev));
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuModuleGetFunction(&f, mod, kernel));
    CHECK(cuStreamCreate(&s, 0));
    CUgraphExec exec = NULL;
    if (!strcmp(api, "graph")) {
        CUgraph g;
        CHECK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
        CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        CHECK(cuStreamEndCapture(s, &g));
        CHECK(cuGraphInstantiate(&exec, g, 0));
    }
    CUlaunchConfig cfg = {.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32,
                          .blockDimY = 1, .blockDimZ = 1, .hStream = s};
    CUDA_LAUNCH_PARAMS multi = {.function = f, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1,
                                .blockDimX = 32, .blockDimY = 1, .blockDimZ = 1, .hStream = s};
    printf("ready pid=%d\n", (int)getpid());
    fflush(stdout);
    long n = 0;
    double start = now_s(), phase = start;
    while (now_s() - start < seconds) {
        if (on_ms > 0 && (now_s() - phase) * 1e3 >= on_ms) {
            CHECK(cuStreamSynchronize(s));
            usleep((useconds_t)(off_ms * 1e3));
            phase = now_s();
        }
        if (!strcmp(api, "kernel")) CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        else if (!strcmp(api, "kernel_ptsz"))
            CHECK(cuLaunchKernel_ptsz(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        else if (!strcmp(api, "ex")) CHECK(cuLaunchKernelEx(&cfg, f, NULL, NULL));
        else if (!strcmp(api, "coop"))
            CHECK(cuLaunchCooperativeKernel(f, 1, 1, 1, 32, 1, 1, 0, s, NULL));
        else if (!strcmp(api, "multi")) CHECK(cuLaunchCooperativeKernelMultiDevice(&multi, 1, 0));
        else if (!strcmp(api, "grid")) CHECK(cuLaunchGrid(f, 1, 1));
        else if (!strcmp(api, "grid_async")) CHECK(cuLaunchGridAsync(f, 1, 1, s));
        else if (!strcmp(api, "legacy")) CHECK(cuLaunch(f));
        else if (!strcmp(api, "graph")) CHECK(cuGraphLaunch(exec, s));
        else { fprintf(stderr, "unknown --api %s\n", api); return 2; }
        n++;
    }
    CHECK(cuCtxSynchronize());
    printf("kernels=%ld\n", n);
    return 0;
}
