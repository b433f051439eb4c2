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

#define BATCH 8

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int run(const char *out, long n) {
    double *s = malloc(sizeof *s * n * NCALLS);
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
        s[CLOCK * n + i] = (double)(now_ns() - t0) / BATCH;
    }
    for (long i = 0; i < n; i++) {
        CUdeviceptr p[BATCH];
        CUresult a = CUDA_SUCCESS, b = CUDA_SUCCESS;
        long long t0 = now_ns();
        for (int k = 0; k < BATCH; k++) {
            a |= cuMemAlloc_v2(&p[k], 1 << 20);
            b |= cuMemFree_v2(p[k]);
        }
        s[PAIR * n + i] = (double)(now_ns() - t0) / BATCH;
        if (a != CUDA_SUCCESS || b != CUDA_SUCCESS) {
            fprintf(stderr, "alloc/free failed: %d %d\n", (int)a, (int)b);
            return 1;
        }
    }
    for (long i = 0; i < n; i++) {
        size_t f, t;
        CUresult a = CUDA_SUCCESS;
        long long t0 = now_ns();
        for (int k = 0; k < BATCH; k++) a |= cuMemGetInfo_v2(&f, &t);
        s[INFO * n + i] = (double)(now_ns() - t0) / BATCH;
        if (a != CUDA_SUCCESS) return 1;
    }
    for (long i = 0; i < n; i++) {
        CUresult a = CUDA_SUCCESS;
        long long t0 = now_ns();
        for (int k = 0; k < BATCH; k++) a |= cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, st, NULL, NULL);
        s[LAUNCH * n + i] = (double)(now_ns() - t0) / BATCH;
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
    double med, p99;
};

static double at(double *v, long n, double q) {
    qsort(v, n, sizeof *v, cmp);
    return v[(long)(n * q)];
}

/* One round of one configuration: each call's samples. */
static double *load_round(const char *dir, const char *which, int r, long want_preloaded, long *n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.%d", dir, which, r);
    FILE *fp = fopen(path, "rb");
    long preloaded;
    if (!fp || fread(n, sizeof *n, 1, fp) != 1 || fread(&preloaded, sizeof preloaded, 1, fp) != 1) {
        perror(path);
        exit(1);
    }
    if (preloaded != want_preloaded) {
        fprintf(stderr, "%s: libvcuda was %s, expected the opposite\n", path, preloaded ? "loaded" : "not loaded");
        exit(1);
    }
    double *s = malloc(sizeof *s * *n * NCALLS);
    if (fread(s, sizeof *s, *n * NCALLS, fp) != (size_t)(*n * NCALLS)) {
        perror(path);
        exit(1);
    }
    fclose(fp);
    return s;
}

static int report(const char *dir, int rounds) {
    /* per round: each configuration's median per call (clock subtracted); merged: p99 */
    double *added[NCALLS], *merged[2][NCALLS];
    struct stats all[2][NCALLS];
    long n = 0;
    for (int c = 0; c < NCALLS; c++) added[c] = malloc(sizeof(double) * rounds);
    for (int w = 0; w < 2; w++)
        for (int c = 0; c < NCALLS; c++) merged[w][c] = NULL;
    for (int r = 0; r < rounds; r++) {
        double med[2][NCALLS];
        for (int w = 0; w < 2; w++) {
            double *s = load_round(dir, w ? "vcuda" : "gpusim", r, w, &n);
            for (int c = 0; c < NCALLS; c++) {
                if (!merged[w][c]) merged[w][c] = malloc(sizeof(double) * n * rounds);
                memcpy(merged[w][c] + (long)r * n, s + (long)c * n, sizeof(double) * n);
                med[w][c] = at(s + (long)c * n, n, 0.5);
            }
            free(s);
        }
        for (int c = 0; c < CLOCK; c++)
            added[c][r] = (med[1][c] - med[1][CLOCK]) - (med[0][c] - med[0][CLOCK]);
    }
    for (int w = 0; w < 2; w++)
        for (int c = 0; c < NCALLS; c++) {
            all[w][c].med = at(merged[w][c], n * rounds, 0.5);
            all[w][c].p99 = at(merged[w][c], n * rounds, 0.99);
        }
    printf("libvcuda overhead: ns per call, %ld samples of %d consecutive calls each in %d alternating rounds "
           "(clock read of %.1f / %.1f ns per call subtracted)\n\n",
           n, BATCH, rounds, all[0][CLOCK].med, all[1][CLOCK].med);
    printf("| %-28s | %13s | %10s | %13s | %10s | %12s | %17s | %9s |\n", "call", "gpusim median", "gpusim p99",
           "vcuda median", "vcuda p99", "added median", "rounds' range", "added p99");
    printf("|------------------------------|---------------|------------|---------------|------------|"
           "--------------|-------------------|-----------|\n");
    double med_added[NCALLS];
    for (int c = 0; c < CLOCK; c++) {
        double bm = all[0][c].med - all[0][CLOCK].med, bp = all[0][c].p99 - all[0][CLOCK].med;
        double wm = all[1][c].med - all[1][CLOCK].med, wp = all[1][c].p99 - all[1][CLOCK].med;
        med_added[c] = at(added[c], rounds, 0.5);
        char range[64];
        snprintf(range, sizeof range, "%.1f .. %.1f", added[c][0], added[c][rounds - 1]);
        printf("| %-28s | %13.1f | %10.1f | %13.1f | %10.1f | %12.1f | %17s | %9.1f |\n", NAMES[c], bm, bp, wm,
               wp, med_added[c], range, wp - bp);
    }
    printf("\nadded median: the median over the %d rounds of (vcuda's median - gpusim's median)\n", rounds);
    printf("target: at most 50 ns added per alloc+free pair at the median: %s (%.1f ns)\n",
           med_added[PAIR] <= 50 ? "met" : "NOT met", med_added[PAIR]);
    printf("target: at most 20 ns added per cuMemGetInfo_v2 at the median: %s (%.1f ns)\n",
           med_added[INFO] <= 20 ? "met" : "NOT met", med_added[INFO]);
    printf("target: at most 10 ns added per launch under the share at the median: %s (%.1f ns)\n",
           med_added[LAUNCH] <= 10 ? "met" : "NOT met", med_added[LAUNCH]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "run")) return run(argv[2], atol(argv[3]));
    if (argc == 4 && !strcmp(argv[1], "report")) return report(argv[2], atoi(argv[3]));
    fprintf(stderr, "usage: %s run OUT CALLS | report DIR ROUNDS\n", argv[0]);
    return 2;
}
