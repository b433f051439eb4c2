"""What is mounted into tenant containers loads in old images: the glibc 2.17 baseline (issue
13). Reads the dynamic section of target/portable/libvcuda.so and vcuda-smi (scripts/build-portable)
with binutils, as the dynamic loader will: every symbol version they require from glibc must be
2.17 or older, and the shared objects they need must be ones every glibc image has.

Why these objects: libc, libm, libdl, libpthread and the loader are part of glibc itself, so
an image with glibc has them; libgcc_s is not (minimal images, distroless, some Alpine-glibc
bases lack it), so it is not allowed.
"""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PORTABLE = ROOT / "target" / "portable"
BASELINE = (2, 17)
ALLOWED = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "ld-linux-x86-64.so.2", "librt.so.1"}


def versions(path):
    """{(library, version string)} of the symbol versions `path` requires (readelf -V)."""
    out = subprocess.run(["readelf", "-V", "--wide", str(path)], check=True, capture_output=True, text=True).stdout
    need = out[out.index("Version needs section"):] if "Version needs section" in out else ""
    found, lib = set(), None
    for line in need.splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            lib = m.group(1)
            continue
        m = re.search(r"Name: (\S+)", line)
        if m and lib:
            found.add((lib, m.group(1)))
    return found


def needed(path):
    out = subprocess.run(["readelf", "-d", "--wide", str(path)], check=True, capture_output=True, text=True).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))


def glibc_version(name):
    m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.(\d+))?", name)
    return tuple(int(x) for x in m.groups() if x is not None) if m else None


@pytest.fixture(scope="module", params=["libvcuda.so", "vcuda-smi"])
def binary(request):
    path = PORTABLE / request.param
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/build-portable (scripts/test does)")
    return path


def test_no_symbol_version_is_newer_than_the_baseline(binary):
    newer = sorted(f"{v} ({lib})" for lib, v in versions(binary)
                   if glibc_version(v) and glibc_version(v) > BASELINE)
    assert not newer, (f"{binary.name} needs glibc newer than {BASELINE[0]}.{BASELINE[1]}: {', '.join(newer)}; "
                       "it would not load in older images (build it with scripts/build-portable)")
    # the check reads what it claims to: a glibc-linked binary always requires some version
    assert any(glibc_version(v) for _, v in versions(binary)), f"no GLIBC_ versions read from {binary}"


def test_it_needs_only_what_every_glibc_image_has(binary):
    extra = needed(binary) - ALLOWED
    assert not extra, f"{binary.name} needs {sorted(extra)}, which images may lack (allowed: {sorted(ALLOWED)})"


def test_the_host_build_would_fail_the_check():
    """The check can fail: the library cargo builds against this host's glibc needs newer
    versions (on Debian 12: GLIBC_2.34) and libgcc_s."""
    host = ROOT / "target" / "release" / "libvcuda.so"
    if not host.exists():
        pytest.fail(f"{host} is missing: run scripts/build-gpusim")
    libc = subprocess.run(["ldd", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    host_glibc = tuple(int(x) for x in re.findall(r"(\d+)\.(\d+)\s*$", libc)[0])
    if host_glibc <= BASELINE:
        pytest.skip(f"this host's glibc {host_glibc} is not newer than the baseline")
    newest = max(glibc_version(v) for _, v in versions(host) if glibc_version(v))
    assert newest > BASELINE or "libgcc_s.so.1" in needed(host), (newest, needed(host))
