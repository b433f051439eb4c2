"""CDI (Container Device Interface, issue 15 §4): with `--cdi on` (or `auto` and the spec
directory present) the manager writes one spec per allocation, `vcuda.io-allocation_<id>.json`
in `--cdi-spec-dir`, making the same edits as its Allocate answer, and returns its device
name `vcuda.io/allocation=<id>` in `cdi_devices` besides the mounts/devices/env answer.

- every spec file the manager writes in a whole run is valid against the CDI JSON schema
  (`../shared/upstream/cdi/schema.json`, and a strict copy refusing unknown fields, as the
  CDI library's loader does), and a reader never sees a partial one;
- a container started the way a CDI-aware runtime starts it (the names kubelet-sim passed
  on, resolved in the spec directory, their edits applied — not the answer's mounts and
  env) runs under libvcuda, held to its quota;
- a spec goes with its allocation (reallocated devices; the control loop's collection),
  stale ones of ours go at start-up, and nobody else's ever; `--cdi off` writes nothing;
- a file or symlink planted at a spec's path is replaced, never followed."""

import copy
import json
import pathlib
import re
import threading
import time

import jsonschema
import pytest
import referencing
import referencing.jsonschema

from node_common import CORE, Node, bins, fill, wait_for  # noqa: F401 (bins: a fixture)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CDI = ROOT.parent / "shared" / "upstream" / "cdi"
KIND = "vcuda.io/allocation"
PRELOAD_LIBRARY = "/usr/local/vcuda/lib64/libvcuda.so"


# ---- the schema ---------------------------------------------------------------------------


def strict(schema):
    """The schema with `additionalProperties: false` on every object that lists its
    properties: the CDI library refuses unknown fields, the published schema does not."""
    schema = copy.deepcopy(schema)

    def walk(x):
        if isinstance(x, dict):
            if "properties" in x and x.get("type") == "object" or x is schema:
                x.setdefault("additionalProperties", False)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(schema)
    return schema


def validators():
    """Validators for the CDI schema as published and strict, `defs.json` resolved beside it."""
    schema = json.loads((CDI / "schema.json").read_text())
    defs = json.loads((CDI / "defs.json").read_text())
    base = (CDI / "schema.json").as_uri()
    out = []
    for s, d in ((schema, defs), (strict(schema), strict(defs))):
        s = dict(s, **{"$id": base})
        d = dict(d, **{"$id": (CDI / "defs.json").as_uri()})
        registry = referencing.Registry().with_resource(
            d["$id"], referencing.Resource.from_contents(d, default_specification=referencing.jsonschema.DRAFT7))
        cls = jsonschema.validators.validator_for(s)
        cls.check_schema(s)
        out.append(cls(s, registry=registry))
    return out


NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")


def check_spec(text, where=""):
    """A spec file's contents: valid JSON, valid against the schema (as published and
    strict), and the SPEC.md rules the schema does not carry: semver version at least 0.5.0
    (device nodes' hostPath), our kind, device names."""
    spec = json.loads(text)
    for v in validators():
        errors = sorted(v.iter_errors(spec), key=str)
        assert not errors, f"{where}: {[e.message for e in errors]}\n{text}"
    ver = tuple(int(x) for x in re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", spec["cdiVersion"]).groups())
    assert ver >= (0, 5, 0), spec["cdiVersion"]
    assert spec["kind"] == KIND
    assert spec["devices"], "a spec needs at least one device"
    for d in spec["devices"]:
        assert NAME.fullmatch(d["name"]), d["name"]
    return spec


def test_the_schema_check_refuses_what_the_cdi_library_refuses():
    good = json.dumps({"cdiVersion": "0.5.0", "kind": KIND, "devices": [{"name": "a1", "containerEdits": {
        "env": ["A=1"], "mounts": [{"hostPath": "/h", "containerPath": "/c", "options": ["ro", "bind"]}],
        "deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/x", "permissions": "rw"}]}}]})
    check_spec(good)
    for bad in (
        {"kind": KIND, "devices": []},  # no version
        {"cdiVersion": "0.5.0", "kind": KIND, "devices": [{"name": "a1"}]},  # no edits
        {"cdiVersion": "0.5.0", "kind": KIND, "devices": [{"name": "a1", "containerEdits": {"mounts": [{"hostPath": "/h"}]}}]},
        {"cdiVersion": "0.5.0", "kind": KIND, "devices": [{"name": "a1", "containerEdits": {"envs": ["A=1"]}}]},  # unknown field
        {"cdiVersion": "0.5.0", "kind": KIND, "devices": [{"name": "a1", "containerEdits": {}, "extra": 1}]},
    ):
        with pytest.raises(AssertionError):
            check_spec(json.dumps(bad))


# ---- watching the spec directory ------------------------------------------------------------


class SpecWatch:
    """Reads every file of the spec directory every few ms for the whole test, as a runtime
    scanning it would: keeps each distinct content per name, and every read that was not a
    whole spec (a partial file would be one)."""

    def __init__(self, d):
        self.dir = d
        self.seen = {}  # name -> set of contents
        self.torn = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            self.scan()
            time.sleep(0.003)

    def scan(self):
        if not self.dir.is_dir():
            return
        for f in self.dir.iterdir():
            if not f.name.endswith(".json") or not f.name.startswith("vcuda.io-"):
                continue
            try:
                text = f.read_text()
            except FileNotFoundError:
                continue  # removed between listing and reading
            try:
                json.loads(text)
            except json.JSONDecodeError:
                self.torn.append((f.name, text))
            self.seen.setdefault(f.name, set()).add(text)

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        self.scan()


def spec_files(node):
    return sorted(p.name for p in node.cdi_dir.glob("vcuda.io-*.json")) if node.cdi_dir.is_dir() else []


def allocation_of(admitted):
    return admitted["containers"][0]["allocate_response"]["annotations"]["vcuda.io/allocation"]


@pytest.fixture
def cdi_node(sim, tmp_path):
    n = Node(sim, tmp_path / "node", recover_after=2)
    n.start_kubelet().start_manager("--cdi", "on").wait_registered()
    yield n
    n.close()


# ---- the runtime's part -------------------------------------------------------------------------


def resolve(spec_dir, names):
    """What a CDI-aware runtime does with the container's CDI device names: load every spec
    in the directory (the CDI registry reads *.json and *.yaml), find each name as
    `kind=device`, and merge the spec-wide and device edits (CDI's ContainerEdits.Apply: env
    appended, a mount or device node replaces one at the same container path). Returns
    (env {name: value}, mounts {container path: mount}, device nodes {path: node})."""
    devices = {}
    for f in sorted(spec_dir.glob("*.json")):
        spec = json.loads(f.read_text())
        for d in spec["devices"]:
            devices[f"{spec['kind']}={d['name']}"] = (spec, d)
    env, mounts, nodes = {}, {}, {}
    for name in names:
        assert name in devices, f"unresolvable CDI device {name!r}: the runtime fails the container"
        spec, d = devices[name]
        for edits in (spec.get("containerEdits") or {}, d["containerEdits"]):
            for e in edits.get("env", []):
                k, v = e.split("=", 1)
                env[k] = v
            for m in edits.get("mounts", []):
                mounts[m["containerPath"]] = m
            for n in edits.get("deviceNodes", []):
                nodes[n["path"]] = n
    return env, mounts, nodes


def cdi_container(node, admitted, pod, namespace="default"):
    """The container as a CDI-aware runtime makes it: from the CDI names kubelet-sim passed
    on and the spec files alone (the answer's mounts and env are not used)."""
    (c,) = admitted["containers"]
    names = c["allocate_response"]["cdi_devices"]
    assert names, f"no CDI device names reached the runtime: {c['allocate_response']}"
    env, mounts, nodes = resolve(node.cdi_dir, names)
    for m in mounts.values():
        assert "bind" in m["options"], m
    binds = {p: m["hostPath"] for p, m in mounts.items()}
    # The preload file, as the dynamic loader in the container would read it.
    (preload,) = pathlib.Path(binds["/etc/ld.so.preload"]).read_text().split()
    return node.container_with(env, binds, pod, namespace, preload=preload), mounts, nodes



# ---- the tests ------------------------------------------------------------------------------------


def test_a_container_made_from_the_cdi_spec_is_held_to_its_quota(cdi_node, bins):
    node = cdi_node
    r = node.admit("a", core=30, memory=16)
    assert r["admitted"] and r["containers"][0]["start"]["started"], r
    resp = r["containers"][0]["allocate_response"]
    alloc = allocation_of(r)
    assert resp["cdi_devices"] == [f"{KIND}={alloc}"], resp
    assert resp["mounts"] and resp["envs"] and resp["devices"], "the answer stays for runtimes without CDI"
    c, mounts, nodes = cdi_container(node, r, "a")
    # The spec makes exactly the answer's edits.
    assert {p: (m["hostPath"], "ro" in m["options"]) for p, m in mounts.items()} == {
        m["container_path"]: (m["host_path"], m["read_only"]) for m in resp["mounts"]}
    assert {p: (n["hostPath"], n["permissions"]) for p, n in nodes.items()} == {
        d["container_path"]: (d["host_path"], d["permissions"]) for d in resp["devices"]}
    assert {k: v for k, v in c.env.items() if k in resp["envs"] and k != "VCUDA_CONFIG"} == {
        k: v for k, v in resp["envs"].items() if k != "VCUDA_CONFIG"}
    assert c.mounts["/usr/local/vcuda/lib64/libvcuda.so"] and c.env["LD_PRELOAD"] == c.mounts[PRELOAD_LIBRARY]
    # The threat model's tenant (root in its container) gets through CDI nothing it could
    # raise its limits with: the library, the preload file, its config and the socket
    # directory are read-only; the one writable mount is this allocation's own region; no
    # host path of the spec directory, the manager's whole state or another allocation's
    # files reaches the container.
    writable = {p: m["hostPath"] for p, m in mounts.items() if "ro" not in m["options"]}
    (region_host,) = writable.values()
    assert alloc in region_host, writable
    for p in ("/usr/local/vcuda/lib64/libvcuda.so", "/etc/ld.so.preload", "/etc/vcuda"):
        assert "ro" in mounts[p]["options"], mounts[p]
    for m in mounts.values():
        host = pathlib.Path(m["hostPath"])
        # neither the spec directory (nor anything in it or above it), nor the manager's
        # whole state directory (only single read-only files from it, the preload file)
        assert node.cdi_dir not in (host, *host.parents) and host not in node.cdi_dir.parents, m
        assert host != node.state and host not in node.state.parents, m
    # A CUDA process under libvcuda: its quota (less its context) and no more.
    gpu = c.config["gpu"][0]
    assert (gpu["memory_mib"], gpu["core"]) == (4096, 30)
    # It registers with the manager over the socket the spec mounts (while it lives:
    # registration runs on a thread of its own, and a process gone first is refused).
    got, out = fill(c, bins, 8192, while_held=lambda: wait_for(
        "the process's registration", lambda: "process registered" in node.log()))
    assert 3072 <= got <= 4096 - 300, out
    assert "refused" in out, out


def test_every_cdi_spec_the_manager_writes_is_valid_and_goes_with_its_allocation(cdi_node):
    node = cdi_node
    watch = SpecWatch(node.cdi_dir)
    try:
        a = node.admit("a", core=30, memory=16)
        b = node.admit("b", core=70, memory=32)
        refused = node.admit("too-many-cores", core=150, memory=4)
        assert not refused["admitted"], refused
        ids = {allocation_of(a), allocation_of(b)}
        assert spec_files(node) == sorted(f"vcuda.io-allocation_{i}.json" for i in ids)
        # Deleted, its devices allocated again: the old allocation and its spec go at once.
        node.ksim_cmd("delete", "--pod", "a")
        c = node.admit("c", core=30, memory=8)
        assert c["containers"][0]["start"]["started"], c
        assert c["containers"][0]["devices"][CORE] == a["containers"][0]["devices"][CORE]
        assert not (node.cdi_dir / f"vcuda.io-allocation_{allocation_of(a)}.json").exists()
        assert (node.cdi_dir / f"vcuda.io-allocation_{allocation_of(c)}.json").exists()
        # A restart: our stale spec and temporary go, another vendor's file stays, a known
        # allocation's lost spec is written again. Pod b's allocation is made old enough
        # for the control loop to collect (2 minutes of grace) once b is deleted.
        node.stop_manager()
        stale = node.cdi_dir / "vcuda.io-allocation_a00000000000000000000000000000000.json"
        # planted whole (write, then rename): the watch must not see the test's own write
        # half done (it once did: an empty file between open and write)
        planting = node.cdi_dir / "planting.tmp"
        planting.write_text("{}")
        planting.replace(stale)
        tmp = node.cdi_dir / ".vcuda.io-allocation_x.json.0f.tmp"
        tmp.write_text("{")
        foreign = node.cdi_dir / "example.com-gpu.json"
        foreign.write_text('{"cdiVersion": "0.5.0", "kind": "example.com/gpu", "devices": []}')
        (node.cdi_dir / f"vcuda.io-allocation_{allocation_of(c)}.json").unlink()
        journal = node.state / "allocations.jsonl"
        lines = [json.loads(x) for x in journal.read_text().splitlines()]
        for x in lines:  # {"v": 1, "put": {allocation}} or {"v": 1, "remove": id}
            if (x.get("put") or {}).get("id") == allocation_of(b):
                x["put"]["created"] = 1
        journal.write_text("".join(json.dumps(x) + "\n" for x in lines))
        node.start_manager("--cdi", "on").wait_registered()
        assert not stale.exists() and not tmp.exists()
        assert foreign.read_text().startswith('{"cdiVersion"'), "another vendor's spec is never touched"
        assert spec_files(node) == sorted(f"vcuda.io-allocation_{allocation_of(x)}.json" for x in (b, c))
        node.ksim_cmd("delete", "--pod", "b")
        wait_for("the collection of b's allocation and its spec", lambda: not (
            node.cdi_dir / f"vcuda.io-allocation_{allocation_of(b)}.json").exists(), timeout=30)
        assert "its container is gone: removing the allocation" in node.log()
        assert spec_files(node) == [f"vcuda.io-allocation_{allocation_of(c)}.json"]
    finally:
        watch.close()
    assert not watch.torn, f"a reader saw a partial spec: {watch.torn[:3]}"
    written = {n: t for n, t in watch.seen.items() if n != stale.name}
    assert len(written) >= 3, written.keys()
    for name, texts in written.items():
        for t in texts:
            spec = check_spec(t, name)
            assert name == f"vcuda.io-allocation_{spec['devices'][0]['name']}.json"
    mode = (node.cdi_dir / spec_files(node)[0]).stat().st_mode & 0o7777
    assert mode == 0o644, oct(mode)


def test_cdi_off_writes_nothing_and_returns_no_names(sim, tmp_path):
    n = Node(sim, tmp_path / "node")
    n.cdi_dir.mkdir(parents=True)  # present: `auto` would write here
    try:
        n.start_kubelet().start_manager("--cdi", "off").wait_registered()
        r = n.admit("a", core=30, memory=16)
        assert r["containers"][0]["start"]["started"], r
        resp = r["containers"][0]["allocate_response"]
        assert resp["cdi_devices"] == [] and resp["mounts"], resp
        assert list(n.cdi_dir.iterdir()) == []
    finally:
        n.close()


def test_cdi_auto_follows_whether_the_spec_directory_exists(sim, tmp_path):
    # Absent: nothing written, no names, the directory not made.
    n = Node(sim, tmp_path / "absent")
    try:
        n.start_kubelet().start_manager().wait_registered()
        r = n.admit("a", core=30, memory=16)
        assert r["containers"][0]["allocate_response"]["cdi_devices"] == []
        assert not n.cdi_dir.exists()
    finally:
        n.close()
    # Present at start-up (a CDI-aware runtime scans it): specs and names.
    n = Node(sim, tmp_path / "present")
    n.cdi_dir.mkdir(parents=True)
    try:
        n.start_kubelet().start_manager().wait_registered()
        r = n.admit("a", core=30, memory=16)
        assert r["containers"][0]["allocate_response"]["cdi_devices"] == [f"{KIND}={allocation_of(r)}"]
        assert spec_files(n) == [f"vcuda.io-allocation_{allocation_of(r)}.json"]
    finally:
        n.close()


def test_a_planted_symlink_or_file_at_a_specs_path_is_replaced_not_followed(cdi_node):
    node = cdi_node
    r = node.admit("a", core=30, memory=16)
    path = node.cdi_dir / f"vcuda.io-allocation_{allocation_of(r)}.json"
    good = path.read_text()
    victim = node.root / "victim"
    victim.write_text("precious")
    # A symlink in place of the spec (to a file someone wants overwritten): the restarted
    # manager writes the spec again, replacing the link, the target untouched.
    path.unlink()
    path.symlink_to(victim)
    node.stop_manager()
    node.start_manager("--cdi", "on").wait_registered()
    assert victim.read_text() == "precious"
    assert path.is_file() and not path.is_symlink() and path.read_text() == good
    # A plain file with other edits: replaced the same way.
    path.write_text('{"cdiVersion": "0.5.0", "kind": "vcuda.io/allocation", "devices": []}')
    node.stop_manager()
    node.start_manager("--cdi", "on").wait_registered()
    assert path.read_text() == good
    # A symlink when the allocation goes: the link is removed, its target stays.
    path.unlink()
    path.symlink_to(victim)
    node.ksim_cmd("delete", "--pod", "a")
    again = node.admit("b", core=30, memory=16)  # the same devices: a's allocation goes
    assert again["containers"][0]["devices"][CORE] == r["containers"][0]["devices"][CORE]
    assert not path.is_symlink() and not path.exists()
    assert victim.read_text() == "precious"
    check_spec((node.cdi_dir / f"vcuda.io-allocation_{allocation_of(again)}.json").read_text())


def test_a_kubelet_that_drops_cdi_names_still_gets_a_working_container(sim, tmp_path, bins):
    # Kubelet 1.28 (DevicePluginCDIDevices off) does not pass `cdi_devices` to the runtime:
    # the container is made from the mounts/devices/env answer, which every mode returns.
    n = Node(sim, tmp_path / "node")
    try:
        n.start_kubelet(kubelet_version="1.28").start_manager("--cdi", "on").wait_registered()
        r = n.admit("a", core=30, memory=16)
        resp = r["containers"][0]["allocate_response"]
        assert resp["cdi_devices"] == [] and resp["mounts"], resp
        check_spec((n.cdi_dir / f"vcuda.io-allocation_{allocation_of(r)}.json").read_text())
        got, out = fill(n.container(r, "a"), bins, 8192)
        assert 3072 <= got <= 4096 - 300, out
    finally:
        n.close()
