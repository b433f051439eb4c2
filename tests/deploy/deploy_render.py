"""Rendering deploy/'s kustomizations, and validating what they render, for tests/deploy.

Every kustomization is rendered with the oldest kustomize it is written for, v2.0.3, built into
Debian bookworm's kubectl 1.20 (scripts/setup-test-deps unpacks it into .venv/tools), and,
when another kubectl is on PATH, with that one's newer kustomize too: both must give the
same objects. Objects of Kubernetes' own kinds are validated against Kubernetes' OpenAPI
schemas (kubernetes-validate's strict JSON schemas: unknown fields are errors)."""

import concurrent.futures
import copy
import functools
import json
import os
import pathlib
import shutil
import subprocess

import importlib.resources
import jsonschema
import referencing
import referencing.jsonschema
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TOOLS = ROOT / ".venv" / "tools"
KUBECTL_V2 = TOOLS / "kubernetes-client" / "usr" / "bin" / "kubectl"
SETUP = "run scripts/setup-test-deps (it unpacks Debian's kubectl 1.20 and the 1.20 schemas into .venv/tools)"


def kubectls():
    """[(name, path)]: Debian's kubectl 1.20 (kustomize v2.0.3) first, then the kubectl on
    PATH if it is another one."""
    assert KUBECTL_V2.is_file(), f"{KUBECTL_V2} is missing: {SETUP}"
    out = [("kubectl 1.20 (kustomize v2.0.3)", str(KUBECTL_V2))]
    other = shutil.which("kubectl")
    if other and os.path.realpath(other) != os.path.realpath(KUBECTL_V2):
        out.append((f"{other} ({kubectl_version(other)})", other))
    return out


@functools.cache
def kubectl_version(kubectl):
    """'kubectl v1.32.4, kustomize v5.5.0' (kustomize's only where kubectl reports it)."""
    p = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True)
    if p.returncode != 0:
        return "version unknown"
    v = json.loads(p.stdout)
    k = v.get("kustomizeVersion")
    return f"kubectl {v['clientVersion']['gitVersion']}" + (f", kustomize {k}" if k else "")


def key(obj):
    m = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], m.get("namespace"), m["name"])


def _run(kubectl, directory):
    p = subprocess.run([kubectl, "kustomize", str(DEPLOY / directory)], capture_output=True, text=True)
    assert p.returncode == 0, f"{kubectl} kustomize deploy/{directory}:\n{p.stderr}"
    objs = [o for o in yaml.safe_load_all(p.stdout) if o]
    keys = [key(o) for o in objs]
    assert len(keys) == len(set(keys)), f"deploy/{directory}: an object twice"
    return {key(o): o for o in objs}


@functools.cache
def _all():
    """Every kustomization rendered by every kubectl, at once (a render takes 0.1-0.5 s):
    {(kubectl, directory): objects or the AssertionError}."""
    jobs = [(k, d) for _, k in kubectls() for d in kustomizations()]

    def one(job):
        try:
            return _run(*job)
        except AssertionError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(jobs, pool.map(one, jobs)))


def _render(kubectl, directory):
    got = _all().get((kubectl, directory)) or _run(kubectl, directory)
    if isinstance(got, AssertionError):
        raise got
    return got


def render(directory, kubectl=None):
    """{(apiVersion, kind, namespace, name): object} of `kubectl kustomize deploy/<directory>`,
    with kustomize v2.0.3 unless `kubectl` is given. A fresh copy each call."""
    return copy.deepcopy(_render(kubectl or str(KUBECTL_V2), directory))


def kustomizations():
    """Every directory under deploy/ with a kustomization.yaml, relative to deploy/."""
    return sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml"))


def files(*paths):
    """{key: object} of manifest files under deploy/."""
    return {key(d): d for p in paths for d in yaml.safe_load_all((DEPLOY / p).read_text()) if d}


# --- Kubernetes' OpenAPI schemas -------------------------------------------------------------

def schema_dir(version):
    """The strict schemas of Kubernetes `version` ('1.20', '1.30', '1.37')."""
    name = f"v{version}.0-local-strict"
    packaged = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / name
    if packaged.is_dir():
        return pathlib.Path(str(packaged))
    extra = TOOLS / "kubernetes-json-schema" / name
    assert extra.is_dir(), f"no Kubernetes {version} schemas in kubernetes-validate or {extra}: {SETUP}"
    return extra


def _resource(path):
    """(its URI, the schema file as a referencing resource): its $id (1.30 on), else its path
    (1.20's schemas have no $id and refer to _definitions.json relatively)."""
    res = referencing.jsonschema.DRAFT202012.create_resource(json.loads(path.read_text()))
    return res.id() or path.as_uri(), res


@functools.cache
def _registry(directory):
    return referencing.Registry().with_resource(*_resource(directory / "_definitions.json"))


def validate(obj, version):
    """Raise jsonschema.ValidationError unless `obj` is valid in Kubernetes `version`."""
    d = schema_dir(version)
    group, _, ver = obj["apiVersion"].rpartition("/")
    path = d / f"{obj['kind'].lower()}-{group.split('.')[0] + '-' if group else ''}{ver}.json"
    assert path.is_file(), f"{obj['kind']} {obj['apiVersion']} does not exist in Kubernetes {version} ({path.name})"
    uri, res = _resource(path)
    registry = _registry(d).with_resource(uri, res)
    jsonschema.Draft202012Validator({"$ref": uri}, registry=registry).validate(obj)
