/* Cost of the calls a GPU-sharing library wraps, in gpusim itself: the baseline later
 * overhead figures are stated against. Each call is timed alone with the vDSO monotonic
 * clock (the clock read itself, measured the same way, is reported and subtracted). */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                             \
    do {                                                                        \
        CUresult rc_ = (call);                                                  \
        if (rc_ != CUDA_SUCCESS) {                                              \
            fprintf(stderr, "%s failed: %d\n", #call, (int)rc_);                \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

static long long *samples;
static long long clock_cost;

static void report(const char *name, int n) {
    qsort(samples, n, sizeof *samples, cmp);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += samples[i];
    long long med = samples[n / 2] - clock_cost, p99 = samples[(int)(n * 0.99)] - clock_cost;
    printf("| %-28s | %10lld | %10lld | %10.0f |\n", name, med < 0 ? 0 : med, p99 < 0 ? 0 : p99,
           sum / n - clock_cost);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 200000;
    samples = malloc(sizeof *samples * n);
    CUcontext ctx;
    CUmodule mod;
    CUfunction f;
    CUstream s;
    static const char ptx[] = ".version 8.0\n.target sm_80\n.address_size 64\n"
                              ".visible .entry tick_1ns() { ret; }\n";
    CHECK(cuInit(0));
    CHECK(cuCtxCreate(&ctx, 0, 0));
    CHECK(cuModuleLoadData(&mod, ptx));
    CHECK(cuModuleGetFunction(&f, mod, "tick_1ns"));
    CHECK(cuStreamCreate(&s, 0));

    for (int i = 0; i < n; i++) {
        long long t0 = now_ns();
        samples[i] = now_ns() - t0;
    }
    qsort(samples, n, sizeof *samples, cmp);
    clock_cost = samples[n / 2];

    printf("gpusim: ns per call, %d calls each (clock read of %lld ns subtracted)\n\n", n, clock_cost);
    printf("| %-28s | %10s | %10s | %10s |\n", "call", "median", "p99", "mean");
    printf("|------------------------------|------------|------------|------------|\n");

    for (int i = 0; i < 1000; i++) CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
    CHECK(cuStreamSynchronize(s));
    for (int i = 0; i < n; i++) {
        long long t0 = now_ns();
        cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        samples[i] = now_ns() - t0;
    }
    CHECK(cuStreamSynchronize(s));
    report("cuLaunchKernel", n);

    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        long long t0 = now_ns();
        cuMemAlloc_v2(&p, 1 << 20);
        cuMemFree_v2(p);
        samples[i] = now_ns() - t0;
    }
    report("cuMemAlloc_v2 + cuMemFree_v2", n);

    for (int i = 0; i < n; i++) {
        size_t fr, tot;
        long long t0 = now_ns();
        cuMemGetInfo_v2(&fr, &tot);
        samples[i] = now_ns() - t0;
    }
    report("cuMemGetInfo_v2", n);
    return 0;
}
