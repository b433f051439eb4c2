/* One worker of a kill storm (kill_storm.py): a process of a vcuda container that makes a
 * primary context on each of its first GPUS devices, then allocates and frees chunks of
 * random size (whole MiB from MIN_MIB to MAX_MIB, cuMemAlloc_v2 / cuMemFree_v2) on random
 * GPUs for as long as it lives.
 *
 * It reports through STATS, a 4 KiB file the driver created and maps too: u64 fields (enum
 * field below) updated as things happen, so the figures survive a SIGKILL. It takes orders
 * on stdin, one a line, read by a control thread:
 *
 *   go                       start allocating (with WAIT 1; the driver starts the first
 *                            processes of a storm together, once all have their contexts)
 *   kill alloc | kill free   SIGKILL this process at a random instant inside one of its next
 *                            cuMemAlloc_v2 / cuMemFree_v2 calls (meanwhile it makes only
 *                            such calls, where it can)
 *   exit                     leave the loop and exit normally: half the time freeing
 *                            everything and releasing the contexts first, half the time not
 *   exit kill US             the same, SIGKILLed at a random instant of the first US µs of
 *                            that exit (if it still runs by then)
 *
 * Usage: vcuda_churn STATS GPUS MIN_MIB MAX_MIB CAP_MIB PROBE_MIB SEED WAIT STARTUP_KILL_US
 *   CAP_MIB          most this process holds on each GPU besides its context (0: no limit,
 *                    allocate until refused)
 *   PROBE_MIB        if not 0, one call in four asks for this much, more than the quota: any
 *                    correct library refuses it, and reclaims dead processes' slots first
 *                    (counted apart from the other refusals)
 *   WAIT             1: once every context is made, print "ready" and wait for "go"; 0: print
 *                    "ready" and start at once
 *   STARTUP_KILL_US  SIGKILL this process at a random instant of its first STARTUP_KILL_US µs
 *                    if it is still starting then (cuInit, the library's slot claim, the
 *                    contexts); 0: never
 *
 * Exit status: 0 after "exit"; 3 when cuInit or a context is refused (the CUresult is in
 * STATS); 2 when stdin closes; 1 on anything unexpected. */
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include "common.h"

#define MAX_GPUS 8
#define LIVE 64
#define MiB (1ull << 20)

/* STATS fields (u64 each, little-endian; kill_storm.py reads them by these indices) */
enum field {
    F_STATE,     /* enum state */
    F_PHASE,     /* enum phase in the low 8 bits, a call count above */
    F_KILLED_IN, /* the phase this process was in when it SIGKILLed itself (0: it did not) */
    F_ALLOCS,    /* successful allocations */
    F_REFUSED,   /* allocations refused with CUDA_ERROR_OUT_OF_MEMORY */
    F_ERRORS,    /* any other failed call */
    F_FAIL_RC,   /* the CUresult that refused cuInit or a context */
    F_FAIL_AT,   /* 1: cuInit, 2 + g: the context on GPU g */
    F_STARTUP_NS, /* from main() to every context made */
    F_EXIT_NS,   /* from the start of a normal exit to this program's atexit handler */
    F_ALLOC_NS,  /* the last cuMemAlloc_v2's duration */
    F_FREE_NS,   /* the last cuMemFree_v2's duration */
    F_PROBES,    /* PROBE_MIB allocations refused */
};
enum state { S_STARTING, S_READY, S_REFUSED, S_EXITING };
enum phase { P_NONE, P_STARTUP, P_ALLOC, P_FREE, P_EXIT };

static _Atomic uint64_t *stats;
static atomic_int exit_order; /* 0: none, 1: exit */
static atomic_int aim;        /* the phase the control thread waits to kill in, or 0 */
static pthread_mutex_t go_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t go_cond = PTHREAD_COND_INITIALIZER;
static int going; /* under go_lock */
static uint64_t seed;
static double t_exit;

struct gpu {
    CUcontext ctx;
    CUdeviceptr live[LIVE];
    size_t size[LIVE];
    int n;
    size_t held;
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

static void set(enum field f, uint64_t v) { atomic_store(&stats[f], v); }
static uint64_t get(enum field f) { return atomic_load(&stats[f]); }
static void bump(enum field f) { atomic_fetch_add(&stats[f], 1); }

static void enter(enum phase p) { set(F_PHASE, ((get(F_PHASE) >> 8) + 1) << 8 | p); }

static void sleep_us(uint64_t us) {
    struct timespec t = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    nanosleep(&t, NULL);
}

static void die_in(enum phase p) {
    set(F_KILLED_IN, p);
    kill(getpid(), SIGKILL);
}

/* SIGKILL this process at a random instant inside a call of phase `p`: wait for such a call,
 * then for a random fraction of the last such call's duration; if the same call is still
 * running, die, else wait for the next one. */
static void kill_inside(enum phase p, uint64_t *s) {
    enum field took = p == P_ALLOC ? F_ALLOC_NS : F_FREE_NS;
    atomic_store(&aim, p);
    for (;;) {
        uint64_t ph = get(F_PHASE);
        if ((ph & 0xff) != p) {
            sched_yield();
            continue;
        }
        double until = now() + (double)(next(s) % (get(took) + 1)) * 1e-9;
        while (now() < until && get(F_PHASE) == ph) {
        }
        if (get(F_PHASE) == ph) die_in(p);
    }
}

static void go(void) {
    pthread_mutex_lock(&go_lock);
    going = 1;
    pthread_cond_signal(&go_cond);
    pthread_mutex_unlock(&go_lock);
}

static void *control(void *arg) {
    uint64_t startup_kill_us = *(uint64_t *)arg;
    uint64_t s = seed ^ 0x5DEECE66Dull;
    if (startup_kill_us) {
        sleep_us(next(&s) % startup_kill_us);
        if ((get(F_PHASE) & 0xff) == P_STARTUP) die_in(P_STARTUP);
    }
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long us = 0;
        if (!strcmp(line, "go\n")) {
            go();
        } else if (!strcmp(line, "kill alloc\n")) {
            kill_inside(P_ALLOC, &s);
        } else if (!strcmp(line, "kill free\n")) {
            kill_inside(P_FREE, &s);
        } else if (!strcmp(line, "exit\n")) {
            atomic_store(&exit_order, 1);
        } else if (sscanf(line, "exit kill %llu", &us) == 1) {
            atomic_store(&exit_order, 1);
            while ((get(F_PHASE) & 0xff) != P_EXIT) sched_yield();
            sleep_us(next(&s) % (us + 1));
            die_in(P_EXIT);
        } else {
            fprintf(stderr, "vcuda_churn: unknown order %s", line);
            exit(1);
        }
    }
    _exit(2); /* the driver is gone: do not churn on unattended */
}

static void at_exit(void) {
    if (t_exit > 0) set(F_EXIT_NS, (uint64_t)((now() - t_exit) * 1e9));
}

static void fail(CUresult rc, uint64_t at) {
    set(F_FAIL_RC, (uint64_t)rc);
    set(F_FAIL_AT, at);
    set(F_STATE, S_REFUSED);
    exit(3);
}

static void error(void) { bump(F_ERRORS); }

static CUresult allocate(CUdeviceptr *p, size_t size) {
    enter(P_ALLOC);
    double t0 = now();
    CUresult rc = cuMemAlloc_v2(p, size);
    set(F_ALLOC_NS, (uint64_t)((now() - t0) * 1e9));
    enter(P_NONE);
    return rc;
}

static void probe(size_t size) {
    CUdeviceptr p;
    CUresult rc = allocate(&p, size);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
        bump(F_PROBES);
        return;
    }
    error();
    if (rc == CUDA_SUCCESS && cuMemFree_v2(p) != CUDA_SUCCESS) error();
}

static void release(struct gpu *g, int i) {
    enter(P_FREE);
    double t0 = now();
    CUresult rc = cuMemFree_v2(g->live[i]);
    set(F_FREE_NS, (uint64_t)((now() - t0) * 1e9));
    enter(P_NONE);
    if (rc != CUDA_SUCCESS) error();
    g->held -= g->size[i];
    g->n--;
    g->live[i] = g->live[g->n];
    g->size[i] = g->size[g->n];
}

int main(int argc, char **argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: %s STATS GPUS MIN_MIB MAX_MIB CAP_MIB PROBE_MIB SEED WAIT STARTUP_KILL_US\n",
                argv[0]);
        return 1;
    }
    double t0 = now();
    int fd = open(argv[1], O_RDWR);
    if (fd < 0) {
        perror(argv[1]);
        return 1;
    }
    stats = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (stats == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    close(fd);
    int gpus = atoi(argv[2]);
    uint64_t min_mib = strtoull(argv[3], NULL, 0), max_mib = strtoull(argv[4], NULL, 0);
    size_t cap = (size_t)strtoull(argv[5], NULL, 0) * MiB;
    size_t probe_size = (size_t)strtoull(argv[6], NULL, 0) * MiB;
    seed = strtoull(argv[7], NULL, 0) * 0x9E3779B97F4A7C15ull + 1;
    int wait = atoi(argv[8]);
    uint64_t startup_kill_us = strtoull(argv[9], NULL, 0);
    if (gpus < 1 || gpus > MAX_GPUS || min_mib < 1 || max_mib < min_mib) {
        fprintf(stderr, "vcuda_churn: bad arguments\n");
        return 1;
    }
    atexit(at_exit);
    enter(P_STARTUP);
    pthread_t th;
    if (pthread_create(&th, NULL, control, &startup_kill_us) != 0) return 1;

    struct gpu g[MAX_GPUS] = {0};
    CUresult rc = cuInit(0);
    if (rc != CUDA_SUCCESS) fail(rc, 1);
    for (int i = 0; i < gpus; i++) {
        rc = cuDevicePrimaryCtxRetain(&g[i].ctx, i);
        if (rc != CUDA_SUCCESS) fail(rc, 2 + (uint64_t)i);
    }
    CHECK(cuCtxSetCurrent(g[0].ctx));
    int current = 0;
    set(F_STARTUP_NS, (uint64_t)((now() - t0) * 1e9));
    set(F_STATE, S_READY);
    enter(P_NONE);
    printf("ready\n");
    fflush(stdout);
    pthread_mutex_lock(&go_lock);
    while (wait && !going) pthread_cond_wait(&go_cond, &go_lock);
    pthread_mutex_unlock(&go_lock);

    while (!atomic_load(&exit_order)) {
        uint64_t r = next(&seed);
        int d = (int)(r % (uint64_t)gpus);
        struct gpu *G = &g[d];
        if (d != current) {
            if (cuCtxSetCurrent(G->ctx) != CUDA_SUCCESS) error();
            current = d;
        }
        size_t size = (size_t)(min_mib + (r >> 8) % (max_mib - min_mib + 1)) * MiB;
        int fits = G->n < LIVE && (cap == 0 || G->held + size <= cap);
        int want = atomic_load(&aim);
        if (probe_size && want != P_FREE && (r >> 48) % 4 == 0) {
            probe(probe_size);
        } else if (fits && (G->n == 0 || want == P_ALLOC || (want != P_FREE && (r >> 40) % 3 != 0))) {
            CUdeviceptr p;
            rc = allocate(&p, size);
            if (rc == CUDA_SUCCESS) {
                G->live[G->n] = p;
                G->size[G->n++] = size;
                G->held += size;
                bump(F_ALLOCS);
            } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
                bump(F_REFUSED);
            } else {
                error();
            }
        } else if (G->n > 0) {
            release(G, (int)((r >> 16) % (uint64_t)G->n));
        }
    }

    set(F_STATE, S_EXITING);
    t_exit = now();
    enter(P_EXIT);
    if (next(&seed) & 1) {
        for (int i = 0; i < gpus; i++) {
            if (cuCtxSetCurrent(g[i].ctx) != CUDA_SUCCESS) error();
            while (g[i].n > 0) release(&g[i], g[i].n - 1);
            enter(P_EXIT);
            if (cuDevicePrimaryCtxRelease(i) != CUDA_SUCCESS) error();
        }
    }
    return get(F_ERRORS) ? 1 : 0;
}
