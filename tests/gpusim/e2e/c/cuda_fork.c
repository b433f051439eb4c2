/* CUDA does not survive fork: a child of a process that initialised the driver gets
 * CUDA_ERROR_NOT_INITIALIZED, while a child forked before cuInit may initialise its own. */
#include <cuda.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

static int child_count(void) {
    int n = -1;
    CUresult rc = cuDeviceGetCount(&n);
    return rc == CUDA_SUCCESS ? n : -(int)rc;
}

int main(void) {
    pid_t early = fork();
    if (early == 0) {
        CHECK(cuInit(0));
        printf("early_child_count=%d\n", child_count());
        fflush(stdout);
        _exit(0);
    }
    waitpid(early, NULL, 0);
    CHECK(cuInit(0));
    CUcontext ctx;
    CHECK(cuCtxCreate(&ctx, 0, 0));
    printf("parent_count=%d\n", child_count());
    fflush(stdout);
    pid_t late = fork();
    if (late == 0) {
        printf("late_child_init=%d\nlate_child_count=%d\n", (int)cuInit(0), child_count());
        fflush(stdout);
        _exit(0);
    }
    waitpid(late, NULL, 0);
    printf("parent_after_count=%d\n", child_count());
    return 0;
}
