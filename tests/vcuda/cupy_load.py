"""A saturating CuPy kernel loop for the compute limiter, the CuPy counterpart of
c/vcuda_load.c:

  python cupy_load.py [--kernel spin_1ms] [--seconds S]

Compiles a RawKernel named KERNEL (extern "C", so NVRTC keeps the name gpusim's cost model
reads) and launches it once, synchronised, so NVRTC and the module load are done; prints
"ready pid=<pid>"; launches it back to back on CuPy's current stream for S seconds; waits
for the device and prints "kernels=<n>".
"""

import argparse
import os
import time

import cupy

ap = argparse.ArgumentParser()
ap.add_argument("--kernel", default="spin_1ms")
ap.add_argument("--seconds", type=float, default=5.0)
args = ap.parse_args()

kernel = cupy.RawKernel(f'extern "C" __global__ void {args.kernel}(float *x) {{ x[threadIdx.x] = 1.0f; }}', args.kernel)
x = cupy.empty(32, dtype=cupy.float32)
kernel((1,), (32,), (x,))
cupy.cuda.Device().synchronize()
print(f"ready pid={os.getpid()}", flush=True)
n = 0
start = time.monotonic()
while time.monotonic() - start < args.seconds:
    kernel((1,), (32,), (x,))
    n += 1
cupy.cuda.Device().synchronize()
print(f"kernels={n}", flush=True)
