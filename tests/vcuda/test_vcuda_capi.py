"""libvcuda's own C API (include/vcuda.h), called from a C program inside a container."""

from gpusim_harness import LIB, ROOT
from vcuda_common import C

MiB = 1 << 20


def test_the_c_api_reports_quota_and_usage(sim, cc, tmp_path):
    prog = cc(C / "vcuda_capi.c", tmp_path / "capi", f"-I{ROOT / 'include'}", "-L", LIB, "-lcuda", "-ldl")
    c = sim.container(2048)
    r = dict(line.split("=", 1) for line in c.run([prog]).stdout.split())
    assert r["preloaded"] == "1"
    assert r["version"] and r["count"] == "1" and r["rc"] == "0"
    assert int(r["limit"]) == 2048 * MiB
    # the process holds its allocation plus its context (gpusim: 300 MiB)
    assert int(r["process"]) == (100 + 300) * MiB
    assert int(r["used"]) == int(r["process"]), "the only process of the container"
    assert r["bad_index"] == "-2" and r["null_out"] == "-2"
    # without libvcuda the functions are simply absent
    plain = dict(line.split("=", 1) for line in sim.run([prog]).stdout.split())
    assert plain["preloaded"] == "0"
