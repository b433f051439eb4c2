"""libvcuda in an old userland, for real (issue 13, point 3; issue 17, point 6).

A pod's container from the Debian 11 image (glibc 2.31: the generation of Ubuntu 20.04 and the
`nvidia/cuda:11.x-*-ubuntu20.04` images), built by `scripts/build-images` from debootstrap,
started by the Docker engine with vcuda-manager's Allocate answer applied: the library
preloaded through the read-only `/etc/ld.so.preload`, so every process of the container
loads it, the shell and the compiler included. gpusim stands in for the driver with its
glibc-2.17-baseline build (`scripts/build-portable`), as the NVIDIA container toolkit would
inject the host driver's libraries.

In it: a shell; `python3` (3.9) with pynvml; the C quota program and the compute load built
*inside* the old root with its own gcc; the quota and the share judged by gpusim's ground
truth. Before issue 13 the library needed GLIBC_2.34 and none of this started.
"""

import json
import os
import pathlib
import re
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpusim" / "e2e"))
sys.path.insert(0, str(ROOT / "tests" / "vcuda"))
sys.path.insert(0, str(ROOT / "tests" / "manager"))
sys.path.insert(0, str(ROOT / "tests" / "containers"))

from gpusim_harness import Sim, cuda_include_dir, gpusim_built  # noqa: E402,F401
from node_common import Node  # noqa: E402
import runtime  # noqa: E402
from test_real_containers import engine_ready, fill_registered, held_mib, pynvml_file  # noqa: E402,F401

OLD = "vcuda/base:bullseye"
PORTABLE_GPUSIM = ROOT / "target" / "portable" / "gpusim" / "lib"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(bool(os.environ.get("VCUDA_NO_IMAGES")),
                                reason=f"real-container tests skipped: {os.environ.get('VCUDA_NO_IMAGES')}")


@pytest.fixture
def old(engine_ready, tmp_path):
    if runtime.image_missing(OLD):
        pytest.fail(f"image {OLD} is missing: run scripts/build-images (scripts/test does)")
    if not (PORTABLE_GPUSIM / "libcuda.so.1").exists():
        pytest.fail(f"{PORTABLE_GPUSIM} is missing: run scripts/build-portable (scripts/test does)")
    sim = Sim(tmp_path)
    node = Node(sim, tmp_path / "node", proc_root="/proc")
    node.start_kubelet().start_manager().wait_registered()
    engine = runtime.Engine(sim, image=OLD, driver_lib=PORTABLE_GPUSIM, mounts=[
        (cuda_include_dir(), "/opt/cuda/include"),
        (ROOT / "tests" / "gpusim" / "e2e" / "c", "/opt/src/c"),
        (ROOT / "tests" / "vcuda" / "c", "/opt/src/vc"),
        (ROOT / "tests" / "demo" / "fill.c", "/opt/src/fill.c"),
        (pynvml_file(), "/opt/python/pynvml.py"),
    ])
    admitted = node.admit("old", core=30, memory=4)  # 30 %, 1 GiB
    assert admitted["admitted"] and admitted["containers"][0]["start"]["started"], admitted
    c = engine.start(admitted, node.pod_uid("old"))
    yield node, c
    engine.close()
    node.close()


def test_every_process_of_an_old_image_starts_with_the_library_and_is_held(old):
    node, c = old
    # The userland is the old one.
    r = c.sh("ldd --version | head -1")
    assert r.returncode == 0 and re.search(r"2\.31$", r.stdout.strip()), r.stdout + r.stderr
    # A shell starts, and the library is in it (through /etc/ld.so.preload alone).
    r = c.sh("grep -c /usr/local/vcuda/lib64/libvcuda.so /proc/$$/maps")
    assert r.returncode == 0 and int(r.stdout) >= 1, f"the shell: {r.stdout}{r.stderr}"
    assert "LD_PRELOAD" not in c.sh("env").stdout

    # Python 3.9 with pynvml sees the container's GPU: one device, the quota's size.
    probe = ("import sys; sys.path.insert(0, '/opt/python'); import pynvml, json; pynvml.nvmlInit(); "
             "h = pynvml.nvmlDeviceGetHandleByIndex(0); "
             "print(json.dumps({'count': pynvml.nvmlDeviceGetCount(), 'total': pynvml.nvmlDeviceGetMemoryInfo(h).total, "
             "'python': sys.version.split()[0]}))")
    r = c.exec("python3", "-c", probe)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["python"].startswith("3.9") and seen["count"] == 1 and seen["total"] == 1024 * MiB, seen

    # The C programs are built inside the old root, by its own gcc (itself preloaded).
    build = ("gcc -std=gnu11 -O1 -I/opt/cuda/include -I/opt/src/c {src} -o {out} "
             "-L/usr/local/gpusim/lib -lcuda -lm")
    for src, out in (("/opt/src/fill.c", "/tmp/fill"), ("/opt/src/vc/vcuda_load.c", "/tmp/load")):
        r = c.sh(build.format(src=src, out=out))
        assert r.returncode == 0, f"gcc in the old root: {r.stderr}"

    # The quota: allocate until refused; gpusim's high-water mark stays within 1 GiB.
    node.sim.gpusim("reset-peak")
    out = fill_registered(node, c, 64, 100000, program="/tmp/fill")
    got = held_mib(out)
    assert "refused" in out and got < 1024, out
    peak = node.sim.status()["gpus"][0]["memory_peak"]
    assert peak <= 1024 * MiB, f"gpusim's high-water mark {peak / MiB:.0f} MiB > the 1024 MiB quota"

    # The share: a saturating load held at 30 % (± 3 pp) of the GPU by gpusim's clock.
    p = c.popen("/tmp/load", "--kernel", "spin_1ms", "--seconds", "8")
    line = p.stdout.readline()
    assert line.startswith("ready pid="), f"{line!r} {p.stderr.read() if p.poll() is not None else ''}"
    # gpusim, like the real driver, names the process by its host pid.
    pid = c.host_pid_of(int(line.split("=")[1]))
    time.sleep(2.0)  # the limiter settles within 1 s (scripts/bench-limiter); then measure
    a = _busy(node, pid)
    time.sleep(4.0)
    b = _busy(node, pid)
    p.stdin.close()
    p.wait(timeout=30)
    share = (b[1] - a[1]) / (b[0] - a[0])
    assert abs(share - 0.30) <= 0.03, f"the load ran at {share:.1%} of the GPU, share 30 %"
    print(f"old userland: {seen}, held {got} MiB of 1024, peak {peak / MiB:.0f} MiB, share {share:.2%}")


def _busy(node, pid):
    """(gpusim time ns, busy ns of process `pid` on GPU 0): gpusim's ground truth."""
    s = node.sim.status()
    for proc in s["gpus"][0]["processes"]:
        if proc["pid"] == pid:
            return s["time_ns"], proc["busy_ns"]
    raise AssertionError(f"gpusim lists no process {pid}: {[g['processes'] for g in s['gpus']]}")
