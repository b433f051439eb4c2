/* fork and libvcuda's per-process accounting. Two modes:
 *
 *   vcuda_fork before PARENT_MIB CHILD_MIB
 *       forks before any CUDA call; parent and child each initialise CUDA, create a context
 *       and allocate their own amount, so each is its own process in the region and gpusim.
 *   vcuda_fork after PARENT_MIB CHILD_MIB
 *       the parent initialises CUDA and allocates, then forks; the child cannot use the
 *       parent's CUDA state (as with the real driver) and reports what its calls return.
 *
 * Both print "parent pid=… alloc=<rc>" and "child pid=… init=<rc> ctx=<rc> alloc=<rc>" (in
 * either order), then the child waits until the parent reads "release-child" on stdin; the
 * parent then lets the child exit (normally), waits for it, and prints "child_exit=<status>".
 * "alloc N" on stdin makes the parent allocate N more bytes ("rc=<rc>"); "quit" ends it. */
#define _GNU_SOURCE
#include <cuda.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

static CUresult setup(size_t mib, CUresult *init, CUresult *ctx_rc) {
    CUcontext ctx;
    CUdeviceptr p;
    *init = cuInit(0);
    *ctx_rc = cuCtxCreate(&ctx, 0, 0);
    return cuMemAlloc(&p, mib << 20);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s before|after PARENT_MIB CHILD_MIB\n", argv[0]);
        return 2;
    }
    int before = !strcmp(argv[1], "before");
    size_t parent_mib = (size_t)atoll(argv[2]), child_mib = (size_t)atoll(argv[3]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    int go[2];
    if (pipe(go)) return 3;
    CUresult pinit = CUDA_SUCCESS, pctx = CUDA_SUCCESS, palloc = CUDA_SUCCESS;
    if (!before) palloc = setup(parent_mib, &pinit, &pctx);
    pid_t child = fork();
    if (child < 0) return 3;
    if (child == 0) {
        close(go[1]);
        CUresult init, ctx, alloc;
        if (before) {
            alloc = setup(child_mib, &init, &ctx);
        } else {
            /* the parent's context is not ours; a fresh cuInit is what a program would try */
            CUdeviceptr p;
            alloc = cuMemAlloc(&p, child_mib << 20);
            init = cuInit(0);
            CUcontext c;
            ctx = cuCtxCreate(&c, 0, 0);
        }
        printf("child pid=%d init=%d ctx=%d alloc=%d\n", (int)getpid(), (int)init, (int)ctx, (int)alloc);
        char b;
        if (read(go[0], &b, 1) < 0) return 4;
        return 0; /* a normal exit: atexit handlers run in the child */
    }
    close(go[0]);
    if (before) palloc = setup(parent_mib, &pinit, &pctx);
    printf("parent pid=%d init=%d ctx=%d alloc=%d\n", (int)getpid(), (int)pinit, (int)pctx, (int)palloc);
    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long n;
        if (!strncmp(line, "release-child", 13)) {
            if (write(go[1], "x", 1) != 1) return 5;
            int status = 0;
            waitpid(child, &status, 0);
            printf("child_exit=%d\n", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        } else if (sscanf(line, "alloc %llu", &n) == 1) {
            CUdeviceptr p;
            printf("rc=%d\n", (int)cuMemAlloc(&p, (size_t)n));
        } else if (!strncmp(line, "quit", 4)) {
            break;
        }
    }
    return 0;
}
