"""Habits the compiler cannot keep on its own (issue 14, point 4): a crate that needs no
`unsafe` says so with `#![forbid(unsafe_code)]` in every crate root, so the first `unsafe`
block added to it is a decision made in review, not a slip.

And a crate whose modules are layered stays layered: Rust accepts modules that import one
another in a circle, so the check here does not, for the crates listed in `LAYERED`."""

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


# Crates whose modules form layers (ARCHITECTURE.md: scheduler's `state` below `admission`
# and `bind` below `server`; the library's `state` below its wrappers, `init` above them).
# Others may still have cycles; add a crate once it has none.
LAYERED = ["scheduler/src", "manager/src", "vcuda/lib/src", "manager/core/src", "webhook/src"]


def module_of(src, f):
    """The top-level module a file belongs to (`placement/tests.rs` → `placement`); `None`
    for the crate roots."""
    top = f.relative_to(src).parts[0].removesuffix(".rs")
    return None if top in ("lib", "main") else top


def crate_paths(path):
    """The modules a `crate::` path starting `path` names first: `crate::a::X` → `a`,
    `crate::{a, b::{Y, Z}}` → `a`, `b`."""
    rest = path.removeprefix("crate::")
    if not rest.startswith("{"):
        return re.findall(r"^\w+", rest)
    out, depth, cur = [], 0, ""
    for c in rest[1:]:
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth < 0 or (c == "," and depth == 0):
            out += re.findall(r"^\s*(\w+)", cur)
            cur = ""
            if depth < 0:
                break
        else:
            cur += c
    return out


def import_graph(src):
    """{module: {module it uses: where (file:line)}} over the crate's top-level modules,
    from every `crate::` path outside comments (`use` lines, groups over several lines,
    inline paths)."""
    files = sorted(src.rglob("*.rs"))
    modules = {m for m in (module_of(src, f) for f in files) if m}
    graph = {m: {} for m in modules}
    for f in files:
        me = module_of(src, f)
        if me is None:
            continue
        code = "\n".join(line.split("//", 1)[0] for line in f.read_text().splitlines())
        for m in re.finditer(r"\bcrate::", code):
            where = f"{f.relative_to(ROOT)}:{code.count(chr(10), 0, m.start()) + 1}"
            for target in crate_paths(code[m.start() :]):
                if target in modules and target != me:
                    graph[me].setdefault(target, where)
    return graph


def import_cycles(graph):
    """One cycle per group of modules that reach one another, e.g. `a -> b -> a [a.rs:3,
    b.rs:9]` (the lines that make each step), naming the whole group when it is larger."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        start = min(group)
        paths, seen = {start: [start]}, set()
        queue = [start]
        while queue:  # the shortest way from `start` back to itself, within the group
            v = queue.pop(0)
            nxt = [w for w in sorted(graph[v]) if w in group]
            if start in nxt:
                path = paths[v] + [start]
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    queue.append(w)
        lines = ", ".join(graph[a][b] for a, b in zip(path, path[1:]))
        also = f" (in a circle with it: {', '.join(sorted(group))})" if len(group) > len(path) - 1 else ""
        cycles.append(f"{' -> '.join(path)} [{lines}]{also}")
    return cycles


def test_layered_crates_have_no_import_cycle():
    found = {src: import_cycles(import_graph(ROOT / src)) for src in LAYERED}
    found = {src: c for src, c in found.items() if c}
    assert not found, f"modules that import one another in a circle (move what they share into a module below both): {found}"


def test_the_cycle_check_sees_imports_and_cycles():
    g = import_graph(ROOT / "scheduler/src")
    # `use crate::{a, b}`-style, multi-line and plain imports are all seen
    assert {"admission", "bind", "state"} <= set(g["server"]), g["server"]
    assert "state" in g["bind"] and "state" in g["admission"]
    assert crate_paths("crate::{\n    a::{X, Y},\n    b,\n};") == ["a", "b"]
    assert crate_paths("crate::a::f(x);") == ["a"]
    assert import_cycles({"a": {"b": "a.rs:1"}, "b": {"c": "b.rs:2"}, "c": {"a": "c.rs:3"}, "d": {}}) == [
        "a -> b -> c -> a [a.rs:1, b.rs:2, c.rs:3]"
    ]
