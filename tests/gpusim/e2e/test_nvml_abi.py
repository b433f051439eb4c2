"""The simulated libnvidia-ml.so.1 exports only functions nvml.h declares, each with exactly
the header's parameter list.

The Rust side is read from tests/gpusim/nvml/src (the `fn name(args)` lines inside its
`nvml_api!` blocks, the generated unsupported.rs included), the C side from nvml.h run through
the C preprocessor: both headers the library answers, NVML API 12 (nvidia-nvml-dev-cu12) and
API 13 (the CUDA 13 wheels), which must agree on every function both declare. Rust parameter
types map to C mechanically: `Out<T>`/`Buf<T>` are `T *`, `In<T>` is `const T *`, `CharBuf`
is `char *`, `CStrIn` is `const char *`, `c_uint` is `unsigned int`, and nvml.h typedef names
(structs the library never reads included, declared as opaque Rust types of the same name)
are spelled alike. Struct layouts are checked by the crate's own unit tests
(`cargo test -p gpusim-nvml`).
"""

import pathlib
import re
import subprocess

import pytest

from gpusim_harness import LIB, nvml_include_dir

ROOT = pathlib.Path(__file__).resolve().parents[3]
SRC = ROOT / "tests" / "gpusim" / "nvml" / "src"

RUST_FN = re.compile(r"\bfn\s+(nvml\w+)\s*\(([^)]*)\)", re.S)
C_DECL = re.compile(r"(?:nvmlReturn_t|const char ?\*)\s*(nvml\w+)\s*\(([^)]*)\)\s*;")
PRIMITIVES = {
    "c_uint": "unsigned int",
    "c_int": "int",
    "c_ulonglong": "unsigned long long",
    "c_ulong": "unsigned long",
    "c_char": "char",
}


def rust_type_to_c(t):
    t = t.strip().split("::")[-1]
    m = re.fullmatch(r"(Out|Buf)<(.+)>", t)
    if m:
        return rust_type_to_c(m.group(2)) + " *"
    m = re.fullmatch(r"In<(.+)>", t)
    if m:
        return "const " + rust_type_to_c(m.group(1)) + " *"
    if t == "CharBuf":
        return "char *"
    if t == "CStrIn":
        return "const char *"
    return PRIMITIVES.get(t, t)


def rust_param(p):
    name, ty = p.split(":", 1)
    name = name.strip().removeprefix("r#").lstrip("_")
    return (rust_type_to_c(ty), name)


def c_param(p):
    p = " ".join(p.replace("*", " * ").split())
    m = re.fullmatch(r"(.+?)\s*(\w+)", p)
    ty, name = m.group(1), m.group(2)
    return (re.sub(r"\s*\*", " *", ty).strip(), name)


def header_decls(h):
    # NVML_NO_UNVERSIONED_FUNC_DEFS declares both the plain and the versioned names
    pp = subprocess.run(
        ["gcc", "-E", "-P", "-DNVML_NO_UNVERSIONED_FUNC_DEFS", str(h)], capture_output=True, text=True, check=True
    ).stdout
    text = " ".join(pp.split())
    decls = {}
    for name, params in C_DECL.findall(text):
        params = params.strip()
        decls[name] = [] if params in ("", "void") else [c_param(p) for p in params.split(",")]
    assert len(decls) > 350
    return decls


@pytest.fixture(scope="module")
def headers():
    """{NVML API version: declarations} of the API 12 and API 13 nvml.h."""
    h13 = sorted(ROOT.glob(".venv/lib/python*/site-packages/nvidia/cu13/include/nvml.h"))
    assert h13, "nvidia/cu13/include/nvml.h not in .venv: run scripts/setup-test-deps"
    return {12: header_decls(nvml_include_dir() / "nvml.h"), 13: header_decls(h13[0])}


@pytest.fixture(scope="module")
def header(headers):
    """Both headers' declarations together; a function both declare has one parameter list."""
    decls = dict(headers[12])
    for name, params in headers[13].items():
        assert decls.setdefault(name, params) == params, f"{name}: API 12 {decls[name]} != API 13 {params}"
    return decls


@pytest.fixture(scope="module")
def rust():
    fns = {}
    for f in sorted(SRC.glob("*.rs")):
        for name, params in RUST_FN.findall(f.read_text()):
            params = [p for p in (x.strip() for x in params.split(",")) if p]
            assert name not in fns, f"{name} defined twice"
            fns[name] = [rust_param(p) for p in params]
    assert len(fns) > 100
    return fns


def test_nvml_exports_match_header_signatures(header, rust):
    problems = []
    for name, params in sorted(rust.items()):
        if name not in header:
            problems.append(f"{name}: not declared in nvml.h")
        elif params != header[name]:
            problems.append(f"{name}: rust {params} != nvml.h {header[name]}")
    assert not problems, "\n".join(problems)


def test_nvml_error_string_signature(header):
    # the one export that does not return nvmlReturn_t
    assert header["nvmlErrorString"] == [("nvmlReturn_t", "result")]
    text = (SRC / "system.rs").read_text()
    assert 'pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char' in text


def test_nvml_library_exports_only_what_was_checked(header, rust):
    lib = LIB / "libnvidia-ml.so.1"
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if " T " in line}
    nvml = {s for s in exported if s.startswith("nvml")}
    assert nvml == set(rust) | {"nvmlErrorString"}
    # every function of either header, and nothing else (issue 22)
    assert nvml == set(header), (sorted(set(header) - nvml)[:10], sorted(nvml - set(header))[:10])
    # versioned and unversioned names the tools and nvml.h's macros use are both present
    for base, versions in {
        "nvmlInit": ["_v2"],
        "nvmlDeviceGetCount": ["_v2"],
        "nvmlDeviceGetHandleByIndex": ["_v2"],
        "nvmlDeviceGetHandleByPciBusId": ["_v2"],
        "nvmlDeviceGetPciInfo": ["_v2", "_v3"],
        "nvmlDeviceGetComputeRunningProcesses": ["_v2", "_v3"],
        "nvmlDeviceGetGraphicsRunningProcesses": ["_v2", "_v3"],
        "nvmlDeviceGetMPSComputeRunningProcesses": ["_v2", "_v3"],
        "nvmlEventSetWait": ["_v2"],
        "nvmlDeviceGetMemoryInfo": ["_v2"],
        "nvmlSystemGetCudaDriverVersion": ["_v2"],
        "nvmlDeviceGetNvLinkRemotePciInfo": ["_v2"],
    }.items():
        for name in [base] + [base + v for v in versions]:
            assert name in nvml, name
    # nothing but NVML leaks out of the cdylib
    assert exported == nvml, exported - nvml


def test_nvml_process_struct_heuristic_of_nvitop(rust):
    # nvitop 1.5.3 reads `_v3` process lists with a 32-byte struct (protected memory added)
    # when nvmlDeviceGetConfComputeMemSizeInfo exists but nvmlDeviceGetRunningProcessDetailList
    # does not; nvml.h 12.9 (and real 575 drivers) use the 24-byte nvmlProcessInfo_t. Export
    # both or neither, so nvitop picks the 24-byte layout.
    assert ("nvmlDeviceGetConfComputeMemSizeInfo" in rust) == ("nvmlDeviceGetRunningProcessDetailList" in rust)


def test_nvml_struct_sizes_pinned_in_rust_match_gcc(cc, tmp_path):
    exe = cc(pathlib.Path(__file__).parent / "c" / "nvml_sizes.c", tmp_path / "nvml_sizes")
    out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    c_sizes = {name: int(size) for name, size in (line.split() for line in out.splitlines())}
    rust_sizes = {
        name: int(size)
        for name, size in re.findall(r"assert_eq!\(size_of::<(\w+)>\(\), (\d+)\);", (SRC / "types.rs").read_text())
    }
    assert rust_sizes == c_sizes
