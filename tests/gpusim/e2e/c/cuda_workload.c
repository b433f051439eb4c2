/* A configurable CUDA workload for gpusim's timeline tests.
 *   cuda_workload [--dev N] [--kernel NAME] [--count N] [--seconds S] [--gap-us U]
 *                 [--hold-mib M] [--wait]
 * Holds M MiB of device memory, prints "ready pid=<pid>", then launches NAME (a kernel of
 * known duration, e.g. spin_1ms) COUNT times or for S seconds. With --gap-us it waits for each
 * kernel and sleeps U µs between them (a duty cycle); without, it keeps the queue full.
 * With --wait it then sleeps until killed. Prints "kernels=<n>", "launched_in=<s>" (time the
 * launch loop took) and "elapsed=<s>" (until all kernels completed) at the end. */
#define _GNU_SOURCE
#include <cuda.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "common.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    int dev = 0, count = -1, gap_us = -1, wait = 0;
    double seconds = -1;
    long hold_mib = 0;
    const char *kernel = "spin_1ms";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dev")) dev = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kernel")) kernel = argv[++i];
        else if (!strcmp(argv[i], "--count")) count = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--gap-us")) gap_us = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hold-mib")) hold_mib = atol(argv[++i]);
        else if (!strcmp(argv[i], "--wait")) wait = 1;
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    CUcontext ctx;
    CUmodule mod;
    CUfunction f;
    CUstream s;
    CHECK(cuInit(0));
    CHECK(cuCtxCreate(&ctx, 0, dev));
    if (hold_mib > 0) {
        CUdeviceptr p;
        CHECK(cuMemAlloc(&p, (size_t)hold_mib << 20));
    }
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuModuleGetFunction(&f, mod, kernel));
    CHECK(cuStreamCreate(&s, 0));
    printf("ready pid=%d\n", (int)getpid());
    fflush(stdout);
    int n = 0;
    double start = now_s();
    while ((count < 0 || n < count) && (seconds < 0 || now_s() - start < seconds) && (count >= 0 || seconds >= 0)) {
        CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        n++;
        if (gap_us >= 0) {
            CHECK(cuStreamSynchronize(s));
            if (gap_us > 0) usleep(gap_us);
        }
    }
    double launched = now_s() - start;
    CHECK(cuStreamSynchronize(s));
    printf("kernels=%d\nlaunched_in=%.6f\nelapsed=%.6f\n", n, launched, now_s() - start);
    fflush(stdout);
    if (wait)
        for (;;) pause();
    return 0;
}
