"""deploy/overlays/mixed: the three sharing modes (issue 19) on nodes labelled
vcuda.io/modes=mixed. A second manager DaemonSet runs there with the modes' flags, the base's
keeps every other GPU node, and no node ever gets two managers or none. (Rendering with both
kustomizes and validation against Kubernetes' schemas: test_kustomize.py, whose OVERLAYS
lists this overlay.)"""

import copy
import itertools
import re

import pytest

from deploy_render import ROOT, render as rendered

MIXED = "overlays/mixed"
LABEL, VALUE = "vcuda.io/modes", "mixed"
MODES_FLAGS = ["--modes=whole,slice,shared", "--slices=2"]

MANAGER_DS = ("apps/v1", "DaemonSet", "vcuda-system", "vcuda-manager")
MIXED_DS = ("apps/v1", "DaemonSet", "vcuda-system", "vcuda-manager-mixed")
MANAGER_NP = ("networking.k8s.io/v1", "NetworkPolicy", "vcuda-system", "vcuda-manager")
EXTENDER_CM = ("v1", "ConfigMap", "kube-system", "vcuda-scheduler-extender")


def pod_spec(ds):
    return ds["spec"]["template"]["spec"]


def manager_command(ds):
    (c,) = pod_spec(ds)["containers"]
    return c["command"]


# --- which nodes a DaemonSet's pods go to ----------------------------------------------------

def expression_matches(expr, labels):
    """One nodeSelectorRequirement (the operators kube-scheduler knows) against a node's labels."""
    k, op, values = expr["key"], expr["operator"], expr.get("values", [])
    if op == "In":
        return k in labels and labels[k] in values
    if op == "NotIn":
        return k not in labels or labels[k] not in values
    if op == "Exists":
        return k in labels
    if op == "DoesNotExist":
        return k not in labels
    if op in ("Gt", "Lt"):
        if k not in labels or not labels[k].lstrip("-").isdigit():
            return False
        (v,) = values
        return int(labels[k]) > int(v) if op == "Gt" else int(labels[k]) < int(v)
    raise AssertionError(f"unknown operator {op}")


def runs_on(ds, labels):
    """Whether the DaemonSet places a pod on an untainted node with these labels: its
    nodeSelector (every pair) and its required node affinity (any term, each term's every
    expression), as the DaemonSet controller and kube-scheduler decide."""
    spec = pod_spec(ds)
    if not spec.get("nodeSelector", {}).items() <= labels.items():
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    for term in required["nodeSelectorTerms"]:
        assert not term.get("matchFields"), "a node field selector: extend this check"
        if all(expression_matches(e, labels) for e in term.get("matchExpressions", [])):
            return True
    return False


def selector_keys_and_values(*daemonsets):
    """{label key: values the DaemonSets' node selection names}."""
    out = {}
    for ds in daemonsets:
        spec = pod_spec(ds)
        for k, v in spec.get("nodeSelector", {}).items():
            out.setdefault(k, set()).add(v)
        required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
        for term in (required or {}).get("nodeSelectorTerms", []):
            for e in term.get("matchExpressions", []):
                out.setdefault(e["key"], set()).update(e.get("values", []))
    return out


ABSENT = object()


def every_node(*daemonsets):
    """Every label set that matters to these DaemonSets: each key they name either absent, or
    one of the values they name, or a value none names. Any node behaves as one of these."""
    keys = selector_keys_and_values(*daemonsets)
    names = sorted(keys)
    choices = [[ABSENT, *sorted(keys[k]), "some-other-value"] for k in names]
    for combo in itertools.product(*choices):
        yield {k: v for k, v in zip(names, combo) if v is not ABSENT}


def managers_per_node(objs):
    """{frozen labels: names of the manager DaemonSets placing a pod there}."""
    managers = [o for o in objs.values() if o["kind"] == "DaemonSet" and o["metadata"]["namespace"] == "vcuda-system"]
    return {frozenset(labels.items()): sorted(ds["metadata"]["name"] for ds in managers if runs_on(ds, labels))
            for labels in every_node(*managers)}


def test_every_gpu_node_gets_exactly_one_manager_and_the_mixed_ones_the_mixed_manager():
    per_node = managers_per_node(rendered(MIXED))
    assert len(per_node) >= 9, "every combination of the selectors' labels"
    for labels, managers in per_node.items():
        labels = dict(labels)
        if labels.get("nvidia.com/gpu.present") != "true":
            assert managers == [], (labels, managers)
        elif labels.get(LABEL) == VALUE:
            assert managers == ["vcuda-manager-mixed"], (labels, managers)
        else:
            assert managers == ["vcuda-manager"], (labels, managers)


def test_the_check_finds_a_node_with_two_managers():
    """Without the base DaemonSet's affinity a mixed node would run both managers: the check
    above sees it (so it can fail)."""
    objs = rendered(MIXED)
    del pod_spec(objs[MANAGER_DS])["affinity"]
    doubled = [dict(labels) for labels, m in managers_per_node(objs).items() if len(m) > 1]
    assert doubled and all(d[LABEL] == VALUE for d in doubled), doubled


def test_the_two_daemonsets_selectors_do_not_overlap():
    """Each DaemonSet's selector matches its own pods and not the other's, so neither
    controller ever counts the other's pod as its own."""
    objs = rendered(MIXED)
    base, mixed = objs[MANAGER_DS], objs[MIXED_DS]
    for own, other in ((base, mixed), (mixed, base)):
        sel = own["spec"]["selector"]["matchLabels"]
        assert sel.items() <= own["spec"]["template"]["metadata"]["labels"].items()
        assert not sel.items() <= other["spec"]["template"]["metadata"]["labels"].items(), own["metadata"]["name"]
    # the base's selector is as installed (a DaemonSet's selector cannot change)
    assert base["spec"]["selector"] == rendered("base")[MANAGER_DS]["spec"]["selector"]


# --- what the overlay changes --------------------------------------------------------------

def test_mixed_adds_the_mixed_daemonset_and_changes_only_where_the_base_one_runs():
    base, mixed = rendered("base"), rendered(MIXED)
    assert set(mixed) == set(base) | {MIXED_DS}
    for k in set(base) - {MANAGER_DS, MANAGER_NP, EXTENDER_CM}:
        assert mixed[k] == base[k], k
    # kube-scheduler sends the other modes' pods to the extender too: two lines more.
    added = ["      - {name: tencent.com/sgpu, ignoredByScheduler: false}",
             "      - {name: nvidia.com/gpu, ignoredByScheduler: false}"]
    text = mixed[EXTENDER_CM]["data"]["scheduler-config.yaml"].splitlines()
    assert [line for line in text if line not in added] == \
        base[EXTENDER_CM]["data"]["scheduler-config.yaml"].splitlines()
    assert all(line in text for line in added)
    ds = mixed[MANAGER_DS]
    assert pod_spec(ds).pop("affinity") == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": LABEL, "operator": "NotIn", "values": [VALUE]}]}]}}}
    assert ds == base[MANAGER_DS], "the base's manager is otherwise unchanged (shares only, no flags)"


def test_the_mixed_daemonset_is_the_base_one_with_the_modes_flags_on_mixed_nodes():
    base, mixed = rendered("base"), rendered(MIXED)
    ds = copy.deepcopy(mixed[MIXED_DS])
    assert manager_command(ds) == manager_command(base[MANAGER_DS]) + MODES_FLAGS
    assert pod_spec(ds)["nodeSelector"] == {**pod_spec(base[MANAGER_DS])["nodeSelector"], LABEL: VALUE}
    # everything else as in the base: privileges, mounts, settings file, tolerations, image
    want = copy.deepcopy(base[MANAGER_DS])
    want["metadata"]["name"] = "vcuda-manager-mixed"
    want["spec"]["selector"]["matchLabels"] = {"app": "vcuda-manager-mixed"}
    want["spec"]["template"]["metadata"]["labels"] = {"app": "vcuda-manager-mixed"}
    pod_spec(want)["nodeSelector"][LABEL] = VALUE
    pod_spec(want)["containers"][0]["command"] += MODES_FLAGS
    assert ds == want


def test_the_manager_networkpolicy_admits_prometheus_to_both_managers():
    base, mixed = rendered("base"), rendered(MIXED)
    np = mixed[MANAGER_NP]
    (expr,) = np["spec"]["podSelector"]["matchExpressions"]
    assert expr["key"] == "app" and expr["operator"] == "In"
    for k in (MANAGER_DS, MIXED_DS):
        assert mixed[k]["spec"]["template"]["metadata"]["labels"]["app"] in expr["values"], k
    assert set(expr["values"]) == {"vcuda-manager", "vcuda-manager-mixed"}, "and no other pods"
    np["spec"]["podSelector"] = base[MANAGER_NP]["spec"]["podSelector"]
    assert np == base[MANAGER_NP]


# --- the flags are the manager's -----------------------------------------------------------

def manager_settings_fields():
    """vcuda-manager's settings: the fields of `Layer` (manager/src/settings.rs); a flag
    --a-b is the field a_b, and the settings file's key a_b."""
    src = (ROOT / "manager" / "src" / "settings.rs").read_text()
    layer = src[src.index("\nlayer! {"):]
    layer = layer[layer.index("pub struct Layer {"):]
    return set(re.findall(r"^\s+pub (\w+): ", layer[:layer.index("\n    }\n")], re.M))


@pytest.mark.parametrize("directory", ["base", MIXED])
def test_every_flag_a_manager_daemonset_gives_is_one_the_manager_has(directory):
    fields = manager_settings_fields()
    assert {"modes", "slices", "domain"} <= fields, "manager/src/settings.rs' Layer as this test reads it"
    daemonsets = [o for o in rendered(directory).values() if o["kind"] == "DaemonSet"]
    assert daemonsets
    for ds in daemonsets:
        for arg in manager_command(ds)[1:]:
            if arg.startswith("--") and arg != "--config":
                name = arg[2:].split("=", 1)[0].replace("-", "_")
                assert name in fields, f"deploy/{directory}: vcuda-manager has no {arg}"


def test_the_mixed_flags_name_valid_modes_and_slices():
    """--modes: whole, slice and shared (the three; manager/core/src/modes.rs Mode::name);
    --slices within 2..=99 (SLICES_MIN, SLICES_MAX there)."""
    flags = dict(a[2:].split("=", 1) for a in manager_command(rendered(MIXED)[MIXED_DS]) if "=" in a)
    modes_rs = (ROOT / "manager" / "core" / "src" / "modes.rs").read_text()
    names = set(re.findall(r'Mode::\w+ => "(\w+)"', modes_rs))
    assert names == {"whole", "slice", "shared"}, names
    assert sorted(flags["modes"].split(",")) == sorted(names)
    lo = int(re.search(r"pub const SLICES_MIN: u32 = (\d+);", modes_rs).group(1))
    hi = int(re.search(r"pub const SLICES_MAX: u32 = (\d+);", modes_rs).group(1))
    assert lo <= int(flags["slices"]) <= hi


def test_the_documented_label_is_the_one_the_daemonsets_use():
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert f"kubectl label node <node> {LABEL}={VALUE}" in readme
    assert "overlays/mixed/" in readme
