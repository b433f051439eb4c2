//! The manager's API server side (I/O, kube-rs): reading the pods bound to this node, and
//! publishing the node's GPUs in the `vcuda.io/gpus` Node annotation. Decisions are in
//! [`crate::assign`].
//!
//! **Why a Node annotation, not a CRD.** The scheduler extender reads the inventory and
//! writes its reservations on the same object, so one compare-and-swap (the Node's
//! `resourceVersion`) orders the manager's publications against every bind: a reservation
//! can be retired in the very write that adds the pod's allocation to the inventory, and
//! the two are never both missing or both counted by a reader. A CRD would need its own
//! install step, RBAC and a second object whose writes are not ordered with the Node's;
//! the inventory is small (≈ 300 bytes per GPU), far below the annotation limit (256 KiB).
//!
//! **Publishing.** One task writes, after any change of the allocations or of GPU health
//! (debounced by [`DEBOUNCE`]) and every [`REFRESH`] otherwise: it lists the node's pods,
//! reads the Node, computes the inventory and the reservations that are over, and
//! merge-patches both annotations with the Node's `resourceVersion` as precondition (409 →
//! read again). Nothing is written when nothing changed.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::{Node as KNode, Pod as KPod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::Api;
use serde_json::json;
use tracing::{debug, info, warn};
use vcuda_cluster::{Reservations, INVENTORY_ANNOTATION, RESERVATIONS_ANNOTATION, SCHEMA};

use crate::assign::{self, PodFacts};
use crate::plugin::Shared;
use crate::settings::{ApiMode, Settings};

/// Wait this long after a change before publishing (a pod's containers change together).
pub const DEBOUNCE: Duration = Duration::from_millis(100);
/// Publish at least this often (health, reservations of pods that never came).
pub const REFRESH: Duration = Duration::from_secs(10);
/// A reservation whose pod is not bound here this long after the bind is dropped.
pub const RESERVATION_GRACE: Duration = Duration::from_secs(60);
/// Attempts per publication when the Node keeps changing under us.
const ATTEMPTS: u32 = 10;

/// The client and what it is about.
pub struct ApiServer {
    client: kube::Client,
    pub node: String,
    domain: String,
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
pub async fn connect(settings: &Settings) -> Result<Option<ApiServer>> {
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
            bail!("the node's name is unknown: pass --node-name or set NODE_NAME (downward API spec.nodeName)");
        }
        let client = match &settings.kubeconfig {
            None => kube::Client::try_default()
                .await
                .context("cannot configure the API server client (in-cluster service account or $KUBECONFIG); pass --kubeconfig")?,
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path)
                    .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
                let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                    .await
                    .with_context(|| format!("kubeconfig {} is not usable", path.display()))?;
                kube::Client::try_from(cfg).context("cannot build the API server client")?
            }
        };
        Ok(ApiServer {
            client,
            node: settings.node_name.clone(),
            domain: settings.domain.clone(),
        })
    };
    match made.await {
        Ok(api) => {
            info!(node = %api.node, "using the API server: publishing vcuda.io/gpus, following vcuda.io/assignment");
            Ok(Some(api))
        }
        Err(e) if settings.api == ApiMode::Auto => {
            warn!(error = %format!("{e:#}"), "running without the API server (--api auto); pass --api on to make this fatal");
            Ok(None)
        }
        Err(e) => Err(e.context("--api on")),
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl ApiServer {
    /// The pods bound to this node.
    pub async fn node_pods(&self) -> Result<Vec<PodFacts>, String> {
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let list = Api::<KPod>::all(self.client.clone())
            .list(&lp)
            .await
            .map_err(|e| format!("cannot list the pods of node {}: {e}", self.node))?;
        Ok(list
            .items
            .iter()
            .map(|p| assign::facts(p, &self.domain))
            .collect())
    }

    /// The scheduler's reservations on this node (`None`: none, or not readable).
    pub async fn reservations(&self) -> Result<Option<Reservations>, String> {
        let node = Api::<KNode>::all(self.client.clone())
            .get(&self.node)
            .await
            .map_err(|e| format!("cannot read node {}: {e}", self.node))?;
        Ok(node
            .metadata
            .annotations
            .and_then(|a| a.get(RESERVATIONS_ANNOTATION).cloned())
            .and_then(|s| serde_json::from_str(&s).ok()))
    }

    /// The pods bound to this node and the scheduler's reservations, each pod's assignment
    /// kept only where a reservation vouches for it ([`assign::vouch`]).
    pub async fn vouched_pods(&self) -> Result<(Vec<PodFacts>, Option<Reservations>), String> {
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
    ) -> Result<(Option<PodFacts>, Option<Reservations>), String> {
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
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<Option<PodFacts>, String> {
        Api::<KPod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map(|p| p.map(|p| assign::facts(&p, &self.domain)))
            .map_err(|e| format!("cannot read pod {namespace}/{name}: {e}"))
    }

    /// At shutdown: publish every GPU as unhealthy, so that the scheduler sends no pod here
    /// while no device plugin answers the kubelet (it would be refused at admission). The
    /// next manager publishes the real health at start. Bounded: a shutdown never waits on
    /// the API server for more than 2 s.
    pub async fn withdraw(&self, shared: &Shared) {
        let attempt = async {
            for _ in 0..ATTEMPTS {
                match self.publish_once_as(shared, true).await {
                    Ok(true) => return Ok(()),
                    Ok(false) => continue,
                    Err(e) => return Err(e),
                }
            }
            Err("the node kept changing".to_string())
        };
        match tokio::time::timeout(Duration::from_secs(2), attempt).await {
            Ok(Ok(())) => {
                info!(node = %self.node, "vcuda.io/gpus marked unhealthy until the manager is back")
            }
            Ok(Err(e)) => warn!(error = %e, "cannot mark the GPUs unhealthy at shutdown"),
            Err(_) => warn!(
                "cannot mark the GPUs unhealthy at shutdown: the API server did not answer in 2 s"
            ),
        }
    }

    /// Publish once: `Ok(true)` written or nothing to write, `Ok(false)` conflict (retry).
    async fn publish_once(&self, shared: &Shared) -> Result<bool, String> {
        self.publish_once_as(shared, false).await
    }

    async fn publish_once_as(&self, shared: &Shared, down: bool) -> Result<bool, String> {
        let pods = self.node_pods().await?;
        let nodes: Api<KNode> = Api::all(self.client.clone());
        let node = nodes.get(&self.node).await.map_err(|e| match &e {
            kube::Error::Api(r) if r.code == 404 => format!(
                "node {} does not exist in the API server: is --node-name / NODE_NAME this node's name?",
                self.node
            ),
            _ => format!("cannot read node {}: {e}", self.node),
        })?;
        let rv = node.metadata.resource_version.clone().unwrap_or_default();
        let ann = node.metadata.annotations.unwrap_or_default();
        let (inventory, allocs, overrides) = {
            let core = shared.core.lock();
            (
                core.inventory.clone(),
                core.allocations().cloned().collect::<Vec<_>>(),
                core.overrides.clone(),
            )
        };
        // Reservations left on the Node after this write (an override of any other is done).
        let mut published: Vec<String> = Vec::new();
        let mut health = shared.health.borrow().clone();
        if down {
            health.iter_mut().for_each(|h| *h = false);
        }
        // An allocation PreStartContainer has not finished counts only while the kubelet still
        // holds its devices: an admission that failed after Allocate leaves one behind until
        // garbage collection. (Its pod's reservation counts it meanwhile.)
        let socket = shared.core.lock().settings.pod_resources_socket.clone();
        let list = {
            let _listing = shared.listing.lock().await;
            shared.fresh_list(&socket).await.ok()
        };
        let held: Option<HashSet<String>> = list.map(|l| {
            l.pod_resources
                .iter()
                .flat_map(|p| &p.containers)
                .flat_map(|c| &c.devices)
                .flat_map(|d| d.device_ids.iter().cloned())
                .collect()
        });
        let counted: Vec<_> = allocs
            .iter()
            .filter(|a| {
                a.finished()
                    || held
                        .as_ref()
                        .is_none_or(|h| a.cores.iter().any(|c| h.contains(c)))
            })
            .cloned()
            .collect();
        let inv = assign::node_inventory(&inventory, &health, &counted, &pods);
        let inv_json = serde_json::to_string(&inv).map_err(|e| e.to_string())?;
        let mut patch = serde_json::Map::new();
        if ann.get(INVENTORY_ANNOTATION) != Some(&inv_json) {
            patch.insert(INVENTORY_ANNOTATION.into(), json!(inv_json));
        }
        let mut retired = Vec::new();
        let mut exchanged = Vec::new();
        if let Some(text) = ann.get(RESERVATIONS_ANNOTATION) {
            match serde_json::from_str::<Reservations>(text) {
                Ok(mut res) => {
                    // Exchanges first (assign::partner): a retired pod's and its partner's
                    // reservations change in the same write.
                    for r in &mut res.pods {
                        if let Some(o) = overrides.get(&r.uid) {
                            if &r.gpus != o {
                                r.gpus = o.clone();
                                exchanged.push(r.uid.clone());
                            }
                        }
                    }
                    retired = assign::retire(
                        &res,
                        &pods,
                        &allocs,
                        unix_ms(),
                        RESERVATION_GRACE.as_millis() as u64,
                    );
                    if !retired.is_empty() || !exchanged.is_empty() {
                        res.pods.retain(|r| !retired.contains(&r.uid));
                        res.schema = SCHEMA;
                        let v = serde_json::to_string(&res).map_err(|e| e.to_string())?;
                        patch.insert(RESERVATIONS_ANNOTATION.into(), json!(v));
                    }
                    published = res.pods.iter().map(|r| r.uid.clone()).collect();
                }
                Err(e) => {
                    warn!(node = %self.node, error = %e, "annotation {RESERVATIONS_ANNOTATION} is not readable; left as it is")
                }
            }
        }
        // After a write (or when none was needed): an exchange now carried by a reservation
        // on the Node is forgotten; one made meanwhile, or of a live pod without a
        // reservation to carry it, is kept.
        let live: Vec<&str> = pods
            .iter()
            .filter(|p| !p.finished)
            .map(|p| p.uid.as_str())
            .collect();
        let forget = |shared: &Shared, published: &[String]| {
            let mut core = shared.core.lock();
            core.overrides.retain(|uid, o| {
                overrides.get(uid) != Some(o)
                    || (!published.contains(uid) && live.contains(&uid.as_str()))
            });
        };
        if patch.is_empty() {
            forget(shared, &published);
            return Ok(true);
        }
        let body = json!({"metadata": {"resourceVersion": rv, "annotations": patch}});
        match nodes
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => {
                forget(shared, &published);
                debug!(node = %self.node, retired = retired.len(), exchanged = exchanged.len(), "published vcuda.io/gpus");
                if !retired.is_empty() {
                    info!(node = %self.node, pods = %retired.join(","), "reservations retired: the pods are allocated here (or gone)");
                }
                Ok(true)
            }
            Err(kube::Error::Api(r)) if r.code == 409 => Ok(false),
            Err(e) => Err(format!(
                "cannot write node {}'s annotations: {e}; the manager needs get and patch on its Node (see deploy/vcuda-manager.yaml)",
                self.node
            )),
        }
    }

    /// Runs for ever: publish after every change (debounced) and every [`REFRESH`].
    pub async fn publish_loop(self: Arc<Self>, shared: Arc<Shared>) {
        let changed = shared.core.lock().changed.clone();
        let mut health = shared.health.subscribe();
        let mut last_error: Option<String> = None;
        loop {
            for _ in 0..ATTEMPTS {
                match self.publish_once(&shared).await {
                    Ok(true) => {
                        if last_error.take().is_some() {
                            info!(node = %self.node, "publishing vcuda.io/gpus again");
                        }
                        break;
                    }
                    Ok(false) => continue,
                    Err(e) => {
                        if last_error.as_ref() != Some(&e) {
                            warn!(error = %e, "cannot publish the node's GPUs; retrying");
                        }
                        last_error = Some(e);
                        break;
                    }
                }
            }
            let wait = if last_error.is_some() {
                Duration::from_secs(2)
            } else {
                REFRESH
            };
            tokio::select! {
                _ = changed.notified() => {}
                _ = health.changed() => {}
                _ = tokio::time::sleep(wait) => {}
            }
            tokio::time::sleep(DEBOUNCE).await;
        }
    }
}
