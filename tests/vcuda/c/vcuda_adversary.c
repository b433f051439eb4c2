/* Launch patterns that try to get more than a compute share (tests/gpusim/bench/bench_adversary.py).
 *   vcuda_adversary --mode MODE [--seconds S] [options]
 * Every mode saturates (launches back to back, never idles) for S seconds (default 11):
 *   steady   one kernel, --kernel NAME (default spin_50us): the baseline
 *   storm    --storm N (20000) short kernels as fast as possible, then long ones
 *   switch   phases of --phase-ms P (500) ms: short kernels, then long, then short, ...;
 *            phases follow CLOCK_MONOTONIC (the machine's clock), so two processes, one
 *            with --invert (long first), are exactly out of phase
 *   bursts   every --period-ms P (100) ms: --burst N (2000) short kernels, then long ones
 *            for the rest of the period
 *   streams  --threads N (8) threads, each with its own stream, launching long kernels
 *   graph    a captured graph of --graph-nodes N (20) long kernels, cuGraphLaunch'ed
 *   pounce   short kernels until a launch returns at once after one that was held back
 *            (the limiter has just lowered its price), then long kernels until one is held
 *            back again, and so on: a switch timed by what the tenant can see, to catch
 *            whatever the limiter admits at the old price's balance
 * Short = spin_1us, long = spin_1ms (durations in their names). With --same-function both
 * are ONE kernel without a duration in its name (wave_kernel, 1024 threads per block), so
 * gpusim runs it in waves: short = a grid of one block (one wave), long = --long-waves W
 * (default 200: 1 ms at gpusim's default wave_ns of 5 µs) full waves. A cost table per
 * function cannot tell them apart.
 * Prints "ready pid=<pid>" once its context, module, streams and graph exist (just before
 * the first launch), and when S seconds of launching are over (before waiting for the
 * queue to drain)
 *   "kernels=<n> graphs=<g> short_grid=<a> long_grid=<b> cpu_ms=<c> wall_ms=<w>"
 * where cpu_ms is the CPU time (user + system, all threads, libvcuda's included) the
 * process used from "ready" to then, and wall_ms the wall time of the same span. */
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include "common.h"

#define MAX_THREADS 64
#define BLOCK 1024
/* A launch that took longer than this was held back by the limiter (an unthrottled launch
 * returns in microseconds; a 1 ms kernel priced right at 10-50 % waits 1-9 ms). */
#define HELD_S 0.0008

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
}

/* A kernel and the grid it is launched with. */
struct kern {
    CUfunction f;
    unsigned grid, block;
};

static CUcontext ctx;
static struct kern shortk, longk;
static double deadline;
static atomic_long kernels;
static atomic_int go;

static void launch(struct kern k, CUstream s) {
    CHECK(cuLaunchKernel(k.f, k.grid, 1, 1, k.block, 1, 1, 0, s, NULL, NULL));
    atomic_fetch_add_explicit(&kernels, 1, memory_order_relaxed);
}

static void *stream_thread(void *arg) {
    (void)arg;
    CUstream s;
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    while (!atomic_load(&go)) usleep(100);
    while (now_s() < deadline) launch(longk, s);
    return NULL;
}

int main(int argc, char **argv) {
    const char *mode = NULL, *kernel = "spin_50us";
    double seconds = 11, phase_ms = 500, period_ms = 100;
    long storm = 20000, burst = 2000, long_waves = 200;
    int threads = 8, nodes = 20, invert = 0, same = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "--mode") && more) mode = argv[++i];
        else if (!strcmp(a, "--seconds") && more) seconds = atof(argv[++i]);
        else if (!strcmp(a, "--kernel") && more) kernel = argv[++i];
        else if (!strcmp(a, "--storm") && more) storm = atol(argv[++i]);
        else if (!strcmp(a, "--phase-ms") && more) phase_ms = atof(argv[++i]);
        else if (!strcmp(a, "--period-ms") && more) period_ms = atof(argv[++i]);
        else if (!strcmp(a, "--burst") && more) burst = atol(argv[++i]);
        else if (!strcmp(a, "--threads") && more) threads = atoi(argv[++i]);
        else if (!strcmp(a, "--graph-nodes") && more) nodes = atoi(argv[++i]);
        else if (!strcmp(a, "--long-waves") && more) long_waves = atol(argv[++i]);
        else if (!strcmp(a, "--invert")) invert = 1;
        else if (!strcmp(a, "--same-function")) same = 1;
        else { fprintf(stderr, "unknown or incomplete argument %s\n", a); return 2; }
    }
    if (!mode) { fprintf(stderr, "--mode is required\n"); return 2; }
    if (threads < 1 || threads > MAX_THREADS || nodes < 1 || long_waves < 1 || phase_ms <= 0 || period_ms <= 0) {
        fprintf(stderr, "bad --threads, --graph-nodes, --long-waves, --phase-ms or --period-ms\n");
        return 2;
    }

    CUmodule mod;
    CUstream s;
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, 0, dev));
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuStreamCreate(&s, 0));

    /* gpusim's cost model: a wave is sm_count × max(1, max_threads_per_sm / block) blocks. */
    int sms, tpsm;
    CHECK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    CHECK(cuDeviceGetAttribute(&tpsm, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev));
    long wave = (long)sms * (tpsm / BLOCK > 1 ? tpsm / BLOCK : 1);
    if (same) {
        CUfunction f;
        CHECK(cuModuleGetFunction(&f, mod, "wave_kernel"));
        shortk = (struct kern){f, 1, BLOCK};
        longk = (struct kern){f, (unsigned)(wave * long_waves), BLOCK};
    } else {
        CHECK(cuModuleGetFunction(&shortk.f, mod, "spin_1us"));
        CHECK(cuModuleGetFunction(&longk.f, mod, "spin_1ms"));
        shortk.grid = longk.grid = 1;
        shortk.block = longk.block = 32;
    }
    struct kern steady = {NULL, 1, 32};
    if (!strcmp(mode, "steady")) CHECK(cuModuleGetFunction(&steady.f, mod, kernel));

    CUgraphExec exec = NULL;
    if (!strcmp(mode, "graph")) {
        CUgraph g;
        CHECK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
        for (int i = 0; i < nodes; i++)
            CHECK(cuLaunchKernel(longk.f, longk.grid, 1, 1, longk.block, 1, 1, 0, s, NULL, NULL));
        CHECK(cuStreamEndCapture(s, &g));
        CHECK(cuGraphInstantiate(&exec, g, 0));
    }
    pthread_t tids[MAX_THREADS];
    int nthreads = 0;
    if (!strcmp(mode, "streams")) {
        for (; nthreads < threads; nthreads++)
            if (pthread_create(&tids[nthreads], NULL, stream_thread, NULL)) {
                fprintf(stderr, "pthread_create failed\n");
                return 1;
            }
    }

    printf("ready pid=%d\n", (int)getpid());
    fflush(stdout);
    double start = now_s(), cpu0 = cpu_s();
    deadline = start + seconds;
    long graphs = 0;
    if (!strcmp(mode, "steady")) {
        while (now_s() < deadline) launch(steady, s);
    } else if (!strcmp(mode, "storm")) {
        for (long i = 0; i < storm && now_s() < deadline; i++) launch(shortk, s);
        while (now_s() < deadline) launch(longk, s);
    } else if (!strcmp(mode, "switch")) {
        double t;
        while ((t = now_s()) < deadline) {
            long phase = (long)(t * 1e3 / phase_ms);
            launch((phase + invert) % 2 == 0 ? shortk : longk, s);
        }
    } else if (!strcmp(mode, "bursts")) {
        long cur = -1;
        double t;
        while ((t = now_s()) < deadline) {
            long period = (long)((t - start) * 1e3 / period_ms);
            if (period != cur) {
                cur = period;
                for (long i = 0; i < burst && now_s() < deadline; i++) launch(shortk, s);
            } else {
                launch(longk, s);
            }
        }
    } else if (!strcmp(mode, "pounce")) {
        int held = 0;
        while (now_s() < deadline) {
            double t = now_s();
            launch(shortk, s);
            if (now_s() - t > HELD_S) {
                held = 1;
            } else if (held) {
                do {
                    t = now_s();
                    launch(longk, s);
                } while (now_s() - t <= HELD_S && now_s() < deadline);
                held = 0;
            }
        }
    } else if (!strcmp(mode, "streams")) {
        atomic_store(&go, 1);
        for (int i = 0; i < nthreads; i++) pthread_join(tids[i], NULL);
    } else if (!strcmp(mode, "graph")) {
        while (now_s() < deadline) {
            CHECK(cuGraphLaunch(exec, s));
            graphs++;
        }
    } else {
        fprintf(stderr, "unknown --mode %s\n", mode);
        return 2;
    }
    double wall = now_s() - start, cpu = cpu_s() - cpu0;
    printf("kernels=%ld graphs=%ld short_grid=%u long_grid=%u cpu_ms=%.1f wall_ms=%.1f\n",
           atomic_load(&kernels), graphs, shortk.grid, longk.grid, cpu * 1e3, wall * 1e3);
    fflush(stdout);
    /* What was admitted but not yet run drains now (a caller that has what it needs may
     * kill the process instead of waiting: an unthrottled graph loop queues ~20 s). */
    CHECK(cuCtxSynchronize());
    return 0;
}
