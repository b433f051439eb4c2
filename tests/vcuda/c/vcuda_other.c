/* A library that is not the CUDA driver but exports a function named cuMemAlloc_v2:
 * dlsym on its handle must return this function, not libvcuda's wrapper. */
#include <stddef.h>
int cuMemAlloc_v2(unsigned long long *dptr, size_t bytesize) {
    (void)dptr;
    (void)bytesize;
    return 4242;
}
