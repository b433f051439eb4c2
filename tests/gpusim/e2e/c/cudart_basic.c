/* The CUDA runtime (libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel) on gpusim.
 *
 * cuda_runtime_api.h needs crt/host_defines.h, which that wheel does not ship (it comes with
 * the nvcc/crt wheels), so the few prototypes used here are declared by hand; they are the
 * runtime's stable C ABI.
 *
 * Usage: cudart_basic [BIG_MIB]. Prints one line per call, "<call> <rc> [values]", and ends
 * with a cudaMalloc of BIG_MIB MiB (default 5000). Exits 0 whatever the codes: the test
 * judges them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
enum { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };

extern cudaError_t cudaDriverGetVersion(int *version);
extern cudaError_t cudaRuntimeGetVersion(int *version);
extern cudaError_t cudaGetDeviceCount(int *count);
extern cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
extern cudaError_t cudaMalloc(void **ptr, size_t size);
extern cudaError_t cudaMemset(void *ptr, int value, size_t count);
extern cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind);
extern cudaError_t cudaFree(void *ptr);
extern cudaError_t cudaDeviceSynchronize(void);
extern cudaError_t cudaGetLastError(void);
extern cudaError_t cudaDeviceReset(void);
extern const char *cudaGetErrorName(cudaError_t err);

#define MIB (1024.0 * 1024.0)

static void report(const char *call, cudaError_t rc, const char *extra) {
    printf("%-22s %3d %-34s %s\n", call, rc, cudaGetErrorName(rc), extra ? extra : "");
}

int main(int argc, char **argv) {
    size_t big_mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 5000;
    char buf[128];
    int v = 0;
    cudaError_t rc;

    setvbuf(stdout, NULL, _IONBF, 0);
    rc = cudaDriverGetVersion(&v);
    snprintf(buf, sizeof buf, "%d", v);
    report("cudaDriverGetVersion", rc, buf);
    rc = cudaRuntimeGetVersion(&v);
    snprintf(buf, sizeof buf, "%d", v);
    report("cudaRuntimeGetVersion", rc, buf);

    int count = -1;
    rc = cudaGetDeviceCount(&count);
    snprintf(buf, sizeof buf, "%d", count);
    report("cudaGetDeviceCount", rc, buf);
    if (rc != 0)
        return 0;

    /* PROBE_FIRST_MALLOC_MIB: allocate that much first, before anything else makes the
     * runtime look at memory (its primary context is made by this call) */
    const char *first = getenv("PROBE_FIRST_MALLOC_MIB");
    if (first) {
        void *p = NULL;
        size_t mib = strtoull(first, NULL, 10);
        rc = cudaMalloc(&p, mib << 20);
        snprintf(buf, sizeof buf, "%zu MiB", mib);
        report("cudaMalloc(first)", rc, buf);
        if (rc == 0)
            report("cudaFree(first)", cudaFree(p), NULL);
        else
            report("cudaGetLastError", cudaGetLastError(), NULL);
    }

    size_t free_b = 0, total_b = 0;
    rc = cudaMemGetInfo(&free_b, &total_b);
    snprintf(buf, sizeof buf, "free %.0f MiB total %.0f MiB", free_b / MIB, total_b / MIB);
    report("cudaMemGetInfo", rc, buf);

    const size_t n = 64 << 20;
    void *d = NULL;
    rc = cudaMalloc(&d, n);
    report("cudaMalloc(64 MiB)", rc, NULL);
    rc = cudaMemset(d, 0x5a, n);
    report("cudaMemset", rc, NULL);
    unsigned char *h = malloc(n);
    memset(h, 0, n);
    rc = cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost);
    int ok = h[0] == 0x5a && h[n - 1] == 0x5a;
    snprintf(buf, sizeof buf, "memset bytes seen: %s", ok ? "yes" : "no");
    report("cudaMemcpy DtoH", rc, buf);
    for (size_t i = 0; i < n; i++)
        h[i] = (unsigned char)i;
    rc = cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);
    report("cudaMemcpy HtoD", rc, NULL);
    unsigned char *back = calloc(1, n);
    rc = cudaMemcpy(back, d, n, cudaMemcpyDeviceToHost);
    snprintf(buf, sizeof buf, "roundtrip: %s", memcmp(back, h, n) == 0 ? "yes" : "no");
    report("cudaMemcpy DtoH", rc, buf);
    rc = cudaDeviceSynchronize();
    report("cudaDeviceSynchronize", rc, NULL);
    rc = cudaFree(d);
    report("cudaFree", rc, NULL);

    void *big = NULL;
    rc = cudaMalloc(&big, big_mib << 20);
    snprintf(buf, sizeof buf, "%zu MiB", big_mib);
    report("cudaMalloc(big)", rc, buf);
    if (rc == 0) {
        rc = cudaFree(big);
        report("cudaFree(big)", rc, NULL);
    } else {
        rc = cudaGetLastError(); /* an allocation failure is not sticky */
        report("cudaGetLastError", rc, NULL);
        rc = cudaMalloc(&d, n);
        report("cudaMalloc(64 MiB)", rc, "after the failure");
        rc = cudaFree(d);
        report("cudaFree", rc, NULL);
    }
    /* A reset destroys the primary context: the driver runs the runtime's context-local
     * storage destructors, and the runtime starts afresh on the next call. */
    rc = cudaDeviceReset();
    report("cudaDeviceReset", rc, NULL);
    rc = cudaMalloc(&d, n);
    report("cudaMalloc(64 MiB)", rc, "after the reset");
    rc = cudaFree(d);
    report("cudaFree", rc, NULL);
    free(h);
    free(back);
    return 0;
}
