"""cuda-python (cuda.bindings.driver, which reaches every entry point through
cuGetProcAddress_v2) inside a container sees GPUs the size of its quotas: cuMemGetInfo total =
quota and free = quota - what the whole container holds, cuDeviceTotalMem = quota, and only
the container's GPUs, in config order, with their real UUIDs (libvcuda sets
CUDA_VISIBLE_DEVICES from the config, which gpusim honours)."""

import json
import subprocess
import sys

import pytest

from vcuda_common import CONTEXT, MODULE, MiB, Shell, build, proc_memory

PROGRAM = r"""
import json, sys
from cuda.bindings import driver as cu

def ok(r):
    err, *rest = r if isinstance(r, tuple) else (r,)
    assert err == cu.CUresult.CUDA_SUCCESS, (err, r)
    return rest[0] if len(rest) == 1 else rest

def say(**kw):
    print(json.dumps(kw), flush=True)

ok(cu.cuInit(0))
n = ok(cu.cuDeviceGetCount())
devs = []
for i in range(n):
    d = ok(cu.cuDeviceGet(i))
    u = bytes(ok(cu.cuDeviceGetUuid(d)).bytes).hex()
    uuid = f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"
    devs.append({"uuid": uuid, "total": ok(cu.cuDeviceTotalMem(d))})
ctx = ok(cu.cuCtxCreate(0, ok(cu.cuDeviceGet(0))))
say(count=n, devs=devs, info=ok(cu.cuMemGetInfo()))
p = ok(cu.cuMemAlloc(256 << 20))
say(info=ok(cu.cuMemGetInfo()))
sys.stdin.readline()            # another process of the container allocates meanwhile
say(info=ok(cu.cuMemGetInfo()))
err, _ = cu.cuMemAlloc(int(sys.argv[1]))
say(over=int(err))
"""


@pytest.fixture(scope="module")
def shell_bin(cc, tmp_path_factory):
    return build(cc, tmp_path_factory.mktemp("bin"), "vcuda_shell")


def read(p):
    line = p.stdout.readline()
    assert line, p.stderr.read()
    return json.loads(line)


def test_cuda_python_sees_the_quota_on_the_containers_only_gpu(sim, shell_bin):
    """A container given only GPU 1 of the two-GPU machine, with a 2 GiB quota."""
    gpus = sim.status()["gpus"]
    quota = 2048 * MiB
    c = sim.container(2048, gpus=[gpus[1]["uuid"]])
    p = c.popen([sys.executable, "-c", PROGRAM, str(quota)], stdin=subprocess.PIPE)
    try:
        r = read(p)
        assert r["count"] == 1
        assert r["devs"] == [{"uuid": gpus[1]["uuid"], "total": quota}]
        assert r["info"] == [quota - CONTEXT, quota]
        assert read(p)["info"] == [quota - CONTEXT - 256 * MiB, quota]
        assert proc_memory(sim, p.pid, gpu=1) == CONTEXT + 256 * MiB
        assert proc_memory(sim, p.pid, gpu=0) is None, "nothing on the GPU the container lacks"
        # a second process of the container (context, module, 100 MiB) shows in the first's figures
        sh = Shell(c, shell_bin).start()
        sh.ok(f"alloc {100 * MiB}")
        p.stdin.write("\n")
        p.stdin.flush()
        assert read(p)["info"] == [quota - CONTEXT - 256 * MiB - (CONTEXT + MODULE + 100 * MiB), quota]
        assert read(p)["over"] == 2, "the whole quota is refused (CUDA_ERROR_OUT_OF_MEMORY)"
        sh.close()
    finally:
        p.stdin.close()
        p.wait(timeout=10)


def test_two_gpus_in_config_order(sim):
    """A container given GPU 1 then GPU 0, with different quotas: CUDA device 0 is GPU 1."""
    gpus = sim.status()["gpus"]
    c = sim.container([1024, 3072], gpus=[gpus[1]["uuid"], gpus[0]["uuid"]])
    p = c.popen([sys.executable, "-c", PROGRAM, str(1 << 30)], stdin=subprocess.PIPE)
    try:
        r = read(p)
        assert r["count"] == 2
        assert r["devs"] == [
            {"uuid": gpus[1]["uuid"], "total": 1024 * MiB},
            {"uuid": gpus[0]["uuid"], "total": 3072 * MiB},
        ]
        assert r["info"] == [1024 * MiB - CONTEXT, 1024 * MiB]
        assert read(p)["info"] == [1024 * MiB - CONTEXT - 256 * MiB, 1024 * MiB]
        assert proc_memory(sim, p.pid, gpu=1) == CONTEXT + 256 * MiB
    finally:
        p.stdin.close()
        p.kill()
        p.wait(timeout=10)
