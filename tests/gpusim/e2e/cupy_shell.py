"""A line-driven CuPy process for the CuPy tests (tests/gpusim/e2e/test_cupy.py and
tests/vcuda/test_vcuda_cupy.py), speaking vcuda_common.Shell's protocol: one command per
line on stdin, one reply per line on stdout, `key=int` pairs, `rc` first.

  count          cupy.cuda.runtime.getDeviceCount() alone: rc count
  init           device count, then the context (memGetInfo creates it): rc count free total
  info           cupy.cuda.runtime.memGetInfo(): rc free total
  alloc N        cupy.empty(N bytes), kept as array `id`: rc id
  raw N          cupy.cuda.runtime.malloc(N), past CuPy's pool: rc id
  del ID         drop array ID (its block goes back to CuPy's pool, not to the driver)
  rawfree ID     cupy.cuda.runtime.free of a `raw` allocation
  pool           the default memory pool: rc used total (bytes in arrays; bytes it holds)
  freeall        cupy.get_default_memory_pool().free_all_blocks()
  roundtrip N    N int32 from the host to the device and back: rc same (1: equal)
  elementwise    x * 2 + 1 (CuPy's elementwise kernels, NVRTC) and an ElementwiseKernel named
                 twice_1ms, timed with events: rc us (device time of the ElementwiseKernel)
  rawkernel NAME a RawKernel named NAME from source declaring spin_20ms (extern "C"), launched
                 once and timed with events: rc us; rc=500 when the module has no NAME
  quit

rc is 0 for success; for a failure (its traceback on stderr) the CUDA error code a CUDA
error carries (2: out of memory), or 1. CuPy's cupy.cuda.memory.OutOfMemoryError replies
`rc=2 oom=1`. Run with CUPY_CACHE_IN_MEMORY=1 so every process compiles with NVRTC itself
and nothing is written to the user's cache.
"""

import sys
import traceback

import cupy
import numpy

RAW_SOURCE = r"""
extern "C" __global__ void spin_20ms(float *x) { if (x) x[threadIdx.x] = 1.0f; }
"""


def timed(launch):
    """Device time of `launch()` in µs, by events on the current stream."""
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    launch()
    end.record()
    end.synchronize()
    return int(round(cupy.cuda.get_elapsed_time(start, end) * 1000))


class Shell:
    def __init__(self):
        self.arrays = {}
        self.pointers = {}
        self.next_id = 1

    def keep(self, table, obj):
        i = self.next_id
        self.next_id += 1
        table[i] = obj
        return {"id": i}

    def count(self):
        return {"count": cupy.cuda.runtime.getDeviceCount()}

    def init(self):
        count = cupy.cuda.runtime.getDeviceCount()
        free, total = cupy.cuda.runtime.memGetInfo()
        return {"count": count, "free": free, "total": total}

    def info(self):
        free, total = cupy.cuda.runtime.memGetInfo()
        return {"free": free, "total": total}

    def alloc(self, n):
        return self.keep(self.arrays, cupy.empty(int(n), dtype=cupy.uint8))

    def raw(self, n):
        return self.keep(self.pointers, cupy.cuda.runtime.malloc(int(n)))

    def del_(self, i):
        del self.arrays[int(i)]
        return {}

    def rawfree(self, i):
        cupy.cuda.runtime.free(self.pointers.pop(int(i)))
        return {}

    def pool(self):
        p = cupy.get_default_memory_pool()
        return {"used": p.used_bytes(), "total": p.total_bytes()}

    def freeall(self):
        cupy.get_default_memory_pool().free_all_blocks()
        return {}

    def roundtrip(self, n):
        host = numpy.arange(int(n), dtype=numpy.int32)
        back = cupy.asnumpy(cupy.asarray(host))
        return {"same": int(numpy.array_equal(host, back))}

    def elementwise(self):
        x = cupy.empty(1 << 20, dtype=cupy.float32)
        y = x * 2 + 1
        twice = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x * 2", "twice_1ms")
        twice(y)  # compiled and loaded before timing
        us = timed(lambda: twice(y))
        cupy.cuda.Device().synchronize()
        return {"us": us}

    def rawkernel(self, name):
        k = cupy.RawKernel(RAW_SOURCE, name)
        x = cupy.empty(32, dtype=cupy.float32)
        k((1,), (32,), (x,))  # compiled and loaded before timing
        cupy.cuda.Device().synchronize()
        return {"us": timed(lambda: k((1,), (32,), (x,)))}


def failure(e):
    """The reply to a command that raised `e`."""
    if isinstance(e, cupy.cuda.memory.OutOfMemoryError):
        return {"rc": 2, "oom": 1}
    status = getattr(e, "status", None)  # CUDARuntimeError, CUDADriverError
    return {"rc": status if isinstance(status, int) and status > 0 else 1}


def main():
    sh = Shell()
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        fn = getattr(sh, words[0] + ("_" if words[0] == "del" else ""), None)
        try:
            if fn is None:
                raise ValueError(f"unknown command {words[0]!r}")
            out = {"rc": 0, **fn(*words[1:])}
        except Exception as e:  # the reply says what failed; the process carries on
            print(f"cupy_shell: {line.strip()}: {type(e).__module__}.{type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            out = failure(e)
        print(" ".join(f"{k}={int(v)}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main()
