/* Shared helpers for gpusim's C tests: fail loudly with the call and the driver's error. */
#ifndef GPUSIM_TEST_COMMON_H
#define GPUSIM_TEST_COMMON_H
#include <stdio.h>
#include <stdlib.h>

/* Programs that must not link libcuda (they dlopen it) define GPUSIM_DLOPEN. */
#ifdef GPUSIM_DLOPEN
#define ERRNAME(rc, out) ((void)(rc), *(out) = "?")
#else
#define ERRNAME(rc, out) cuGetErrorName(rc, out)
#endif

#define CHECK(call)                                                                  \
    do {                                                                             \
        CUresult rc_ = (call);                                                       \
        if (rc_ != CUDA_SUCCESS) {                                                   \
            const char *n_ = "?";                                                    \
            ERRNAME(rc_, &n_);                                                       \
            fprintf(stderr, "%s:%d: %s failed: %s (%d)\n", __FILE__, __LINE__, #call, \
                    n_, (int)rc_);                                                   \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

#define EXPECT(call, want)                                                           \
    do {                                                                             \
        CUresult rc_ = (call);                                                       \
        if (rc_ != (want)) {                                                         \
            fprintf(stderr, "%s:%d: %s returned %d, expected %s (%d)\n", __FILE__,    \
                    __LINE__, #call, (int)rc_, #want, (int)(want));                  \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

/* A PTX module with kernels of known durations (gpusim's cost model: a name ending in
 * _<N>us / _<N>ms runs that long; wave_kernel's length follows its grid) and one global. */
static const char PTX[] =
    ".version 8.0\n.target sm_80\n.address_size 64\n"
    ".global .align 4 .b8 table[256];\n"
    ".visible .entry spin_1ms(.param .u64 p) { ret; }\n"
    ".visible .entry spin_50us(.param .u64 p) { ret; }\n"
    ".visible .entry spin_20ms(.param .u64 p) { ret; }\n"
    ".visible .entry spin_2ms(.param .u64 p) { ret; }\n"
    ".visible .entry spin_5ms(.param .u64 p) { ret; }\n"
    ".visible .entry vector_add(.param .u64 a, .param .u64 b) { ret; }\n"
    ".visible .entry spin_1us(.param .u64 p) { ret; }\n"
    /* no duration in its name: runs in waves, so its length follows its grid */
    ".visible .entry wave_kernel(.param .u64 p) { ret; }\n";

#endif
