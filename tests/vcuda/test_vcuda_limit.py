"""libvcuda's compute limiter, judged by gpusim's ground truth (each process's busy time).

Tolerances, stated once:
- ACCURACY: a saturating tenant's utilization, averaged over 10 s (from 1 s after start),
  is its share ± 2 percentage points.
- Any 1 s window may exceed the share by what the bucket spends at once on top of the 2 pp
  (the calibration's error): window_slack(kernel, share). A window may open with the bucket
  full, and its capacity is 20 ms of earnings at the share (vcuda-limiter's
  CAPACITY_WINDOW_NS), at least one kernel: 1.8 pp at 90 %, 0.1 pp at 5 % with 1 ms kernels.
  Judged by one kernel alone, a 90 % tenant of 1 ms kernels failed CI at 92.28 % in one
  window of 18 tenants sharing 2 cores (and 92.50 % here, 1 run in 6 under load; the
  library before issue 14's changes behaved the same, 90.43-91.36 % over 15 quiet runs
  against 90.31-91.68 % now). The windows as measured are scripts/bench-limiter's table.
  For 20 ms kernels the bucket holds one kernel and a launch may take it one kernel into
  debt, so a window can hold two kernels (4 pp) beyond the share on top of the
  calibration's error; there the bound is issue 12's, share ± 5 pp per 1 s window
  (CI failed at 79.3 % for 75 % and 94.2 % for 90 % with a tighter one).
- Settled: the second second after start (or after a change) is already within the window
  tolerance, either way: a saturating process's queue may deepen by a bucket's capacity
  within one second as well as drain by it (CI failed at 72.37 % for a 75 % tenant of
  50 µs kernels with the low side held to the 2 pp and one kernel).
"""

import resource
import time

import pytest

from limit_common import KERNELS, Machine, build_load, set_share

ACCURACY = 0.02


WINDOW_BOUND = 0.05  # issue 12: no 1 s window more than 5 pp over the share


CAPACITY_WINDOW = 0.020  # vcuda-limiter's CAPACITY_WINDOW_NS, in seconds


def kernel_slack(kernel):
    """How far a tenant running `kernel` may be from its share in one 1 s window before the
    bucket is counted: the 2 pp and one kernel (issue 12's 5 pp for 20 ms)."""
    slack = ACCURACY + KERNELS[kernel] / 1.0
    # as long as the bucket's 20 ms of earnings: the bucket holds one kernel, and a launch
    # may take it one more into debt
    return max(slack, WINDOW_BOUND) if KERNELS[kernel] >= 0.02 else slack


def window_slack(kernel, share):
    """How far one 1 s window of a tenant with `share` (a fraction) may go over it: the
    module docstring's rule, the 2 pp and the bucket's capacity (at least one kernel)."""
    return max(kernel_slack(kernel), ACCURACY + CAPACITY_WINDOW * share)


@pytest.fixture(scope="module")
def load_bin(cc, tmp_path_factory):
    return build_load(cc, tmp_path_factory.mktemp("limit-bin"))


@pytest.fixture
def machines(tmp_path, load_bin):
    made = []

    def make(gpus):
        m = Machine(tmp_path / f"m{len(made)}", gpus, load_bin)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


def check_tenant(load, share, kernel, seconds, label):
    avg = load.util(1.0, seconds - 0.2)
    assert abs(avg - share) <= ACCURACY, f"{label}: averaged {avg:.2%}, share {share:.0%}"
    settle = load.util(1.0, 2.0)
    assert abs(settle - share) <= window_slack(kernel, share), f"{label}: {settle:.2%} in its second second (not settled)"
    worst = max(load.machine.windows(load, 1.0, seconds - 0.2))
    assert worst <= share + window_slack(kernel, share), f"{label}: a 1 s window reached {worst:.2%}"


SHARES = [5, 10, 25, 50, 75, 90]


def test_a_single_tenant_gets_its_share_for_every_kernel_length(machines):
    """Targets 5-90 % × kernels of 50 µs, 1 ms and 20 ms, all saturating, 18 GPUs at once."""
    combos = [(s, k) for s in SHARES for k in KERNELS]
    ms = [machines(6) for _ in range(3)]
    loads = []
    for i, (share, kernel) in enumerate(combos):
        m, gpu = ms[i // 6], i % 6
        c = m.tenant(gpu, f"t{i}", core=share)
        loads.append((share, kernel, m, gpu, c))
    for m in ms:
        m.sample()
    started = [(s, k, m.start(c, gpu, kernel=k, seconds=11)) for s, k, m, gpu, c in loads]
    for _, _, load in started:
        load.wait()
    for m in ms:
        m.stop()
    for share, kernel, load in started:
        check_tenant(load, share / 100, kernel, 11, f"share {share}% kernel {kernel}")


@pytest.mark.parametrize(
    "shares",
    [[30, 70], [10, 90], [20, 30, 50], [10, 20, 30, 40]],
    ids=["30-70", "10-90", "20-30-50", "10-20-30-40"],
)
def test_tenants_sharing_a_gpu_each_get_their_share(machines, shares):
    m = machines(1)
    cs = [m.tenant(0, f"t{i}", core=s) for i, s in enumerate(shares)]
    m.sample()
    loads = [m.start(c, 0, kernel="spin_1ms", seconds=7) for c in cs]
    for ld in loads:
        ld.wait()
    m.stop()
    for s, ld in zip(shares, loads):
        check_tenant(ld, s / 100, "spin_1ms", 7, f"tenant {s}% of {shares}")


def test_a_multi_gpu_container_gets_each_gpus_share_whatever_order_the_application_sees_them_in(machines):
    """A container on two GPUs, 20 % of the first and 60 % of the second (config order). Its
    processes list them the other way round (CUDA_VISIBLE_DEVICES=1,0), so CUDA ordinal 0
    is config GPU 1: a process on each ordinal is held to the share of the GPU it really
    runs on (a limiter that took ordinals for config indices would swap the shares)."""
    m = machines(2)
    c = m.sim.container([4096, 4096], gpus=[m.uuids[0], m.uuids[1]], name="pair", core=50)
    c.env["CUDA_VISIBLE_DEVICES"] = "1,0"
    m.sample()
    on_gpu1 = m.start(c, 1, "spin_1ms", 7, "--device", "0")
    on_gpu0 = m.start(c, 0, "spin_1ms", 7, "--device", "1")
    # the region exists once a process has started; a share written to it applies within
    # 200 ms (test_a_share_changed_at_run_time_applies_within_200ms), before the first second
    set_share(c.region, 0, 20)
    set_share(c.region, 1, 60)
    on_gpu1.wait()
    on_gpu0.wait()
    m.stop()
    for ld, share in ((on_gpu0, 0.20), (on_gpu1, 0.60)):
        got = ld.util(1.0, 6.8)
        assert abs(got - share) <= ACCURACY, f"the process on gpusim GPU {ld.gpu} got {got:.2%}, its share {share:.0%}"


def test_a_hard_tenant_does_not_take_a_neighbours_unused_share(machines):
    """B (50 %) runs in bursts; A (30 %, hard) saturates and stays at 30 % throughout."""
    m = machines(1)
    a, b = m.tenant(0, "a", core=30), m.tenant(0, "b", core=50)
    m.sample()
    la = m.start(a, 0, kernel="spin_1ms", seconds=7)
    lb = m.start(b, 0, "spin_1ms", 7, "--on-ms", "500", "--off-ms", "1000")
    la.wait()
    lb.wait()
    m.stop()
    check_tenant(la, 0.30, "spin_1ms", 7, "hard tenant beside a bursty one")
    assert lb.util(1.0, 6.8) <= 0.50 + ACCURACY


def test_a_bursty_tenant_is_held_to_its_share(machines):
    """On/off phases: no 1 s window above the share, and no catch-up after idle phases."""
    m = machines(2)
    c0, c1 = m.tenant(0, "b0", core=40), m.tenant(1, "b1", core=25)
    m.sample(0.1)
    l0 = m.start(c0, 0, "spin_1ms", 8, "--on-ms", "300", "--off-ms", "300")
    l1 = m.start(c1, 1, "spin_50us", 8, "--on-ms", "1000", "--off-ms", "500")
    l0.wait()
    l1.wait()
    m.stop()
    for ld, share, kernel in ((l0, 0.40, "spin_1ms"), (l1, 0.25, "spin_50us")):
        worst = max(m.windows(ld, 0.5, 7.8))
        assert worst <= share + window_slack(kernel, share), f"bursty tenant at {share:.0%}: a 1 s window reached {worst:.2%}"
        # Inside an on-phase it still gets its share (not starved by the phases).
        best = max(m.windows(ld, 0.5, 7.8, width=0.3, step=0.1))
        assert best >= share - 2 * ACCURACY, f"bursty tenant at {share:.0%} never got its share ({best:.2%})"


def test_an_elastic_tenant_bursts_while_the_gpu_idles_and_gives_back(machines):
    """A: 30 % guaranteed, up to 80 %. Alone it takes 80 %; when B (50 %, hard) starts, B
    has its share within 1 s and A falls back to what is left."""
    m = machines(1)
    a = m.tenant(0, "a", core=30, core_limit=80)
    b = m.tenant(0, "b", core=50)
    m.sample()
    la = m.start(a, 0, kernel="spin_1ms", seconds=9)
    time.sleep(4)
    lb = m.start(b, 0, kernel="spin_1ms", seconds=5)
    la.wait()
    lb.wait()
    m.stop()
    alone = la.util(1.0, 3.8)
    assert abs(alone - 0.80) <= ACCURACY, f"alone, the elastic tenant got {alone:.2%} (limit 80%)"
    got = lb.util(1.0, 4.8)
    assert abs(got - 0.50) <= ACCURACY, f"the hard neighbour got {got:.2%} of its 50%"
    first = lb.util(0.0, 1.0)
    assert first >= 0.50 - kernel_slack("spin_1ms") - 0.02, f"the neighbour's first second: {first:.2%}"
    shared = la.util(5.0, 8.8)
    assert 0.30 - ACCURACY <= shared <= 0.50 + ACCURACY, f"the elastic tenant kept {shared:.2%} beside its neighbour"


def test_a_share_changed_at_run_time_applies_within_200ms(machines):
    m = machines(1)
    c = m.tenant(0, "c", core=20)
    m.sample(0.1)
    ld = m.start(c, 0, kernel="spin_1ms", seconds=8)
    steps = [(2.0, 60), (4.0, 10), (6.0, 100)]
    marks = []
    for at, pct in steps:
        time.sleep(max(0.0, ld.t0 + at - time.monotonic()))
        set_share(c.region, 0, pct)
        marks.append((time.monotonic() - ld.t0, pct))
    ld.wait()
    m.stop()
    assert abs(ld.util(1.0, 1.9) - 0.20) <= ACCURACY
    for t, pct in marks:
        got = ld.util(t + 0.2, t + 1.8)
        want = min(pct, 100) / 100
        if pct >= 100:
            assert got >= 0.98, f"made exclusive at {t:.2f}s: {got:.2%}"
        else:
            assert abs(got - want) <= ACCURACY, f"share {pct}% from {t:.2f}s: got {got:.2%} 0.2 s later"


def test_an_exclusive_container_is_not_throttled(machines):
    m = machines(1)
    c = m.tenant(0, "x", core=100)
    m.sample()
    ld = m.start(c, 0, kernel="spin_50us", seconds=3)
    ld.wait()
    m.stop()
    assert ld.util(0.3, 2.8) >= 0.99


@pytest.mark.parametrize("api", ["kernel_ptsz", "ex", "coop", "multi", "grid", "grid_async", "legacy", "graph"])
def test_every_launch_path_is_limited(machines, api):
    m = machines(1)
    c = m.tenant(0, "c", core=30)
    m.sample()
    ld = m.start(c, 0, "spin_1ms", 4, "--api", api)
    ld.wait()
    m.stop()
    got = ld.util(1.0, 3.8)
    assert abs(got - 0.30) <= ACCURACY, f"{api}: {got:.2%} at a 30% share"


def test_a_containers_processes_share_its_share(machines):
    """Two processes of one 40 % container: 40 % together, each about half."""
    m = machines(1)
    c = m.tenant(0, "c", core=40)
    m.sample()
    l1 = m.start(c, 0, kernel="spin_1ms", seconds=7)
    l2 = m.start(c, 0, kernel="spin_1ms", seconds=7)
    l1.wait()
    l2.wait()
    m.stop()
    a, b = l1.util(2.0, 6.6), l2.util(2.0, 6.6)
    assert abs(a + b - 0.40) <= ACCURACY, f"together {a + b:.2%} of a 40% share"
    assert abs(a - b) <= 0.04, f"split {a:.2%} / {b:.2%}"


def test_a_throttled_launch_sleeps_instead_of_spinning(machines):
    """A 5 % tenant launching 20 ms kernels waits ~95 % of the time: its CPU time stays a
    small fraction of the wall time."""
    m = machines(1)
    c = m.tenant(0, "c", core=5)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    ld = m.start(c, 0, kernel="spin_20ms", seconds=3)
    ld.wait()
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.15 * wall, f"the throttled process used {cpu:.2f} s of CPU in {wall:.2f} s"
