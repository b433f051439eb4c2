//! Keeping the node Lease alive (I/O): the task that renews this node's
//! `coordination.k8s.io/v1` Lease (`vcuda-manager-<node>` in `--lease-namespace`) every
//! quarter of `--lease-duration`, while the manager runs with the API server. What the Lease
//! says and when to renew are [`vcuda_manager_core::lease`]'s; the inventory
//! ([`crate::publisher`]) names the Lease, so vcuda-scheduler knows to watch it and stops
//! placing pods on the node when it stops changing (the node died or lost the API server).
//!
//! A renewal writes from the Lease last read or written, with its `resourceVersion` (a
//! compare-and-swap): a conflict (409) re-reads it, a Lease that is gone is created again.
//! Failures are logged (once per distinct error, and when renewals work again) and retried
//! sooner than the interval; they never stop the manager: a node that cannot reach the API
//! server is exactly what the Lease is there to show.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};
use tracing::{debug, info, warn};
use vcuda_manager_core::lease::{self, Cadence};

use crate::apiserver::ApiServer;

/// Writes per renewal when the Lease keeps changing under us (each conflict re-reads it).
const ATTEMPTS: u32 = 3;

/// A renewal did not happen (retried; never fatal).
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("cannot read Lease {namespace}/{name}: {source}; the manager needs get, create and update on leases (coordination.k8s.io) in namespace {namespace} (deploy/base/manager-api/vcuda-manager-rbac.yaml), and may write only its own node's Lease (deploy/admission-policy)")]
    Read {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("cannot write Lease {namespace}/{name}: {source}; the manager needs get, create and update on leases (coordination.k8s.io) in namespace {namespace} (deploy/base/manager-api/vcuda-manager-rbac.yaml), and may write only its own node's Lease (deploy/admission-policy)")]
    Write {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("Lease {namespace}/{name} changed under each of {attempts} renewals in a row; is another vcuda-manager running with --node-name {node}?")]
    KeptChanging {
        namespace: String,
        name: String,
        node: String,
        attempts: u32,
    },
    #[error("renewing Lease {namespace}/{name} took longer than {timeout:?}: the API server is slow or unreachable")]
    Timeout {
        namespace: String,
        name: String,
        timeout: Duration,
    },
}

impl LeaseError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            LeaseError::Read { .. } => "lease-read",
            LeaseError::Write { .. } => "lease-write",
            LeaseError::KeptChanging { .. } => "lease-kept-changing",
            LeaseError::Timeout { .. } => "lease-timeout",
        }
    }
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(r) => Some(r.code),
        _ => None,
    }
}

/// What is known of the Lease in the API server before a renewal.
enum Known {
    /// Nothing: read it first.
    Unknown,
    /// It does not exist: create it.
    Absent,
    /// As last read or written (its `resourceVersion` is the precondition).
    Is(Box<Lease>),
}

/// One renewal (up to [`ATTEMPTS`] writes); `known` is updated with what was learnt.
async fn renew(api: &ApiServer, known: &mut Known) -> Result<(), LeaseError> {
    let h = &api.holder;
    let (namespace, name) = (h.lease.namespace.clone(), h.lease.name.clone());
    let leases: Api<Lease> = Api::namespaced(api.client(), &namespace);
    let pp = PostParams::default();
    for _ in 0..ATTEMPTS {
        let current = match std::mem::replace(known, Known::Unknown) {
            Known::Is(l) => Some(*l),
            Known::Absent => None,
            Known::Unknown => leases
                .get_opt(&name)
                .await
                .map_err(|source| LeaseError::Read {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    source,
                })?,
        };
        let body = lease::renewed(current.as_ref(), h, now_micros());
        let written = match &current {
            None => leases.create(&pp, &body).await,
            Some(_) => leases.replace(&name, &pp, &body).await,
        };
        match written {
            Ok(l) => {
                *known = Known::Is(Box::new(l));
                return Ok(());
            }
            // Conflict (someone wrote it, or created it first): read it again.
            Err(e) if code(&e) == Some(409) => {
                debug!(lease = %h.lease, "Lease changed meanwhile; re-reading");
            }
            // Deleted meanwhile: create it again.
            Err(e) if code(&e) == Some(404) && current.is_some() => *known = Known::Absent,
            Err(source) => {
                return Err(LeaseError::Write {
                    namespace,
                    name,
                    source,
                })
            }
        }
    }
    Err(LeaseError::KeptChanging {
        namespace,
        name,
        node: h.node.clone(),
        attempts: ATTEMPTS,
    })
}

/// Runs for ever: renew the Lease every quarter of its duration, sooner after failures.
pub async fn keep_alive(api: Arc<ApiServer>) {
    let h = &api.holder;
    let interval = h.interval();
    let mut cadence = Cadence::new(interval);
    let mut known = Known::Unknown;
    // The last failure's message: logged when it changes, not at every retry.
    let mut last_error: Option<String> = None;
    let mut renewed_once = false;
    loop {
        // A renewal that hangs must not hold the next one back.
        let outcome = match tokio::time::timeout(interval, renew(&api, &mut known)).await {
            Ok(r) => r,
            Err(_) => Err(LeaseError::Timeout {
                namespace: h.lease.namespace.clone(),
                name: h.lease.name.clone(),
                timeout: interval,
            }),
        };
        let ok = match outcome {
            Ok(()) => {
                if !renewed_once {
                    info!(lease = %h.lease, holder = %h.identity, duration_s = h.lease.duration_seconds,
                        every_ms = interval.as_millis() as u64, "keeping the node Lease alive");
                    renewed_once = true;
                } else if last_error.take().is_some() {
                    info!(lease = %h.lease, "renewing the node Lease again");
                }
                last_error = None;
                true
            }
            Err(e) => {
                let text = e.to_string();
                if last_error.as_ref() != Some(&text) {
                    warn!(error = %text, kind = e.kind(), failures = cadence.failures() + 1,
                        "cannot renew the node Lease; retrying (the scheduler stops placing pods here once it has not changed for {} s)",
                        h.lease.duration_seconds);
                }
                last_error = Some(text);
                // Read it afresh next time: what we hold may be what failed.
                known = Known::Unknown;
                false
            }
        };
        tokio::time::sleep(cadence.next(ok)).await;
    }
}
