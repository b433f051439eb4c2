"""cuda-python (cuda.bindings.driver 12.9, which resolves every entry point through
cuGetProcAddress_v2) driving gpusim: init, context, allocation, module, launch, free."""

import json

CUDA_PYTHON = r"""
import json, time
from cuda.bindings import driver as cu

def ok(r):
    err, *rest = r if isinstance(r, tuple) else (r,)
    assert err == cu.CUresult.CUDA_SUCCESS, (err, r)
    return rest[0] if len(rest) == 1 else rest

ok(cu.cuInit(0))
out = {"count": ok(cu.cuDeviceGetCount()), "version": ok(cu.cuDriverGetVersion())}
dev = ok(cu.cuDeviceGet(1))
out["name"] = ok(cu.cuDeviceGetName(64, dev)).split(b"\0")[0].decode()
ctx = ok(cu.cuCtxCreate(0, dev))
ptr = ok(cu.cuMemAlloc(256 << 20))
data = bytes(range(256)) * 16
ok(cu.cuMemcpyHtoD(ptr, data, len(data)))
back = bytearray(len(data))
ok(cu.cuMemcpyDtoH(back, ptr, len(back)))
out["roundtrip"] = bytes(back) == data
ptx = b".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry spin_5ms(.param .u64 p) { ret; }\n\0"
mod = ok(cu.cuModuleLoadData(ptx))
f = ok(cu.cuModuleGetFunction(mod, b"spin_5ms"))
stream = ok(cu.cuStreamCreate(0))
start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
ok(cu.cuEventRecord(start, stream))
for _ in range(20):
    ok(cu.cuLaunchKernel(f, 1, 1, 1, 64, 1, 1, 0, stream, 0, 0))
ok(cu.cuEventRecord(end, stream))
ok(cu.cuStreamSynchronize(stream))
out["elapsed_ms"] = ok(cu.cuEventElapsedTime(start, end))
free, total = ok(cu.cuMemGetInfo())
out["used_by_me"] = total - free
print(json.dumps(out), flush=True)
input()  # hold everything until the test has looked
ok(cu.cuMemFree(ptr))
ok(cu.cuCtxDestroy(ctx))
print("freed", flush=True)
"""


def test_cuda_python_runs_a_workload(sim):
    import sys

    p = sim.popen([sys.executable, "-c", CUDA_PYTHON], stdin=-1)
    out = json.loads(p.stdout.readline())
    assert out["count"] == 2 and out["version"] == 12090
    assert out["name"] == "NVIDIA A100-SXM4-40GB"
    assert out["roundtrip"] is True
    # The start event lands on an idle device at record time, so the host's gap before the
    # first launch shows up in the elapsed time, as on a real GPU; the kernels themselves run
    # back to back (busy_ns below is exact). A slow CI host can add a few milliseconds, never
    # take any away.
    assert 100.0 <= out["elapsed_ms"] < 105.0, "20 kernels of 5 ms on the device timeline"
    held = (256 + 300 + 1) << 20  # allocation + context + module
    assert out["used_by_me"] == held
    gpu1 = sim.status()["gpus"][1]
    me = next(x for x in gpu1["processes"] if x["pid"] == p.pid)
    assert me["memory"] == held and me["kernels"] == 20 and me["busy_ns"] == 100_000_000
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "freed"
    assert sim.status()["gpus"][1]["memory_used"] == 0, "cuMemFree and cuCtxDestroy gave it all back"
    p.stdin.close()
    assert p.wait() == 0, p.stderr.read()


WRITE_VALUE = r"""
import ctypes, json
from cuda.bindings import driver as cu

def ok(r):
    err, *rest = r if isinstance(r, tuple) else (r,)
    assert err == cu.CUresult.CUDA_SUCCESS, (err, r)
    return rest[0] if len(rest) == 1 else rest

ok(cu.cuInit(0))
ctx = ok(cu.cuCtxCreate(0, ok(cu.cuDeviceGet(0))))
ptr = ok(cu.cuMemAlloc(64))
ok(cu.cuMemsetD8(ptr, 0, 64))
stream = ok(cu.cuStreamCreate(0))
ok(cu.cuStreamWriteValue32(stream, int(ptr) + 4, 0xDEADBEEF, 0))
ok(cu.cuStreamWriteValue32(stream, int(ptr) + 8, 7, 1))  # CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER
ok(cu.cuStreamSynchronize(stream))
back = bytearray(16)
ok(cu.cuMemcpyDtoH(back, ptr, 16))
out = {
    "words": [int.from_bytes(back[i:i + 4], "little") for i in range(0, 16, 4)],
    "bad_flags": int(cu.cuStreamWriteValue32(stream, ptr, 1, 2)[0]),
    "unaligned": int(cu.cuStreamWriteValue32(stream, int(ptr) + 2, 1, 0)[0]),
    "not_device": int(cu.cuStreamWriteValue32(stream, 4096, 1, 0)[0]),
}
# what PyTorch's c10::cuda::DriverAPI asks for: the name at CUDA 12000
lib = ctypes.CDLL("libcuda.so.1")
fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
lib.cuGetProcAddress_v2(b"cuStreamWriteValue32", ctypes.byref(fn), 12000, 0, ctypes.byref(status))
out["procaddr"] = [status.value, fn.value == ctypes.cast(lib.cuStreamWriteValue32_v2, ctypes.c_void_p).value]
print(json.dumps(out))
"""


def test_stream_write_value_writes_the_word(sim):
    """cuStreamWriteValue32 (the _v2 ABI every caller from CUDA 11.7 on gets): PyTorch's
    c10::cuda::DriverAPI requires it, and without it every out-of-memory in PyTorch's
    caching allocator is a RuntimeError instead of torch.OutOfMemoryError."""
    out = json.loads(sim.python(WRITE_VALUE).stdout)
    assert out["words"] == [0, 0xDEADBEEF, 7, 0]
    assert out["bad_flags"] == 1, "flags other than 0 and 1: CUDA_ERROR_INVALID_VALUE"
    assert out["unaligned"] == 1
    assert out["not_device"] == 1
    assert out["procaddr"] == [0, True]
