"""deploy/webhook (and deploy/webhook-cert-manager): the admission webhook vcuda-webhook as
Kubernetes objects. The Deployment runs the binary as its contract says (flags, files, port,
/healthz) with the least privilege; RBAC, PDB, Service and NetworkPolicy fit it; the two
webhook configurations send only pods that concern vcuda, with the failure policies written
down; the ConfigMap's VM pod mutation is what seed 000 injects, as valid Kubernetes objects.

The matchConditions are evaluated here the way the API server does for webhooks
(https://kubernetes.io/docs/reference/access-authn-authz/extensible-admission-controllers/#matching-requests-matchconditions):
rules (resource, subresource, operation), then namespaceSelector, then every matchCondition
(all true: the webhook is called; false: it is not; an error: failurePolicy decides). CEL by
cel-expr-python (cel-cpp) *without* the optional-types extension, so an expression that
needed it (which 1.28 does not have for matchConditions) would not compile here."""

import copy
import re

import pytest
import yaml
from cel_expr_python import cel

import deploy_render as render
from deploy_render import DEPLOY, render as rendered

NS = "vcuda-system"
SA = ("v1", "ServiceAccount", NS, "vcuda-webhook")
CR = ("rbac.authorization.k8s.io/v1", "ClusterRole", None, "vcuda-webhook")
CRB = ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", None, "vcuda-webhook")
CM = ("v1", "ConfigMap", NS, "vcuda-webhook")
DEP = ("apps/v1", "Deployment", NS, "vcuda-webhook")
PDB = ("policy/v1", "PodDisruptionBudget", NS, "vcuda-webhook")
SVC = ("v1", "Service", NS, "vcuda-webhook")
NP = ("networking.k8s.io/v1", "NetworkPolicy", NS, "vcuda-webhook")
VWC = ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration", None, "vcuda-pods")
MWC = ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", None, "vcuda-vm-pods")
WEBHOOK_OLDEST, NEWEST = "1.28", "1.37"  # matchConditions (beta, on by default in 1.28)

ENV = cel.NewEnv(variables={name: cel.Type.DYN for name in ("request", "object", "oldObject")})


def objs():
    return rendered("webhook")


def container():
    (c,) = objs()[DEP]["spec"]["template"]["spec"]["containers"]
    return c


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


# --- the objects -----------------------------------------------------------------------------

def test_renders_exactly_the_webhooks_objects():
    assert set(objs()) == {SA, CR, CRB, CM, DEP, PDB, SVC, NP, VWC, MWC}


@pytest.mark.parametrize("directory", ["webhook", "webhook-cert-manager"])
@pytest.mark.parametrize("version", [WEBHOOK_OLDEST, NEWEST])
def test_objects_are_valid_kubernetes(directory, version):
    for obj in rendered(directory).values():
        if not obj["apiVersion"].startswith("cert-manager.io/"):
            render.validate(obj, version)


def test_the_schemas_catch_a_misspelt_match_condition():
    vwc = objs()[VWC]
    vwc["webhooks"][0]["matchCondition"] = vwc["webhooks"][0].pop("matchConditions")
    with pytest.raises(Exception, match="matchCondition"):
        render.validate(vwc, WEBHOOK_OLDEST)


def test_it_is_applied_beside_the_base_and_leaves_the_namespace_to_it():
    """No Namespace (`kubectl delete -k deploy/webhook` must not delete vcuda-system with all
    of vcuda); every namespaced object in the namespace the base creates; no object of the
    base or an overlay is touched."""
    webhook = objs()
    assert not [k for k in webhook if k[1] == "Namespace"]
    assert ("v1", "Namespace", None, NS) in rendered("base")
    assert {k[2] for k in webhook} == {NS, None}
    for d in ["base", "overlays/custom-domain", "overlays/mixed", "overlays/monitoring", "overlays/no-api",
              "overlays/node-only", "overlays/vm", "admission-policy"]:
        assert not set(webhook) & set(rendered(d)), d


def test_the_deployment_runs_the_binary_as_its_contract_says():
    c = container()
    cmd = c["command"]
    assert cmd[0] == "vcuda-webhook"
    assert flag(cmd, "--listen") == "0.0.0.0:8443"
    assert c["image"].split(":")[0] == "vcuda/vcuda", "the product image (its /usr/local/bin/vcuda-webhook)"
    assert c["ports"] == [{"name": "https", "containerPort": 8443, "protocol": "TCP"}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}, probe
    pod = objs()[DEP]["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert all(m["readOnly"] is True for m in mounts.values())
    # --tls-cert/--tls-key: the Secret vcuda-webhook-tls's files
    (tls,) = [v for v in vols.values() if "secret" in v]
    assert tls["secret"]["secretName"] == "vcuda-webhook-tls"
    items = {i["key"]: i["path"] for i in tls["secret"]["items"]}
    assert items == {"tls.crt": "tls.crt", "tls.key": "tls.key"}
    base = mounts[tls["name"]]["mountPath"]
    assert flag(cmd, "--tls-cert") == f"{base}/tls.crt" == "/etc/vcuda-webhook/tls/tls.crt"
    assert flag(cmd, "--tls-key") == f"{base}/tls.key" == "/etc/vcuda-webhook/tls/tls.key"
    # readable by the non-root user through fsGroup, by nobody else
    assert tls["secret"]["defaultMode"] & 0o007 == 0 and tls["secret"]["defaultMode"] & 0o040
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    # --config: the ConfigMap's vm-pods.yaml, mounted as a directory (a subPath never updates)
    (cfg,) = [v for v in vols.values() if "configMap" in v]
    assert cfg["configMap"]["name"] == CM[3]
    (item,) = cfg["configMap"]["items"]
    assert item["key"] in objs()[CM]["data"]
    m = mounts[cfg["name"]]
    assert "subPath" not in m
    assert flag(cmd, "--config") == f"{m['mountPath']}/{item['path']}" == "/etc/vcuda-webhook/config/vm-pods.yaml"
    assert flag(cmd, "--api") == "auto"


def test_least_privilege():
    dep = objs()[DEP]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                      "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}}
    assert container()["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                              "capabilities": {"drop": ["ALL"]}}
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert "limits" in container()["resources"] and "requests" in container()["resources"]
    # the token: in the webhook's pods only (for --api auto), not for every pod of the account
    assert objs()[SA]["automountServiceAccountToken"] is False
    assert pod["automountServiceAccountToken"] is True and pod["serviceAccountName"] == SA[3]
    # RBAC: list Nodes, nothing else
    assert objs()[CR]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    crb = objs()[CRB]
    assert crb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CR[3]}
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": SA[3], "namespace": NS}]
    assert not [k for k in objs() if k[1] in ("Role", "RoleBinding")]


def test_two_replicas_spread_over_nodes_and_one_kept_through_a_drain():
    dep = objs()[DEP]
    assert dep["spec"]["replicas"] == 2
    labels = dep["spec"]["template"]["metadata"]["labels"]
    (term,) = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    pdb = objs()[PDB]["spec"]
    assert pdb["minAvailable"] == 1
    assert pdb["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    # its pods carry no vcuda.io/ annotation (the pod annotation policy would refuse them)
    assert not [k for k in dep["spec"]["template"]["metadata"].get("annotations", {}) if k.startswith("vcuda.io/")]


def test_the_service_reaches_the_port_and_the_network_policy_admits_only_it():
    svc = objs()[SVC]["spec"]
    labels = objs()[DEP]["spec"]["template"]["metadata"]["labels"]
    assert svc["selector"].items() <= labels.items()
    (port,) = svc["ports"]
    assert port["port"] == 443 and port["targetPort"] == "https" and port["protocol"] == "TCP"
    np = objs()[NP]["spec"]
    assert np["podSelector"]["matchLabels"].items() <= labels.items()
    assert np["policyTypes"] == ["Ingress"]
    # one rule: the https port, from anywhere (no `from`: the API server's address is unknowable)
    assert np["ingress"] == [{"ports": [{"port": "https", "protocol": "TCP"}]}]
    assert [p["containerPort"] for p in container()["ports"] if p["name"] == "https"] == [8443]


# --- the webhook configurations ----------------------------------------------------------------

def webhook(k):
    (w,) = objs()[k]["webhooks"]
    return w


def test_the_webhook_configurations_call_the_service_over_tls():
    svc = objs()[SVC]
    for k, path in ((VWC, "/validate"), (MWC, "/mutate")):
        w = webhook(k)
        assert w["clientConfig"]["service"] == {"namespace": NS, "name": svc["metadata"]["name"], "path": path,
                                                "port": svc["spec"]["ports"][0]["port"]}
        assert "url" not in w["clientConfig"]
        assert "caBundle" not in w["clientConfig"], "the bootstrap adds it (make-webhook-certs.sh or cert-manager)"
        assert w["timeoutSeconds"] == 5 and w["sideEffects"] == "None" and w["admissionReviewVersions"] == ["v1"]
        assert w["namespaceSelector"] == {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                                                "values": ["kube-system", "vcuda-system"]}]}
        assert "objectSelector" not in w


def test_validating_is_pods_create_update_and_fails_open():
    w = webhook(VWC)
    assert w["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                           "resources": ["pods"], "scope": "Namespaced"}]
    assert w["failurePolicy"] == "Ignore"


def test_mutating_is_pod_create_only_and_fails_closed_once():
    w = webhook(MWC)
    assert w["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["pods"], "scope": "Namespaced"}]
    assert w["failurePolicy"] == "Fail"
    assert w["reinvocationPolicy"] == "Never"


def test_the_failure_policies_say_why():
    text = (DEPLOY / "webhook" / "vcuda-webhook-configurations.yaml").read_text()
    ignore = text[text.index("# failurePolicy Ignore:"):text.index("- name: vcuda-pods.vcuda.io")]
    for why in ("extender and", "vcuda-pod-annotations", "cross-checks vcuda.io/assignment", "never blocked"):
        assert why in ignore.replace("\n  #", ""), why
    fail = text[text.index("# failurePolicy Fail:"):text.index("- name: vcuda-vm-pods.vcuda.io")]
    for why in ("driver loader", "licensing", "tencent.com/vgpu-", "never any other pod"):
        assert why in fail.replace("\n  #", ""), why


# --- who is sent to the webhooks (the API server's dispatch) ----------------------------------

class Error(Exception):
    pass


def evaluate(expr, data):
    try:
        v = ENV.compile(expr).eval(data=data)
    except Exception as e:
        raise Error(str(e)) from e
    if v.type() == cel.Type.ERROR:
        raise Error(str(v.value()))
    return v.plain_value()


def selected(selector, labels):
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "NotIn", "the harness knows NotIn only"
        if labels.get(e["key"]) in e["values"]:
            return False
    return selector.get("matchLabels", {}).items() <= labels.items()


def sent(k, obj, old=None, operation="CREATE", namespace="tenant-a", sub=None):
    """Whether the API server calls webhook `k` for this pod request. An error in a
    matchCondition raises (it would be failurePolicy's to decide: for the mutating webhook,
    a refused pod)."""
    w = webhook(k)
    resource = "pods" + (f"/{sub}" if sub else "")
    if not any("" in r["apiGroups"] and "v1" in r["apiVersions"] and operation in r["operations"]
               and resource in r["resources"] for r in w["rules"]):
        return False
    # the API server labels every namespace with its name
    if not selected(w["namespaceSelector"], {"kubernetes.io/metadata.name": namespace}):
        return False
    request = {"uid": "r", "kind": {"group": "", "version": "v1", "kind": "Pod"},
               "resource": {"group": "", "version": "v1", "resource": "pods"}, "operation": operation,
               "namespace": namespace, "name": obj["metadata"]["name"] if obj else old["metadata"]["name"],
               "userInfo": {"username": "alice", "groups": ["system:authenticated"]}}
    if sub:
        request["subResource"] = sub
    data = {"request": request, "object": obj, "oldObject": old}
    return all(evaluate(mc["expression"], data) is True for mc in w["matchConditions"])


def pod(limits=None, requests=None, init_limits=None, init_requests=None, annotations=None, name="p"):
    def ctr(n, lim, req):
        c = {"name": n, "image": "app:1"}
        res = {}
        if lim is not None:
            res["limits"] = lim
        if req is not None:
            res["requests"] = req
        if res:
            c["resources"] = res
        return c

    p = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "tenant-a"},
         "spec": {"containers": [ctr("main", limits, requests)]}}
    if init_limits is not None or init_requests is not None:
        p["spec"]["initContainers"] = [ctr("init", init_limits, init_requests)]
    if annotations is not None:
        p["metadata"]["annotations"] = annotations
    return p


CPU = {"cpu": "1", "memory": "1Gi"}
CASES = {
    # name: (pod, validating sent, mutating sent)
    "vgpu": (pod(limits={"tencent.com/vgpu-492": "1"}), True, True),
    "vgpu-requests-only": (pod(requests={"tencent.com/vgpu-277": "1", **CPU}), True, True),
    "vgpu-in-init-container-only": (pod(limits=CPU, init_limits={"tencent.com/vgpu-492": "1"}), True, True),
    "vgpu-init-requests-only": (pod(init_requests={"tencent.com/vgpu-490": "1"}), True, True),
    "share": (pod(limits={"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "4", **CPU}), True, False),
    "share-requests-only": (pod(requests={"tencent.com/vcuda-core": "30"}), True, False),
    "share-in-init-container": (pod(init_limits={"tencent.com/vcuda-core": "50"}), True, False),
    "slice": (pod(limits={"tencent.com/sgpu": "1"}), True, False),
    "whole-gpu": (pod(limits={"nvidia.com/gpu": "2"}), True, False),
    "whole-gpu-requests-only": (pod(requests={"nvidia.com/gpu": "1"}), True, False),
    "only-gpu-count-annotation": (pod(limits=CPU, annotations={"vcuda.io/gpu-count": "2"}), True, False),
    "only-assignment-annotation": (pod(annotations={"vcuda.io/assignment": "{}"}), True, False),
    "plain": (pod(limits=CPU, requests=CPU), False, False),
    "no-resources": (pod(), False, False),
    "empty-resources": (pod(limits={}, requests={}, init_limits={}), False, False),
    "other-annotations": (pod(limits=CPU, annotations={"example.com/x": "1", "xvcuda.io/y": "2",
                                                       "vcuda.io.example.com/z": "3"}), False, False),
    "other-gpu-vendor": (pod(limits={"amd.com/gpu": "1", "nvidia.com/gpu-shared": "1"}), False, False),
    "vgpu-lookalike": (pod(limits={"example.com/vgpu-492": "1", "tencent.com/vgpu": "1"}), True, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_who_is_sent_at_create(case):
    p, validating, mutating = CASES[case]
    assert sent(VWC, p) is validating
    assert sent(MWC, p) is mutating


def test_a_pod_with_resources_claims_only_is_evaluated_without_error():
    p = pod()
    p["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    assert sent(VWC, p) is False and sent(MWC, p) is False


def test_updates_are_sent_for_vcuda_pods_and_for_pods_that_lose_a_vcuda_annotation():
    share = CASES["share"][0]
    assert sent(VWC, share, share, "UPDATE")
    # the tenant strips vcuda.io/assignment: the new object has none, the old one had
    old = pod(limits=CPU, annotations={"vcuda.io/assignment": "{}"})
    new = copy.deepcopy(old)
    del new["metadata"]["annotations"]
    assert sent(VWC, new, old, "UPDATE")
    plain = CASES["plain"][0]
    assert not sent(VWC, plain, plain, "UPDATE")
    # the mutating webhook: creates only
    vgpu = CASES["vgpu"][0]
    assert not sent(MWC, vgpu, vgpu, "UPDATE")


def test_subresources_deletes_and_system_namespaces_are_never_sent():
    vgpu = CASES["vgpu"][0]
    for k in (VWC, MWC):
        for sub in ("binding", "status", "ephemeralcontainers", "resize", "eviction"):
            assert not sent(k, vgpu, vgpu, "UPDATE", sub=sub) and not sent(k, vgpu, None, "CREATE", sub=sub), sub
        assert not sent(k, None, vgpu, "DELETE")
        for ns in ("kube-system", "vcuda-system"):
            assert not sent(k, vgpu, namespace=ns), ns
        assert sent(k, vgpu, namespace="default")


def test_match_conditions_are_standard_cel_with_has_only():
    for k in (VWC, MWC):
        for mc in webhook(k)["matchConditions"]:
            assert not re.search(r"\?\.|\[\?|orValue|optional\.", mc["expression"]), mc["name"]
            ENV.compile(mc["expression"])  # compiles without the optional-types extension


def test_the_vgpu_prefix_is_the_config_maps():
    """The mutating webhook is called for exactly the resources the ConfigMap names as VM pods'."""
    (pattern,) = vm_pods()["resources"]
    assert pattern.endswith("*")
    prefix = pattern[:-1]
    (mc,) = webhook(MWC)["matchConditions"]
    assert set(re.findall(r"startsWith\('([^']+)'\)", mc["expression"])) == {prefix}


# --- the VM pod mutation (ConfigMap vcuda-webhook, vm-pods.yaml) --------------------------------

def vm_pods():
    return yaml.safe_load(objs()[CM]["data"]["vm-pods.yaml"])


def test_vm_pods_is_what_seed_000_injects():
    cfg = vm_pods()
    assert set(cfg) == {"resources", "runtimeClassName", "initContainers", "containers", "volumes"}
    assert cfg["runtimeClassName"] == "kata-qemu"
    (init,) = cfg["initContainers"]
    assert init["name"] == "nvidia"
    assert init["command"][-1] == "modprobe nvidia; modprobe nvidia-drm modeset=1; nvidia-modprobe -u -m"
    (gridd,) = cfg["containers"]
    assert gridd["name"] == "gridd" and gridd["command"][-1] == "nvidia-gridd; sleep infinity"
    for c in (init, gridd):
        assert c["securityContext"]["capabilities"]["add"] == ["ALL"]
        assert {"name": "dev", "mountPath": "/dev"} in c["volumeMounts"]
    vols = {v["name"]: v for v in cfg["volumes"]}
    assert vols["dev"] == {"name": "dev", "hostPath": {"path": "/dev"}}
    assert vols["nvidia-driver"]["hostPath"]["path"] == "/opt/vcuda/nvidia-guest-driver"
    # every mount names one of the volumes it adds
    for c in (init, gridd):
        for m in c["volumeMounts"]:
            assert m["name"] in vols, m
            if m["name"] == "nvidia-driver":
                assert m["readOnly"] is True


def test_vm_pods_images_must_be_replaced_and_the_readme_says_so():
    cfg = vm_pods()
    readme = (DEPLOY / "README.md").read_text()
    for c in cfg["initContainers"] + cfg["containers"]:
        assert c["image"].endswith(":CHANGE-ME") and c["image"].startswith("registry.example.com/"), c["image"]
        assert c["image"] in readme, f"deploy/README.md does not say to replace {c['image']}"
    assert "/opt/vcuda/nvidia-guest-driver" in readme


@pytest.mark.parametrize("version", [WEBHOOK_OLDEST, NEWEST])
def test_vm_pods_are_valid_kubernetes_containers_and_volumes(version):
    """What the webhook adds is valid in a Pod of both versions (strict schemas: a misspelt
    field fails here, not in every vGPU pod's creation)."""
    cfg = vm_pods()
    p = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vm"},
         "spec": {"runtimeClassName": cfg["runtimeClassName"], "initContainers": cfg["initContainers"],
                  "containers": [{"name": "main", "image": "app:1"}] + cfg["containers"], "volumes": cfg["volumes"]}}
    render.validate(p, version)
    bad = copy.deepcopy(p)
    bad["spec"]["volumes"][0]["hostpath"] = bad["spec"]["volumes"][0].pop("hostPath")
    with pytest.raises(Exception, match="hostpath"):
        render.validate(bad, version)


# --- cert-manager ------------------------------------------------------------------------------

CM_ISSUER = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
             "properties": {"apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Issuer"},
                            "metadata": {"type": "object", "required": ["name", "namespace"]},
                            "spec": {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
                                     "properties": {"selfSigned": {"type": "object", "additionalProperties": False},
                                                    "ca": {"type": "object", "required": ["secretName"],
                                                           "additionalProperties": False,
                                                           "properties": {"secretName": {"type": "string"}}}}}}}
USAGES = ["signing", "digital signature", "content commitment", "key encipherment", "key agreement",
          "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
          "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
          "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]
CM_CERTIFICATE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Certificate"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {"type": "object", "required": ["secretName", "issuerRef"], "additionalProperties": False, "properties": {
            "secretName": {"type": "string"}, "commonName": {"type": "string"}, "isCA": {"type": "boolean"},
            "dnsNames": {"type": "array", "items": {"type": "string"}},
            "duration": {"type": "string", "pattern": r"^\d+h$"}, "renewBefore": {"type": "string", "pattern": r"^\d+h$"},
            "usages": {"type": "array", "items": {"enum": USAGES}},
            "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"},
                "rotationPolicy": {"enum": ["Never", "Always"]}, "encoding": {"enum": ["PKCS1", "PKCS8"]}}},
            "issuerRef": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                "name": {"type": "string"}, "kind": {"enum": ["Issuer", "ClusterIssuer"]}, "group": {"type": "string"}}}}}},
}


def test_cert_manager_variant_makes_the_secret_and_injects_the_ca():
    """cert-manager.io/v1 fields as cert-manager documents them (https://cert-manager.io/docs/reference/api-docs/)."""
    import jsonschema

    cm = rendered("webhook-cert-manager")
    extra = {k: o for k, o in cm.items() if k not in objs()}
    issuers = {k[3]: o for k, o in extra.items() if k[1] == "Issuer"}
    certs = {k[3]: o for k, o in extra.items() if k[1] == "Certificate"}
    assert set(extra) == {k for k in extra if k[1] in ("Issuer", "Certificate")}
    for o in issuers.values():
        jsonschema.validate(o, CM_ISSUER)
    for o in certs.values():
        jsonschema.validate(o, CM_CERTIFICATE)
    # the serving certificate: into the Secret the Deployment mounts, for the Service's names
    (serving,) = [c for c in certs.values() if not c["spec"].get("isCA")]
    assert serving["spec"]["secretName"] == "vcuda-webhook-tls"
    assert set(serving["spec"]["dnsNames"]) == {f"vcuda-webhook.{NS}.svc", f"vcuda-webhook.{NS}.svc.cluster.local"}
    assert serving["spec"]["usages"] == ["digital signature", "server auth"]
    assert serving["spec"]["privateKey"]["algorithm"] == "ECDSA" and serving["spec"]["privateKey"]["size"] == 256
    # signed by a CA Issuer whose CA is a Certificate of its own, self-signed
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    (ca,) = [c for c in certs.values() if c["spec"].get("secretName") == ca_issuer["spec"]["ca"]["secretName"]]
    assert ca["spec"]["isCA"] is True
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    for o in list(issuers.values()) + list(certs.values()):
        assert o["metadata"]["namespace"] == NS
    # both configurations get the serving Certificate's CA; nothing else changes
    for k in (VWC, MWC):
        assert cm[k]["metadata"]["annotations"] == {
            "cert-manager.io/inject-ca-from": f"{NS}/{serving['metadata']['name']}"}
        without = copy.deepcopy(cm[k])
        del without["metadata"]["annotations"]
        assert without == objs()[k]
    for k in objs():
        if k not in (VWC, MWC):
            assert cm[k] == objs()[k], k


# --- documentation ------------------------------------------------------------------------------

def test_readme_documents_the_webhook():
    readme = (DEPLOY / "README.md").read_text()
    assert re.search(r"^## The admission webhook$", readme, re.M)
    for row in ("| `webhook/` |", "| `webhook-cert-manager/` |"):
        (line,) = [l for l in readme.splitlines() if l.startswith(row)]
        assert line.rstrip().endswith("| ≥ 1.28 |"), line
    section = readme[readme.index("## The admission webhook"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    for words in ("deploy/certs/make-webhook-certs.sh", "kubectl apply -k", "failurePolicy", "Ignore", "Fail",
                  "vcuda-pod-annotations", "kata-qemu", "privileged", "CHANGE-ME", "rollout restart"):
        assert words in section, words
