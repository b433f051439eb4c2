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
