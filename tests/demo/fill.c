/* Demo program: allocate device memory in steps until the driver says no, report what the
 * process got and what cuMemGetInfo shows, then hold it until stdin closes.
 *   fill STEP_MIB [MAX_MIB]                                                            */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    size_t step = (argc > 1 ? strtoull(argv[1], NULL, 10) : 256) << 20;
    size_t max = (argc > 2 ? strtoull(argv[2], NULL, 10) : 1 << 20) << 20;
    CUcontext ctx;
    CUresult rc = cuInit(0);
    if (rc != CUDA_SUCCESS) {
        const char *s = "?";
        cuGetErrorName(rc, &s);
        printf("  cuInit failed: %s\n", s);
        return 1;
    }
    rc = cuCtxCreate(&ctx, 0, 0);
    if (rc != CUDA_SUCCESS) {
        const char *s = "?";
        cuGetErrorName(rc, &s);
        printf("  context creation refused: %s\n", s);
        return 1;
    }
    size_t free0, total;
    cuMemGetInfo(&free0, &total);
    printf("  sees a GPU of %zu MiB, %zu MiB free\n", total >> 20, free0 >> 20);
    size_t got = 0;
    for (;;) {
        CUdeviceptr p;
        if (got + step > max) break;
        rc = cuMemAlloc(&p, step);
        if (rc != CUDA_SUCCESS) {
            const char *s = "?";
            cuGetErrorName(rc, &s);
            printf("  allocation of %zu MiB more refused: %s\n", step >> 20, s);
            break;
        }
        got += step;
    }
    size_t free1;
    cuMemGetInfo(&free1, &total);
    printf("  holds %zu MiB; cuMemGetInfo: %zu of %zu MiB free\n", got >> 20, free1 >> 20, total >> 20);
    fflush(stdout);
    /* Hold the memory until told to exit. */
    while (getchar() != EOF) {
    }
    return 0;
}
