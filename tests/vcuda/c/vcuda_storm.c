/* One process of an allocation storm: creates its context, prints "ready pid=<pid>", waits
 * for a line on stdin (so every process of the storm starts together, after all contexts
 * exist), then runs THREADS threads that for SECONDS allocate and free at random:
 * cuMemAlloc_v2 / cuMemFree_v2 and, for ASYNC_PCT percent of allocations, cuMemAllocAsync /
 * cuMemFreeAsync on the thread's own stream. Sizes are random multiples of 512 B (gpusim's
 * allocation granule, so the container's count and the driver's agree byte for byte) up to
 * MAX_KIB. At the end every thread frees what it holds and the process prints
 *
 *     allocs=<successful allocations> refused=<CUDA_ERROR_OUT_OF_MEMORY> errors=<other> ...
 *
 * Usage: vcuda_storm THREADS SECONDS MAX_KIB ASYNC_PCT SEED */
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "common.h"

#define LIVE 32

static CUcontext ctx;
static double seconds;
static unsigned max_units, async_pct;
static atomic_ullong n_alloc, n_refused, n_error, n_async;
static atomic_int first_error;

struct held {
    CUdeviceptr p;
    int async;
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void error(CUresult rc) {
    atomic_fetch_add(&n_error, 1);
    int zero = 0;
    atomic_compare_exchange_strong(&first_error, &zero, (int)rc);
}

static void release(struct held *h, CUstream s) {
    CUresult rc = h->async ? cuMemFreeAsync(h->p, s) : cuMemFree_v2(h->p);
    if (rc != CUDA_SUCCESS) error(rc);
}

static void *worker(void *arg) {
    uint64_t seed = (uint64_t)(uintptr_t)arg;
    struct held live[LIVE];
    int n = 0;
    CHECK(cuCtxSetCurrent(ctx));
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    double end = now() + seconds;
    while (now() < end) {
        uint64_t r = next(&seed);
        if (n < LIVE && (n == 0 || r % 3 != 0)) {
            size_t size = (size_t)(1 + (r >> 8) % max_units) * 512;
            int async = (r >> 40) % 100 < async_pct;
            CUdeviceptr p;
            CUresult rc = async ? cuMemAllocAsync(&p, size, s) : cuMemAlloc_v2(&p, size);
            if (rc == CUDA_SUCCESS) {
                live[n++] = (struct held){p, async};
                atomic_fetch_add(&n_alloc, 1);
                if (async) atomic_fetch_add(&n_async, 1);
            } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
                atomic_fetch_add(&n_refused, 1);
            } else {
                error(rc);
            }
        } else {
            int i = (int)((r >> 8) % (unsigned)n);
            release(&live[i], s);
            live[i] = live[--n];
            if ((r >> 32) % 8 == 0) {
                CUresult rc = cuStreamSynchronize(s);
                if (rc != CUDA_SUCCESS) error(rc);
            }
        }
    }
    while (n > 0) release(&live[--n], s);
    CHECK(cuStreamSynchronize(s));
    CHECK(cuStreamDestroy(s));
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s THREADS SECONDS MAX_KIB ASYNC_PCT SEED\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    seconds = atof(argv[2]);
    max_units = (unsigned)atoi(argv[3]) * 2;
    async_pct = (unsigned)atoi(argv[4]);
    uint64_t seed = strtoull(argv[5], NULL, 0) * 0x9E3779B97F4A7C15ull + 1;
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    printf("ready pid=%d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 3;
    double t0 = now();
    pthread_t t[64];
    for (int i = 0; i < threads && i < 64; i++)
        pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)(next(&seed) | 1));
    for (int i = 0; i < threads && i < 64; i++) pthread_join(t[i], NULL);
    CHECK(cuDevicePrimaryCtxRelease(0));
    printf("allocs=%llu refused=%llu errors=%llu async=%llu first_error=%d elapsed=%.3f\n",
           (unsigned long long)n_alloc, (unsigned long long)n_refused, (unsigned long long)n_error,
           (unsigned long long)n_async, first_error, now() - t0);
    fflush(stdout);
    return n_error ? 1 : 0;
}
