//! The manager's API server client (I/O, kube-rs): reading the pods bound to this node and
//! its Node, and writing the Node's annotations with a compare-and-swap. Decisions are in
//! [`vcuda_manager_core::assign`]; the task that publishes the node's GPUs in the `vcuda.io/gpus` Node
//! annotation is [`crate::publisher`].
//!
//! **Why a Node annotation, not a CRD.** The scheduler extender reads the inventory and
//! writes its reservations on the same object, so one compare-and-swap (the Node's
//! `resourceVersion`) orders the manager's publications against every bind: a reservation
//! can be retired in the very write that adds the pod's allocation to the inventory, and
//! the two are never both missing or both counted by a reader. A CRD would need its own
//! install step, RBAC and a second object whose writes are not ordered with the Node's;
//! the inventory is small (≈ 300 bytes per GPU), far below the annotation limit (256 KiB).
//!

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Node as KNode, Pod as KPod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::Api;
use tracing::{info, warn};
use vcuda_cluster::{Reservations, RESERVATIONS_ANNOTATION};

use crate::settings::{ApiMode, Settings};
use vcuda_manager_core::assign::{self, PodFacts};
use vcuda_manager_core::lease::Holder;

/// The API server cannot be used or did not answer. Each names the object (node, pod,
/// kubeconfig) and, where the fix is the operator's, what to change.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("the node's name is unknown: pass --node-name or set NODE_NAME (downward API spec.nodeName)")]
    NoNodeName,
    #[error("cannot configure the API server client (in-cluster service account or $KUBECONFIG): {0}; pass --kubeconfig")]
    DefaultClient(#[source] kube::Error),
    #[error("cannot read kubeconfig {}: {source}; fix --kubeconfig", path.display())]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig {} is not usable: {source}; fix --kubeconfig", path.display())]
    KubeconfigUnusable {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("cannot build the API server client: {0}")]
    Client(#[source] kube::Error),
    #[error("--api on: {0}; pass --api auto to run without the API server instead")]
    Required(#[source] Box<ApiError>),
    #[error("cannot list the pods of node {node}: {source}")]
    ListPods { node: String, source: kube::Error },
    #[error("cannot read node {node}: {source}")]
    ReadNode { node: String, source: kube::Error },
    #[error("node {node} does not exist in the API server: is --node-name / NODE_NAME this node's name?")]
    NoSuchNode { node: String },
    #[error("cannot read pod {namespace}/{name}: {source}")]
    ReadPod {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("cannot write node {node}'s annotations: {source}; the manager needs get and patch on its Node (see deploy/base/manager-api/vcuda-manager-rbac.yaml)")]
    WriteNode { node: String, source: kube::Error },
}

impl ApiError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::NoNodeName => "no-node-name",
            ApiError::DefaultClient(_) => "default-client",
            ApiError::Kubeconfig { .. } => "kubeconfig",
            ApiError::KubeconfigUnusable { .. } => "kubeconfig-unusable",
            ApiError::Client(_) => "client",
            ApiError::Required(e) => e.kind(),
            ApiError::ListPods { .. } => "list-pods",
            ApiError::ReadNode { .. } => "read-node",
            ApiError::NoSuchNode { .. } => "no-such-node",
            ApiError::ReadPod { .. } => "read-pod",
            ApiError::WriteNode { .. } => "write-node",
        }
    }
}

/// The client and what it is about.
pub struct ApiServer {
    client: kube::Client,
    pub node: String,
    domain: String,
    /// The node Lease this start of the manager keeps ([`crate::lease`]); the inventory
    /// names it.
    pub holder: Holder,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// The API server client the settings ask for: `None` when `--api off`, or `auto` without
/// any kubeconfig (then the manager works as a plain device plugin).
pub async fn connect(settings: &Settings) -> Result<Option<ApiServer>, ApiError> {
    let found = settings.kubeconfig.is_some()
        || std::env::var_os("KUBECONFIG").is_some()
        || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    match settings.api {
        ApiMode::Off => return Ok(None),
        ApiMode::Auto if !found => {
            info!("no API server configured (no --kubeconfig, $KUBECONFIG or in-cluster service account): not publishing vcuda.io/gpus; scheduler assignments and vcuda.io/gpu-count are not followed");
            return Ok(None);
        }
        _ => {}
    }
    let made = async {
        if settings.node_name.is_empty() {
            return Err(ApiError::NoNodeName);
        }
        let client = match &settings.kubeconfig {
            None => kube::Client::try_default()
                .await
                .map_err(ApiError::DefaultClient)?,
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path).map_err(|source| {
                    ApiError::Kubeconfig {
                        path: path.clone(),
                        source,
                    }
                })?;
                let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                    .await
                    .map_err(|source| ApiError::KubeconfigUnusable {
                        path: path.clone(),
                        source,
                    })?;
                kube::Client::try_from(cfg).map_err(ApiError::Client)?
            }
        };
        // Random per start: a restarted manager is a new holder (the scheduler sees the
        // Lease change at once). Without randomness, the time is unique enough.
        let instance = getrandom::u64().unwrap_or_else(|_| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        Ok(ApiServer {
            client,
            node: settings.node_name.clone(),
            domain: settings.domain.clone(),
            holder: Holder::new(
                &settings.lease_namespace,
                &settings.node_name,
                settings.lease_duration_seconds,
                instance,
            ),
        })
    };
    match made.await {
        Ok(api) => {
            info!(node = %api.node, "using the API server: publishing vcuda.io/gpus, following vcuda.io/assignment");
            Ok(Some(api))
        }
        Err(e) if settings.api == ApiMode::Auto => {
            warn!(error = %e, kind = e.kind(), "running without the API server (--api auto); pass --api on to make this fatal");
            Ok(None)
        }
        Err(e) => Err(ApiError::Required(Box::new(e))),
    }
}

impl ApiServer {
    /// The client (for [`crate::lease`]).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The pods bound to this node.
    pub async fn node_pods(&self) -> Result<Vec<PodFacts>, ApiError> {
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let list = Api::<KPod>::all(self.client.clone())
            .list(&lp)
            .await
            .map_err(|source| ApiError::ListPods {
                node: self.node.clone(),
                source,
            })?;
        Ok(list
            .items
            .iter()
            .map(|p| assign::facts(p, &self.domain))
            .collect())
    }

    /// The scheduler's reservations on this node (`None`: none, or not readable).
    pub async fn reservations(&self) -> Result<Option<Reservations>, ApiError> {
        let node = Api::<KNode>::all(self.client.clone())
            .get(&self.node)
            .await
            .map_err(|source| ApiError::ReadNode {
                node: self.node.clone(),
                source,
            })?;
        Ok(node
            .metadata
            .annotations
            .and_then(|a| a.get(RESERVATIONS_ANNOTATION).cloned())
            .and_then(|s| serde_json::from_str(&s).ok()))
    }

    /// This node's annotations and the `resourceVersion` they were read at (for
    /// [`Self::patch_annotations`]).
    pub async fn node_annotations(&self) -> Result<(String, BTreeMap<String, String>), ApiError> {
        let node = Api::<KNode>::all(self.client.clone())
            .get(&self.node)
            .await
            .map_err(|source| match &source {
                kube::Error::Api(r) if r.code == 404 => ApiError::NoSuchNode {
                    node: self.node.clone(),
                },
                _ => ApiError::ReadNode {
                    node: self.node.clone(),
                    source,
                },
            })?;
        Ok((
            node.metadata.resource_version.unwrap_or_default(),
            node.metadata.annotations.unwrap_or_default(),
        ))
    }

    /// Merge `annotations` (name → JSON text) into this node's, if it is still at
    /// `resource_version`: `Ok(false)` when it changed meanwhile (read again and retry).
    pub async fn patch_annotations(
        &self,
        resource_version: &str,
        annotations: serde_json::Map<String, serde_json::Value>,
    ) -> Result<bool, ApiError> {
        let body = serde_json::json!({
            "metadata": {"resourceVersion": resource_version, "annotations": annotations}
        });
        match Api::<KNode>::all(self.client.clone())
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(r)) if r.code == 409 => Ok(false),
            Err(source) => Err(ApiError::WriteNode {
                node: self.node.clone(),
                source,
            }),
        }
    }

    /// The pods bound to this node and the scheduler's reservations, each pod's assignment
    /// kept only where a reservation vouches for it ([`assign::vouch`]).
    pub async fn vouched_pods(&self) -> Result<(Vec<PodFacts>, Option<Reservations>), ApiError> {
        let (mut pods, reservations) = tokio::try_join!(self.node_pods(), self.reservations())?;
        for p in &mut pods {
            if let Some(why) = assign::vouch(p, reservations.as_ref()) {
                warn!("{why}");
            }
        }
        Ok((pods, reservations))
    }

    /// One pod (`None`: it does not exist) and the reservations, vouched as
    /// [`Self::vouched_pods`].
    pub async fn vouched_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<(Option<PodFacts>, Option<Reservations>), ApiError> {
        let (mut pod, reservations) =
            tokio::try_join!(self.pod(namespace, name), self.reservations())?;
        if let Some(p) = &mut pod {
            if let Some(why) = assign::vouch(p, reservations.as_ref()) {
                warn!("{why}");
            }
        }
        Ok((pod, reservations))
    }

    /// One pod (`None`: it does not exist).
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<Option<PodFacts>, ApiError> {
        Api::<KPod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map(|p| p.map(|p| assign::facts(&p, &self.domain)))
            .map_err(|source| ApiError::ReadPod {
                namespace: namespace.to_string(),
                name: name.to_string(),
                source,
            })
    }
}
