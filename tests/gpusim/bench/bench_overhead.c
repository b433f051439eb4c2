/* What libvcuda adds to the calls it wraps on its hot paths: a cuMemAlloc_v2 +
 * cuMemFree_v2 pair (1 MiB), cuMemGetInfo_v2, and cuLaunchKernel of a 100 ns kernel (a
 * process under its compute share: about a third of the GPU), each timed alone with the vDSO monotonic
 * clock. scripts/bench-overhead runs this program alternately without and with libvcuda
 * preloaded (several rounds each, so drift and noise hit both alike) and then has it print
 * the comparison.
 *
 *   bench_overhead run OUT CALLS     measure CALLS of each, write the raw samples to OUT
 *   bench_overhead report DIR ROUNDS read DIR/{gpusim,vcuda}.<round> and print the table
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
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

enum { PAIR, INFO, LAUNCH, CLOCK, NCALLS };
static const char *NAMES[NCALLS] = {"cuMemAlloc_v2 + cuMemFree_v2", "cuMemGetInfo_v2",
                                    "cuLaunchKernel (under share)", "clock read"};

/* gpusim's cost model runs a kernel named ..._100ns for 100 ns. */
static const char PTX[] = ".version 8.0\n.target sm_80\n.address_size 64\n"
                          ".visible .entry tick_100ns() { ret; }\n";

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

static int run(const char *out, long n) {
    long long *s = malloc(sizeof *s * n * NCALLS);
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuCtxCreate(&ctx, 0, 0));
    CUmodule mod;
    CUfunction f;
    CUstream st;
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuModuleGetFunction(&f, mod, "tick_100ns"));
    CHECK(cuStreamCreate(&st, 0));
    /* Launch for 2 s first: libvcuda's first estimate of a launch's cost comes from timing
     * one with events, which for a kernel this short mostly measures the host's gap between
     * calls; its NVML calibration then finds the true cost within about a second. */
    for (long long t0 = now_ns(); now_ns() - t0 < 2000000000LL;)
        for (int i = 0; i < 1000; i++) CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, st, NULL, NULL));
    CHECK(cuStreamSynchronize(st));
    /* warm up: page in the code paths, the allocation table, the driver's structures */
    for (int i = 0; i < 5000; i++) {
        CUdeviceptr p;
        size_t f, t;
        CHECK(cuMemAlloc_v2(&p, 1 << 20));
        CHECK(cuMemFree_v2(p));
        CHECK(cuMemGetInfo_v2(&f, &t));
    }
    for (long i = 0; i < n; i++) {
        long long t0 = now_ns();
        s[CLOCK * n + i] = now_ns() - t0;
    }
    for (long i = 0; i < n; i++) {
        CUdeviceptr p;
        long long t0 = now_ns();
        CUresult a = cuMemAlloc_v2(&p, 1 << 20);
        CUresult b = cuMemFree_v2(p);
        s[PAIR * n + i] = now_ns() - t0;
        if (a != CUDA_SUCCESS || b != CUDA_SUCCESS) {
            fprintf(stderr, "alloc/free failed: %d %d\n", (int)a, (int)b);
            return 1;
        }
    }
    for (long i = 0; i < n; i++) {
        size_t f, t;
        long long t0 = now_ns();
        CUresult a = cuMemGetInfo_v2(&f, &t);
        s[INFO * n + i] = now_ns() - t0;
        if (a != CUDA_SUCCESS) return 1;
    }
    for (long i = 0; i < n; i++) {
        long long t0 = now_ns();
        CUresult a = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, st, NULL, NULL);
        s[LAUNCH * n + i] = now_ns() - t0;
        if (a != CUDA_SUCCESS) return 1;
    }
    CHECK(cuStreamSynchronize(st));
    /* whether libvcuda is in the process (its own C API is then resolvable) */
    long preloaded = dlsym(RTLD_DEFAULT, "vcuda_version") != NULL;
    FILE *fp = fopen(out, "wb");
    if (!fp || fwrite(&n, sizeof n, 1, fp) != 1 || fwrite(&preloaded, sizeof preloaded, 1, fp) != 1 || fwrite(s, sizeof *s, n * NCALLS, fp) != (size_t)(n * NCALLS)) {
        perror(out);
        return 1;
    }
    fclose(fp);
    return 0;
}

struct stats {
    long long med, p99;
};

/* All rounds of one configuration, merged, per call. */
static void load(const char *dir, const char *which, int rounds, long want_preloaded, struct stats st[NCALLS],
                 long *total) {
    long cap = 0, used[NCALLS] = {0};
    long long *all[NCALLS] = {0};
    for (int r = 0; r < rounds; r++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s.%d", dir, which, r);
        FILE *fp = fopen(path, "rb");
        long n, preloaded;
        if (!fp || fread(&n, sizeof n, 1, fp) != 1 || fread(&preloaded, sizeof preloaded, 1, fp) != 1) {
            perror(path);
            exit(1);
        }
        if (preloaded != want_preloaded) {
            fprintf(stderr, "%s: libvcuda was %s, expected the opposite\n", path, preloaded ? "loaded" : "not loaded");
            exit(1);
        }
        if (!cap) {
            cap = n * rounds;
            for (int c = 0; c < NCALLS; c++) all[c] = malloc(sizeof(long long) * cap);
        }
        for (int c = 0; c < NCALLS; c++) {
            if (fread(all[c] + used[c], sizeof(long long), n, fp) != (size_t)n) { perror(path); exit(1); }
            used[c] += n;
        }
        fclose(fp);
    }
    for (int c = 0; c < NCALLS; c++) {
        qsort(all[c], used[c], sizeof(long long), cmp);
        st[c].med = all[c][used[c] / 2];
        st[c].p99 = all[c][(long)(used[c] * 0.99)];
        free(all[c]);
    }
    *total = used[0];
}

static int report(const char *dir, int rounds) {
    struct stats base[NCALLS], with[NCALLS];
    long n;
    load(dir, "gpusim", rounds, 0, base, &n);
    load(dir, "vcuda", rounds, 1, with, &n);
    printf("libvcuda overhead: ns per call, %ld calls each in %d alternating rounds "
           "(clock read of %lld / %lld ns subtracted)\n\n",
           n, rounds, base[CLOCK].med, with[CLOCK].med);
    printf("| %-28s | %13s | %10s | %13s | %10s | %12s | %9s |\n", "call", "gpusim median", "gpusim p99",
           "vcuda median", "vcuda p99", "added median", "added p99");
    printf("|------------------------------|---------------|------------|---------------|------------|"
           "--------------|-----------|\n");
    for (int c = 0; c < CLOCK; c++) {
        long long bm = base[c].med - base[CLOCK].med, bp = base[c].p99 - base[CLOCK].med;
        long long wm = with[c].med - with[CLOCK].med, wp = with[c].p99 - with[CLOCK].med;
        printf("| %-28s | %13lld | %10lld | %13lld | %10lld | %12lld | %9lld |\n", NAMES[c], bm, bp, wm, wp,
               wm - bm, wp - bp);
    }
    long long added = (with[PAIR].med - with[CLOCK].med) - (base[PAIR].med - base[CLOCK].med);
    printf("\ntarget: at most 50 ns added per alloc+free pair at the median: %s (%lld ns)\n",
           added <= 50 ? "met" : "NOT met", added);
    long long launch = (with[LAUNCH].med - with[CLOCK].med) - (base[LAUNCH].med - base[CLOCK].med);
    printf("target: at most 10 ns added per launch under the share at the median: %s (%lld ns)\n",
           launch <= 10 ? "met" : "NOT met", launch);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "run")) return run(argv[2], atol(argv[3]));
    if (argc == 4 && !strcmp(argv[1], "report")) return report(argv[2], atoi(argv[3]));
    fprintf(stderr, "usage: %s run OUT CALLS | report DIR ROUNDS\n", argv[0]);
    return 2;
}
