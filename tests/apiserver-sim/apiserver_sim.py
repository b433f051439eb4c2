#!/usr/bin/env python3
"""A fake Kubernetes API server for vcuda's tests (Python 3.11 standard library only).

It speaks the core/v1 REST API in JSON for the objects vcuda-scheduler and vcuda-manager use:
nodes (cluster-scoped), pods and configmaps (namespaced), the pods/binding subresource and the
pods/status and nodes/status subresources; coordination.k8s.io/v1 leases (namespaced: the
managers' node Leases); plus the discovery documents (/api, /api/v1, /apis, /apis/<group>,
/apis/<group>/v1) and /version, so that kube-rs clients (`Client::try_default()` with KUBECONFIG pointing at the
file written by --kubeconfig) work against it unchanged.

Dynamic admission (k8s.io/apiserver/pkg/admission/plugin/webhook): admissionregistration.k8s.io/v1
Mutating- and ValidatingWebhookConfigurations are stored like any object and their webhooks are
called over HTTPS for every write (create, update, delete, pods/status, pods/binding), mutating
first, then validating; see the "admission" section below. Bearer tokens map to users (--user).

Which upstream behaviour each part follows is said in the docstring of that part; README.md
has the table and the known gaps (no watch, no server-side apply, ...).

    python3 apiserver_sim.py --port 0 [--kubeconfig PATH] [--user TOKEN=USER[,GROUP...]]...
                             [--service-endpoint NAMESPACE/NAME=HOST:PORT]...

prints one JSON line {"ready": true, "url": "http://127.0.0.1:PORT"} once listening.

Test-only endpoints live outside the Kubernetes URL space, under /_sim/:
    GET  /_sim/requests                      the request log (method, path, query, content type, status)
    GET  /_sim/objects                       every stored object
    POST /_sim/reset                         forget all objects, the log and injected faults
    POST /_sim/conflict-next?path=P&count=N  the next N updates of object P answer 409 Conflict
    POST /_sim/users                         {"token", "username", "uid"?, "groups"?, "extra"?}: a bearer token's user
    GET  /_sim/users                         the token table
    POST /_sim/service-endpoint              {"namespace", "name", "address": "HOST:PORT"}: where a webhook Service is
    GET  /_sim/service-endpoints             the Service table
"""

import argparse
import base64
import binascii
import copy
import datetime
import http.client
import json
import random
import re
import socket
import ssl
import sys
import threading
import urllib.parse
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:  # optional: only webhooks with matchConditions need it (tests/requirements.txt has it)
    from cel_expr_python import cel as _cel
    from cel_expr_python.ext import ext_optional as _cel_optional
except ImportError:  # pragma: no cover - depends on the environment
    _cel = _cel_optional = None

GIT_VERSION = "v1.36.3"


# ---- resources ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    """One resource as the real registry (pkg/registry/<group>/<resource>/) defines it: core/v1
    (group "") or a named group's v1."""

    name: str  # plural, as in the URL and in error messages ("nodes")
    kind: str
    namespaced: bool
    short_names: tuple
    fields: tuple  # field selectors the real server accepts (the registry's GetAttrs)
    subresources: tuple
    # pods set ReturnDeletedObject (the DELETE answer is the pod); the others answer a Status.
    return_deleted: bool
    group: str = ""  # "" = the core group (/api/v1); else /apis/<group>/v1

    @property
    def api_version(self):
        return f"{self.group}/v1" if self.group else "v1"


ADMISSION_GROUP = "admissionregistration.k8s.io"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

RESOURCES = {
    r.name: r
    for r in (
        Resource("nodes", "Node", False, ("no",), ("metadata.name", "spec.unschedulable"), ("status",), False),
        Resource(
            "pods", "Pod", True, ("po",),
            ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
             "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"),
            ("status", "binding"), True,
        ),
        Resource("configmaps", "ConfigMap", True, ("cm",), ("metadata.name", "metadata.namespace"), (), False),
        # pkg/registry/coordination/lease: namespaced, the generic field set, no subresources.
        Resource("leases", "Lease", True, (), ("metadata.name", "metadata.namespace"), (), False, "coordination.k8s.io"),
        # pkg/registry/core/namespace: cluster-scoped; field selectors metadata.name and status.phase.
        Resource("namespaces", "Namespace", False, ("ns",), ("metadata.name", "status.phase"), (), False),
        # pkg/registry/admissionregistration/{mutating,validating}webhookconfiguration: cluster-scoped.
        Resource("mutatingwebhookconfigurations", "MutatingWebhookConfiguration", False, (), ("metadata.name",), (), False,
                 ADMISSION_GROUP),
        Resource("validatingwebhookconfigurations", "ValidatingWebhookConfiguration", False, (), ("metadata.name",), (), False,
                 ADMISSION_GROUP),
    )
}

# The named API groups (GET /apis), each served at version v1 only.
GROUPS = sorted({r.group for r in RESOURCES.values() if r.group})

# Verbs as the real discovery document lists them. watch and deletecollection: see README (watch is
# advertised like the real server does, but answered 405).
MAIN_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
STATUS_VERBS = ["get", "patch", "update"]

PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
)


# ---- Status errors -------------------------------------------------------------------------------
# k8s.io/apimachinery/pkg/api/errors: the constructors below reproduce NewNotFound, NewAlreadyExists,
# NewConflict, NewBadRequest, NewInvalid, NewMethodNotSupported, NewGenericServerResponse and
# NewInternalError, including their messages and the quirk that details.kind holds the *resource*.


class ApiError(Exception):
    def __init__(self, code, reason, message, details=None):
        super().__init__(message)
        self.status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason}
        if details is not None:
            self.status["details"] = details
        self.status["code"] = code
        self.code = code


def _qualified(resource, name, group):
    """schema.GroupResource.String() and the details: "leases.coordination.k8s.io", group set
    only for a named group."""
    details = {"name": name, "group": group, "kind": resource} if group else {"name": name, "kind": resource}
    return (f"{resource}.{group}" if group else resource), details


def not_found(resource, name, group=""):
    q, details = _qualified(resource, name, group)
    return ApiError(404, "NotFound", f'{q} "{name}" not found', details)


def already_exists(resource, name, group=""):
    q, details = _qualified(resource, name, group)
    return ApiError(409, "AlreadyExists", f'{q} "{name}" already exists', details)


def conflict(resource, name, why="the object has been modified; please apply your changes to the latest version and try again",
             group=""):
    q, details = _qualified(resource, name, group)
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {q} "{name}": {why}', details)


def bad_request(message):
    return ApiError(400, "BadRequest", message)


def path_not_found():
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def method_not_allowed(message="the server does not allow this method on the requested resource"):
    return ApiError(405, "MethodNotAllowed", message, {})


def internal_error(message):
    return ApiError(500, "InternalError", f"Internal error occurred: {message}", {"causes": [{"message": message}]})


def forbidden(resource, name, message, group=""):
    """NewForbidden: 403, `<resource> "<name>" is forbidden: <message>`."""
    q, details = _qualified(resource, name, group)
    return ApiError(403, "Forbidden", f'{q} "{name}" is forbidden: {message}', details)


def patch_not_applied():
    """A JSON patch whose operation fails (a `test`, a missing path): NewGenericServerResponse(422)
    with no server message, so the body carries only the generic text and empty details."""
    return ApiError(422, "Invalid", "the server rejected our request due to an error in our request", {})


class FieldError:
    """k8s.io/apimachinery/pkg/util/validation/field.Error: "<field>: <type>[: <value>][: <detail>]"."""

    TYPES = {"Required": ("FieldValueRequired", "Required value"), "Invalid": ("FieldValueInvalid", "Invalid value"),
             "Forbidden": ("FieldValueForbidden", "Forbidden"), "NotSupported": ("FieldValueNotSupported", "Unsupported value"),
             "Duplicate": ("FieldValueDuplicate", "Duplicate value")}

    def __init__(self, kind, field, detail="", value=None):
        self.reason, text = self.TYPES[kind]
        if kind in ("Invalid", "NotSupported", "Duplicate"):
            text += ": " + json.dumps(value)
        self.body = text + (": " + detail if detail else "")
        self.field = field

    def __str__(self):
        return f"{self.field}: {self.body}"


def invalid(kind, name, errors, group=""):
    """NewInvalid: 422, details.kind is the Kind here (not the resource), one cause per error."""
    agg = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(map(str, errors)) + "]"
    causes = [{"reason": e.reason, "message": e.body, "field": e.field} for e in errors]
    q, details = _qualified(kind, name, group)
    return ApiError(422, "Invalid", f'{q} "{name}" is invalid: {agg}', {**details, "causes": causes})


# ---- selectors -----------------------------------------------------------------------------------
# Label selectors follow k8s.io/apimachinery/pkg/labels (=, ==, !=, in, notin, exists, !exists);
# field selectors follow k8s.io/apimachinery/pkg/fields (=, ==, != over the registry's field set).


def _split_top(text):
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


_SET_RE = re.compile(r"^([A-Za-z0-9_./-]+)\s+(in|notin)\s+\(([^)]*)\)$")
_EQ_RE = re.compile(r"^([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)$")
_EXISTS_RE = re.compile(r"^(!?)\s*([A-Za-z0-9_./-]+)$")


def parse_label_selector(text):
    """Returns a predicate over a labels dict; raises BadRequest on syntax it does not know."""
    reqs = []
    for part in _split_top(text or ""):
        if m := _SET_RE.match(part):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                reqs.append(lambda ls, k=key, vs=values: ls.get(k) in vs)
            else:
                reqs.append(lambda ls, k=key, vs=values: ls.get(k) not in vs)
        elif m := _EQ_RE.match(part):
            key, op, value = m.groups()
            if op == "!=":
                reqs.append(lambda ls, k=key, v=value: ls.get(k) != v)
            else:
                reqs.append(lambda ls, k=key, v=value: k in ls and ls[k] == v)
        elif m := _EXISTS_RE.match(part):
            neg, key = m.groups()
            reqs.append((lambda ls, k=key: k not in ls) if neg else (lambda ls, k=key: k in ls))
        else:
            raise bad_request(f"unable to parse requirement: {part!r}")
    return lambda labels: all(r(labels or {}) for r in reqs)


def field_value(obj, field):
    """The string the registry's GetAttrs gives a field ("" when absent, booleans as true/false)."""
    if field == "status.podIP":
        ips = (obj.get("status") or {}).get("podIPs") or []
        return ips[0].get("ip", "") if ips else (obj.get("status") or {}).get("podIP", "")
    cur = obj
    for p in field.split("."):
        cur = cur.get(p) if isinstance(cur, dict) else None
    if isinstance(cur, bool) or (cur is None and field in ("spec.unschedulable", "spec.hostNetwork")):
        return "true" if cur else "false"
    return "" if cur is None else str(cur)


def parse_field_selector(text, res):
    reqs = []
    for part in _split_top(text or ""):
        m = re.match(r"^([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)$", part)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        field, op, value = m.groups()
        if field not in res.fields:
            raise bad_request(f"field label not supported: {field}")
        if op == "!=":
            reqs.append(lambda o, f=field, v=value: field_value(o, f) != v)
        else:
            reqs.append(lambda o, f=field, v=value: field_value(o, f) == v)
    return lambda obj: all(r(obj) for r in reqs)


# ---- patches -------------------------------------------------------------------------------------
# Merge patch: RFC 7386. Strategic merge patch: handled as a merge patch (maps merge, null deletes)
# except that lists are REPLACED, where the real server merges some lists by their patchMergeKey
# (containers by name, conditions by type, ...); patch directives ($patch, $retainKeys,
# $setElementOrder/..., $deleteFromPrimitiveList/...) are refused with 400 rather than misapplied.
# JSON patch: RFC 6902 (add, remove, replace, move, copy, test) with RFC 6901 pointers.


def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _reject_directives(patch):
    if isinstance(patch, dict):
        for key, value in patch.items():
            if key.startswith("$"):
                raise bad_request(f"apiserver-sim does not simulate strategic merge patch directive {key!r}")
            _reject_directives(value)
    elif isinstance(patch, list):
        for item in patch:
            _reject_directives(item)


class _PatchFailed(Exception):
    pass


def _pointer(path):
    if path == "":
        return []
    if not path.startswith("/"):
        raise _PatchFailed(f"invalid pointer {path!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _parent(doc, tokens):
    cur = doc
    for t in tokens[:-1]:
        if isinstance(cur, dict) and t in cur:
            cur = cur[t]
        elif isinstance(cur, list) and t.isdigit() and int(t) < len(cur):
            cur = cur[int(t)]
        else:
            raise _PatchFailed(f"missing path {t!r}")
    return cur


def _get(doc, tokens):
    if not tokens:
        return doc
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise _PatchFailed(f"missing value at {tokens}")


def _add(doc, tokens, value):
    if not tokens:
        return value
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        idx = len(parent) if last == "-" else int(last) if last.isdigit() else -1
        if not 0 <= idx <= len(parent):
            raise _PatchFailed(f"index {last} out of range")
        parent.insert(idx, value)
    else:
        raise _PatchFailed("parent is not a container")
    return doc


def _remove(doc, tokens):
    _get(doc, tokens)  # must exist
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, dict):
        del parent[last]
    else:
        del parent[int(last)]
    return doc


def check_json_patch(ops):
    """A malformed patch document is a 400 (jsonpatch.DecodePatch fails before the object is read)."""
    if not isinstance(ops, list) or not all(isinstance(o, dict) and isinstance(o.get("op"), str) for o in ops):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")


def json_patch(doc, ops):
    """Raises BadRequest for a malformed patch document, 422 (patch_not_applied) when an operation fails."""
    check_json_patch(ops)
    doc = copy.deepcopy(doc)
    try:
        for op in ops:
            kind, path = op["op"], _pointer(op.get("path", ""))
            if kind in ("add", "replace", "test") and "value" not in op:
                raise bad_request(f"missing value for {kind} operation")
            if kind == "add":
                doc = _add(doc, path, copy.deepcopy(op["value"]))
            elif kind == "remove":
                doc = _remove(doc, path)
            elif kind == "replace":
                _get(doc, path)
                doc = _add(_remove(doc, path), path, copy.deepcopy(op["value"])) if path else copy.deepcopy(op["value"])
            elif kind in ("move", "copy"):
                src = _pointer(op.get("from", ""))
                value = copy.deepcopy(_get(doc, src))
                if kind == "move":
                    doc = _remove(doc, src)
                doc = _add(doc, path, value)
            elif kind == "test":
                if _get(doc, path) != op["value"]:
                    raise _PatchFailed("test failed")
            else:
                raise bad_request(f"Unexpected kind: {kind}")
    except _PatchFailed:
        raise patch_not_applied()
    return doc


# ---- the store -----------------------------------------------------------------------------------
# Follows "Kubernetes API Concepts": every successful write gets a new resourceVersion from one
# global, increasing counter (etcd's revision); a list carries the revision it was read at; an
# update whose metadata.resourceVersion is set and stale fails with 409 Conflict (optimistic
# concurrency); an update that changes nothing is not written and keeps its resourceVersion (the
# storage layer skips no-op GuaranteedUpdates). All state sits behind one lock, so every request is
# atomic, as an etcd transaction is.

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# metav1.MicroTime: time.Parse(RFC3339Micro) (six fractional digits, Z or an offset).
_MICRO_TIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}(Z|[+-]\d{2}:\d{2})$")
_NAME_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
             "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
             "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_POD_UPDATE_MSG = ("pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,"
                   "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),"
                   "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)")


def typed(res, obj):
    """A copy with kind and apiVersion set and first, as the real server serialises objects."""
    if not isinstance(obj, dict):
        raise bad_request(f"the body of the request is not a {res.kind} object")
    out = {"kind": res.kind, "apiVersion": res.api_version}
    out.update((k, copy.deepcopy(v)) for k, v in obj.items() if k not in ("kind", "apiVersion"))
    _meta(out)
    return out


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _meta(obj):
    m = obj.get("metadata")
    if not isinstance(m, dict):
        m = obj["metadata"] = {}
    return m


def _pod_qos(spec):
    """pkg/apis/core/helper/qos.GetPodQOS, over cpu and memory only (as upstream)."""
    containers = (spec.get("containers") or []) + (spec.get("initContainers") or [])
    requests_seen = limits_seen = False
    guaranteed = True
    for c in containers:
        res = c.get("resources") or {}
        req = {k: v for k, v in (res.get("requests") or {}).items() if k in ("cpu", "memory")}
        lim = {k: v for k, v in (res.get("limits") or {}).items() if k in ("cpu", "memory")}
        requests_seen |= bool(req)
        limits_seen |= bool(lim)
        if set(lim) != {"cpu", "memory"} or any(req.get(k, lim[k]) != lim[k] for k in lim):
            guaranteed = False
    if not requests_seen and not limits_seen:
        return "BestEffort"
    return "Guaranteed" if guaranteed and limits_seen else "Burstable"


class Store:
    def __init__(self):
        self.lock = threading.Lock()
        self.rv = 0
        self.objects = {}  # (resource, namespace, name) -> object (with kind/apiVersion)
        self.conflicts = {}  # object path -> injected conflicts left

    def _bump(self):
        self.rv += 1
        return str(self.rv)

    def reset(self):
        """Clears everything but the resourceVersion counter (resourceVersions never go backwards)."""
        with self.lock:
            self.objects.clear()
            self.conflicts.clear()

    # -- reads --

    def get(self, res, ns, name):
        with self.lock:
            obj = self.objects.get((res.name, ns, name))
            if obj is None:
                raise not_found(res.name, name, res.group)
            return copy.deepcopy(obj)

    def list(self, res, ns, label_selector="", field_selector=""):
        """A list: kind <Kind>List, metadata.resourceVersion, items sorted by namespace/name (etcd key
        order) and, as the real server sends them, without their own kind/apiVersion."""
        labels_ok = parse_label_selector(label_selector)
        fields_ok = parse_field_selector(field_selector, res)
        with self.lock:
            items = []
            for (r, o_ns, _), obj in sorted(self.objects.items()):
                if r == res.name and (ns is None or o_ns == ns) and labels_ok(_meta(obj).get("labels")) and fields_ok(obj):
                    item = copy.deepcopy(obj)
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
                    items.append(item)
            return {"kind": res.kind + "List", "apiVersion": res.api_version, "metadata": {"resourceVersion": str(self.rv)},
                    "items": items}

    # -- create --

    def create(self, res, ns, body, admission=None):
        """The create handler (endpoints/handlers/create.go): decode, set the request's namespace,
        mutating admission, then Store.Create: rest.BeforeCreate (generateName, system fields, the
        strategy's PrepareForCreate and validation), validating admission, the write."""
        obj = self.decode(res, body)
        meta = _meta(obj)
        if res.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if admission is not None:
            obj = typed(res, admission.mutate(obj, None))
        obj = self._before_create(res, ns, obj)
        if admission is not None:
            admission.validate(obj, None)
        return self._insert(res, ns, obj)

    def _before_create(self, res, ns, obj):
        meta = _meta(obj)
        if res.namespaced:
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        name = meta.get("name") or ""
        errors = self._validate_meta(meta)
        if res.name == "pods":
            errors += self._prepare_pod(obj)
        if res.name == "leases":
            errors += self._validate_lease(obj)
        if res.name == "namespaces":
            self._prepare_namespace(obj, create=True)
        if res.group == ADMISSION_GROUP:
            errors += validate_webhook_configuration(res, obj)
        if errors:
            raise invalid(res.kind, name, errors, res.group)
        if meta.get("resourceVersion"):
            # etcd3 store: "resourceVersion should not be set on objects to be created" (a plain error → 500).
            raise internal_error("resourceVersion should not be set on objects to be created")
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            meta.pop(k, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        return obj

    def _insert(self, res, ns, obj):
        name = obj["metadata"]["name"]
        with self.lock:
            key = (res.name, ns if res.namespaced else "", name)
            if key in self.objects:
                raise already_exists(res.name, name, res.group)
            obj["metadata"]["resourceVersion"] = self._bump()
            self.objects[key] = obj
            return copy.deepcopy(obj)

    def decode(self, res, body):
        if not isinstance(body, dict):
            raise bad_request(f"the body of the request is not a {res.kind} object")
        if body.get("apiVersion", res.api_version) != res.api_version:
            raise bad_request(f"the API version in the data ({body['apiVersion']}) does not match the expected API version "
                              f"({res.api_version})")
        if body.get("kind", res.kind) != res.kind:
            raise bad_request(f"the kind in the data ({body['kind']}) does not match the expected kind ({res.kind})")
        return typed(res, body)

    @staticmethod
    def _validate_lease(lease):
        """ValidateLeaseSpec (pkg/apis/coordination/validation): leaseDurationSeconds > 0 and
        leaseTransitions >= 0 when set. renewTime/acquireTime are MicroTime: RFC 3339 with
        microseconds (2026-11-28T04:00:00.123456Z); one that does not parse fails decoding (400)."""
        spec = lease.get("spec") or {}
        if not isinstance(spec, dict):
            raise bad_request("the body of the request is not a Lease object: spec is not an object")
        for k in ("renewTime", "acquireTime"):
            v = spec.get(k)
            if v is not None and not (isinstance(v, str) and _MICRO_TIME_RE.match(v)):
                raise bad_request(f'Lease in version "v1" cannot be handled as a Lease: spec.{k}: {v!r} is not a MicroTime '
                                  "(RFC 3339, e.g. 2026-11-28T04:00:00.123456Z)")
        errors = []
        d = spec.get("leaseDurationSeconds")
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d <= 0):
            errors.append(FieldError("Invalid", "spec.leaseDurationSeconds", "must be greater than 0", d))
        t = spec.get("leaseTransitions")
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            errors.append(FieldError("Invalid", "spec.leaseTransitions", "must be greater than or equal to 0", t))
        return errors

    @staticmethod
    def _prepare_namespace(ns_obj, create):
        """namespaceStrategy.PrepareForCreate/PrepareForUpdate: the label kubernetes.io/metadata.name
        always equals the name (the NamespaceDefaultLabelName feature, GA in 1.22); a new namespace
        is Active with the `kubernetes` finalizer."""
        meta = _meta(ns_obj)
        labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
        labels[NAMESPACE_NAME_LABEL] = meta.get("name") or ""
        meta["labels"] = labels
        if create:
            ns_obj["status"] = {"phase": "Active"}
            spec = ns_obj.setdefault("spec", {})
            if isinstance(spec, dict):
                spec.setdefault("finalizers", ["kubernetes"])

    @staticmethod
    def _validate_meta(meta):
        name = meta.get("name") or ""
        if not name:
            return [FieldError("Required", "metadata.name", "name or generateName is required")]
        if len(name) > 253 or not _NAME_RE.match(name):
            return [FieldError("Invalid", "metadata.name", _NAME_MSG, name)]
        return []

    @staticmethod
    def _prepare_pod(pod):
        """podStrategy.PrepareForCreate (status reset to Pending + qosClass), a subset of the v1
        defaulting, and the container checks of ValidatePod."""
        spec = pod.setdefault("spec", {})
        errors = []
        containers = spec.get("containers")
        if not containers:
            errors.append(FieldError("Required", "spec.containers"))
        for i, c in enumerate(containers or []):
            if not c.get("name"):
                errors.append(FieldError("Required", f"spec.containers[{i}].name"))
            if not c.get("image"):
                errors.append(FieldError("Required", f"spec.containers[{i}].image"))
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        pod["status"] = {"phase": "Pending", "qosClass": _pod_qos(spec)}
        return errors

    # -- update (PUT, PATCH, subresources) --

    def update(self, res, ns, name, mutate, subresource=None, path=None, admission=None):
        """GuaranteedUpdate: `mutate(current)` returns the new object (the PUT body or the patched
        object); then mutating admission, the resourceVersion precondition, the strategy's
        PrepareForUpdate and validation, validating admission, the no-op check, the write.
        Admission runs outside the lock (webhooks take time); if the object changed meanwhile, the
        whole update is tried again on the new object, as GuaranteedUpdate retries tryUpdate."""
        key = (res.name, ns if res.namespaced else "", name)
        first = True
        while True:
            with self.lock:
                current = self.objects.get(key)
                if current is None:
                    raise not_found(res.name, name, res.group)
                if first and path and self.conflicts.get(path, 0) > 0:
                    self.conflicts[path] -= 1
                    raise conflict(res.name, name, group=res.group)
                first = False
                cand = typed(res, mutate(copy.deepcopy(current)))
                if admission is None:
                    return self._commit(key, current, self._prepare_update(res, ns, name, current, cand, subresource))
                snapshot = copy.deepcopy(current)
            cand = typed(res, admission.mutate(cand, snapshot))
            new = self._prepare_update(res, ns, name, snapshot, cand, subresource)
            admission.validate(new, snapshot)
            with self.lock:
                current = self.objects.get(key)
                if current is None:
                    raise not_found(res.name, name, res.group)
                if current["metadata"]["resourceVersion"] == snapshot["metadata"]["resourceVersion"]:
                    return self._commit(key, current, new)

    def _commit(self, key, current, new):
        if new == current:
            return copy.deepcopy(current)
        new["metadata"]["resourceVersion"] = self._bump()
        self.objects[key] = new
        return copy.deepcopy(new)

    def _prepare_update(self, res, ns, name, current, new, subresource):
        """The precondition, PrepareForUpdate and validation of an update; returns the object to write."""
        meta, cur_meta = _meta(new), current["metadata"]
        if meta.get("name") != name:
            raise bad_request(f"the name of the object ({meta.get('name', '')}) does not match the name on the URL ({name})")
        if res.namespaced and meta.get("namespace", ns) != ns:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        rv = meta.get("resourceVersion")
        if rv and rv != cur_meta["resourceVersion"]:
            raise conflict(res.name, name, group=res.group)
        if meta.get("uid") and meta["uid"] != cur_meta["uid"]:
            raise invalid(res.kind, name, [FieldError("Invalid", "metadata.uid", "field is immutable", meta["uid"])], res.group)
        if subresource == "status":
            # *StatusStrategy.PrepareForUpdate + ResetObjectMetaForStatus: only status changes.
            status = new.get("status")
            new = copy.deepcopy(current)
            new["status"] = status
        else:
            # node/pod/namespace strategy PrepareForUpdate: status changes through the main resource are dropped.
            if res.name in ("nodes", "pods", "namespaces"):
                if "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                else:
                    new.pop("status", None)
            meta["uid"] = cur_meta["uid"]
            meta["creationTimestamp"] = cur_meta["creationTimestamp"]
            for k in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                if k in cur_meta:
                    meta[k] = cur_meta[k]
                else:
                    meta.pop(k, None)
            meta["namespace"] = cur_meta.get("namespace")
            if meta["namespace"] is None:
                del meta["namespace"]
            if res.name == "pods" and self._mask_pod_spec(new.get("spec")) != self._mask_pod_spec(current.get("spec")):
                raise invalid("Pod", name, [FieldError("Forbidden", "spec", _POD_UPDATE_MSG)])
            if res.name == "leases":
                errors = self._validate_lease(new)
                if errors:
                    raise invalid("Lease", name, errors, res.group)
            if res.name == "namespaces":
                self._prepare_namespace(new, create=False)
            if res.group == ADMISSION_GROUP:
                errors = validate_webhook_configuration(res, new)
                if errors:
                    raise invalid(res.kind, name, errors, res.group)
        _meta(new)["resourceVersion"] = cur_meta["resourceVersion"]
        return new

    @staticmethod
    def _mask_pod_spec(spec):
        """ValidatePodUpdate: everything but these fields of a pod's spec is immutable."""
        s = copy.deepcopy(spec or {})
        for c in (s.get("containers") or []) + (s.get("initContainers") or []):
            c.pop("image", None)
        for k in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds", "schedulingGates"):
            s.pop(k, None)
        return s

    # -- binding --

    def bind(self, ns, name, binding, path):
        """BindingREST.Create (pkg/registry/core/pod/storage): validation, then in one update:
        uid/resourceVersion preconditions from the Binding's metadata, "being deleted" and "already
        assigned" conflicts (NewConflict on pods/binding), spec.nodeName, the Binding's annotations,
        and the PodScheduled=True condition. The target node is NOT looked up (upstream does not)."""
        if not isinstance(binding, dict) or binding.get("kind", "Binding") != "Binding":
            raise bad_request("not a Binding object")
        bmeta = binding.get("metadata") or {}
        if bmeta.get("name") != name:
            raise bad_request("name in URL does not match name in Binding object")
        if bmeta.get("namespace", ns) != ns:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        target = binding.get("target") or {}
        errors = []
        if target.get("kind", "") not in ("", "Node"):
            errors.append(FieldError("Invalid", "target.kind", "must be empty or 'Node'", target["kind"]))
        if not target.get("name"):
            errors.append(FieldError("Required", "target.name"))
        if errors:
            raise invalid("Binding", name, errors)

        def assign(pod):
            meta = pod["metadata"]
            if bmeta.get("uid") and bmeta["uid"] != meta["uid"]:
                raise conflict("pods", name, f"Precondition failed: UID in precondition: {bmeta['uid']}, UID in object meta: {meta['uid']}")
            if bmeta.get("resourceVersion") and bmeta["resourceVersion"] != meta["resourceVersion"]:
                raise conflict("pods", name)
            if meta.get("deletionTimestamp"):
                raise conflict("pods/binding", name, f"pod {name} is being deleted, cannot be assigned to a host")
            node = pod.get("spec", {}).get("nodeName")
            if node:
                raise conflict("pods/binding", name, f'pod {name} is already assigned to node "{node}"')
            pod.setdefault("spec", {})["nodeName"] = target["name"]
            if bmeta.get("annotations"):
                meta.setdefault("annotations", {}).update(bmeta["annotations"])
            conds = pod.setdefault("status", {}).setdefault("conditions", [])
            cond = {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now()}
            for i, c in enumerate(conds):
                if c.get("type") == "PodScheduled":
                    conds[i] = cond
                    break
            else:
                conds.append(cond)
            return pod

        # The binding writes status too, so it goes through the store without the main resource's
        # "status is dropped" rule: use a private mutate + direct write.
        with self.lock:
            key = ("pods", ns, name)
            current = self.objects.get(key)
            if current is None:
                raise not_found("pods", name)
            if path and self.conflicts.get(path, 0) > 0:
                self.conflicts[path] -= 1
                raise conflict("pods", name)
            new = assign(copy.deepcopy(current))
            new["metadata"]["resourceVersion"] = self._bump()
            self.objects[key] = new
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    # -- delete --

    def delete(self, res, ns, name, options):
        """Store.Delete: preconditions (409), graceful deletion for pods (podStrategy.CheckGracefulDelete:
        a pod bound to a node gets deletionTimestamp and stays until deleted with grace period 0; an
        unbound or finished pod goes at once), then the answer: the pod itself (ReturnDeletedObject), or
        for nodes and configmaps a Status Success whose details name the object."""
        pre = options.get("preconditions") or {}
        with self.lock:
            key = (res.name, ns if res.namespaced else "", name)
            current = self.objects.get(key)
            if current is None:
                raise not_found(res.name, name, res.group)
            meta = current["metadata"]
            if pre.get("uid") and pre["uid"] != meta["uid"]:
                raise conflict(res.name, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {meta['uid']}",
                               res.group)
            if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
                raise conflict(res.name, name, f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                                               f"ResourceVersion in object meta: {meta['resourceVersion']}", res.group)
            if res.name == "pods":
                grace = options.get("gracePeriodSeconds")
                spec, phase = current.get("spec") or {}, (current.get("status") or {}).get("phase")
                if grace is None:
                    grace = spec.get("terminationGracePeriodSeconds", 30)
                if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
                    grace = 0
                if grace > 0:
                    if meta.get("deletionGracePeriodSeconds", grace + 1) > grace:
                        at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=grace)
                        new = copy.deepcopy(current)
                        new["metadata"]["deletionTimestamp"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
                        new["metadata"]["deletionGracePeriodSeconds"] = grace
                        new["metadata"]["resourceVersion"] = self._bump()
                        self.objects[key] = current = new
                    return copy.deepcopy(current)
            del self.objects[key]
            meta["resourceVersion"] = self._bump()
        if res.return_deleted:
            return current
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "kind": res.name, "uid": meta["uid"]}}

    def webhooks(self, resource):
        """[(configuration name, webhook)] of one kind, configurations sorted by name and webhooks in
        their order, as the real server calls mutating webhooks (generic/webhook.go sorts the
        accessors by configuration name)."""
        with self.lock:
            out = []
            for (r, _, name), obj in sorted(self.objects.items()):
                if r == resource:
                    out.extend((name, copy.deepcopy(w)) for w in obj.get("webhooks") or [])
            return out

    def namespace_labels(self, ns):
        """A namespace's labels; a namespace that is not stored counts as existing with only its
        kubernetes.io/metadata.name label (the sim does not require namespaces to exist)."""
        with self.lock:
            obj = self.objects.get(("namespaces", "", ns))
            return copy.deepcopy(_meta(obj).get("labels") or {}) if obj else {NAMESPACE_NAME_LABEL: ns}

    def dump(self):
        with self.lock:
            out = {r: [] for r in RESOURCES}
            for (r, _, _), obj in sorted(self.objects.items()):
                out[r].append(copy.deepcopy(obj))
            return {"resourceVersion": str(self.rv), "objects": out}


# ---- dynamic admission ---------------------------------------------------------------------------
# k8s.io/apiserver/pkg/admission/plugin/webhook: generic/webhook.go ShouldCallHook (namespaceSelector,
# objectSelector, rules, then matchConditions), mutating/dispatcher.go and validating/dispatcher.go
# (the call, failurePolicy, patches, warnings), request/admissionreview.go (the AdmissionReview v1
# request and the checks on the response), errors/statuserror.go ToStatusErr (a denial), and
# k8s.io/apiserver/pkg/util/webhook (ErrCallingWebhook: `failed calling webhook "<name>": ...`).
# Documented at https://kubernetes.io/docs/reference/access-authn-authz/extensible-admission-controllers/

OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")
CEL_MISSING = ("apiserver-sim cannot evaluate matchConditions: the cel_expr_python package is not importable "
               "(pip install -r tests/requirements.txt)")
_CEL = {}  # "env" and compiled programs by expression


def _cel_program(expr):
    """Compiles (and caches) a matchCondition with the variables the API server declares for
    webhook matchConditions (object, oldObject, request; authorizer is not offered) and the
    optional-types extension Kubernetes enables. Raises RuntimeError when it does not compile."""
    if _cel is None:
        raise RuntimeError(CEL_MISSING)
    if "env" not in _CEL:
        _CEL["env"] = _cel.NewEnv(variables={n: _cel.Type.DYN for n in ("object", "oldObject", "request")},
                                  extensions=[_cel_optional.ExtOptional()])
    if expr not in _CEL:
        _CEL[expr] = _CEL["env"].compile(expr)
    return _CEL[expr]


def _cel_eval(expr, data):
    """True/False, or raises ValueError (an evaluation error or a result that is not a bool)."""
    try:
        v = _cel_program(expr).eval(data=data)
    except Exception as e:
        raise ValueError(str(e)) from e
    if v.type() == _cel.Type.ERROR:
        raise ValueError(str(v.value()))
    out = v.plain_value()
    if not isinstance(out, bool):
        raise ValueError(f"matchCondition {expr!r} evaluated to {out!r}, not a bool")
    return out


def validate_webhook_configuration(res, obj):
    """SetDefaults_{Mutating,Validating}Webhook (admissionregistration/v1/defaults.go) and a subset of
    ValidateMutatingWebhookConfiguration (pkg/apis/admissionregistration/validation): the errors,
    as FieldErrors. Deviation: admissionReviewVersions must include "v1" (the sim sends v1 only)."""
    mutating = res.name == "mutatingwebhookconfigurations"
    errors, seen = [], set()
    hooks = obj.get("webhooks")
    if hooks is None:
        hooks = []
    if not isinstance(hooks, list):
        return [FieldError("Invalid", "webhooks", "must be a list", hooks)]
    for i, w in enumerate(hooks):
        f = f"webhooks[{i}]"
        if not isinstance(w, dict):
            errors.append(FieldError("Invalid", f, "must be an object", w))
            continue
        w.setdefault("failurePolicy", "Fail")
        w.setdefault("matchPolicy", "Equivalent")
        w.setdefault("namespaceSelector", {})
        w.setdefault("objectSelector", {})
        w.setdefault("timeoutSeconds", 10)
        if mutating:
            w.setdefault("reinvocationPolicy", "Never")
        name = w.get("name") or ""
        if not name:
            errors.append(FieldError("Required", f"{f}.name"))
        elif name in seen:
            errors.append(FieldError("Duplicate", f"{f}.name", value=name))
        seen.add(name)
        cc = w.get("clientConfig") if isinstance(w.get("clientConfig"), dict) else {}
        if bool(cc.get("url")) == bool(cc.get("service")):
            errors.append(FieldError("Required", f"{f}.clientConfig", "exactly one of url or service is required"))
        elif cc.get("url"):
            u = urllib.parse.urlsplit(cc["url"])
            if u.scheme != "https":
                errors.append(FieldError("Invalid", f"{f}.clientConfig.url", "'https' is the only allowed URL scheme", cc["url"]))
            if not u.hostname:
                errors.append(FieldError("Invalid", f"{f}.clientConfig.url", "host must be specified", cc["url"]))
        else:
            svc = cc["service"]
            for k in ("namespace", "name"):
                if not svc.get(k):
                    errors.append(FieldError("Required", f"{f}.clientConfig.service.{k}", "service " + k + " is required"))
            svc.setdefault("port", 443)
            if not (isinstance(svc["port"], int) and 1 <= svc["port"] <= 65535):
                errors.append(FieldError("Invalid", f"{f}.clientConfig.service.port", "port is not valid", svc["port"]))
        if cc.get("caBundle"):
            try:
                base64.b64decode(cc["caBundle"], validate=True)
            except (binascii.Error, TypeError):
                errors.append(FieldError("Invalid", f"{f}.clientConfig.caBundle", "not base64", "<caBundle>"))
        versions = w.get("admissionReviewVersions")
        if not versions:
            errors.append(FieldError("Required", f"{f}.admissionReviewVersions", "must specify one of v1, v1beta1"))
        elif "v1" not in versions:
            errors.append(FieldError("Invalid", f"{f}.admissionReviewVersions",
                                     "apiserver-sim sends AdmissionReview v1 only: must include v1", versions))
        if w.get("sideEffects") is None:
            errors.append(FieldError("Required", f"{f}.sideEffects", "must specify one of None, NoneOnDryRun"))
        elif w["sideEffects"] not in ("None", "NoneOnDryRun"):
            errors.append(FieldError("NotSupported", f"{f}.sideEffects", 'supported values: "None", "NoneOnDryRun"', w["sideEffects"]))
        if w["failurePolicy"] not in ("Fail", "Ignore"):
            errors.append(FieldError("NotSupported", f"{f}.failurePolicy", 'supported values: "Fail", "Ignore"', w["failurePolicy"]))
        if mutating and w["reinvocationPolicy"] not in ("Never", "IfNeeded"):
            errors.append(FieldError("NotSupported", f"{f}.reinvocationPolicy", 'supported values: "IfNeeded", "Never"',
                                     w["reinvocationPolicy"]))
        t = w["timeoutSeconds"]
        if not isinstance(t, int) or isinstance(t, bool) or not 1 <= t <= 30:
            errors.append(FieldError("Invalid", f"{f}.timeoutSeconds", "the timeout value must be between 1 and 30 seconds", t))
        for j, rule in enumerate(w.get("rules") or []):
            rule.setdefault("scope", "*")
            for op in rule.get("operations") or []:
                if op != "*" and op not in OPERATIONS:
                    errors.append(FieldError("NotSupported", f"{f}.rules[{j}].operations",
                                             'supported values: "*", "CONNECT", "CREATE", "DELETE", "UPDATE"', op))
        for j, mc in enumerate(w.get("matchConditions") or []):
            if not mc.get("name"):
                errors.append(FieldError("Required", f"{f}.matchConditions[{j}].name"))
            if _cel is None:
                errors.append(FieldError("Forbidden", f"{f}.matchConditions[{j}].expression", CEL_MISSING))
                continue
            try:
                _cel_program(mc.get("expression") or "")
            except RuntimeError as e:
                errors.append(FieldError("Invalid", f"{f}.matchConditions[{j}].expression", f"compilation failed: {e}",
                                         mc.get("expression")))
    return errors


def label_selector_matches(sel, labels):
    """metav1.LabelSelectorAsSelector: matchLabels and matchExpressions (In, NotIn, Exists,
    DoesNotExist) all hold; an empty selector matches everything. An operator it does not know
    makes the selector match nothing."""
    labels = labels or {}
    sel = sel or {}
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            return False
        if not ok:
            return False
    return True


def _rule_matches(rule, a):
    """rules.Matcher (admission/plugin/webhook/predicates/rules/rules.go): operation, group, version,
    resource and scope. "pods" matches only the main resource, "pods/status" one subresource,
    "pods/*" every pods subresource, "*" every main resource, "*/*" everything. A namespace object
    is cluster-scoped for the scope check."""
    def has(values, v):
        return "*" in (values or []) or v in (values or [])
    if not (has(rule.get("operations"), a["operation"]) and has(rule.get("apiGroups"), a["group"])
            and has(rule.get("apiVersions"), "v1")):
        return False
    for r in rule.get("resources") or []:
        res, _, sub = r.partition("/")
        if (res == "*" or res == a["resource"]) and (sub == "*" or sub == a["subResource"]):
            break
    else:
        return False
    scope = rule.get("scope") or "*"
    if scope == "Cluster":
        return a["resource"] == "namespaces" or a["namespace"] == ""
    if scope == "Namespaced":
        return a["resource"] != "namespaces" and a["namespace"] != ""
    return True


class _CallError(Exception):
    """webhookutil.ErrCallingWebhook: subject to the failurePolicy."""


class _HookConnection(http.client.HTTPSConnection):
    """HTTPS to `address`, verifying the certificate for `server_hostname` (the name the real
    server would dial: NAME.NAMESPACE.svc for a Service, the url's host for a url)."""

    def __init__(self, address, server_hostname, port, context, timeout):
        super().__init__(server_hostname, port, timeout=timeout, context=context)
        self._address = address

    def connect(self):
        sock = socket.create_connection(self._address, self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _warning_header(text):
    """warning.AddWarning → `Warning: 299 - "<text>"` (quotes and backslashes escaped)."""
    text = "".join(c if c.isprintable() else " " for c in text)
    return '299 - "' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_status_err(webhook_name, result):
    """webhookerrors.ToStatusErr: the webhook's Status with code at least 400, status Failure, and
    the message `admission webhook "<name>" denied the request: <message or reason>`."""
    result = dict(result) if isinstance(result, dict) else {}
    denied = f'admission webhook "{webhook_name}" denied the request'
    if result.get("message"):
        message = f"{denied}: {result['message']}"
    elif result.get("reason"):
        message = f"{denied}: {result['reason']}"
    else:
        message = f"{denied} without explanation"
    code = result.get("code") if isinstance(result.get("code"), int) else 0
    err = ApiError(max(code, 400), result.get("reason") or "", message, result.get("details"))
    if not err.status["reason"]:
        del err.status["reason"]  # omitempty
    return err


class AdmissionContext:
    """What one API request collects: its user, the webhook calls (for /_sim/requests) and warnings."""

    def __init__(self, user):
        self.user = user
        self.calls = None  # a list once admission ran
        self.warnings = []


class Admission:
    """One admission request (attributes fixed: operation, resource, names, options). `mutate(obj,
    old)` runs the mutating webhooks and returns the object they produced; `validate(obj, old)` runs
    the validating ones. Both raise ApiError when the request must fail."""

    def __init__(self, server, ctx, operation, res, namespace, name, subresource="", kind=None, options=None):
        self.server, self.ctx = server, ctx
        kind = kind or {"group": res.group, "version": "v1", "kind": res.kind}
        self.res = res
        self.attrs = {
            "operation": operation, "group": res.group, "resource": res.name, "subResource": subresource or "",
            # for a namespace object, the request's namespace is the namespace's own name
            "namespace": name if res.name == "namespaces" else (namespace or ""),
        }
        self.request = {
            "kind": kind, "resource": {"group": res.group, "version": "v1", "resource": res.name},
            "requestKind": kind, "requestResource": {"group": res.group, "version": "v1", "resource": res.name},
            "name": name or "", "namespace": self.attrs["namespace"], "operation": operation,
            "userInfo": ctx.user, "dryRun": False, "options": options,
        }
        if subresource:
            self.request["subResource"] = self.request["requestSubResource"] = subresource
        if ctx.calls is None:
            ctx.calls = []

    def mutate(self, obj, old):
        return self._run("mutatingwebhookconfigurations", obj, old)

    def validate(self, obj, old):
        self._run("validatingwebhookconfigurations", obj, old)

    # -- which webhooks --

    def _should_call(self, hook, obj, old, request):
        """ShouldCallHook: namespaceSelector, objectSelector, rules, then every matchCondition (one
        false: skipped; an error and none false: failurePolicy, Fail = 403 Forbidden)."""
        ns_sel = hook.get("namespaceSelector") or {}
        if ns_sel:
            if self.res.name == "namespaces":
                labels = _meta(obj or old or {}).get("labels")
            elif self.res.namespaced:
                labels = self.server.store.namespace_labels(self.attrs["namespace"])
            else:
                labels = None  # other cluster-scoped objects: never skipped by the namespaceSelector
            if labels is not None and not label_selector_matches(ns_sel, labels):
                return False
        obj_sel = hook.get("objectSelector") or {}
        if obj_sel and not any(o is not None and label_selector_matches(obj_sel, _meta(copy.deepcopy(o)).get("labels"))
                               for o in (obj, old)):
            return False
        if not any(_rule_matches(r, self.attrs) for r in hook.get("rules") or []):
            return False
        conditions = hook.get("matchConditions") or []
        if not conditions:
            return True
        if _cel is None:
            raise internal_error(CEL_MISSING)
        data = {"object": obj, "oldObject": old, "request": request}
        errors = []
        for mc in conditions:
            try:
                if not _cel_eval(mc.get("expression") or "", data):
                    return False
            except ValueError as e:
                errors.append(f"matchCondition {mc.get('name')!r}: {e}")
        if not errors:
            return True
        if hook.get("failurePolicy") == "Ignore":
            self.ctx.calls.append({"webhook": hook.get("name"), "called": False, "allowed": None, "patched": False,
                                   "error": "; ".join(errors)})
            return False
        msg = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
        raise forbidden(self.res.name, self.request["name"], msg, self.res.group)

    # -- the dispatch --

    def _run(self, kind, obj, old):
        mutating = kind == "mutatingwebhookconfigurations"
        for configuration, hook in self.server.store.webhooks(kind):
            request = dict(self.request, uid=str(uuid.uuid4()), object=obj, oldObject=old)
            cel_request = {k: v for k, v in request.items() if k not in ("object", "oldObject", "uid")}
            if not self._should_call(hook, obj, old, cel_request):
                continue
            name = hook.get("name")
            record = {"webhook": name, "configuration": configuration, "type": "mutating" if mutating else "validating",
                      "operation": self.attrs["operation"], "called": True, "allowed": None, "patched": False, "error": None}
            self.ctx.calls.append(record)
            try:
                response = self._call(hook, request, mutating)
            except _CallError as e:
                record["error"] = f'failed calling webhook "{name}": {e}'
                if hook.get("failurePolicy") == "Ignore":
                    continue  # fail open: the webhook's mutations are not applied
                raise internal_error(record["error"])
            for w in response.get("warnings") or []:
                if isinstance(w, str) and w not in self.ctx.warnings:
                    self.ctx.warnings.append(w)
            record["allowed"] = response.get("allowed") is True
            if not record["allowed"]:
                raise to_status_err(name, response.get("status"))
            if mutating and response.get("patch"):
                obj = self._apply_patch(hook, record, response, obj)
        return obj

    def _apply_patch(self, hook, record, response, obj):
        name = hook.get("name")
        if response.get("patchType") != "JSONPatch":
            record["error"] = f'failed calling webhook "{name}": unsupported patch type "{response.get("patchType")}"'
            if hook.get("failurePolicy") == "Ignore":
                return obj
            raise internal_error(record["error"])
        try:
            ops = json.loads(base64.b64decode(response["patch"], validate=True))
            check_json_patch(ops)
        except (binascii.Error, ValueError, TypeError, ApiError) as e:
            record["error"] = (f'failed calling webhook "{name}": received undecodable patch in webhook response: '
                               f"{getattr(e, 'status', {}).get('message') or e}")
            if hook.get("failurePolicy") == "Ignore":
                return obj
            raise internal_error(record["error"])
        if not ops:
            return obj
        if obj is None:  # DELETE: there is no object to patch
            record["error"] = f'admission webhook "{name}" attempted to modify the object, which is not supported for this operation'
            raise internal_error(record["error"])
        try:
            patched = json_patch(obj, ops)
        except ApiError as e:
            # patchObj.Apply failing is an InternalError whatever the failurePolicy (mutating/dispatcher.go)
            record["error"] = f'the JSON patch of admission webhook "{name}" does not apply: {e.status["message"]}'
            raise internal_error(record["error"])
        record["patched"] = patched != obj
        return patched

    def _call(self, hook, request, mutating):
        """POSTs the AdmissionReview and returns the verified `response` (VerifyAdmissionResponse)."""
        cc = hook.get("clientConfig") or {}
        timeout = hook.get("timeoutSeconds") or 10
        if cc.get("url"):
            u = urllib.parse.urlsplit(cc["url"])
            host, port = u.hostname, u.port or 443
            address = (host, port)
            path = (u.path or "/") + "?" + (u.query + "&" if u.query else "")
            shown = cc["url"]
        else:
            svc = cc.get("service") or {}
            host, port = f"{svc.get('name')}.{svc.get('namespace')}.svc", svc.get("port") or 443
            address = self.server.service_endpoints.get((svc.get("namespace"), svc.get("name")))
            path = (svc.get("path") or "/") + "?"
            shown = f"https://{host}:{port}{svc.get('path') or '/'}"
        path += f"timeout={timeout}s"
        shown += ("&" if "?" in shown else "?") + f"timeout={timeout}s"
        post = f'failed to call webhook: Post "{shown}"'
        if address is None:
            raise _CallError(f"{post}: apiserver-sim has no address for service {svc.get('namespace')}/{svc.get('name')} "
                             "(--service-endpoint or POST /_sim/service-endpoint)")
        try:
            context = ssl.create_default_context()
            if cc.get("caBundle"):
                context = ssl.create_default_context(cadata=base64.b64decode(cc["caBundle"]).decode())
        except (ssl.SSLError, ValueError, binascii.Error) as e:
            raise _CallError(f"could not get REST client: unable to load root certificates: {e}")
        body = json.dumps({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": request}).encode()
        conn = _HookConnection(address, host, port, context, timeout)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json", "Accept": "application/json",
                                              "User-Agent": f"kube-apiserver-admission/{GIT_VERSION}"})
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        except (TimeoutError, socket.timeout):
            raise _CallError(f"{post}: context deadline exceeded")
        except ConnectionRefusedError:
            raise _CallError(f"{post}: dial tcp {address[0]}:{address[1]}: connect: connection refused")
        except ssl.SSLCertVerificationError as e:
            raise _CallError(f"{post}: tls: failed to verify certificate: {e.verify_message}")
        except (OSError, http.client.HTTPException) as e:
            raise _CallError(f"{post}: {type(e).__name__}: {e}")
        finally:
            conn.close()
        if not 200 <= status < 300:
            raise _CallError(f"{post}: the webhook answered HTTP {status}: {raw[:200].decode(errors='replace')}")
        try:
            review = json.loads(raw)
        except ValueError as e:
            raise _CallError(f"failed to call webhook: the answer is not JSON: {e}")
        bad = "received invalid webhook response: "
        if not isinstance(review, dict) or not isinstance(review.get("response"), dict):
            raise _CallError(bad + "webhook response was absent")
        response = review["response"]
        if response.get("uid") != request["uid"]:
            raise _CallError(bad + f'expected response.uid="{request["uid"]}", got "{response.get("uid", "")}"')
        if (review.get("apiVersion"), review.get("kind")) != ("admission.k8s.io/v1", "AdmissionReview"):
            raise _CallError(bad + "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got "
                             f"{review.get('apiVersion', '')}, Kind={review.get('kind', '')}")
        if mutating:
            if response.get("patch") and response.get("patchType") is None:
                raise _CallError(bad + "webhook returned response.patch but not response.patchType")
            if not response.get("patch") and response.get("patchType") is not None:
                raise _CallError(bad + "webhook returned response.patchType but not response.patch")
        elif response.get("patch"):
            raise _CallError(bad + "validating webhook may not return response.patch")
        elif response.get("patchType") is not None:
            raise _CallError(bad + "validating webhook may not return response.patchType")
        return response


# ---- discovery -----------------------------------------------------------------------------------
# /api (APIVersions), /api/v1 (APIResourceList), /apis (APIGroupList of the named groups served),
# /apis/<group>[/v1] and /version (version.Info), shaped like the real documents.


def api_versions(host):
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]}


def api_group(group):
    gv = {"groupVersion": f"{group}/v1", "version": "v1"}
    return {"name": group, "versions": [gv], "preferredVersion": gv}


def api_group_list():
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group(g) for g in GROUPS]}


def api_resource_list(group=""):
    resources = []
    for res in (r for r in RESOURCES.values() if r.group == group):
        singular = res.kind.lower()
        resources.append({"name": res.name, "singularName": singular, "namespaced": res.namespaced, "kind": res.kind,
                          "verbs": MAIN_VERBS, "shortNames": list(res.short_names)})
        for sub in res.subresources:
            if sub == "binding":
                resources.append({"name": "pods/binding", "singularName": "", "namespaced": True, "kind": "Binding", "verbs": ["create"]})
            else:
                resources.append({"name": f"{res.name}/{sub}", "singularName": "", "namespaced": res.namespaced, "kind": res.kind,
                                  "verbs": STATUS_VERBS})
    resources.sort(key=lambda r: r["name"])
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/v1" if group else "v1",
            "resources": resources}


def version_info():
    major, minor, _ = GIT_VERSION[1:].split(".")
    return {"major": major, "minor": minor, "emulationMajor": major, "emulationMinor": minor,
            "minCompatibilityMajor": major, "minCompatibilityMinor": str(int(minor) - 1),
            "gitVersion": GIT_VERSION, "gitCommit": "0" * 40, "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25.5", "compiler": "gc", "platform": "linux/amd64"}


# ---- HTTP ----------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    """Routes the core/v1 URL space (pkg/endpoints/installer.go's paths) and /_sim/."""

    protocol_version = "HTTP/1.1"
    server_version = "apiserver-sim"

    # -- plumbing --

    def log_message(self, fmt, *args):  # the request log at /_sim/requests replaces stderr noise
        pass

    def _body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _json_body(self, raw):
        if not raw.strip():
            raise bad_request("the request body is empty")
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise bad_request(f"json: cannot unmarshal the request body: {e}")

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        parsed = urllib.parse.urlsplit(self.path)  # logged before answering, so the log is in answer order
        adm = getattr(self, "_adm", None)
        if not parsed.path.startswith("/_sim/"):
            entry = {
                "method": self.command, "path": parsed.path, "query": parsed.query,
                "contentType": self.headers.get("Content-Type", ""), "status": code,
                "authorization": (self.headers.get("Authorization") or "").split(" ")[0],
            }
            if adm is not None:
                entry["user"] = adm.user["username"]
                if adm.calls is not None:
                    entry["admission"] = adm.calls
            self.server.log_request_entry(entry)
        self.send_response(code)
        for w in (adm.warnings if adm is not None else []):
            self.send_header("Warning", _warning_header(w))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        self.wfile.write(data)

    def _user(self):
        """The authenticated user: a bearer token from --user or /_sim/users; any other bearer token is
        the default user `apiserver-sim` (tokens are not checked, so that every client keeps working);
        no token is `system:anonymous` (anonymous auth, as kube-apiserver enables by default)."""
        auth = self.headers.get("Authorization") or ""
        if auth[:7].lower() == "bearer ":
            return copy.deepcopy(self.server.users.get(auth[7:].strip()) or DEFAULT_USER)
        return copy.deepcopy(ANONYMOUS_USER)

    def _handle(self):
        raw = self._body()
        self._adm = AdmissionContext(self._user())
        try:
            code, obj = self._route(raw)
        except ApiError as e:
            code, obj = e.code, e.status
        except Exception as e:  # a bug in the simulator: answer like the real server's InternalError
            err = internal_error(f"apiserver-sim: {type(e).__name__}: {e}")
            code, obj = err.code, err.status
        self._send(code, obj)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

    # -- routing --

    def _route(self, raw):
        parsed = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(parsed.query, keep_blank_values=True))
        parts = [urllib.parse.unquote(p) for p in parsed.path.split("/") if p]
        store, method = self.server.store, self.command

        if parts[:1] == ["_sim"]:
            self._raw = raw
            return self._sim(parts[1:], query, method)
        if method == "GET" and parts == ["version"]:
            return 200, version_info()
        if method == "GET" and parts == ["api"]:
            return 200, api_versions(f"{self.server.server_address[0]}:{self.server.server_address[1]}")
        if method == "GET" and parts == ["api", "v1"]:
            return 200, api_resource_list()
        if method == "GET" and parts == ["apis"]:
            return 200, api_group_list()
        if method == "GET" and len(parts) == 2 and parts[0] == "apis" and parts[1] in GROUPS:
            return 200, {"kind": "APIGroup", "apiVersion": "v1", **api_group(parts[1])}
        if method == "GET" and len(parts) == 3 and parts[0] == "apis" and parts[1] in GROUPS and parts[2] == "v1":
            return 200, api_resource_list(parts[1])
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3 and parts[1] in GROUPS and parts[2] == "v1":
            group, rest = parts[1], parts[3:]
        else:
            raise path_not_found()
        if query.get("watch") in ("true", "1") or rest[:1] == ["watch"]:
            raise method_not_allowed("watch is not simulated by apiserver-sim: list and poll instead")
        if query.get("dryRun"):
            raise bad_request("dryRun is not simulated by apiserver-sim")

        # /api/v1/namespaces/{ns}/{resource}[/{name}[/{sub}]] or /api/v1/{resource}[/{name}[/{sub}]]
        # (and the same under /apis/<group>/v1)
        ns = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        if not rest or rest[0] not in RESOURCES or RESOURCES[rest[0]].group != group or len(rest) > 3:
            raise path_not_found()
        res = RESOURCES[rest[0]]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if ns is not None and not res.namespaced:
            raise path_not_found()
        if res.namespaced and ns is None and (name is not None or method != "GET"):
            raise path_not_found()  # a namespaced object needs its namespace (only list works across them)
        if sub is not None and sub not in res.subresources:
            raise path_not_found()
        obj_path = "/" + "/".join(parts[:len(parts) - (1 if sub else 0)])

        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if method in ("POST", "PUT") and ctype != "application/json":
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted media types "
                           "include: application/json (apiserver-sim speaks JSON only)", {})

        if name is None:  # the collection
            if method == "GET":
                return 200, store.list(res, ns, query.get("labelSelector", ""), query.get("fieldSelector", ""))
            if method == "POST":
                body = self._json_body(raw)
                gen = body.get("metadata", {}).get("name", "") if isinstance(body, dict) and isinstance(body.get("metadata"), dict) else ""
                return 201, store.create(res, ns or "", body, self._admission("CREATE", res, ns, gen, options=CREATE_OPTIONS))
            if method == "DELETE":
                return 200, self._delete_collection(res, ns, query, raw)
            raise method_not_allowed()

        if sub == "binding":
            if method != "POST":
                raise method_not_allowed()
            binding = self._json_body(raw)
            if isinstance(binding, dict):
                binding = typed(Resource("bindings", "Binding", True, (), (), (), False), binding)
                adm = self._admission("CREATE", res, ns, name, "binding", {"group": "", "version": "v1", "kind": "Binding"},
                                      CREATE_OPTIONS)
                if adm is not None:
                    binding = adm.mutate(binding, None)
                    adm.validate(binding, None)
            return 201, store.bind(ns, name, binding, obj_path)
        if method == "GET":
            return 200, store.get(res, ns or "", name)
        adm = self._admission("UPDATE", res, ns, name, sub, options=UPDATE_OPTIONS)
        if method == "PUT":
            body = self._json_body(raw)
            if not isinstance(body, dict):
                raise bad_request(f"the body of the request is not a {res.kind} object")
            return 200, store.update(res, ns or "", name, lambda cur: store.decode(res, body), sub, obj_path, adm)
        if method == "PATCH":
            return 200, self._patch(res, ns or "", name, sub, raw, obj_path, adm)
        if method == "DELETE" and sub is None:
            return 200, self._delete(res, ns or "", name, self._delete_options(query, raw))
        raise method_not_allowed()

    def _admission(self, operation, res, ns, name, sub=None, kind=None, options=None):
        """The admission request for a write, or None for the webhook configurations themselves
        (rules.IsExemptAdmissionConfigurationResource: they never go through webhooks)."""
        if res.group == ADMISSION_GROUP:
            return None
        return Admission(self.server, self._adm, operation, res, ns, name, sub or "", kind, options)

    def _delete(self, res, ns, name, opts):
        """DELETE: admission (object null, oldObject the stored object, options the DeleteOptions), then the delete."""
        adm = self._admission("DELETE", res, ns, name,
                              options={"kind": "DeleteOptions", "apiVersion": "meta.k8s.io/v1",
                                       **{k: v for k, v in opts.items() if k not in ("kind", "apiVersion")}})
        if adm is not None:
            old = self.server.store.get(res, ns, name)
            adm.mutate(None, old)
            adm.validate(None, old)
        return self.server.store.delete(res, ns, name, opts)

    def _patch(self, res, ns, name, sub, raw, obj_path, adm=None):
        """PATCH (staging/.../endpoints/handlers/patch.go): the patch is applied to the current object,
        then saved as an update, so a metadata.resourceVersion in the patch acts as a precondition."""
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if ctype not in PATCH_TYPES:
            raise ApiError(415, "UnsupportedMediaType",
                           f"the body of the request was in an unknown format - accepted media types include: {', '.join(PATCH_TYPES)}"
                           + (" (server-side apply is not simulated by apiserver-sim)" if ctype == "application/apply-patch+yaml" else ""),
                           {})
        patch = self._json_body(raw)
        if ctype == "application/json-patch+json":
            check_json_patch(patch)
            return self.server.store.update(res, ns, name, lambda cur: json_patch(cur, patch), sub, obj_path, adm)
        if not isinstance(patch, dict):
            raise bad_request("Invalid JSON Patch")
        if ctype == "application/strategic-merge-patch+json":
            _reject_directives(patch)
        return self.server.store.update(res, ns, name, lambda cur: merge_patch(cur, patch), sub, obj_path, adm)

    def _delete_options(self, query, raw):
        opts = self._json_body(raw) if raw.strip() else {}
        if not isinstance(opts, dict):
            raise bad_request("the body of the request is not a DeleteOptions object")
        if "gracePeriodSeconds" in query:
            try:
                opts["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
            except ValueError:
                raise bad_request(f"invalid gracePeriodSeconds {query['gracePeriodSeconds']!r}")
        return opts

    def _delete_collection(self, res, ns, query, raw):
        """DeleteCollection: deletes each listed object as a DELETE would; answers the list of them."""
        store = self.server.store
        opts = self._delete_options(query, raw)
        listed = store.list(res, ns, query.get("labelSelector", ""), query.get("fieldSelector", ""))
        items = []
        for item in listed["items"]:
            try:
                out = self._delete(res, item["metadata"].get("namespace", ""), item["metadata"]["name"], opts)
            except ApiError as e:
                if e.code == 404:
                    continue  # deleted meanwhile
                raise
            items.append(out if out.get("kind") == res.kind else item)
        for item in items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {"kind": res.kind + "List", "apiVersion": res.api_version, "metadata": {"resourceVersion": str(store.rv)},
                "items": items}

    # -- test-only endpoints --

    def _sim(self, parts, query, method):
        store = self.server.store
        if method == "GET" and parts == ["requests"]:
            return 200, {"requests": self.server.request_log_snapshot()}
        if method == "GET" and parts == ["objects"]:
            return 200, store.dump()
        if method == "POST" and parts == ["reset"]:
            store.reset()
            self.server.clear_request_log()
            return 200, {"reset": True}
        if method == "POST" and parts == ["conflict-next"]:
            path = query.get("path", "")
            if not path.startswith(("/api/v1/", "/apis/")):
                raise bad_request("conflict-next needs path=/api/v1/... or /apis/<group>/v1/... (an object path)")
            try:
                count = int(query.get("count", "1"))
            except ValueError:
                raise bad_request("count must be an integer")
            with store.lock:
                store.conflicts[path.rstrip("/")] = count
            return 200, {"path": path, "count": count}
        if parts == ["users"] and method == "GET":
            return 200, {"users": self.server.users}
        if parts == ["users"] and method == "POST":
            body = self._json_body(self._raw)
            if not isinstance(body, dict) or not body.get("token") or not body.get("username"):
                raise bad_request('POST /_sim/users needs {"token", "username", "uid"?, "groups"?, "extra"?}')
            info = user_info(body["username"], body.get("groups") or [], body.get("uid"), body.get("extra"))
            self.server.users[body["token"]] = info
            return 200, {"token": body["token"], "userInfo": info}
        if parts == ["service-endpoints"] and method == "GET":
            return 200, {"endpoints": [{"namespace": ns, "name": n, "address": f"{h}:{p}"}
                                       for (ns, n), (h, p) in sorted(self.server.service_endpoints.items())]}
        if parts == ["service-endpoint"] and method == "POST":
            body = self._json_body(self._raw)
            if not isinstance(body, dict) or not body.get("namespace") or not body.get("name"):
                raise bad_request('POST /_sim/service-endpoint needs {"namespace", "name", "address": "HOST:PORT"}')
            try:
                address = parse_address(body.get("address") or "")
            except ValueError as e:
                raise bad_request(str(e))
            self.server.service_endpoints[(body["namespace"], body["name"])] = address
            return 200, {"namespace": body["namespace"], "name": body["name"], "address": f"{address[0]}:{address[1]}"}
        raise path_not_found()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address):
        super().__init__(address, Handler)
        self.store = Store()
        self.users = {}  # bearer token -> userInfo (authentication.k8s.io/v1 UserInfo)
        self.service_endpoints = {}  # (namespace, name) -> (host, port) of a webhook Service
        self._log = []
        self._log_lock = threading.Lock()

    def log_request_entry(self, entry):
        with self._log_lock:
            self._log.append(entry)

    def request_log_snapshot(self):
        with self._log_lock:
            return list(self._log)

    def clear_request_log(self):
        with self._log_lock:
            self._log.clear()

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


# ---- users -----------------------------------------------------------------------------------------
# authentication.k8s.io/v1 UserInfo as a token authenticator gives it: every authenticated user is also
# in system:authenticated (k8s.io/apiserver/pkg/authentication/group.AuthenticatedGroupAdder).

CREATE_OPTIONS = {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
UPDATE_OPTIONS = {"kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1"}  # PATCH too (patchToUpdateOptions)


def user_info(username, groups=(), uid=None, extra=None):
    groups = [g for g in groups if g]
    if username != "system:anonymous" and "system:authenticated" not in groups:
        groups.append("system:authenticated")
    info = {"username": username, "uid": uid or str(uuid.uuid5(uuid.NAMESPACE_URL, "apiserver-sim:" + username)),
            "groups": groups}
    if extra:
        info["extra"] = {k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in extra.items()}
    return info


DEFAULT_USER = user_info("apiserver-sim", ["system:masters"])
ANONYMOUS_USER = {"username": "system:anonymous", "groups": ["system:unauthenticated"]}


def parse_user(text):
    """--user TOKEN=USERNAME[,GROUP...] or TOKEN={"username": ..., "uid": ..., "groups": [...], "extra": {...}}.
    (Groups follow a comma, not a colon: service account names contain colons.)"""
    token, sep, rest = text.partition("=")
    if not sep or not token or not rest:
        raise ValueError(f"--user {text!r}: expected TOKEN=USERNAME[,GROUP...] or TOKEN={{json}}")
    if rest.lstrip().startswith("{"):
        d = json.loads(rest)
        return token, user_info(d["username"], d.get("groups") or [], d.get("uid"), d.get("extra"))
    username, *groups = rest.split(",")
    return token, user_info(username, groups)


def parse_address(text):
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def parse_service_endpoint(text):
    """--service-endpoint NAMESPACE/NAME=HOST:PORT"""
    svc, sep, addr = text.partition("=")
    ns, slash, name = svc.partition("/")
    if not sep or not slash or not ns or not name:
        raise ValueError(f"--service-endpoint {text!r}: expected NAMESPACE/NAME=HOST:PORT")
    return (ns, name), parse_address(addr)


# ---- kubeconfig and CLI --------------------------------------------------------------------------


def kubeconfig_text(url, token="apiserver-sim-token", namespace="default"):
    """A kubeconfig (clientcmd v1 Config) for a plain-http server and a dummy bearer-token user,
    written by hand (no YAML library needed; every value is a plain scalar)."""
    return f"""apiVersion: v1
kind: Config
clusters:
- name: apiserver-sim
  cluster:
    server: {url}
users:
- name: apiserver-sim
  user:
    token: {token}
contexts:
- name: apiserver-sim
  context:
    cluster: apiserver-sim
    user: apiserver-sim
    namespace: {namespace}
current-context: apiserver-sim
preferences: {{}}
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free port)")
    ap.add_argument("--kubeconfig", help="write a kubeconfig pointing at this server to PATH")
    ap.add_argument("--user", action="append", default=[], metavar="TOKEN=USERNAME[,GROUP...]",
                    help='map a bearer token to a user (repeatable); TOKEN={"username":..., "groups":[...], "extra":{...}} also works')
    ap.add_argument("--service-endpoint", action="append", default=[], metavar="NAMESPACE/NAME=HOST:PORT",
                    help="where a webhook's clientConfig.service is reachable (repeatable)")
    args = ap.parse_args(argv)
    try:
        users = dict(parse_user(u) for u in args.user)
        endpoints = dict(parse_service_endpoint(e) for e in args.service_endpoint)
    except (ValueError, KeyError) as e:
        ap.error(str(e))
    server = Server(("127.0.0.1", args.port))
    server.users.update(users)
    server.service_endpoints.update(endpoints)
    if args.kubeconfig:
        with open(args.kubeconfig, "w") as f:
            f.write(kubeconfig_text(server.url))
    print(json.dumps({"ready": True, "url": server.url}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
