"""ARCHITECTURE.md is the code map (DEVELOPERS' guide: "a test keeps it complete"): every
crate of the workspace is named by its path, and every module of a crate that vcuda ships
(the workspace's crates outside tests/) is named in it. A new module without a line there
fails here, in the commit that adds it."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARCH = (ROOT / "ARCHITECTURE.md").read_text()


def members():
    return tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["members"]


def test_every_crate_of_the_workspace_is_on_the_map():
    missing = [m for m in members() if f"`{m}`" not in ARCH and f"{m} " not in ARCH]
    assert not missing, f"crates not in ARCHITECTURE.md (add a section or a line for each): {missing}"


def sections():
    """Each crate's section of the map: {path: text}, from its "## name (`path`)" heading to
    the next heading of that level."""
    out = {}
    parts = re.split(r"^(## .*)$", ARCH, flags=re.M)
    for head, body in zip(parts[1::2], parts[2::2]):
        m = re.search(r"\(`([^`]+)`\)", head)
        if m:
            out[m.group(1)] = body
    return out


def test_every_module_of_a_shipped_crate_is_on_the_map():
    # Named as code (`name`, `name.rs`, `name::`) in its own crate's section: a word that
    # happens to appear elsewhere ("admission" in the webhook's prose) does not count.
    missing = []
    secs = sections()
    for m in members():
        if m.startswith("tests/"):
            continue
        text = secs.get(m)
        assert text is not None, f"ARCHITECTURE.md has no '## name (`{m}`)' section"
        for f in sorted((ROOT / m / "src").rglob("*.rs")):
            name = f.stem
            if name in ("lib", "main", "mod", "tests"):
                continue
            if not re.search(rf"`(?:[\w/]*/)?{re.escape(name)}(?:\.rs|::[^`]*)?`", text):
                missing.append(str(f.relative_to(ROOT)))
    assert not missing, f"modules not in their crate's section of ARCHITECTURE.md (say what each owns): {missing}"


def test_the_map_names_no_crate_that_is_gone():
    # Every "## name (`path`)" heading points at a directory that exists.
    for path in re.findall(r"^## .*\(`([^`]+)`\)", ARCH, re.M):
        assert (ROOT / path).exists(), f"ARCHITECTURE.md maps {path}, which does not exist"
