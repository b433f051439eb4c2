//! What a vGPU (VM) pod is given at creation (pure): seed 000's mutation, so a user writes
//! an ordinary pod asking for `tencent.com/vgpu-<n>` and it runs under Kata with the driver
//! loaded and the licence served.
//!
//! The configuration ([`VmPods`], the ConfigMap `vcuda-webhook`'s `vm-pods.yaml`) names
//! which resources make a pod a VM pod, and what such a pod gets: init containers (put
//! first, so the driver is loaded before the pod's own init containers run), sidecar
//! containers (appended), volumes, and a `runtimeClassName`.
//!
//! **The init containers get the pod's vGPU**: each added init container asks for the vGPU
//! resources the pod's containers ask for (the most any one of them asks for each), as seed
//! 000's does, so the driver loader sees the device it loads the driver for. This costs the
//! pod nothing: the kubelet sizes a pod by the larger of its largest init container and its
//! containers together, and hands an init container's devices on to the containers.
//!
//! **Idempotent by name**: a container or volume the pod already has under the configured
//! name is left as the pod has it, and so is a `runtimeClassName` already set (another one
//! than configured gets a warning); applying the patch and judging the result again gives
//! no patch ([`tests`], property-tested). A configured container whose name the pod uses for
//! a container of the other kind (an init container named like a sidecar) is not added
//! (two containers of one name make the pod invalid); a warning says so.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Container, Volume};
use serde::Deserialize;
use serde_json::{json, Value};
use thiserror::Error;

use vcuda_scheduler::request::parse_integer_quantity;

use crate::rules::ResourcePatterns;

/// The mutation of VM pods, as configured.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VmPods {
    /// Which resources make a pod a VM pod (exact names, or prefixes ending in `*`); empty:
    /// vcuda-manager's own names, `<domain>/vgpu-*`.
    #[serde(default)]
    pub resources: Vec<String>,
    /// The runtime class a VM pod runs with when it names none (Kata's, e.g. `kata-qemu`).
    #[serde(default)]
    pub runtime_class_name: Option<String>,
    /// Init containers put before the pod's own.
    #[serde(default)]
    pub init_containers: Vec<Container>,
    /// Containers added after the pod's own (sidecars: the licensing daemon).
    #[serde(default)]
    pub containers: Vec<Container>,
    /// Volumes the added containers mount.
    #[serde(default)]
    pub volumes: Vec<Volume>,
}

/// Why a configuration cannot be used; each names the entry and the fix.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("{path}: not a VM pod configuration: {source}; see deploy/webhook/vm-pods.yaml for the fields (resources, runtimeClassName, initContainers, containers, volumes)")]
    Parse {
        path: String,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("{path}: {what} has no name; every container and volume needs one (it is how a pod that already has it is recognised)")]
    Unnamed { path: String, what: &'static str },
    #[error("{path}: the name {name:?} is used twice among the containers it adds; a pod's container names must be unique")]
    Duplicate { path: String, name: String },
    #[error("{path}: {what} {name:?} is not a DNS label (lower-case letters, digits and '-', at most 63); rename it")]
    BadName {
        path: String,
        what: &'static str,
        name: String,
    },
}

fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl VmPods {
    /// Parse and check a configuration (`path` names it in errors).
    pub fn parse(text: &str, path: &str) -> Result<VmPods, ConfigError> {
        let cfg: VmPods = if text.trim().is_empty() {
            VmPods::default()
        } else {
            serde_yaml::from_str(text).map_err(|source| ConfigError::Parse {
                path: path.to_string(),
                source,
            })?
        };
        let mut seen = BTreeSet::new();
        for c in cfg.init_containers.iter().chain(&cfg.containers) {
            if c.name.is_empty() {
                return Err(ConfigError::Unnamed {
                    path: path.into(),
                    what: "a container",
                });
            }
            if !dns_label(&c.name) {
                return Err(ConfigError::BadName {
                    path: path.into(),
                    what: "container",
                    name: c.name.clone(),
                });
            }
            if !seen.insert(c.name.clone()) {
                return Err(ConfigError::Duplicate {
                    path: path.into(),
                    name: c.name.clone(),
                });
            }
        }
        let mut volumes = BTreeSet::new();
        for v in &cfg.volumes {
            if v.name.is_empty() {
                return Err(ConfigError::Unnamed {
                    path: path.into(),
                    what: "a volume",
                });
            }
            if !volumes.insert(v.name.clone()) {
                return Err(ConfigError::Duplicate {
                    path: path.into(),
                    name: v.name.clone(),
                });
            }
        }
        Ok(cfg)
    }

    /// The resources that make a pod a VM pod, `<domain>/vgpu-*` when none are configured.
    pub fn patterns(&self, domain: &str) -> ResourcePatterns {
        if self.resources.is_empty() {
            ResourcePatterns::default_for(domain)
        } else {
            ResourcePatterns::new(self.resources.iter().cloned())
        }
    }
}

/// The JSON Patch (RFC 6902) for `pod` (the object as the API server sent it) and the
/// warnings; no operations when the pod is not a VM pod or has everything already.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Mutation {
    pub patch: Vec<Value>,
    pub warnings: Vec<String>,
}

fn names(list: Option<&Value>) -> BTreeSet<&str> {
    list.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("name").and_then(Value::as_str))
        .collect()
}

fn asks_for(pod: &Value, patterns: &ResourcePatterns) -> bool {
    ["containers", "initContainers"]
        .iter()
        .filter_map(|k| pod.pointer(&format!("/spec/{k}")).and_then(Value::as_array))
        .flatten()
        .filter_map(|c| c.get("resources"))
        .flat_map(|r| ["limits", "requests"].map(|k| r.get(k)))
        .flatten()
        .filter_map(Value::as_object)
        .any(|m| m.keys().any(|k| patterns.matches(k)))
}

/// The vGPU resources the pod's (app) containers ask for, each at the most one container
/// asks for (limits, else requests), as quantities the pod wrote.
fn vgpus(pod: &Value, patterns: &ResourcePatterns) -> BTreeMap<String, (u64, Value)> {
    let mut out: BTreeMap<String, (u64, Value)> = BTreeMap::new();
    let containers = pod.pointer("/spec/containers").and_then(Value::as_array);
    for r in containers
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("resources"))
    {
        for key in ["requests", "limits"] {
            let Some(m) = r.get(key).and_then(Value::as_object) else {
                continue;
            };
            for (k, q) in m.iter().filter(|(k, _)| patterns.matches(k)) {
                let text = match q {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                let n = parse_integer_quantity(&text).unwrap_or(0);
                if out.get(k).is_none_or(|(m, _)| n >= *m) {
                    out.insert(k.clone(), (n, q.clone()));
                }
            }
        }
    }
    out
}

/// `c` as JSON, asking for `vgpus` (limits and requests) where it names none of them itself.
fn with_vgpus(c: &Container, vgpus: &BTreeMap<String, (u64, Value)>) -> Value {
    let mut v = serde_json::to_value(c).unwrap_or(Value::Null);
    for (name, (n, q)) in vgpus {
        if *n == 0 {
            continue;
        }
        for key in ["limits", "requests"] {
            let slot = &mut v["resources"][key];
            if slot.is_null() {
                *slot = json!({});
            }
            if let Some(m) = slot.as_object_mut() {
                m.entry(name.clone()).or_insert_with(|| q.clone());
            }
        }
    }
    v
}

/// The mutation `cfg` makes of `pod` (vGPU resources as `patterns`).
pub fn mutate(cfg: &VmPods, patterns: &ResourcePatterns, pod: &Value) -> Mutation {
    let mut m = Mutation::default();
    if !asks_for(pod, patterns) {
        return m;
    }
    let spec = pod.get("spec");
    let inits = spec.and_then(|s| s.get("initContainers"));
    let apps = spec.and_then(|s| s.get("containers"));
    let volumes = spec.and_then(|s| s.get("volumes"));
    let (init_names, app_names) = (names(inits), names(apps));
    let vgpus = vgpus(pod, patterns);
    let has_list = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());

    // init containers, first, in the configured order
    let mut missing = Vec::new();
    for c in &cfg.init_containers {
        if init_names.contains(c.name.as_str()) {
            continue;
        }
        if app_names.contains(c.name.as_str()) {
            m.warnings.push(format!("the pod has a container named {:?}, so vcuda's init container of that name was not added; rename the container", c.name));
            continue;
        }
        missing.push(with_vgpus(c, &vgpus));
    }
    if !missing.is_empty() {
        if has_list(inits) {
            for c in missing.iter().rev() {
                m.patch
                    .push(json!({"op": "add", "path": "/spec/initContainers/0", "value": c}));
            }
        } else {
            m.patch
                .push(json!({"op": "add", "path": "/spec/initContainers", "value": missing}));
        }
    }
    // sidecars, last
    let mut missing = Vec::new();
    for c in &cfg.containers {
        if app_names.contains(c.name.as_str()) {
            continue;
        }
        if init_names.contains(c.name.as_str()) {
            m.warnings.push(format!("the pod has an init container named {:?}, so vcuda's container of that name was not added; rename the init container", c.name));
            continue;
        }
        missing.push(c);
    }
    if !missing.is_empty() {
        if has_list(apps) {
            for c in &missing {
                m.patch
                    .push(json!({"op": "add", "path": "/spec/containers/-", "value": c}));
            }
        } else {
            m.patch
                .push(json!({"op": "add", "path": "/spec/containers", "value": missing}));
        }
    }
    // volumes
    let have = names(volumes);
    let missing: Vec<&Volume> = cfg
        .volumes
        .iter()
        .filter(|v| !have.contains(v.name.as_str()))
        .collect();
    if !missing.is_empty() {
        if has_list(volumes) {
            for v in &missing {
                m.patch
                    .push(json!({"op": "add", "path": "/spec/volumes/-", "value": v}));
            }
        } else {
            m.patch
                .push(json!({"op": "add", "path": "/spec/volumes", "value": missing}));
        }
    }
    // the runtime class
    if let Some(class) = &cfg.runtime_class_name {
        match spec.and_then(|s| s.get("runtimeClassName")) {
            None | Some(Value::Null) => m.patch.push(
                json!({"op": "add", "path": "/spec/runtimeClassName", "value": class}),
            ),
            Some(Value::String(s)) if s == class => {}
            Some(other) => m.warnings.push(format!(
                "the pod's runtimeClassName {other} is kept; vGPU pods are configured to run with {class:?} (ConfigMap vcuda-webhook)"
            )),
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Seed 000's injection ("How Kata works?"), as deploy/webhook ships it.
    const SEED: &str = r#"
resources: ["tencent.com/vgpu-*"]
runtimeClassName: kata-qemu
initContainers:
  - name: nvidia
    image: registry.example.com/nvidia-driver:CHANGE-ME
    command: ["/bin/sh", "-c", "modprobe nvidia; modprobe nvidia-drm modeset=1; nvidia-modprobe -u -m"]
    securityContext: {capabilities: {add: [ALL]}}
    volumeMounts:
      - {name: dev, mountPath: /dev}
      - {name: nvidia-driver, mountPath: /lib/modules, subPath: lib/modules, readOnly: true}
containers:
  - name: gridd
    image: registry.example.com/nvidia-gridd:CHANGE-ME
    command: ["/bin/bash", "-c", "nvidia-gridd; sleep infinity"]
    volumeMounts:
      - {name: nvidia-driver, mountPath: /etc/nvidia, subPath: etc/nvidia, readOnly: true}
volumes:
  - {name: dev, hostPath: {path: /dev}}
  - {name: nvidia-driver, hostPath: {path: /usr/local/nvidia}}
"#;

    fn cfg() -> VmPods {
        VmPods::parse(SEED, "vm-pods.yaml").unwrap()
    }

    fn vm_pod() -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "vm", "namespace": "default"},
            "spec": {"containers": [{"name": "app", "image": "app",
                "resources": {"limits": {"tencent.com/vgpu-492": "1"}}}]}
        })
    }

    fn apply(pod: &Value, m: &Mutation) -> Value {
        let mut pod = pod.clone();
        let patch: json_patch::Patch =
            serde_json::from_value(Value::Array(m.patch.clone())).unwrap();
        json_patch::patch(&mut pod, &patch).unwrap();
        pod
    }

    fn container_names(pod: &Value, list: &str) -> Vec<String> {
        pod["spec"][list]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn a_vgpu_pod_gets_the_driver_loader_the_licence_sidecar_volumes_and_kata() {
        let c = cfg();
        let p = c.patterns("tencent.com");
        let pod = vm_pod();
        let m = mutate(&c, &p, &pod);
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        let out = apply(&pod, &m);
        assert_eq!(container_names(&out, "initContainers"), ["nvidia"]);
        assert_eq!(container_names(&out, "containers"), ["app", "gridd"]);
        assert_eq!(out["spec"]["runtimeClassName"], "kata-qemu");
        assert_eq!(
            out["spec"]["volumes"][1]["hostPath"]["path"],
            "/usr/local/nvidia"
        );
        assert_eq!(
            out["spec"]["initContainers"][0]["command"][2],
            "modprobe nvidia; modprobe nvidia-drm modeset=1; nvidia-modprobe -u -m"
        );
        assert_eq!(
            out["spec"]["initContainers"][0]["securityContext"]["capabilities"]["add"][0],
            "ALL"
        );
        // the loader asks for the pod's vGPU, as seed 000's does (the kubelet hands it on)
        let loader = &out["spec"]["initContainers"][0]["resources"];
        assert_eq!(loader["limits"]["tencent.com/vgpu-492"], "1");
        assert_eq!(loader["requests"]["tencent.com/vgpu-492"], "1");
        // the sidecar does not
        assert!(out["spec"]["containers"][1].get("resources").is_none());
        // the user's container is untouched
        assert_eq!(out["spec"]["containers"][0], pod["spec"]["containers"][0]);
        // applying twice changes nothing
        assert_eq!(mutate(&c, &p, &out), Mutation::default());
    }

    #[test]
    fn the_loader_runs_before_the_pods_own_init_containers_and_existing_entries_are_kept() {
        let c = cfg();
        let p = c.patterns("tencent.com");
        let mut pod = vm_pod();
        pod["spec"]["initContainers"] = json!([{"name": "setup", "image": "x"}]);
        pod["spec"]["volumes"] = json!([{"name": "dev", "emptyDir": {}}]);
        pod["spec"]["containers"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "gridd", "image": "mine"}));
        let out = apply(&pod, &mutate(&c, &p, &pod));
        assert_eq!(container_names(&out, "initContainers"), ["nvidia", "setup"]);
        assert_eq!(container_names(&out, "containers"), ["app", "gridd"]);
        assert_eq!(out["spec"]["containers"][1]["image"], "mine");
        assert_eq!(
            out["spec"]["volumes"][0],
            json!({"name": "dev", "emptyDir": {}})
        );
        assert_eq!(out["spec"]["volumes"][1]["name"], "nvidia-driver");
    }

    #[test]
    fn another_runtime_class_is_kept_with_a_warning() {
        let c = cfg();
        let p = c.patterns("tencent.com");
        let mut pod = vm_pod();
        pod["spec"]["runtimeClassName"] = json!("kata-clh");
        let m = mutate(&c, &p, &pod);
        assert!(!m
            .patch
            .iter()
            .any(|op| op["path"] == "/spec/runtimeClassName"));
        assert_eq!(m.warnings.len(), 1);
        assert!(
            m.warnings[0].contains("\"kata-clh\" is kept"),
            "{:?}",
            m.warnings
        );
    }

    #[test]
    fn a_name_clash_across_kinds_is_not_added_but_said() {
        let c = cfg();
        let p = c.patterns("tencent.com");
        let mut pod = vm_pod();
        pod["spec"]["containers"][0]["name"] = json!("nvidia");
        let m = mutate(&c, &p, &pod);
        let out = apply(&pod, &m);
        assert!(container_names(&out, "initContainers").is_empty());
        assert!(
            m.warnings[0].contains("container named \"nvidia\""),
            "{:?}",
            m.warnings
        );
    }

    #[test]
    fn pods_without_a_vgpu_are_left_alone() {
        let c = cfg();
        let p = c.patterns("tencent.com");
        let mut pod = vm_pod();
        pod["spec"]["containers"][0]["resources"] =
            json!({"limits": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}});
        assert_eq!(mutate(&c, &p, &pod), Mutation::default());
        // a vGPU asked for in requests or by an init container only counts too
        pod["spec"]["initContainers"] =
            json!([{"name": "i", "resources": {"requests": {"tencent.com/vgpu-1": "1"}}}]);
        assert!(!mutate(&c, &p, &pod).patch.is_empty());
    }

    #[test]
    fn configurations_are_checked_with_the_fix() {
        let e = VmPods::parse("initContainers: [{image: x}]", "f.yaml").unwrap_err();
        assert!(e.to_string().contains("has no name"), "{e}");
        let e = VmPods::parse("containers: [{name: a}, {name: a}]", "f.yaml").unwrap_err();
        assert!(e.to_string().contains("\"a\" is used twice"), "{e}");
        let e = VmPods::parse("containers: [{name: Big}]", "f.yaml").unwrap_err();
        assert!(e.to_string().contains("not a DNS label"), "{e}");
        let e = VmPods::parse("sidecars: []", "f.yaml").unwrap_err();
        assert!(
            e.to_string().contains("f.yaml") && e.to_string().contains("sidecars"),
            "{e}"
        );
        assert_eq!(VmPods::parse("", "f").unwrap(), VmPods::default());
        assert_eq!(
            VmPods::default().patterns("example.com"),
            ResourcePatterns::new(["example.com/vgpu-*"])
        );
    }

    fn arb_pod() -> impl Strategy<Value = Value> {
        let names = prop::sample::subsequence(vec!["nvidia", "gridd", "app", "setup", "x"], 0..=5);
        let vols = prop::sample::subsequence(vec!["dev", "nvidia-driver", "data"], 0..=3);
        (
            names,
            names_split(),
            vols,
            any::<Option<bool>>(),
            any::<bool>(),
        )
            .prop_map(|(names, split, vols, class, null_lists)| {
                let split = split.min(names.len());
                let (inits, apps) = names.split_at(split);
                let cont = |n: &&str| json!({"name": n, "image": "i"});
                let mut apps: Vec<Value> = apps.iter().map(cont).collect();
                apps.push(
                    json!({"name": "vm", "resources": {"limits": {"tencent.com/vgpu-7": "1"}}}),
                );
                let mut spec = json!({"containers": apps});
                if !inits.is_empty() {
                    spec["initContainers"] = Value::Array(inits.iter().map(cont).collect());
                } else if null_lists {
                    spec["initContainers"] = Value::Null;
                }
                if !vols.is_empty() {
                    spec["volumes"] = Value::Array(
                        vols.iter()
                            .map(|v| json!({"name": v, "emptyDir": {}}))
                            .collect(),
                    );
                } else if null_lists {
                    spec["volumes"] = Value::Null;
                }
                match class {
                    Some(true) => spec["runtimeClassName"] = json!("kata-qemu"),
                    Some(false) => spec["runtimeClassName"] = json!("other"),
                    None => {}
                }
                json!({"metadata": {"name": "p"}, "spec": spec})
            })
    }

    fn names_split() -> impl Strategy<Value = usize> {
        0usize..=5
    }

    proptest! {
        /// Whatever the pod has already: the patch applies, the result holds every
        /// configured container and volume exactly once (unless its name clashes across
        /// kinds, which is warned about), keeps all the pod had, and a second pass changes
        /// nothing.
        #[test]
        fn the_mutation_applies_completes_and_is_idempotent(pod in arb_pod()) {
            let c = cfg();
            let p = c.patterns("tencent.com");
            let m = mutate(&c, &p, &pod);
            let out = apply(&pod, &m);
            let inits = container_names(&out, "initContainers");
            let apps = container_names(&out, "containers");
            for (name, list, other) in [("nvidia", &inits, &apps), ("gridd", &apps, &inits)] {
                let n = list.iter().filter(|x| *x == name).count();
                prop_assert_eq!(n, usize::from(!other.contains(&name.to_string())));
            }
            let before: BTreeSet<String> = container_names(&pod, "containers").into_iter().chain(container_names(&pod, "initContainers")).collect();
            let after: BTreeSet<String> = apps.iter().chain(&inits).cloned().collect();
            prop_assert!(before.is_subset(&after));
            prop_assert!(before.len() + 2 >= after.len());
            let vols = out["spec"]["volumes"].as_array().unwrap();
            for v in ["dev", "nvidia-driver"] {
                prop_assert_eq!(vols.iter().filter(|x| x["name"] == v).count(), 1);
            }
            prop_assert!(out["spec"]["runtimeClassName"].is_string());
            let again = mutate(&c, &p, &out);
            prop_assert!(again.patch.is_empty(), "{:?}", again.patch);
        }
    }
}
