/* What libvcuda adds to the calls it wraps on the allocation hot path: a cuMemAlloc_v2 +
 * cuMemFree_v2 pair (1 MiB) and cuMemGetInfo_v2, each timed alone with the vDSO monotonic
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

enum { PAIR, INFO, CLOCK, NCALLS };
static const char *NAMES[NCALLS] = {"cuMemAlloc_v2 + cuMemFree_v2", "cuMemGetInfo_v2", "clock read"};

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
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "run")) return run(argv[2], atol(argv[3]));
    if (argc == 4 && !strcmp(argv[1], "report")) return report(argv[2], atoi(argv[3]));
    fprintf(stderr, "usage: %s run OUT CALLS | report DIR ROUNDS\n", argv[0]);
    return 2;
}
