"""The compute share against a tenant that games the cost estimate (issue 12), judged by
gpusim's ground truth. The patterns are c/vcuda_adversary.c's, as scripts/bench-limiter's
adversarial table runs them; this file holds the cases the limiter bounds today.

The storm: 20 000 launches of 1 µs teach the estimate "a launch costs 1 µs", then 1 ms
kernels fill the launch queue with a thousand times what they paid. Before the ledger a
20 % tenant averaged 36 % over the 10 s from its first launch with NVML's 1/6 s samples and
71 % with 1 s samples. The ledger charges what NVML measured running unpaid as debt the
bucket repays, and markers (events on the slow path) bound the queue and charge a window
that ran far longer than it paid as soon as the GPU reaches it, so over 10 s the tenant
gets its share. The same holds for kernel lengths switching 1000x every half second, and
for two processes of one container switching out of phase.

Tolerances (issue 12, point 1): share + 2 pp over the 10 s from the first launch; for the
storm, share + 5 pp in every 1 s window after the first second, with NVML's 1/6 s and 1 s
samples (worst windows in bench runs: +0.4 to +1.0 pp at 20 %); and not starved (share - 5
or - 6 pp: the switches cost a pattern some of it). Not asserted yet, and why
(scripts/bench-limiter's adversarial table shows them): the 1 s windows of switches and
bursts (a window of 48 launches priced for 1 µs kernels that run 1 ms is charged once the
GPU has run it, and the slow path waits for a late window only once two are queued: +5 to
+11 pp in some windows at 10-20 %, bench runs of 2026-11-27).

Elastic shares (issue 12, point 3): a tenant with share 20 % and limit 80 % storms or
switches alone (held to its limit + 2 pp on average, + 5 pp per second), then a 50 %
neighbour starts and is at its share within 3 pp from its first half second: the elastic
tenant gives back within 3 NVML periods (1/6 s), as scripts/bench-limiter states.
"""

import pathlib
import subprocess

import pytest

from gpusim_harness import C_COMMON, LIB, VCUDA_LIB, cuda_include_dir
from vcuda_common import C
from limit_common import ELASTIC, Machine, elastic_run

SHARE = 20
SLACK_PP = 2.0
WINDOW_PP = 5.0
SECONDS = 11


@pytest.fixture(scope="module")
def adversary(tmp_path_factory):
    out = tmp_path_factory.mktemp("adversary") / "vcuda_adversary"
    cmd = ["gcc", "-std=gnu11", "-O1", "-Wno-deprecated-declarations", f"-I{cuda_include_dir()}",
           str(C / "vcuda_adversary.c"), f"-I{C_COMMON}", "-o", str(out),
           f"-L{LIB}", "-lcuda", "-pthread"]
    subprocess.run(cmd, check=True)
    return out


@pytest.mark.parametrize("period_us", [166_667, 1_000_000], ids=["nvml-1/6s", "nvml-1s"])
def test_a_storm_of_tiny_kernels_buys_no_more_than_the_share_in_any_second(tmp_path, adversary, period_us):
    # gpusim's wave cost of 1 µs makes the adversary's 1-wave kernels 1 µs long.
    m = Machine(tmp_path / "m", 1, adversary, sample_period_us=period_us, wave_ns=1000)
    try:
        c = m.tenant(0, "storm", core=SHARE)
        c.env["LD_PRELOAD"] = str(VCUDA_LIB)
        m.sample(0.2)
        ld = m.spawn(c, 0, ["--mode", "storm", "--seconds", str(SECONDS)])
        ld.wait(timeout=SECONDS + 30)
    finally:
        m.stop()
    avg = ld.util(0.0, 10.0) * 100
    assert avg <= SHARE + SLACK_PP, (
        f"a {SHARE} % tenant's storm got {avg:.1f} % of the GPU over 10 s (NVML period {period_us} µs)")
    # And the ledger and markers do not starve it: it still gets most of its share.
    assert avg >= SHARE - 5, f"the storm got {avg:.1f} % of a {SHARE} % share"
    # No second after the first runs above share + 5 pp (issue 12, point 1): the markers
    # charge the switch to 1 ms kernels as soon as the GPU has run one group of them.
    worst = max(m.windows(ld, 1.0, SECONDS - 0.2)) * 100
    assert worst <= SHARE + WINDOW_PP, (
        f"a {SHARE} % tenant's storm got {worst:.1f} % of the GPU in its worst second (NVML period {period_us} µs)")


@pytest.mark.parametrize("pattern", [
    ("switch", [["--mode", "switch"]], 6),
    ("opposite", [["--mode", "switch"], ["--mode", "switch", "--invert"]], 6),
    # Switches to 1 ms kernels the moment its launches stop being held back (the price just
    # fell), to run whatever the old price's balance admits: libvcuda forfeits a balance
    # beyond the new price's capacity. Its short phases are priced as long kernels until a
    # marker window shows otherwise, so it wastes much of its share: no floor.
    ("pounce", [["--mode", "pounce"]], None),
], ids=lambda p: p[0])
def test_kernel_lengths_switching_1000x_buy_no_more_than_the_share_over_10s(tmp_path, adversary, pattern):
    name, procs, floor = pattern
    period_us = 166_667
    m = Machine(tmp_path / "m", 1, adversary, sample_period_us=period_us, wave_ns=1000)
    try:
        c = m.tenant(0, name, core=SHARE)
        c.env["LD_PRELOAD"] = str(VCUDA_LIB)
        m.sample(0.2)
        loads = [m.spawn(c, 0, [*args, "--seconds", str(SECONDS)]) for args in procs]
        for ld in loads:
            ld.wait(timeout=SECONDS + 30)
    finally:
        m.stop()
    t0 = loads[0].t0
    avg = sum(m.util(0, ld.pid, t0, t0 + 10.0) for ld in loads) * 100  # % over 10 s
    assert avg <= SHARE + SLACK_PP, (
        f"a {SHARE} % container switching kernel lengths ({name}) got {avg:.1f} % of the GPU over 10 s")
    if floor is not None:
        assert avg >= SHARE - floor, f"{name} got {avg:.1f} % of a {SHARE} % share"


@pytest.mark.parametrize("mode", ["storm", "switch"])
def test_an_elastic_tenant_gaming_the_estimate_stays_under_its_limit_and_gives_back(tmp_path, adversary, mode):
    share, limit, other = ELASTIC
    seconds = 12.0
    alone, worst, beside, neighbour, reach = elastic_run(tmp_path / "m", adversary, VCUDA_LIB, mode, 166_667,
                                                         seconds, 1000)
    assert alone <= limit + SLACK_PP, f"elastic {share}-{limit} % ({mode}) alone got {alone:.1f} % over 5 s"
    assert worst <= limit + WINDOW_PP, f"elastic {share}-{limit} % ({mode}) alone got {worst:.1f} % in a second"
    assert reach is not None and reach <= 0.5, (
        f"a {other} % neighbour of an elastic tenant ({mode}) was not at its share within 0.5 s "
        f"(first half second at {other} ± 3 %: {reach}); it averaged {neighbour:.1f} %")
    assert neighbour >= other - 3, f"the {other} % neighbour averaged {neighbour:.1f} % beside {mode}"
    # The elastic tenant keeps its own share beside the neighbour (it is not starved either).
    assert beside >= share - 5, f"the elastic tenant ({mode}) got {beside:.1f} % beside a {other} % neighbour"
