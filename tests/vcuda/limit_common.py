"""The compute limiter's rig, shared by test_vcuda_limit.py and scripts/bench-limiter.

A `Machine` is one gpusim machine with up to 8 GPUs, so independent experiments run side by
side on separate GPUs (each GPU has its own timeline). Tenants are vcuda containers running
c/vcuda_load.c (a saturating or bursty kernel loop). What a tenant achieved is judged by
gpusim's ground truth only: each process's busy time from `gpusim status --json`, sampled
by a background thread.
"""

import json
import subprocess
import threading
import time

from gpusim_harness import GPUSIM, Sim
from vcuda_common import build

# Kernels of known duration in gpusim's cost model (c/common.h's PTX), in seconds.
KERNELS = {"spin_50us": 50e-6, "spin_1ms": 1e-3, "spin_20ms": 20e-3}

# Byte offsets in the region header (vcuda/contract/src/region.rs, layout version 4; a Rust
# test there pins them): the manager's run-time share and elastic limit per GPU, in ppm.
CORE_OVERRIDE = 288
CORE_LIMIT_OVERRIDE = 352


def gpus_config(n, **settings):
    """A gpusim config of `n` A100s (gpusim's defaults otherwise); `settings` are top-level
    keys of the config (e.g. sample_period_us=1000000, wave_ns=1000), None meaning default."""
    lines = [f"{k} = {v}" for k, v in settings.items() if v is not None]
    lines += [""] if lines else []
    for i in range(n):
        lines += [
            "[[gpu]]",
            'name = "NVIDIA A100-SXM4-40GB"',
            f'uuid = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d5{i:02x}"',
            "memory_mib = 40960",
            "sm_count = 108",
            "max_threads_per_sm = 2048",
            'compute_capability = "8.0"',
            f'pci_bus_id = "00000000:{0x10 + i:02X}:00.0"',
            "",
        ]
    return "\n".join(lines)


def set_share(region, gpu, share_pct=None, limit_pct=None):
    """Write the run-time share (and elastic limit) of `gpu` into a container's region, as
    the manager does. Percent; None leaves a value as it is, 0 returns to the config's."""
    with open(region, "r+b") as f:
        for off, pct in ((CORE_OVERRIDE, share_pct), (CORE_LIMIT_OVERRIDE, limit_pct)):
            if pct is not None:
                f.seek(off + 8 * gpu)
                f.write(int(round(pct * 10_000)).to_bytes(8, "little"))


def build_load(cc, out):
    """Compile c/vcuda_load.c into directory `out`."""
    return build(cc, out, "vcuda_load")


def build_adversary(cc, out):
    """Compile c/vcuda_adversary.c (the launch patterns of bench_adversary.py) into `out`."""
    return build(cc, out, "vcuda_adversary", "-pthread")


class Load:
    """One running vcuda_load process."""

    def __init__(self, machine, gpu, proc, pid, t0):
        self.machine = machine
        self.gpu = gpu
        self.proc = proc
        self.pid = pid
        self.t0 = t0

    def util(self, a, b):
        """Fraction of the GPU this process used between `a` and `b` seconds after it
        started, from the samples nearest inside the window."""
        return self.machine.util(self.gpu, self.pid, self.t0 + a, self.t0 + b)

    def wait(self, timeout=120):
        out, err = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0:
            raise AssertionError(f"vcuda_load exited {self.proc.returncode}\n{out}\n{err}")
        return out


class Machine:
    """A gpusim machine with `gpus` GPUs and a sampler of its ground truth."""

    def __init__(self, root, gpus, program, sample_period_us=None, wave_ns=None):
        """`sample_period_us` (NVML's utilization sample period) and `wave_ns` (the cost of a
        wave of a kernel without a duration in its name) go into the gpusim config; None
        keeps gpusim's default (166667 µs, 5000 ns)."""
        root.mkdir(parents=True, exist_ok=True)
        self.sim = Sim(root)
        self.sim.write_config(gpus_config(gpus, sample_period_us=sample_period_us, wave_ns=wave_ns))
        self.uuids = [g["uuid"] for g in self.sim.status()["gpus"]]
        self.program = program
        self.samples = []  # (wall s, sim ns, {(gpu, pid): busy ns})
        self.errors = []  # stderr of failed `gpusim status` calls
        self._stop = threading.Event()
        self._thread = None

    def tenant(self, gpu, name, core, core_limit=None):
        return self.sim.container([4096], gpus=[self.uuids[gpu]], name=name, core=core, core_limit=core_limit)

    def start(self, container, gpu, kernel="spin_1ms", seconds=5, *extra):
        """Start vcuda_load in `container` (on its GPU `gpu` of this machine)."""
        p = container.popen([self.program, "--kernel", kernel, "--seconds", seconds, *extra])
        line = p.stdout.readline()
        if not line.startswith("ready pid="):
            p.kill()
            raise AssertionError(f"vcuda_load did not start: {line!r} {p.stderr.read()}")
        return Load(self, gpu, p, int(line.split("=")[1]), time.monotonic())

    def spawn(self, container, gpu, args):
        """Start any program that prints "ready pid=<pid>" once its context exists (e.g.
        c/vcuda_adversary.c) in `container`, with `args` after the program's path."""
        p = container.popen([self.program, *args])
        line = p.stdout.readline()
        if not line.startswith("ready pid="):
            p.kill()
            raise AssertionError(f"{self.program} {args} did not start: {line!r} {p.stderr.read()}")
        return Load(self, gpu, p, int(line.split("=")[1]), time.monotonic())

    def poll(self):
        p = subprocess.run([GPUSIM, "status", "--json"], env=self.sim.env, capture_output=True, text=True)
        if p.returncode != 0:
            self.errors.append(p.stderr.strip())
            return
        s = json.loads(p.stdout)
        busy = {(g["index"], p["pid"]): p["busy_ns"] for g in s["gpus"] for p in g["processes"]}
        self.samples.append((time.monotonic(), s["time_ns"], busy))

    def sample(self, period=0.2):
        """Start sampling the ground truth every `period` seconds (until `stop`)."""

        def loop():
            while not self._stop.is_set():
                self.poll()
                self._stop.wait(period)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join()

    def util(self, gpu, pid, a, b):
        """Fraction of GPU `gpu` process `pid` used between wall times `a` and `b`: busy time
        and simulated time interpolated between the samples around each end."""
        have = [s for s in self.samples if (gpu, pid) in s[2]]
        inside = [s for s in have if a <= s[0] <= b]
        if len(inside) < 2:
            raise AssertionError(
                f"no ground-truth samples of pid {pid} on GPU {gpu} between {a:.2f} and {b:.2f} "
                f"({len(self.samples)} samples in all; gpusim status errors: {self.errors[-3:]})"
            )

        def at(t):
            before = [s for s in have if s[0] <= t]
            after = [s for s in have if s[0] >= t]
            if not before or not after:
                s = (before or after)[-1 if before else 0]
                return s[1], s[2][(gpu, pid)]
            s0, s1 = before[-1], after[0]
            f = 0.0 if s1[0] == s0[0] else (t - s0[0]) / (s1[0] - s0[0])
            return (s0[1] + f * (s1[1] - s0[1]), s0[2][(gpu, pid)] + f * (s1[2][(gpu, pid)] - s0[2][(gpu, pid)]))

        (t0, b0), (t1, b1) = at(a), at(b)
        return (b1 - b0) / (t1 - t0)

    def windows(self, load, a, b, width=1.0, step=0.2):
        """Utilization of every `width`-second window between `a` and `b` (seconds after the
        load started)."""
        out = []
        t = a
        while t + width <= b + 1e-9:
            out.append(load.util(t, t + width))
            t += step
        return out


ELASTIC = (20, 80, 50)  # the elastic tenant's share and limit, the neighbour's share (%)


def elastic_run(work, program, vcuda_lib, mode, period, seconds, wave_ns):
    """Issue 12, point 3: an elastic tenant (share 20 %, limit 80 %) runs `mode` alone for
    half the run, then a 50 % neighbour starts saturating (`program`: c/vcuda_adversary.c;
    `wave_ns`: gpusim's cost of a kernel wave, 1000 makes its tiny kernels 1 µs). Returns
    (elastic alone: average, worst 1 s window; elastic beside the neighbour; the
    neighbour's average; when the neighbour first held 50 ± 3 % over half a second, s after
    it started, or None)."""
    share, limit, other = ELASTIC
    m = Machine(work, 1, program, sample_period_us=period, wave_ns=wave_ns)
    try:
        a = m.tenant(0, "elastic", core=share, core_limit=limit)
        b = m.tenant(0, "neighbour", core=other)
        for c in (a, b):
            c.env["LD_PRELOAD"] = str(vcuda_lib)
        m.sample(0.2)
        la = m.spawn(a, 0, ["--mode", mode, "--seconds", f"{seconds:g}"])
        time.sleep(seconds / 2)
        lb = m.spawn(b, 0, ["--mode", "steady", "--kernel", "spin_1ms", "--seconds", f"{seconds / 2:g}"])
        la.wait(timeout=seconds + 30)
        lb.wait(timeout=seconds + 30)
    finally:
        m.stop()
    off = lb.t0 - la.t0
    reach, t = None, 0.0
    while t < 3.0:
        if abs(lb.util(t, t + 0.5) * 100 - other) <= 3:
            reach = t
            break
        t += 0.1
    end = seconds / 2 - 0.5
    return (la.util(1.0, off) * 100, max(m.windows(la, 1.0, off - 0.1)) * 100,
            la.util(off + 1.0, off + end) * 100, lb.util(1.0, end) * 100, reach)
