/* Sizes of the nvml.h structs gpusim-nvml defines in Rust (tests/gpusim/nvml/src/types.rs).
 * test_nvml_abi.py compiles this against the official header and compares each line with the
 * `assert_eq!(size_of::<T>(), N)` the crate's unit tests pin. */
#include <stdio.h>

#include <nvml.h>

#define SIZE(t) printf("%s %zu\n", #t, sizeof(t))

int main(void) {
    SIZE(nvmlPciInfo_t);
    SIZE(nvmlMemory_t);
    SIZE(nvmlMemory_v2_t);
    SIZE(nvmlBAR1Memory_t);
    SIZE(nvmlProcessInfo_v1_t);
    SIZE(nvmlProcessInfo_t);
    SIZE(nvmlProcessDetail_v1_t);
    SIZE(nvmlProcessDetailList_t);
    SIZE(nvmlUtilization_t);
    SIZE(nvmlProcessUtilizationSample_t);
    SIZE(nvmlProcessUtilizationInfo_v1_t);
    SIZE(nvmlProcessesUtilizationInfo_t);
    SIZE(nvmlTemperature_t);
    SIZE(nvmlEventData_t);
    SIZE(nvmlValue_t);
    SIZE(nvmlSample_t);
    SIZE(nvmlFieldValue_t);
    SIZE(nvmlConfComputeMemSizeInfo_t);
    return 0;
}
