//! When a PodResources `List` taken earlier may answer a PreStartContainer (pure).
//!
//! PreStartContainer must name the container holding its devices, which only PodResources
//! `List` tells: every pod of the node, ~1 ms for 100 pods (the kubelet encodes, we decode
//! ~100 KB). The kubelet creates the pod sandbox between admission (Allocate) and container
//! start (PreStartContainer), so the manager lists once the Allocates have gone quiet and
//! PreStartContainer usually finds the answer waiting. A list taken earlier is used only when
//! it is as good as a fresh one:
//!
//! 1. **It was requested after the last Allocate was answered.** The kubelet frees a device
//!    (drops it from its records) before it allocates it again, so such a list cannot show a
//!    device under a previous holder: no stale owner, which is how identical replicas get
//!    each other's config.
//! 2. **It shows every device of every Allocate answered before it was requested.** The
//!    kubelet records an allocation only after Allocate returns; a list served in between
//!    would show the container without its other resource. Entries that never show up (an
//!    admission that failed after our Allocate) are forgotten after [`PENDING_TTL`]; until
//!    then, every PreStartContainer lists afresh (slower, never wrong).
//!
//! Otherwise PreStartContainer lists afresh, and that list is authoritative.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vcuda_proto::podresources::v1 as pr;

/// How long an answered Allocate may stay invisible in PodResources before it is forgotten.
pub const PENDING_TTL: Duration = Duration::from_secs(30);

/// An answered Allocate not yet seen in a list.
#[derive(Debug, Clone)]
struct Pending {
    seq: u64,
    resource: String,
    ids: Vec<String>,
    at: Instant,
}

/// The cache of the latest list and what it must show.
#[derive(Debug, Default)]
pub struct ListCache {
    /// Allocates answered so far.
    answered: u64,
    pending: Vec<Pending>,
    /// The newest list and the value of `answered` when it was requested.
    latest: Option<(u64, Arc<pr::ListPodResourcesResponse>)>,
}

impl ListCache {
    /// Allocate answered `ids` of `resource` (call just before returning the answer).
    pub fn answered(&mut self, resource: &str, ids: &[String], now: Instant) {
        self.answered += 1;
        self.pending.push(Pending {
            seq: self.answered,
            resource: resource.to_string(),
            ids: ids.to_vec(),
            at: now,
        });
    }

    /// A list is about to be requested: the token to store it with.
    pub fn requesting(&self) -> u64 {
        self.answered
    }

    /// A list requested with `token` arrived.
    pub fn store(&mut self, token: u64, list: Arc<pr::ListPodResourcesResponse>, now: Instant) {
        let shown = shown(&list);
        self.pending.retain(|p| {
            let seen = p.seq <= token
                && p.ids
                    .iter()
                    .all(|id| shown.contains(&(p.resource.as_str(), id.as_str())));
            !seen && now.duration_since(p.at) < PENDING_TTL
        });
        if self.latest.as_ref().is_none_or(|(t, _)| *t <= token) {
            self.latest = Some((token, list));
        }
    }

    /// The cached list, when it is as good as a fresh one (see the module's rules).
    pub fn usable(&self) -> Option<Arc<pr::ListPodResourcesResponse>> {
        let (token, list) = self.latest.as_ref()?;
        let complete = self.pending.iter().all(|p| p.seq > *token);
        (*token == self.answered && complete).then(|| list.clone())
    }

    /// Whether a prefetch would add anything (some Allocate is newer than the cached list).
    pub fn stale(&self) -> bool {
        self.usable().is_none()
    }
}

/// Every (resource, device) a list shows.
fn shown(list: &pr::ListPodResourcesResponse) -> HashSet<(&str, &str)> {
    list.pod_resources
        .iter()
        .flat_map(|p| &p.containers)
        .flat_map(|c| &c.devices)
        .flat_map(|d| {
            d.device_ids
                .iter()
                .map(move |id| (d.resource_name.as_str(), id.as_str()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(entries: &[(&str, &str, &[&str])]) -> Arc<pr::ListPodResourcesResponse> {
        Arc::new(pr::ListPodResourcesResponse {
            pod_resources: entries
                .iter()
                .map(|(pod, resource, ids)| pr::PodResources {
                    name: pod.to_string(),
                    namespace: "default".into(),
                    containers: vec![pr::ContainerResources {
                        name: "main".into(),
                        devices: ids
                            .iter()
                            .map(|id| pr::ContainerDevices {
                                resource_name: resource.to_string(),
                                device_ids: vec![id.to_string()],
                                topology: None,
                            })
                            .collect(),
                        ..Default::default()
                    }],
                })
                .collect(),
        })
    }

    fn ids(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_list_requested_after_every_allocate_and_showing_them_is_used() {
        let now = Instant::now();
        let mut c = ListCache::default();
        assert!(c.usable().is_none(), "nothing listed yet");
        c.answered("core", &ids(&["c1"]), now);
        c.answered("mem", &ids(&["m1"]), now);
        let t = c.requesting();
        c.store(
            t,
            list(&[("p", "core", &["c1"]), ("p", "mem", &["m1"])]),
            now,
        );
        assert!(c.usable().is_some());
    }

    #[test]
    fn a_list_served_before_the_kubelet_recorded_an_allocation_is_not_used() {
        let now = Instant::now();
        let mut c = ListCache::default();
        c.answered("core", &ids(&["c1"]), now);
        c.answered("mem", &ids(&["m1"]), now);
        let t = c.requesting();
        // The kubelet had not recorded the memory yet.
        c.store(t, list(&[("p", "core", &["c1"])]), now);
        assert!(c.usable().is_none());
        // A later list that shows it is fine.
        let t = c.requesting();
        c.store(
            t,
            list(&[("p", "core", &["c1"]), ("p", "mem", &["m1"])]),
            now,
        );
        assert!(c.usable().is_some());
    }

    #[test]
    fn a_list_older_than_an_allocate_is_not_used_even_if_it_shows_the_devices() {
        // Identical replicas: pod q gets the devices p just freed. A list requested before
        // q's Allocate still shows p holding them.
        let now = Instant::now();
        let mut c = ListCache::default();
        c.answered("core", &ids(&["c1"]), now);
        let t = c.requesting();
        c.answered("core", &ids(&["c1"]), now); // q
        c.store(t, list(&[("p", "core", &["c1"])]), now);
        assert!(c.usable().is_none());
    }

    #[test]
    fn an_allocate_that_never_shows_up_is_forgotten_after_a_while() {
        let now = Instant::now();
        let mut c = ListCache::default();
        c.answered("core", &ids(&["c1"]), now);
        let t = c.requesting();
        c.store(t, list(&[]), now);
        assert!(c.usable().is_none(), "its admission may still be recorded");
        let t = c.requesting();
        c.store(t, list(&[]), now + PENDING_TTL);
        assert!(c.usable().is_some());
    }

    #[test]
    fn an_older_list_arriving_late_does_not_replace_a_newer_one() {
        let now = Instant::now();
        let mut c = ListCache::default();
        let old = c.requesting();
        c.answered("core", &ids(&["c1"]), now);
        let new = c.requesting();
        c.store(new, list(&[("p", "core", &["c1"])]), now);
        c.store(old, list(&[]), now);
        assert!(c.usable().is_some());
    }
}
