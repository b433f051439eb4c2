/* The NVML ABI from C: built with gcc against the official nvml.h (NVML API 12) and linked
 * with -lnvidia-ml, as any NVML client is. Prints one line per fact for the test to check. */
#include <stdio.h>
#include <string.h>

#include <nvml.h>

#define CHECK(call)                                                                         \
    do {                                                                                    \
        nvmlReturn_t rc_ = (call);                                                          \
        if (rc_ != NVML_SUCCESS) {                                                          \
            fprintf(stderr, "%s failed: %d (%s)\n", #call, (int)rc_, nvmlErrorString(rc_)); \
            return 1;                                                                       \
        }                                                                                   \
    } while (0)

int main(void) {
    CHECK(nvmlInit_v2());
    char version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    CHECK(nvmlSystemGetDriverVersion(version, sizeof version));
    printf("driver %s\n", version);

    unsigned int count = 0;
    CHECK(nvmlDeviceGetCount_v2(&count));
    printf("count %u\n", count);

    for (unsigned int i = 0; i < count; i++) {
        nvmlDevice_t dev;
        CHECK(nvmlDeviceGetHandleByIndex_v2(i, &dev));

        char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
        CHECK(nvmlDeviceGetName(dev, name, sizeof name));

        nvmlMemory_v2_t mem;
        memset(&mem, 0xff, sizeof mem);
        mem.version = nvmlMemory_v2;
        CHECK(nvmlDeviceGetMemoryInfo_v2(dev, &mem));

        /* size query, then the list */
        unsigned int nproc = 0;
        nvmlReturn_t rc = nvmlDeviceGetComputeRunningProcesses_v3(dev, &nproc, NULL);
        if (rc != NVML_SUCCESS && rc != NVML_ERROR_INSUFFICIENT_SIZE) {
            fprintf(stderr, "process size query failed: %d\n", (int)rc);
            return 1;
        }
        nvmlProcessInfo_t procs[64];
        nproc = 64;
        CHECK(nvmlDeviceGetComputeRunningProcesses_v3(dev, &nproc, procs));

        nvmlUtilization_t util;
        CHECK(nvmlDeviceGetUtilizationRates(dev, &util));

        printf("gpu %u name=%s total=%llu reserved=%llu free=%llu used=%llu version=%#x processes=%u "
               "util=%u/%u\n",
               i, name, mem.total, mem.reserved, mem.free, mem.used, mem.version, nproc, util.gpu,
               util.memory);
    }

    /* a wrong struct version is refused */
    nvmlDevice_t dev0;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &dev0));
    nvmlMemory_v2_t bad = {.version = 1};
    printf("bad_version %d\n", (int)nvmlDeviceGetMemoryInfo_v2(dev0, &bad));

    CHECK(nvmlShutdown());
    printf("after_shutdown %d\n", (int)nvmlDeviceGetCount_v2(&count));
    return 0;
}
