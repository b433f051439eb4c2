"""The generated cuGetProcAddress table (tests/gpusim/cuda/src/procaddr_table.rs).

Needs no gpusim libraries: it checks that the committed table is what scripts/gen-procaddr-table
makes from the installed headers (the CUDA 12.9 set of nvidia-cuda-runtime-cu12 and the 13.x set
of nvidia-cuda-runtime, merged), that it names those headers by version and hash, that every
variant the 12.9 headers give alone is kept, and that it holds facts we know about the driver's
versioned entry points. The table is read with a regex, not compiled.
"""

import hashlib
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gen-procaddr-table"
TABLE = ROOT / "tests" / "gpusim" / "cuda" / "src" / "procaddr_table.rs"


def header_dir(rel):
    """A header set of the venv: rel is nvidia/cuda_runtime/include or nvidia/cu13/include."""
    found = sorted(ROOT.glob(f".venv/lib/python*/site-packages/{rel}/cudaTypedefs.h"))
    assert found, f"{rel}/cudaTypedefs.h not in .venv: run scripts/setup-test-deps"
    return found[0].parent


H12 = "nvidia/cuda_runtime/include"
H13 = "nvidia/cu13/include"

VARIANT = re.compile(
    r'Variant\s*\{\s*base:\s*"(\w+)",\s*version:\s*(\d+),\s*symbol:\s*"(\w+)",'
    r"\s*per_thread:\s*(true|false),?\s*\}"
)


def parse_variants(text):
    found = [(b, int(v), s, p == "true") for b, v, s, p in VARIANT.findall(text)]
    # every `Variant {` in the file was understood by the regex
    assert len(found) == text.count("Variant {") - text.count("pub struct Variant {")
    return found


@pytest.fixture(scope="module")
def variants():
    found = parse_variants(TABLE.read_text())
    assert len(found) > 600
    return found


@pytest.fixture(scope="module")
def table(variants):
    """(base, version, per_thread) -> symbol"""
    return {(b, v, p): s for b, v, s, p in variants}


def lookup(table, base, cuda_version, per_thread):
    """What cuGetProcAddress returns: the newest variant introduced at or before cuda_version;
    with the per-thread flag the per-thread variant if there is one, else the legacy one."""
    for want_pt in ([True, False] if per_thread else [False]):
        vs = [v for (b, v, p) in table if b == base and p == want_pt and v <= cuda_version]
        if vs:
            return table[(base, max(vs), want_pt)]
    return None


def test_table_is_up_to_date():
    p = subprocess.run([str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}{p.stderr}"


def test_check_reports_a_stale_table(tmp_path):
    stale = tmp_path / "procaddr_table.rs"
    stale.write_text(TABLE.read_text().replace('"cuMemAlloc_v2"', '"cuMemAlloc_v9"'))
    p = subprocess.run([str(SCRIPT), "--check", "--output", str(stale)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1
    assert "procaddr_table.rs is stale: run scripts/gen-procaddr-table" in p.stderr


def test_help():
    p = subprocess.run([str(SCRIPT), "--help"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and "--check" in p.stdout and "--include" in p.stdout


def cuda_version_of(include):
    m = re.search(r"^#define CUDA_VERSION (\d+)", (include / "cuda.h").read_text(errors="replace"), re.M)
    return int(m.group(1))


def test_names_the_headers_it_was_generated_from():
    """The table states each header set's CUDA_VERSION and the sha256 of its cudaTypedefs.h and
    cuda.h: those of the installed wheels (so a header change is a stale table even if no
    variant changes)."""
    text = TABLE.read_text()
    m = re.search(r"pub const HEADER_CUDA_VERSIONS: &\[u32\] = &\[([\d, ]+)\];", text)
    assert m and [int(v) for v in m.group(1).split(",")] == [12090, 13050]
    for rel in (H12, H13):
        inc = header_dir(rel)
        assert f"//! - CUDA {cuda_version_of(inc)}: {rel}\n" in text
        for h in ("cudaTypedefs.h", "cuda.h"):
            digest = hashlib.sha256((inc / h).read_bytes()).hexdigest()
            assert f"//!   {h} sha256 {digest}\n" in text, (rel, h)


def test_check_reports_a_table_of_other_headers(tmp_path):
    inc = header_dir(H13)
    digest = hashlib.sha256((inc / "cuda.h").read_bytes()).hexdigest()
    other = tmp_path / "procaddr_table.rs"
    other.write_text(TABLE.read_text().replace(digest, "0" * 64))
    p = subprocess.run([str(SCRIPT), "--check", "--output", str(other)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1 and "stale" in p.stderr


def generate(tmp_path, *includes):
    """Run the generator on the given header directories; (exit code, variants or None, stderr)."""
    out = tmp_path / "out.rs"
    args = [str(SCRIPT), "--output", str(out)]
    for inc in includes:
        args += ["--include", str(inc)]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    return p.returncode, (parse_variants(out.read_text()) if p.returncode == 0 else None), p.stderr


def test_every_12_9_variant_is_kept(tmp_path, variants):
    """What a 12.x caller gets: every variant the 12.9 headers give on their own is in the table
    with the same symbol, and nothing the 13.x headers add is at a version a 12.x caller can
    ask for except what the 13.x headers list at 12090 (cuGreenCtxGetId, which the 12.9
    headers lack)."""
    rc, only12, err = generate(tmp_path, header_dir(H12))
    assert rc == 0, err
    assert len(only12) == 617
    assert set(only12) <= set(variants)
    added_for_12x = sorted((b, v, s) for b, v, s, p in set(variants) - set(only12) if v <= 12090)
    assert added_for_12x == [("cuGreenCtxGetId", 12090, "cuGreenCtxGetId")]


def test_union_keeps_what_a_newer_header_drops(tmp_path, variants):
    """If a 13.x header dropped a 12.x entry point (here: the cuTexRefSetAddress2D typedefs
    removed from a copy), the merged table still has it: a 12.x caller loses nothing."""
    h13 = tmp_path / "h13"
    shutil.copytree(header_dir(H13), h13)
    t = h13 / "cudaTypedefs.h"
    lines = t.read_text().splitlines(True)
    kept = [line for line in lines if "PFN_cuTexRefSetAddress2D_v" not in line]
    assert len(lines) - len(kept) == 3
    t.write_text("".join(kept))
    rc, alone, err = generate(tmp_path, h13)
    assert rc == 0, err
    assert not [v for v in alone if v[0] == "cuTexRefSetAddress2D"]
    rc, merged, err = generate(tmp_path, header_dir(H12), h13)
    assert rc == 0, err
    assert merged == variants


def test_headers_that_disagree_are_an_error(tmp_path):
    """A key two header sets both list must name one symbol: with the oldest cuMemAlloc typedef
    removed from a 13.x copy, cuMemAlloc 3020 would be `cuMemAlloc` there and `cuMemAlloc_v2`
    in 12.9."""
    h13 = tmp_path / "h13"
    shutil.copytree(header_dir(H13), h13)
    t = h13 / "cudaTypedefs.h"
    t.write_text("".join(line for line in t.read_text().splitlines(True) if "PFN_cuMemAlloc_v2000" not in line))
    rc, _, err = generate(tmp_path, header_dir(H12), h13)
    assert rc == 2
    assert "the headers disagree on cuMemAlloc 3020" in err, err


def test_keys_unique_and_sorted(variants):
    keys = [(b, v, p) for b, v, s, p in variants]
    assert len(keys) == len(set(keys)), "a (base, version, per_thread) appears twice"
    order = [(b.encode(), p, v) for b, v, s, p in variants]
    assert order == sorted(order), "VARIANTS is not sorted by (base, per_thread, version)"
    # within one base, every ABI is a different exported symbol
    per_base = {}
    for b, v, s, p in variants:
        assert s not in per_base.setdefault(b, set()), f"{b}: {s} listed twice"
        per_base[b].add(s)


def test_per_thread_flags_match_suffixes(variants):
    for b, v, s, p in variants:
        assert p == s.endswith(("_ptds", "_ptsz")), (b, v, s, p)


@pytest.mark.parametrize(
    "base, version, per_thread, symbol",
    [
        ("cuMemAlloc", 2000, False, "cuMemAlloc"),
        ("cuMemAlloc", 3020, False, "cuMemAlloc_v2"),
        ("cuMemFree", 2000, False, "cuMemFree"),
        ("cuMemFree", 3020, False, "cuMemFree_v2"),
        ("cuLaunchKernel", 4000, False, "cuLaunchKernel"),
        ("cuLaunchKernel", 7000, True, "cuLaunchKernel_ptsz"),
        ("cuLaunchKernelEx", 11060, False, "cuLaunchKernelEx"),
        ("cuLaunchKernelEx", 11060, True, "cuLaunchKernelEx_ptsz"),
        ("cuMemcpyHtoD", 2000, False, "cuMemcpyHtoD"),
        ("cuMemcpyHtoD", 3020, False, "cuMemcpyHtoD_v2"),
        ("cuMemcpyHtoD", 7000, True, "cuMemcpyHtoD_v2_ptds"),
        ("cuCtxCreate", 2000, False, "cuCtxCreate"),
        ("cuCtxCreate", 3020, False, "cuCtxCreate_v2"),
        ("cuCtxCreate", 11040, False, "cuCtxCreate_v3"),
        ("cuCtxCreate", 12050, False, "cuCtxCreate_v4"),
        ("cuMemAllocAsync", 11020, False, "cuMemAllocAsync"),
        ("cuMemAllocAsync", 11020, True, "cuMemAllocAsync_ptsz"),
        ("cuGraphLaunch", 10000, False, "cuGraphLaunch"),
        ("cuGraphLaunch", 10000, True, "cuGraphLaunch_ptsz"),
        ("cuGetProcAddress", 11030, False, "cuGetProcAddress"),
        ("cuGetProcAddress", 12000, False, "cuGetProcAddress_v2"),
        ("cuStreamBeginCapture", 10000, False, "cuStreamBeginCapture"),
        ("cuStreamBeginCapture", 10010, False, "cuStreamBeginCapture_v2"),
        ("cuStreamBeginCapture", 10010, True, "cuStreamBeginCapture_v2_ptsz"),
        ("cuStreamGetCaptureInfo", 10010, False, "cuStreamGetCaptureInfo"),
        ("cuStreamGetCaptureInfo", 11030, False, "cuStreamGetCaptureInfo_v2"),
        ("cuStreamGetCaptureInfo", 12030, False, "cuStreamGetCaptureInfo_v3"),
        ("cuTexRefSetAddress2D", 2020, False, "cuTexRefSetAddress2D"),
        ("cuTexRefSetAddress2D", 3020, False, "cuTexRefSetAddress2D_v2"),
        ("cuTexRefSetAddress2D", 4010, False, "cuTexRefSetAddress2D_v3"),
        ("cuEventElapsedTime", 2000, False, "cuEventElapsedTime"),
        ("cuEventElapsedTime", 12080, False, "cuEventElapsedTime_v2"),
        ("cuGraphInstantiate", 10000, False, "cuGraphInstantiate"),
        ("cuGraphInstantiate", 11000, False, "cuGraphInstantiate_v2"),
        ("cuGraphInstantiate", 12000, False, "cuGraphInstantiateWithFlags"),
        ("cuMemCreate", 10020, False, "cuMemCreate"),
        ("cuDeviceTotalMem", 3020, False, "cuDeviceTotalMem_v2"),
    ],
)
def test_known_variant(table, base, version, per_thread, symbol):
    assert table.get((base, version, per_thread)) == symbol


@pytest.mark.parametrize(
    "base, version, per_thread, symbol",
    [
        ("cuCtxGetDevice", 13000, False, "cuCtxGetDevice_v2"),
        ("cuCtxSynchronize", 13000, False, "cuCtxSynchronize_v2"),
        ("cuMemGetDefaultMemPool", 13000, False, "cuMemGetDefaultMemPool"),
        ("cuMemGetMemPool", 13000, False, "cuMemGetMemPool"),
        ("cuMemSetMemPool", 13000, False, "cuMemSetMemPool"),
        ("cuMemcpyBatchAsync", 12080, False, "cuMemcpyBatchAsync"),
        ("cuMemcpyBatchAsync", 13000, False, "cuMemcpyBatchAsync_v2"),
        ("cuMemcpyBatchAsync", 13000, True, "cuMemcpyBatchAsync_v2_ptsz"),
        ("cuLaunchHostFunc", 13010, False, "cuLaunchHostFunc_v2"),
        ("cuLaunchHostFunc", 13010, True, "cuLaunchHostFunc_v2_ptsz"),
        ("cuGraphAddNode", 13040, False, "cuGraphAddNode_v3"),
        ("cuKernelGetParamCount", 13020, False, "cuKernelGetParamCount"),
        ("cuTensorMapSetAllocationClass", 13050, False, "cuTensorMapSetAllocationClass"),
    ],
)
def test_known_cuda13_variant(table, base, version, per_thread, symbol):
    assert table.get((base, version, per_thread)) == symbol


def test_known_variant_sets(table):
    def of(base):
        return sorted((v, p, s) for (b, v, p), s in table.items() if b == base)

    assert of("cuMemAlloc") == [(2000, False, "cuMemAlloc"), (3020, False, "cuMemAlloc_v2")]
    assert of("cuLaunchKernel") == [(4000, False, "cuLaunchKernel"), (7000, True, "cuLaunchKernel_ptsz")]
    assert of("cuGetProcAddress") == [(11030, False, "cuGetProcAddress"), (12000, False, "cuGetProcAddress_v2")]


@pytest.mark.parametrize(
    "base, cuda_version, per_thread, symbol",
    [
        ("cuMemAlloc", 3010, False, "cuMemAlloc"),
        ("cuMemAlloc", 12090, False, "cuMemAlloc_v2"),
        ("cuMemAlloc", 12090, True, "cuMemAlloc_v2"),  # no per-thread variant: the legacy one
        ("cuMemAlloc", 1000, False, None),
        ("cuLaunchKernel", 12090, True, "cuLaunchKernel_ptsz"),
        ("cuLaunchKernel", 6050, True, "cuLaunchKernel"),  # per-thread variants start at 7000
        ("cuMemcpyHtoD", 12000, True, "cuMemcpyHtoD_v2_ptds"),
        ("cuCtxCreate", 12040, False, "cuCtxCreate_v3"),
        ("cuGraphInstantiate", 11080, False, "cuGraphInstantiate_v2"),
        ("cuGraphInstantiate", 12090, False, "cuGraphInstantiateWithFlags"),
        ("cuNoSuchFunction", 12090, False, None),
        # 13.x ABIs only from the version that introduced them
        ("cuCtxGetDevice", 12090, False, "cuCtxGetDevice"),
        ("cuCtxGetDevice", 13050, False, "cuCtxGetDevice_v2"),
        ("cuCtxSynchronize", 13000, True, "cuCtxSynchronize_v2"),  # no per-thread variant
        ("cuMemGetMemPool", 12090, False, None),
        ("cuLaunchHostFunc", 13000, True, "cuLaunchHostFunc_ptsz"),
        ("cuLaunchHostFunc", 13050, True, "cuLaunchHostFunc_v2_ptsz"),
        ("cuMemcpyBatchAsync", 12090, True, "cuMemcpyBatchAsync_ptsz"),
    ],
)
def test_lookup_semantics(table, base, cuda_version, per_thread, symbol):
    assert lookup(table, base, cuda_version, per_thread) == symbol


# cuda-bindings 12.9.4 asks for the cuLogs* functions with cudaVersion 12080, while cudaTypedefs.h
# of 12.9 types them PFN_cuLogs*_v12090. Which number the real driver registers is not known.
BINDINGS_DISAGREE = {
    "cuLogsRegisterCallback", "cuLogsUnregisterCallback", "cuLogsCurrent", "cuLogsDumpToFile",
    "cuLogsDumpToMemory",
}


def cydriver_source():
    import importlib.util

    try:
        spec = importlib.util.find_spec("cuda.bindings")
    except ImportError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            f = pathlib.Path(loc) / "_bindings" / "cydriver.pyx"
            if f.exists():
                return f
    for f in sorted(ROOT.glob(".venv/lib/python*/site-packages/cuda/bindings/_bindings/cydriver.pyx")):
        return f
    return None


def test_agrees_with_cuda_bindings(table):
    """cuda-bindings (NVIDIA's generated Python binding) fetches every driver function with
    cuGetProcAddress_v2(base, &__<symbol>, <version>, <flags>): an independent statement of which
    ABI each (base, version) is. Its per-thread calls (made for exactly the functions that have
    per-thread variants) store into the legacy-named variable."""
    src = cydriver_source()
    if src is None:
        pytest.skip("cuda-bindings is not installed (scripts/setup-test-deps installs it)")
    calls = re.findall(
        r"cuGetProcAddress_v2\('(\w+)', &__(\w+), (\d+), (CU_GET_PROC_ADDRESS_\w+), NULL\)",
        src.read_text(),
    )
    assert len(calls) > 400
    bases = {b for (b, _, _) in table}
    checked, disagree, asked_per_thread = 0, set(), set()
    for base, var, version, flags in calls:
        if base not in bases:
            continue  # GL/EGL/VDPAU interop and cuProfiler*: not in cudaTypedefs.h
        per_thread = flags == "CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM"
        got = lookup(table, base, int(version), per_thread)
        want = {var + "_ptds", var + "_ptsz"} if per_thread else {var}
        if per_thread:
            asked_per_thread.add(base)
        if got not in want:
            disagree.add(base)
        checked += 1
    assert checked > 400
    assert disagree == BINDINGS_DISAGREE
    # cuda-bindings 12.9 knows the per-thread variants up to 12.9
    assert asked_per_thread == {b for (b, v, p) in table if p and v <= 12090}
