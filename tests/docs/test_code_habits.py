"""Habits the compiler cannot keep on its own (issue 14, point 4): a crate that needs no
`unsafe` says so with `#![forbid(unsafe_code)]` in every crate root, so the first `unsafe`
block added to it is a decision made in review, not a slip."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBID = "#![forbid(unsafe_code)]"


def members():
    return tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["members"]


def uses_unsafe(src):
    """Whether any line of the crate's sources, comments aside, says `unsafe`."""
    for f in src.rglob("*.rs"):
        for line in f.read_text().splitlines():
            code = line.split("//", 1)[0]
            if re.search(r"\bunsafe\b", code) and FORBID not in code:
                return True
    return False


def roots(src):
    return [p for p in [src / "lib.rs", src / "main.rs", *sorted((src / "bin").glob("*.rs"))] if p.exists()]


def test_every_crate_without_unsafe_forbids_it():
    missing = []
    for m in members():
        src = ROOT / m / "src"
        if uses_unsafe(src):
            continue
        missing += [str(r.relative_to(ROOT)) for r in roots(src) if FORBID not in r.read_text()]
    assert not missing, f"crate roots of crates with no unsafe code that do not say {FORBID}: {missing}"


def test_the_check_sees_the_crates_that_need_unsafe():
    # The library and the simulated driver cannot be written without it; if the check
    # stopped seeing their `unsafe`, it would ask them to forbid it and the build would fail.
    assert uses_unsafe(ROOT / "vcuda/lib/src")
    assert uses_unsafe(ROOT / "tests/gpusim/cuda/src")
    assert not uses_unsafe(ROOT / "vcuda/limiter/src")
