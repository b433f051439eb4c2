"""The manager's decisions are pure because the build says so (issue 14, point 2): the crate
that holds them, `manager/core` (vcuda-manager-core), depends on no crate that does I/O, and
its code (tests aside) names no filesystem, process, socket, environment or clock. The
daemon (`manager/`) does the reading and writing and hands these functions what it read.

Rust cannot forbid `std::fs` in a crate, so the second half is this scan; the first half is
the dependency graph as cargo resolves it, transitive dependencies included."""

import json
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "manager/core"

# Crates that do I/O (runtimes, RPC, HTTP, the API-server client, NVML, file watching).
IO_CRATES = {"tokio", "tonic", "hyper", "h2", "axum", "kube", "kube-client", "kube-runtime",
             "nvml-wrapper", "nvml-wrapper-sys", "notify", "reqwest", "mio", "tracing-subscriber"}

# What the core's own code may not name: std's I/O and the clock's present.
IO_NAMES = re.compile(
    r"\bstd::(fs|net|process|env|thread|io)\b|\bos::(unix|fd)\b|\b(File|OpenOptions|TcpStream|"
    r"UnixStream|UnixListener|Command)::|\b(Instant|SystemTime)::now\b|\bunsafe\b")


def io_names(text):
    """Lines of Rust source before its `#[cfg(test)]` module that name I/O (comments aside)."""
    found = []
    for n, line in enumerate(text.split("#[cfg(test)]", 1)[0].splitlines(), 1):
        code = line.split("//", 1)[0]
        if IO_NAMES.search(code):
            found.append((n, line.strip()))
    return found


def dependencies():
    """Every package the core's library build pulls in, transitively (normal edges only)."""
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    names = {p["id"]: p["name"] for p in meta["packages"]}
    root = next(p["id"] for p in meta["packages"] if p["name"] == "vcuda-manager-core")
    seen, todo = set(), [root]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        for d in nodes[i]["deps"]:
            if any(k["kind"] is None for k in d["dep_kinds"]):
                todo.append(d["pkg"])
    return {names[i] for i in seen}


def test_the_core_depends_on_no_crate_that_does_io():
    deps = dependencies()
    assert "vcuda-contract" in deps, "the scan must see the core's dependencies"
    assert not deps & IO_CRATES, (
        f"vcuda-manager-core pulls in {sorted(deps & IO_CRATES)}: move the code that needs "
        "them to the daemon crate (manager/src) and pass the core what it read")


def test_the_cores_code_names_no_io():
    found = {str(f.relative_to(ROOT)): hits for f in sorted((CORE / "src").rglob("*.rs"))
             if (hits := io_names(f.read_text()))}
    assert not found, (
        f"the pure core names I/O: {found}; do it in manager/src and pass the result in "
        "(a time as an argument, text that was read as a &str)")


def test_the_scan_sees_io_and_lets_tests_use_it():
    assert io_names("use std::fs;\nfn f() {}\n") == [(1, "use std::fs;")]
    assert io_names("let t = Instant::now();") != []
    assert io_names("let f = File::open(p)?;") != []
    assert io_names("// std::fs in a comment\nlet d = Duration::from_secs(1);") == []
    assert io_names("fn f() {}\n#[cfg(test)]\nmod tests { use std::fs; }") == []
