//! AdmissionReview v1 in, AdmissionReview v1 out (pure): the envelope around
//! [`crate::rules`] and [`crate::inject`].
//!
//! The request is read with kube-rs's types (`kube::core::admission`); the answer is written
//! as the API documents it (`response.uid` copied, `allowed`, `status` {code, reason,
//! message} when refused, `warnings`, and a `patch` as base64 of the RFC 6902 JSON Patch
//! with `patchType: JSONPatch`).
//!
//! Anything but a Pod (a subresource, another kind) is allowed unchanged: the webhook is
//! configured for pods only, and a wrong configuration must not block other objects. A body
//! that is not an AdmissionReview is a [`ReviewError`] (HTTP 400): the API server then
//! applies the webhook's failurePolicy.

use base64::Engine;
use kube::core::admission::{AdmissionRequest, AdmissionReview, Operation as KubeOperation};
use kube::core::DynamicObject;
use serde_json::{json, Value};
use thiserror::Error;
use vcuda_scheduler::extender::Pod;

use crate::inject::{self, VmPods};
use crate::rules::{self, Offered, Operation, Policy, ResourcePatterns};

/// A body that cannot be answered.
#[derive(Debug, Error)]
pub enum ReviewError {
    #[error("the body is not an AdmissionReview (admission.k8s.io/v1) with a request: {0}; vcuda-webhook answers the API server's admission calls only")]
    NotAReview(String),
}

/// What an answer says (for the log and the tests); the JSON to send is [`Answer::body`].
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The request's identity, for the log: `namespace/name` (or generateName) and operation.
    pub about: String,
    pub allowed: bool,
    /// The refusal's kind, when refused.
    pub kind: Option<&'static str>,
    pub message: Option<String>,
    /// RFC 6902 operations (mutate only).
    pub patch: Vec<Value>,
    pub warnings: Vec<String>,
    uid: String,
    code: u16,
    reason: &'static str,
}

impl Answer {
    fn allow(about: String, uid: String) -> Answer {
        Answer {
            about,
            allowed: true,
            kind: None,
            message: None,
            patch: Vec::new(),
            warnings: Vec::new(),
            uid,
            code: 200,
            reason: "",
        }
    }

    /// The AdmissionReview v1 response.
    pub fn body(&self) -> Value {
        let mut response = json!({"uid": self.uid, "allowed": self.allowed});
        if !self.allowed {
            response["status"] = json!({
                "status": "Failure",
                "code": self.code,
                "reason": self.reason,
                "message": self.message.clone().unwrap_or_default(),
            });
        }
        if !self.patch.is_empty() {
            let bytes = serde_json::to_vec(&self.patch).unwrap_or_default();
            response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(bytes));
            response["patchType"] = json!("JSONPatch");
        }
        if !self.warnings.is_empty() {
            response["warnings"] = json!(self.warnings);
        }
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
    }
}

struct Parsed {
    req: AdmissionRequest<DynamicObject>,
    about: String,
}

fn parse(body: &[u8]) -> Result<Parsed, ReviewError> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| ReviewError::NotAReview(e.to_string()))?;
    let req: AdmissionRequest<DynamicObject> = review
        .try_into()
        .map_err(|_| ReviewError::NotAReview("it has no request".into()))?;
    let ns = req.namespace.clone().unwrap_or_default();
    let name = if req.name.is_empty() {
        req.object
            .as_ref()
            .and_then(|o| o.metadata.generate_name.clone())
            .map(|g| format!("{g}*"))
            .unwrap_or_default()
    } else {
        req.name.clone()
    };
    let about = format!("{:?} pod {ns}/{name}", req.operation);
    Ok(Parsed { req, about })
}

fn is_pod(req: &AdmissionRequest<DynamicObject>) -> bool {
    req.kind.group.is_empty()
        && req.kind.kind == "Pod"
        && req.sub_resource.as_deref().unwrap_or("").is_empty()
}

fn as_value(o: &DynamicObject) -> Value {
    serde_json::to_value(o).unwrap_or(Value::Null)
}

fn as_pod(v: &Value) -> Result<Pod, ReviewError> {
    serde_json::from_value(v.clone())
        .map_err(|e| ReviewError::NotAReview(format!("its object is not a Pod: {e}")))
}

/// `/validate`: judge the pod of `body` by `policy`, the vGPU types as `offered`.
pub fn validate(body: &[u8], policy: &Policy, offered: Offered<'_>) -> Result<Answer, ReviewError> {
    let Parsed { req, about } = parse(body)?;
    let mut answer = Answer::allow(about, req.uid.clone());
    let op = match req.operation {
        KubeOperation::Create => Operation::Create,
        KubeOperation::Update => Operation::Update,
        _ => return Ok(answer),
    };
    let Some(object) = req.object.as_ref().filter(|_| is_pod(&req)) else {
        return Ok(answer);
    };
    let pod = as_pod(&as_value(object))?;
    let old = req
        .old_object
        .as_ref()
        .map(|o| as_pod(&as_value(o)))
        .transpose()?;
    let verdict = rules::judge(
        policy,
        op,
        &req.user_info.username.clone().unwrap_or_default(),
        &pod,
        old.as_ref(),
        offered,
    );
    answer.warnings = verdict.warnings;
    if let Some(r) = verdict.refusal {
        answer.allowed = false;
        answer.kind = Some(r.kind());
        answer.code = r.code();
        answer.reason = r.reason();
        answer.message = Some(r.to_string());
    }
    Ok(answer)
}

/// `/mutate`: give a VM pod of `body` what `cfg` says (vGPUs as `patterns`).
pub fn mutate(
    body: &[u8],
    cfg: &VmPods,
    patterns: &ResourcePatterns,
) -> Result<Answer, ReviewError> {
    let Parsed { req, about } = parse(body)?;
    let mut answer = Answer::allow(about, req.uid.clone());
    if req.operation != KubeOperation::Create {
        return Ok(answer);
    }
    let Some(object) = req.object.as_ref().filter(|_| is_pod(&req)) else {
        return Ok(answer);
    };
    let m = inject::mutate(cfg, patterns, &as_value(object));
    answer.patch = m.patch;
    answer.warnings = m.warnings;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// An AdmissionReview as kube-apiserver sends it (admission/v1 `AdmissionRequest`, field
    /// for field, from `kubectl create` of a pod by user alice).
    fn review(op: &str, pod: Value, old: Option<Value>, user: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "name": pod["metadata"]["name"],
                "namespace": "team-a",
                "operation": op,
                "userInfo": {"username": user, "uid": "014fbff9a07c", "groups": ["system:authenticated"]},
                "object": pod,
                "oldObject": old,
                "dryRun": false,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
            }
        }))
        .unwrap()
    }

    fn pod(limits: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "team-a"},
            "spec": {"containers": [{"name": "c", "image": "i", "resources": {"limits": limits}}]}})
    }

    #[test]
    fn a_refusal_is_an_admission_review_carrying_the_uid_code_and_words() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let body = review(
            "CREATE",
            pod(json!({"tencent.com/vcuda-core": "150"})),
            None,
            "alice",
        );
        let a = validate(&body, &policy, Offered::NotChecked).unwrap();
        assert_eq!(a.about, "Create pod team-a/p");
        let out = a.body();
        assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(out["kind"], "AdmissionReview");
        assert_eq!(
            out["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(out["response"]["status"]["code"], 422);
        assert_eq!(out["response"]["status"]["reason"], "Invalid");
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(
            msg.starts_with("container c: vcuda-core 150 is neither a share"),
            "{msg}"
        );
        assert!(out["response"].get("patch").is_none());
    }

    #[test]
    fn an_allowed_pod_is_a_bare_allow() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let body = review(
            "CREATE",
            pod(json!({"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"})),
            None,
            "alice",
        );
        let out = validate(&body, &policy, Offered::NotChecked)
            .unwrap()
            .body();
        assert_eq!(
            out["response"],
            json!({"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": true})
        );
    }

    #[test]
    fn an_edit_of_the_assignment_is_forbidden_for_tenants_only() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let mut old = pod(json!({}));
        old["metadata"]["annotations"] = json!({"vcuda.io/assignment": "{\"a\":1}"});
        let mut new = old.clone();
        new["metadata"]["annotations"]["vcuda.io/assignment"] = json!("{\"a\":2}");
        let body = review("UPDATE", new.clone(), Some(old.clone()), "alice");
        let out = validate(&body, &policy, Offered::NotChecked)
            .unwrap()
            .body();
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(out["response"]["status"]["code"], 403);
        assert_eq!(out["response"]["status"]["reason"], "Forbidden");
        let body = review(
            "UPDATE",
            new,
            Some(old),
            "system:serviceaccount:vcuda-system:vcuda-scheduler",
        );
        assert_eq!(
            validate(&body, &policy, Offered::NotChecked)
                .unwrap()
                .body()["response"]["allowed"],
            true
        );
    }

    #[test]
    fn warnings_travel_in_the_response() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let body = review(
            "CREATE",
            pod(json!({"tencent.com/vgpu-1": "1"})),
            None,
            "alice",
        );
        let out = validate(&body, &policy, Offered::Unknown("no node list yet"))
            .unwrap()
            .body();
        assert_eq!(out["response"]["allowed"], true);
        assert!(out["response"]["warnings"][0]
            .as_str()
            .unwrap()
            .contains("no node list yet"));
        let known: BTreeSet<String> = BTreeSet::new();
        let out = validate(&body, &policy, Offered::Known(&known))
            .unwrap()
            .body();
        assert_eq!(out["response"]["allowed"], false);
    }

    #[test]
    fn the_patch_is_base64_json_patch_that_applies_to_the_object() {
        let cfg = VmPods::parse(
            "runtimeClassName: kata\ninitContainers: [{name: nvidia, image: loader}]\n",
            "f",
        )
        .unwrap();
        let patterns = cfg.patterns("tencent.com");
        let object = pod(json!({"tencent.com/vgpu-492": "1"}));
        let body = review("CREATE", object.clone(), None, "alice");
        let out = mutate(&body, &cfg, &patterns).unwrap().body();
        assert_eq!(out["response"]["allowed"], true);
        assert_eq!(out["response"]["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(out["response"]["patch"].as_str().unwrap())
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        let mut applied = object.clone();
        json_patch::patch(&mut applied, &patch).unwrap();
        assert_eq!(applied["spec"]["initContainers"][0]["image"], "loader");
        assert_eq!(applied["spec"]["runtimeClassName"], "kata");
        // the patched pod sent again gets no patch
        let again = mutate(&review("CREATE", applied, None, "alice"), &cfg, &patterns).unwrap();
        assert!(again.patch.is_empty() && again.body()["response"].get("patch").is_none());
    }

    #[test]
    fn other_kinds_subresources_and_operations_pass_untouched() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let bad = pod(json!({"tencent.com/vcuda-core": "150"}));
        let mut v: Value =
            serde_json::from_slice(&review("CREATE", bad.clone(), None, "alice")).unwrap();
        v["request"]["kind"]["kind"] = json!("ConfigMap");
        let out = validate(
            &serde_json::to_vec(&v).unwrap(),
            &policy,
            Offered::NotChecked,
        )
        .unwrap();
        assert!(out.allowed);
        let mut v: Value =
            serde_json::from_slice(&review("CREATE", bad.clone(), None, "alice")).unwrap();
        v["request"]["subResource"] = json!("binding");
        assert!(
            validate(
                &serde_json::to_vec(&v).unwrap(),
                &policy,
                Offered::NotChecked
            )
            .unwrap()
            .allowed
        );
        let out = validate(
            &review("DELETE", bad, None, "alice"),
            &policy,
            Offered::NotChecked,
        )
        .unwrap();
        assert!(out.allowed);
    }

    #[test]
    fn a_body_that_is_not_a_review_is_an_error_naming_it() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        for body in [
            &b"{"[..],
            b"{}",
            b"[1]",
            b"{\"apiVersion\":\"admission.k8s.io/v1\",\"kind\":\"AdmissionReview\"}",
        ] {
            let e = validate(body, &policy, Offered::NotChecked)
                .unwrap_err()
                .to_string();
            assert!(e.contains("not an AdmissionReview"), "{e}");
        }
    }

    fn arb_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z/.0-9-]{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 40, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(
                    prop_oneof![
                        Just("metadata".to_string()),
                        Just("spec".to_string()),
                        Just("containers".to_string()),
                        Just("initContainers".to_string()),
                        Just("resources".to_string()),
                        Just("limits".to_string()),
                        Just("annotations".to_string()),
                        Just("name".to_string()),
                        Just("tencent.com/vgpu-1".to_string()),
                        Just("tencent.com/vcuda-core".to_string()),
                        "[a-z]{1,6}",
                    ],
                    inner,
                    0..5
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Whatever a caller puts in the object (the port is reachable by tenants, and an
        /// object may be anything the API server's schema lets through): an answer or a
        /// ReviewError, never a panic, and an answer always carries the request's uid.
        #[test]
        fn any_object_is_answered_or_refused_without_a_panic(
            object in arb_json(), old in arb_json(), op in proptest::sample::select(vec!["CREATE", "UPDATE", "DELETE", "CONNECT"])
        ) {
            let policy = Policy::new("tencent.com", "nvidia.com/gpu");
            let cfg = VmPods::parse("initContainers: [{name: nvidia, image: loader}]\nvolumes: [{name: dev, hostPath: {path: /dev}}]", "f").unwrap();
            let patterns = cfg.patterns("tencent.com");
            let mut v: Value = serde_json::from_slice(&review(op, json!({"metadata": {"name": "p"}}), None, "alice")).unwrap();
            v["request"]["object"] = object;
            v["request"]["oldObject"] = old;
            let body = serde_json::to_vec(&v).unwrap();
            for a in [validate(&body, &policy, Offered::NotChecked), mutate(&body, &cfg, &patterns)].into_iter().flatten() {
                proptest::prop_assert_eq!(&a.body()["response"]["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
            }
        }
    }
}
