"""A kill storm against one vcuda container (issue 23), for test_vcuda_kill_storm.py and
scripts/bench-kill-storm (run as a script, it prints the benchmark's table).

PROCS processes of the container (c/vcuda_churn.c) share its quota on one or several GPUs:
each makes a context on every GPU, then allocates and frees chunks of 16-256 MiB on random
GPUs. Every 5-50 ms (at random) a killer acts, and each process found dead is replaced by a
fresh one once the killer has reaped it. Where the kills land depends on the variant:

    uniform  a random process is SIGKILLed at once, whatever it is doing (start-up included)
    startup  as uniform, and 3 replacements in 4 are SIGKILLed at a random instant of their
             own start-up (cuInit, the library's slot claim and its reclaim of dead slots,
             the contexts)
    alloc    a random running process is SIGKILLed at a random instant inside one of its
             next cuMemAlloc_v2 calls (with a full quota: inside the library's reclaim)
    free     the same inside cuMemFree_v2
    exit     a random running process exits normally (half of them freeing everything
             first), half of those SIGKILLed at a random instant of that exit; and another
             process is SIGKILLed at once
    mixed    each action drawn from uniform, alloc, free, exit, and 1 replacement in 4
             killed in start-up

Kills inside a call or an exit are made by the process itself (its control thread SIGKILLs
it when the driver arms it), so that they land where they are aimed; a kill is a death by
SIGKILL, however delivered.

Two workloads:

    pressing  (cap_mib=0) every process allocates until the library refuses: the quota is
              full all the time, so a replacement is often refused its context, rightly.
    headroom  (cap_mib=headroom_cap(...)) every process holds at most cap_mib per GPU
              besides its context, and PROCS × (context + cap) + 2 contexts <= quota. The
              container then never has more than the quota less two contexts, at any
              instant, by construction: a correct library refuses nothing. (The 2 spare
              contexts cover the library's by-design double count while a context is made:
              the cost it reserved in advance and the cost it measured are both counted
              until it lets go of the reservation, a few µs.) One call in four is a probe:
              an allocation larger than the whole quota, which any correct library refuses
              (counted apart), after reclaiming dead processes' slots as it does before any
              refusal; so the library's reclaim runs as often as under a pressing workload.
              (A probe exceeds the quota alone: it is refused without ever being counted,
              so it takes no room from the others.)

Every 0.25 s the storm is sampled with its processes stopped (Storm.sample): gpusim's ground
truth for the live processes against the quota (contexts included: they count toward it, and
the container is the GPUs' only user) and against what the region counts for each. After the
storm every process left is SIGKILLed and reaped; then the run records gpusim's memory_peak
(the high-water mark since the storm's start, which counts live processes' memory only:
gpusim reaps the dead before recording a new peak), audits the region file (audit_region)
and has a fresh process fill each GPU (fresh_fill).
"""

import argparse
import dataclasses
import json
import mmap
import os
import pathlib
import random
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections import Counter

# run as a script (scripts/bench-kill-storm), gpusim's harness is not on the path yet
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gpusim" / "e2e"))

from gpusim_harness import C_COMMON, Sim, cuda_include_dir, nvml_include_dir  # noqa: E402
from vcuda_common import (
    CONTEXT,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
    MAX_GPUS,
    MAX_PROCS,
    REGION_HEADER,
    REGION_MAGIC,
    REGION_VERSION,
    SLOT_SIZE,
    MiB,
    Shell,
    build,
)

VARIANTS = ("uniform", "startup", "alloc", "free", "exit", "mixed")
MIN_MIB, MAX_MIB = 16, 256
TICK_S = (0.005, 0.050)
SAMPLE_S = 0.25  # between two samples of ground truth (Storm.sample)
SAMPLE_TIMEOUT_S = 0.5  # a status takes a few ms, unless a stopped process holds gpusim's lock
SPARE_CONTEXTS = 2  # headroom for contexts being made (see the module docstring)
STARTUP_ARMED = {"startup": 0.75, "mixed": 0.25}  # share of replacements killed in start-up
EXIT_NS = 100_000  # how long a normal exit is taken to last until one has been timed

# c/vcuda_churn.c's STATS fields (u64 indices), states and phases
F_STATE, F_PHASE, F_KILLED_IN, F_ALLOCS, F_REFUSED, F_ERRORS, F_FAIL_RC, F_FAIL_AT = range(8)
F_STARTUP_NS, F_EXIT_NS, F_PROBES = 8, 9, 12
S_STARTING, S_READY = 0, 1
PHASES = {0: "between calls", 1: "start-up", 2: "alloc", 3: "free", 4: "exit"}

# region.rs, layout version 4: Slot { state u32 @0, pid u32 @4, host_pid u32 @8, generation u32
# @12, start_time u64 @16, api [u64; 8] @24, hidden [u64; 8] @88, launched_at @152 (pinned by
# the Rust test layout_is_stable) }; api holds bytes in its low 48 bits (API_BYTES)
SLOT_FREE = 0
SLOT_STATES = {SLOT_FREE: "FREE", 1: "ACTIVE", 2: "BUSY"}
SLOT_API, SLOT_HIDDEN = 24, 24 + 8 * MAX_GPUS
API_BYTES = (1 << 48) - 1


def headroom_cap(quota_mib, procs):
    """The most each process may hold per GPU (MiB) in the headroom workload."""
    cap = (quota_mib * MiB - (procs + SPARE_CONTEXTS) * CONTEXT) // procs // MiB
    assert cap >= MIN_MIB, f"a {quota_mib} MiB quota leaves no headroom for {procs} processes"
    return cap


def build_programs(cc, out):
    """vcuda_churn and vcuda_shell, built into `out` with `cc` (gpusim_harness's fixture, or gcc)."""
    return {"churn": build(cc, out, "vcuda_churn", "-pthread"), "shell": build(cc, out, "vcuda_shell")}


def gcc(src, out, *extra):
    """gpusim_harness's `cc` fixture, for use outside pytest."""
    cmd = ["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-deprecated-declarations", "-O1", "-g",
           f"-I{cuda_include_dir()}", f"-I{nvml_include_dir()}", f"-I{C_COMMON}", str(src), "-o", str(out), *extra]
    subprocess.run(cmd, check=True)
    return out


@dataclasses.dataclass
class Result:
    variant: str
    procs: int
    quotas_mib: list
    cap_mib: int
    seconds: float = 0.0
    kills: int = 0  # deaths by SIGKILL during the storm (not the final one)
    kills_in: Counter = dataclasses.field(default_factory=Counter)  # by phase
    replacements: int = 0
    exits: int = 0  # normal exits ordered by the killer
    ctx_refused: int = 0  # processes refused cuInit or a context
    ctx_refused_rc: Counter = dataclasses.field(default_factory=Counter)  # by call and CUresult
    allocs: int = 0
    alloc_refused: int = 0  # not counting probes
    probes: int = 0  # probes refused (headroom workload)
    errors: list = dataclasses.field(default_factory=list)  # anything unexpected
    samples: int = 0  # of ground truth with every live process stopped (Storm.sample)
    samples_skipped: int = 0
    live_max: list = dataclasses.field(default_factory=list)  # bytes, per GPU, over the samples
    violations: list = dataclasses.field(default_factory=list)  # what the samples found wrong
    peaks: list = dataclasses.field(default_factory=list)  # gpusim's memory_peak, bytes, per GPU
    bad_slots: list = dataclasses.field(default_factory=list)
    fill_mib: list = dataclasses.field(default_factory=list)  # per GPU
    fill_exact: bool = False
    leftover_slots: list = dataclasses.field(default_factory=list)  # after the fresh process's fill

    @property
    def gpus(self):
        return len(self.quotas_mib)

    def fill_expected_mib(self):
        return [q - CONTEXT // MiB for q in self.quotas_mib]

    def summary(self):
        """Everything, for an assertion message."""
        return "\n".join(f"  {f.name}: {getattr(self, f.name)}" for f in dataclasses.fields(self))


class Worker:
    """One vcuda_churn process and its STATS page."""

    def __init__(self, container, program, stats, args, log):
        stats.write_bytes(bytes(4096))
        fd = os.open(stats, os.O_RDWR)
        self.page = mmap.mmap(fd, 4096)
        os.close(fd)
        self.stats = stats
        self.p = container.popen([program, stats, *args], stdin=subprocess.PIPE, stderr=log)
        self.armed = False  # given an order to die (or to exit) already
        self.shot_in = None  # phase when the killer SIGKILLed it

    def field(self, i):
        return struct.unpack_from("<Q", self.page, 8 * i)[0]

    def phase(self):
        if self.field(F_STATE) == S_STARTING:
            return PHASES[1]
        return PHASES.get(self.field(F_PHASE) & 0xFF, "?")

    def ready(self):
        return self.field(F_STATE) == S_READY

    def order(self, line):
        try:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        except OSError:
            pass  # it died meanwhile: the next reap records it

    def shoot(self):
        self.shot_in = self.phase()
        self.p.kill()

    def close(self):
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.page.close()
        self.stats.unlink()


class Storm:
    """The killer: starts the processes, acts every 5-50 ms as its variant says, replaces
    the dead once reaped, samples ground truth, and records everything in a Result."""

    def __init__(self, sim, container, programs, work, uuids, result, *, variant, seed):
        assert variant in VARIANTS, variant
        assert 2 <= result.procs <= 16, result.procs
        self.sim = sim
        self.container = container
        self.programs = programs
        self.work = work
        self.uuids = uuids
        self.gpus = len(uuids)
        self.procs = result.procs
        self.variant = variant
        self.rng = random.Random(seed)
        self.cap_mib = result.cap_mib
        self.probe_mib = max(result.quotas_mib) + 1 if result.cap_mib else 0
        self.r = result
        self.live = []
        self.n = 0
        self.log = open(work / "workers.log", "a")
        self.first = set()  # the first PROCS processes
        self.startup_ns = []  # start-up durations seen, to aim start-up kills
        self.exit_ns = []  # the same for normal exits

    def spawn(self, wait=False, startup_kill_us=0):
        self.n += 1
        args = [self.gpus, MIN_MIB, MAX_MIB, self.cap_mib, self.probe_mib, self.rng.getrandbits(32), int(wait),
                startup_kill_us]
        w = Worker(self.container, self.programs["churn"], self.work / f"w{self.n}.stats", args, self.log)
        self.live.append(w)
        return w

    def start(self):
        """The first PROCS processes, started together once all have their contexts."""
        ws = [self.spawn(wait=True) for _ in range(self.procs)]
        self.first = set(ws)
        for w in ws:
            if w.p.stdout.readline() != "ready\n":
                w.p.wait()
                raise AssertionError(f"a first process of the storm did not start: exit {w.p.returncode}, "
                                     f"CUresult {w.field(F_FAIL_RC)}; see {self.log.name}")
        self.startup_ns += [w.field(F_STARTUP_NS) for w in ws]
        for w in ws:
            w.order("go")

    def record(self, w, storm=True):
        rc = w.p.returncode
        self.r.allocs += w.field(F_ALLOCS)
        self.r.alloc_refused += w.field(F_REFUSED)
        self.r.probes += w.field(F_PROBES)
        if w.field(F_ERRORS):
            self.r.errors.append(f"pid {w.p.pid}: {w.field(F_ERRORS)} failed calls")
        if w.field(F_STARTUP_NS) and w not in self.first:
            self.startup_ns.append(w.field(F_STARTUP_NS))
        if rc == -9:
            if storm:
                self.r.kills += 1
                killed_in = w.field(F_KILLED_IN)  # 0: not by itself
                self.r.kills_in[PHASES[killed_in] if killed_in else w.shot_in or "?"] += 1
        elif rc == 0:
            self.r.exits += 1
            self.exit_ns.append(w.field(F_EXIT_NS))
        elif rc == 3:
            self.r.ctx_refused += 1
            at = w.field(F_FAIL_AT)  # 1: cuInit, 2 + g: the context on GPU g
            call = "cuInit" if at == 1 else f"context on GPU {at - 2}"
            self.r.ctx_refused_rc[f"{call}: {w.field(F_FAIL_RC)}"] += 1
        else:
            self.r.errors.append(f"pid {w.p.pid} exited {rc}")
        w.close()

    def reap(self):
        for w in [w for w in self.live if w.p.poll() is not None]:
            self.live.remove(w)
            self.record(w)

    def refill(self):
        share = STARTUP_ARMED.get(self.variant, 0)
        window_us = statistics.median(self.startup_ns) // 1000
        while len(self.live) < self.procs:
            self.r.replacements += 1
            armed = self.rng.random() < share
            self.spawn(startup_kill_us=window_us if armed else 0).armed = armed

    def act(self):
        action = self.variant
        if action == "mixed":
            action = self.rng.choice(("uniform", "alloc", "free", "exit"))
        running = [w for w in self.live if w.ready() and not w.armed]
        if action in ("uniform", "startup"):
            if self.live:
                self.rng.choice(self.live).shoot()
        elif action in ("alloc", "free"):
            if running:
                w = self.rng.choice(running)
                w.armed = True
                w.order(f"kill {action}")
        elif action == "exit" and running:
            w = self.rng.choice(running)
            w.armed = True
            if self.rng.random() < 0.5:
                w.order("exit")
            else:
                w.order(f"exit kill {3 * statistics.median(self.exit_ns or [EXIT_NS]) // 1000}")
            others = [o for o in self.live if o is not w]
            if others:
                self.rng.choice(others).shoot()

    def sample(self, t):
        """Ground truth at one instant, `t` s into the storm: every live process is stopped
        (SIGSTOP, waited for) so that nothing changes but deaths, then gpusim's status (which
        first reaps the dead: only live processes' memory is left) and the region are read.
        Per GPU, what the live processes hold must fit the quota, and each must hold no more
        than the region counts for it (the library reserves before the driver charges and
        releases after it frees, so its count is never below the driver's). A stopped process
        may hold gpusim's lock, which the status would wait for: the sample is then skipped."""
        alive = [w for w in self.live if w.p.poll() is None]
        for w in alive:
            w.p.send_signal(signal.SIGSTOP)  # reaps (and spares) one that died meanwhile
        try:
            for w in [w for w in alive if w.p.returncode is None]:
                os.waitid(os.P_PID, w.p.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
            try:
                status = json.loads(self.sim.gpusim("status", "--json", timeout=SAMPLE_TIMEOUT_S).stdout)
            except subprocess.TimeoutExpired:
                self.r.samples_skipped += 1
                return
            counted = {}
            for _, state, pid, api, hidden in _slots(self.container.region, self.gpus):
                if state != SLOT_FREE:
                    counted[pid] = [a + h + c for a, h, c in zip(api, hidden, counted.get(pid, [0] * self.gpus))]
        finally:
            for w in alive:
                w.p.send_signal(signal.SIGCONT)
        self.r.samples += 1
        by_uuid = {g["uuid"]: g for g in status["gpus"]}
        for g, (uuid, quota) in enumerate(zip(self.uuids, self.r.quotas_mib)):
            procs = by_uuid[uuid]["processes"]
            held = sum(p["memory"] for p in procs)
            self.r.live_max[g] = max(self.r.live_max[g], held)
            if held > quota * MiB:
                self.r.violations.append(f"{t:.2f} s: live processes held {held / MiB:.1f} MiB on GPU {g}")
            for p in procs:
                count = counted.get(p["pid"], [0] * self.gpus)[g]
                if p["memory"] > count:
                    self.r.violations.append(f"{t:.2f} s: pid {p['pid']} held {p['memory'] / MiB:.1f} MiB on GPU "
                                             f"{g}, the region counts {count / MiB:.1f} MiB for it")

    def run(self, seconds):
        """The storm; then every process left is SIGKILLed and reaped. Returns the
        monotonic time of that last kill."""
        try:
            self.start()
            t0 = time.monotonic()
            next_sample = t0 + SAMPLE_S
            while time.monotonic() - t0 < seconds:
                time.sleep(self.rng.uniform(*TICK_S))  # the killer's random interval
                self.reap()
                self.act()
                self.reap()
                self.refill()
                if time.monotonic() >= next_sample:
                    self.sample(time.monotonic() - t0)
                    next_sample = time.monotonic() + SAMPLE_S
            self.r.seconds = time.monotonic() - t0
        finally:
            for w in self.live:
                w.p.kill()
            last_kill = time.monotonic()
            for w in self.live:
                w.p.wait()
                self.record(w, storm=False)
            self.log.close()
        return last_kill


def _slots(path, num_gpus):
    """Every slot of the region, raw: (index, state, pid, [allocation bytes], [hidden bytes])
    per GPU. Checks the magic and the layout version first, so a layout change fails here."""
    data = path.read_bytes()
    assert data[:8] == REGION_MAGIC, f"{path}: not a vcuda region"
    version = struct.unpack_from("<I", data, 8)[0]
    assert version == REGION_VERSION, f"{path}: layout version {version}, kill_storm reads {REGION_VERSION}"
    for i in range(MAX_PROCS):
        off = REGION_HEADER + i * SLOT_SIZE
        state, pid = struct.unpack_from("<II", data, off)
        api = [a & API_BYTES for a in struct.unpack_from(f"<{num_gpus}Q", data, off + SLOT_API)]
        yield i, state, pid, api, list(struct.unpack_from(f"<{num_gpus}Q", data, off + SLOT_HIDDEN))


def audit_region(path, num_gpus):
    """What is wrong in the region once every process of the container is dead: a counter
    below zero (a byte count of 2^47 or more: a release that outran its reservation, read as
    a 48-bit two's complement number, wraps to nearly 2^48), or a FREE slot that still
    counts bytes (given up or reclaimed, yet summed into the container's usage: the library
    sums every slot ever used, whatever its state). A slot left BUSY (a claim or reclaim
    whose process died half-way) is not wrong yet: the next process may finish the change
    (see leftover_slots)."""
    bad = []
    for i, state, pid, api, hidden in _slots(path, num_gpus):
        name = f"slot {i} ({SLOT_STATES.get(state, state)}, pid {pid})"
        for g in range(num_gpus):
            if api[g] >= 1 << 47:
                bad.append(f"{name}: GPU {g} allocation counter is negative: {api[g] - (1 << 48)} B")
            if hidden[g] >= 1 << 63:
                bad.append(f"{name}: GPU {g} hidden counter is negative: {hidden[g] - (1 << 64)} B")
        if state == SLOT_FREE and (any(api) or any(hidden)):
            bad.append(f"{name} still counts allocations {api} B and hidden {hidden} B")
    return bad


def leftover_slots(path, num_gpus, pid):
    """Slots other than process `pid`'s that are not FREE: once a fresh process has started
    (and reclaimed dead processes' slots, as the library does at start-up) and filled the
    quota, every other process of the container being dead, each is a dead process still
    counted or a slot lost for good."""
    return [f"slot {i} ({SLOT_STATES.get(state, state)}, pid {p}): allocations {api} B, hidden {hidden} B"
            for i, state, p, api, hidden in _slots(path, num_gpus) if state != SLOT_FREE and p != pid]


def _fill_once(container, shell, quotas_mib, region):
    """One fresh process: (MiB it allocated on each GPU beside its context, 0 where it got
    no context; whether that was exactly the quota less the context; leftover_slots then)."""
    sh = Shell(container, shell, "fresh")
    try:
        if sh.rc("init") != CUDA_SUCCESS:
            return [0] * len(quotas_mib), False, []
        fills, exact = [], True
        for g, quota in enumerate(quotas_mib):
            rest = quota * MiB - CONTEXT
            if sh.rc(f"ctx {g}") != CUDA_SUCCESS:
                fills.append(0)
                exact = False
            elif sh.rc(f"alloc {rest}") == CUDA_SUCCESS:
                fills.append(rest // MiB)
                exact = exact and sh.rc("alloc 512") == CUDA_ERROR_OUT_OF_MEMORY
            else:
                fills.append(sh.do(f"many {rest // MiB} {MiB}")["done"])
                exact = False
        return fills, exact, leftover_slots(region, len(quotas_mib), sh.pid)
    finally:
        sh.close()


def fresh_fill(container, shell, quotas_mib, region, deadline):
    """Whether a fresh process of the container gets each GPU's whole quota less its context
    (and not one granule more), by `deadline`: fresh processes try one after another until
    one does or the deadline passes (the library frees dead processes' slots when a
    reservation would be refused, and on its sweep every 0.5 s). Returns the last try's
    (MiB per GPU, exact, leftover_slots after its fill)."""
    while True:
        fills, exact, leftover = _fill_once(container, shell, quotas_mib, region)
        if (exact and not leftover) or time.monotonic() >= deadline:
            return fills, exact, leftover
        time.sleep(0.05)  # nothing signals the library's reclaim


def run(sim, container, programs, work, *, uuids, quotas_mib, procs, seconds, variant, seed=1, cap_mib=0):
    """One storm against `container` (a gpusim_harness Container, or node_common's under the
    manager) whose GPUs are `uuids` with `quotas_mib`; returns its Result."""
    work.mkdir(parents=True, exist_ok=True)
    r = Result(variant, procs, list(quotas_mib), cap_mib, live_max=[0] * len(uuids))
    last_kill = Storm(sim, container, programs, work, uuids, r, variant=variant, seed=seed).run(seconds)
    by_uuid = {g["uuid"]: g for g in sim.status()["gpus"]}
    r.peaks = [by_uuid[u]["memory_peak"] for u in uuids]
    r.bad_slots = audit_region(container.region, len(uuids))
    r.fill_mib, r.fill_exact, r.leftover_slots = fresh_fill(
        container, programs["shell"], quotas_mib, container.region, last_kill + 1.0
    )
    return r


# ---- the benchmark ------------------------------------------------------------------------

# (variant, processes, GPUs): every variant at 2, 6 and 16 processes, and one run on 2 GPUs
BENCH_RUNS = [(v, n, 1) for v in VARIANTS[:5] for n in (2, 6, 16)] + [("mixed", 6, 2)]


def bench_quota_mib(procs):
    """4 GiB (the issue's quota), or more when the processes' contexts would take most of it."""
    return max(4096, -(-(procs * CONTEXT // MiB + 2048) // 256) * 256)


def bench_one(work, programs, variant, procs, gpus, seconds, seed):
    work.mkdir(parents=True)
    sim = Sim(work)
    quota = bench_quota_mib(procs)
    c = sim.container([quota] * gpus)
    uuids = [g["uuid"] for g in sim.status()["gpus"]][:gpus]
    return run(sim, c, programs, work / "storm", uuids=uuids, quotas_mib=[quota] * gpus, procs=procs,
               seconds=seconds, variant=variant, seed=seed)


def table(results):
    """The benchmark's table, in markdown; what breaks an invariant is in bold."""
    head = ["variant", "procs", "GPUs", "kills", "peak MiB / quota MiB", "sampled live max MiB (violations)",
            "replacements refused a context", "allocation refusals", "bad slots after", "fresh-process fill MiB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def bold(text, bad):
        return f"**{text}**" if bad else text

    for r in results:
        peak = ", ".join(bold(f"{p / MiB:.0f} / {q}", p > q * MiB) for p, q in zip(r.peaks, r.quotas_mib))
        live = ", ".join(f"{m / MiB:.0f}" for m in r.live_max) + " " + bold(f"({len(r.violations)})", r.violations)
        fill = ", ".join(bold(f"{f} of {e}", f != e) for f, e in zip(r.fill_mib, r.fill_expected_mib()))
        bad = bold(str(len(r.bad_slots)), r.bad_slots)
        if r.leftover_slots:
            bad += " " + bold(f"(+{len(r.leftover_slots)} left after the fill)", True)
        rows.append(f"| {r.variant} | {r.procs} | {r.gpus} | {r.kills} | {peak} | {live} | {r.ctx_refused} of "
                    f"{r.replacements} | {r.alloc_refused} | {bad} | {fill} |")
    return "\n".join(rows)


def notes(results):
    """What the table cannot show: where kills landed, refusals' codes, bad slots, errors."""
    out = []
    for r in results:
        what = [f"kills in {dict(r.kills_in)}"]
        if r.ctx_refused_rc:
            what.append(f"refusals by call and CUresult {dict(r.ctx_refused_rc)}")
        if r.leftover_slots:
            what.append(f"slots left after the fresh process's fill: {r.leftover_slots[:3]}")
        what.append(f"{r.samples} samples ({r.samples_skipped} skipped)")
        what += r.violations[:3] + (["…"] if len(r.violations) > 3 else [])
        what += r.bad_slots[:3] + (["…"] if len(r.bad_slots) > 3 else []) + r.errors[:3]
        out.append(f"- {r.variant}, {r.procs} procs, {r.gpus} GPU(s): " + "; ".join(what))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=pathlib.Path, required=True)
    ap.add_argument("--seconds", type=float, default=30)
    default = " ".join(f"{v}:{n}:{g}" for v, n, g in BENCH_RUNS)
    ap.add_argument("--only", action="append", metavar="VARIANT:PROCS[:GPUS]",
                    help=f"run only these (repeatable); default: {default}")
    args = ap.parse_args()
    runs = BENCH_RUNS
    if args.only:
        runs = [(s.split(":") + ["1"])[:3] for s in args.only]
        runs = [(v, int(n), int(g)) for v, n, g in runs]
    args.work.mkdir(parents=True, exist_ok=True)
    programs = build_programs(gcc, args.work)
    results = []
    for i, (variant, procs, gpus) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {variant}, {procs} processes, {gpus} GPU(s), {args.seconds:g} s",
              file=sys.stderr, flush=True)
        results.append(bench_one(args.work / f"run{i}", programs, variant, procs, gpus, args.seconds, seed=i + 1))
    print(f"{args.seconds:g} s per run; every process allocates until refused; quota per GPU "
          f"{bench_quota_mib(2)} MiB ({bench_quota_mib(16)} MiB for 16 processes). Peak: gpusim's "
          "memory_peak, live processes' memory at its highest; sampled live max: ground truth "
          f"every {SAMPLE_S} s with the processes stopped, and how many samples found the quota "
          "exceeded or a process holding more than the region counts (kill_storm.Storm.sample).")
    print()
    print(table(results))
    print()
    print(notes(results))


if __name__ == "__main__":
    main()
