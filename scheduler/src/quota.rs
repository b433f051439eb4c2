//! Namespace GPU pools and quotas (pure): read from a ConfigMap's `data`, checked per node
//! against a placement and the namespace's current usage (both given as inputs).
//!
//! **Format.** Each key of the ConfigMap's `data` is a namespace (or [`DEFAULT_KEY`] for every
//! namespace not listed); each value is JSON:
//!
//! ```json
//! {"pool": {"matchLabels": {"gpu-pool": "research"}},
//!  "quota": {"A100": {"core": 300, "memory": "160Gi"}, "*": {"core": 50}}}
//! ```
//!
//! - `pool.matchLabels`: the namespace's pods may run only on nodes carrying all these labels
//!   (absent: any node).
//! - `quota`: per GPU model, the most the namespace may hold at once: `core` in vcuda-core
//!   units (100 = one whole GPU) and `memory` as a Kubernetes quantity (`"40Gi"`) or bytes;
//!   either may be left out (unlimited). A key matches a model whose name contains it,
//!   ignoring case (`"A100"` matches `NVIDIA A100-SXM4-80GB`); `"*"` matches any model; the
//!   longest matching key wins. With a `quota` map, a model no key matches is refused;
//!   without one, the namespace is unlimited.
//! - A namespace that is neither listed nor covered by [`DEFAULT_KEY`] is unrestricted.
//!
//! Placement does not steer around models a namespace has no quota for: on a node with
//! mixed models the quota check applies to the GPUs [`crate::placement::filter`] chose.

use std::collections::BTreeMap;

use serde::Deserialize;
use thiserror::Error;
use vcuda_cluster::GpuShare;

use crate::placement::{Choice, NodeView};
use crate::request::parse_integer_quantity;

/// The ConfigMap key whose rule applies to namespaces without a key of their own (namespace
/// names cannot contain `_`).
pub const DEFAULT_KEY: &str = "_default";

/// An amount of GPU resources: vcuda-core units and memory bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Amount {
    /// vcuda-core units (100 = one whole GPU).
    pub core: u64,
    /// Bytes.
    pub memory_bytes: u64,
}

/// The most a namespace may hold of one model; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limit {
    /// vcuda-core units.
    pub core: Option<u64>,
    /// Bytes.
    pub memory_bytes: Option<u64>,
}

/// One namespace's pool and quota.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamespaceRule {
    /// Labels a node must carry (all of them).
    pub pool: BTreeMap<String, String>,
    /// Per model key; `None`: no quota.
    pub quota: Option<BTreeMap<String, Limit>>,
}

/// Every namespace's rule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Quotas {
    /// By namespace.
    pub namespaces: BTreeMap<String, NamespaceRule>,
    /// For namespaces not listed ([`DEFAULT_KEY`]).
    pub default: Option<NamespaceRule>,
}

/// A ConfigMap entry that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuotaConfigError {
    #[error("quota ConfigMap key {key}: not the expected JSON ({error}); see the format in vcuda-scheduler's README: {{\"pool\": {{\"matchLabels\": {{...}}}}, \"quota\": {{\"A100\": {{\"core\": 300, \"memory\": \"40Gi\"}}}}}}")]
    Json { key: String, error: String },
    #[error("quota ConfigMap key {key}: memory {value:?} of model {model:?} is not a quantity; use bytes or e.g. \"40Gi\"")]
    Memory {
        key: String,
        model: String,
        value: String,
    },
}

/// Why a namespace may not place the pod on a node.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuotaRefusal {
    #[error("namespace {namespace} may use only nodes labelled {label}={want} (its GPU pool in the quota ConfigMap); this node has {label}={}", have.as_deref().unwrap_or("<none>"))]
    NotInPool {
        namespace: String,
        label: String,
        want: String,
        have: Option<String>,
    },
    #[error("namespace {namespace} has no GPU quota for model {model}; ask an administrator to add one to the quota ConfigMap")]
    NoQuotaForModel { namespace: String, model: String },
    #[error("namespace {namespace}: {} quota for {key} is {}, {} in use, this pod asks {}; free some or ask for a larger quota",
        resource.name(), resource.show(*limit), resource.show(*used), resource.show(*asked))]
    OverQuota {
        namespace: String,
        key: String,
        resource: Resource,
        limit: u64,
        used: u64,
        asked: u64,
    },
}

/// The resource a quota limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// vcuda-core units.
    Core,
    /// Memory bytes.
    Memory,
}

impl Resource {
    fn name(self) -> &'static str {
        match self {
            Resource::Core => "vcuda-core",
            Resource::Memory => "memory",
        }
    }
    fn show(self, v: u64) -> String {
        match self {
            Resource::Core => v.to_string(),
            Resource::Memory => gib(v),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    #[serde(default)]
    pool: Option<RawPool>,
    #[serde(default)]
    quota: Option<BTreeMap<String, RawLimit>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawPool {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    #[serde(default)]
    core: Option<u64>,
    #[serde(default)]
    memory: Option<serde_json::Value>,
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30))
}

impl Quotas {
    /// Read the ConfigMap's `data`.
    pub fn from_config_map(data: &BTreeMap<String, String>) -> Result<Quotas, QuotaConfigError> {
        let mut q = Quotas::default();
        for (key, value) in data {
            let raw: RawRule = serde_json::from_str(value).map_err(|e| QuotaConfigError::Json {
                key: key.clone(),
                error: e.to_string(),
            })?;
            let quota = match raw.quota {
                None => None,
                Some(models) => {
                    let mut out = BTreeMap::new();
                    for (model, l) in models {
                        let memory_bytes = match l.memory {
                            None => None,
                            Some(v) => {
                                let text = match &v {
                                    serde_json::Value::String(s) => s.clone(),
                                    other => other.to_string(),
                                };
                                Some(parse_integer_quantity(&text).ok_or_else(|| {
                                    QuotaConfigError::Memory {
                                        key: key.clone(),
                                        model: model.clone(),
                                        value: text.clone(),
                                    }
                                })?)
                            }
                        };
                        out.insert(
                            model,
                            Limit {
                                core: l.core,
                                memory_bytes,
                            },
                        );
                    }
                    Some(out)
                }
            };
            let rule = NamespaceRule {
                pool: raw.pool.map(|p| p.match_labels).unwrap_or_default(),
                quota,
            };
            if key == DEFAULT_KEY {
                q.default = Some(rule);
            } else {
                q.namespaces.insert(key.clone(), rule);
            }
        }
        Ok(q)
    }

    /// The rule for `namespace`, if any.
    pub fn rule(&self, namespace: &str) -> Option<&NamespaceRule> {
        self.namespaces.get(namespace).or(self.default.as_ref())
    }

    /// May `namespace` place `charges` (per GPU model) on a node with `node_labels`, holding
    /// `usage` (per GPU model) already?
    pub fn check(
        &self,
        namespace: &str,
        node_labels: &BTreeMap<String, String>,
        charges: &[(String, Amount)],
        usage: &BTreeMap<String, Amount>,
    ) -> Result<(), QuotaRefusal> {
        let Some(rule) = self.rule(namespace) else {
            return Ok(());
        };
        for (label, want) in &rule.pool {
            let have = node_labels.get(label);
            if have != Some(want) {
                return Err(QuotaRefusal::NotInPool {
                    namespace: namespace.to_string(),
                    label: label.clone(),
                    want: want.clone(),
                    have: have.cloned(),
                });
            }
        }
        let Some(quota) = &rule.quota else {
            return Ok(());
        };
        // charges and usage summed per quota key
        let mut asked: BTreeMap<&str, Amount> = BTreeMap::new();
        for (model, a) in charges {
            let key = key_for(quota, model).ok_or_else(|| QuotaRefusal::NoQuotaForModel {
                namespace: namespace.to_string(),
                model: model.clone(),
            })?;
            let e = asked.entry(key).or_default();
            e.core += a.core;
            e.memory_bytes += a.memory_bytes;
        }
        for (key, a) in asked {
            let mut used = Amount::default();
            for (model, u) in usage {
                if key_for(quota, model) == Some(key) {
                    used.core += u.core;
                    used.memory_bytes += u.memory_bytes;
                }
            }
            let limit = quota[key];
            let over = |resource, limit, used, asked| QuotaRefusal::OverQuota {
                namespace: namespace.to_string(),
                key: key.to_string(),
                resource,
                limit,
                used,
                asked,
            };
            if let Some(l) = limit.core {
                if used.core.saturating_add(a.core) > l {
                    return Err(over(Resource::Core, l, used.core, a.core));
                }
            }
            if let Some(l) = limit.memory_bytes {
                if used.memory_bytes.saturating_add(a.memory_bytes) > l {
                    return Err(over(Resource::Memory, l, used.memory_bytes, a.memory_bytes));
                }
            }
        }
        Ok(())
    }
}

/// The quota key governing `model`: the longest key the model's name contains (ignoring
/// case), else `"*"`.
fn key_for<'a>(quota: &'a BTreeMap<String, Limit>, model: &str) -> Option<&'a str> {
    let m = model.to_ascii_lowercase();
    quota
        .keys()
        .filter(|k| k.as_str() != "*" && m.contains(&k.to_ascii_lowercase()))
        .max_by_key(|k| k.len())
        .or_else(|| quota.keys().find(|k| k.as_str() == "*"))
        .map(String::as_str)
}

/// What a placement charges, per GPU model (core units, bytes), from [`Choice::per_gpu`].
pub fn charges(view: &NodeView, choice: &Choice) -> Vec<(String, Amount)> {
    let mut out: BTreeMap<String, Amount> = BTreeMap::new();
    for GpuShare {
        uuid,
        core_percent,
        memory_bytes,
    } in choice.per_gpu(view)
    {
        if let Some(g) = view.gpus.iter().find(|g| g.uuid == uuid) {
            let e = out.entry(g.model.clone()).or_default();
            e.core += u64::from(core_percent);
            e.memory_bytes += memory_bytes;
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn config() -> Quotas {
        let data = BTreeMap::from([
            (
                "ml".to_string(),
                r#"{"pool": {"matchLabels": {"gpu-pool": "research"}},
                    "quota": {"A100": {"core": 300, "memory": "160Gi"}, "A100-SXM4-80GB": {"core": 100}, "*": {"core": 50}}}"#
                    .to_string(),
            ),
            ("web".to_string(), r#"{"quota": {"T4": {"memory": 8589934592}}}"#.to_string()),
            (DEFAULT_KEY.to_string(), r#"{"pool": {"matchLabels": {"shared": "yes"}}}"#.to_string()),
        ]);
        Quotas::from_config_map(&data).unwrap()
    }

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn amt(core: u64, gib: u64) -> Amount {
        Amount {
            core,
            memory_bytes: gib * GIB,
        }
    }

    #[test]
    fn the_format_reads_and_errors_name_the_key() {
        let q = config();
        assert_eq!(
            q.namespaces["web"].quota.as_ref().unwrap()["T4"].memory_bytes,
            Some(8 * GIB)
        );
        assert_eq!(
            q.namespaces["ml"].quota.as_ref().unwrap()["A100"].memory_bytes,
            Some(160 * GIB)
        );
        let bad = |v: &str| {
            Quotas::from_config_map(&BTreeMap::from([("ns".to_string(), v.to_string())]))
                .unwrap_err()
                .to_string()
        };
        assert!(bad("{").starts_with("quota ConfigMap key ns: not the expected JSON"));
        assert!(
            bad(r#"{"pools": {}}"#).contains("unknown field"),
            "typos are caught"
        );
        assert!(bad(r#"{"quota": {"A100": {"memory": "lots"}}}"#)
            .contains("memory \"lots\" of model \"A100\""));
    }

    #[test]
    fn pools_are_node_labels() {
        let q = config();
        let e = q
            .check("ml", &labels(&[]), &[], &BTreeMap::new())
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "namespace ml may use only nodes labelled gpu-pool=research (its GPU pool in the quota ConfigMap); this node has gpu-pool=<none>"
        );
        assert!(q
            .check(
                "ml",
                &labels(&[("gpu-pool", "research")]),
                &[],
                &BTreeMap::new()
            )
            .is_ok());
        // the default rule covers other namespaces; an unlisted namespace without default is free
        assert!(q
            .check("other", &labels(&[]), &[], &BTreeMap::new())
            .is_err());
        assert!(q
            .check(
                "other",
                &labels(&[("shared", "yes")]),
                &[],
                &BTreeMap::new()
            )
            .is_ok());
        assert!(Quotas::default()
            .check(
                "x",
                &labels(&[]),
                &[("T4".into(), amt(100, 16))],
                &BTreeMap::new()
            )
            .is_ok());
    }

    #[test]
    fn quotas_are_per_model_with_usage() {
        let q = config();
        let node = labels(&[("gpu-pool", "research")]);
        let a100 = "NVIDIA A100-SXM4-40GB".to_string();
        let usage = BTreeMap::from([(a100.clone(), amt(250, 100))]);
        assert!(
            q.check("ml", &node, &[(a100.clone(), amt(50, 20))], &usage)
                .is_ok(),
            "250 + 50 = 300"
        );
        let e = q
            .check("ml", &node, &[(a100.clone(), amt(60, 20))], &usage)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "namespace ml: vcuda-core quota for A100 is 300, 250 in use, this pod asks 60; free some or ask for a larger quota"
        );
        let e = q
            .check("ml", &node, &[(a100.clone(), amt(10, 61))], &usage)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("memory quota for A100 is 160.0 GiB, 100.0 GiB in use"),
            "{e}"
        );
        // the longest key wins: the 80GB model has its own, smaller quota; usage of the
        // 40GB model does not count against it
        let a100_80 = "NVIDIA A100-SXM4-80GB".to_string();
        assert!(q
            .check("ml", &node, &[(a100_80.clone(), amt(100, 1))], &usage)
            .is_ok());
        assert!(q
            .check("ml", &node, &[(a100_80, amt(101, 1))], &usage)
            .is_err());
        // "*" catches other models; without "*", an unlisted model is refused
        assert!(q
            .check("ml", &node, &[("Tesla T4".into(), amt(60, 1))], &usage)
            .is_err());
        assert!(q
            .check("ml", &node, &[("Tesla T4".into(), amt(50, 1))], &usage)
            .is_ok());
        let e = q
            .check(
                "web",
                &node,
                &[("NVIDIA H100".into(), amt(10, 1))],
                &BTreeMap::new(),
            )
            .unwrap_err();
        assert_eq!(
            e,
            QuotaRefusal::NoQuotaForModel {
                namespace: "web".into(),
                model: "NVIDIA H100".into()
            }
        );
        assert!(
            q.check(
                "web",
                &node,
                &[("Tesla T4".into(), amt(900, 8))],
                &BTreeMap::new()
            )
            .is_ok(),
            "core unlimited"
        );
        assert!(q
            .check(
                "web",
                &node,
                &[("Tesla T4".into(), amt(1, 9))],
                &BTreeMap::new()
            )
            .is_err());
    }

    #[test]
    fn charges_follow_the_placement() {
        use crate::placement::{filter, Policy};
        use crate::request::{ContainerNeed, Need, PodRequest};
        use vcuda_cluster::{Allocated, GpuInventory, NodeInventory, SCHEMA};
        let gpu = |i: u32, model: &str| GpuInventory {
            index: i,
            uuid: format!("GPU-{i}"),
            model: model.into(),
            compute_capability: "8.0".into(),
            memory_bytes: 40 * GIB,
            numa_node: None,
            links: vec![],
            healthy: true,
            allocated: Allocated::default(),
        };
        let inv = NodeInventory {
            schema: SCHEMA,
            gpus: vec![gpu(0, "A100"), gpu(1, "A100")],
        };
        let v = NodeView::new(&inv, &[]);
        let req = PodRequest {
            containers: vec![ContainerNeed {
                name: "c".into(),
                need: Need::Shares {
                    gpus: 2,
                    percent: 30,
                    memory_bytes: 4 * GIB,
                },
            }],
            init_containers: vec![],
        };
        let c = filter(&v, &req, &Policy::default()).unwrap();
        assert_eq!(charges(&v, &c), vec![("A100".to_string(), amt(60, 8))]);
    }
}
