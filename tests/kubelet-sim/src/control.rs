//! The control socket: JSON lines over a Unix socket. Each line a client writes is one
//! request; the simulator answers each with one line:
//! `{"ok":true,"result":…}` or `{"ok":false,"error":"…"}`. Connections are served
//! concurrently, requests on one connection in order.
//!
//! ```text
//! {"op":"status"}
//! {"op":"admit","pod":"p","namespace":"default","start":true,
//!  "containers":[{"name":"main","resources":[{"resource":"tencent.com/vcuda-core","quantity":50}]}]}
//! {"op":"admit","pod":"p","uid":"<the API server's metadata.uid>","containers":[{"name":"main"}]}
//! {"op":"start-container","pod":"p","namespace":"default","container":"main"}
//! {"op":"delete","pod":"p","namespace":"default"}
//! {"op":"restart"}
//! {"op":"wait-registered","resource":"tencent.com/vcuda-core","timeout_s":30}
//! {"op":"wait-capacity","capacity":{"nvidia.com/gpu":4},"allocatable":{"nvidia.com/gpu":4},"timeout_s":10}
//! {"op":"ping","resource":"tencent.com/vcuda-core","count":100,"group":2,"gap_ms":20}
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tracing::{debug, warn};

use crate::api::{AdmitRequest, DEFAULT_NAMESPACE};
use crate::sim::{SimError, Simulator};

fn default_namespace() -> String {
    DEFAULT_NAMESPACE.to_string()
}

fn one() -> u32 {
    1
}

fn default_timeout() -> f64 {
    30.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    Status,
    Admit(AdmitRequest),
    StartContainer {
        pod: String,
        #[serde(default = "default_namespace")]
        namespace: String,
        container: String,
    },
    Delete {
        pod: String,
        #[serde(default = "default_namespace")]
        namespace: String,
    },
    Restart,
    WaitRegistered {
        resource: String,
        #[serde(default = "default_timeout")]
        timeout_s: f64,
    },
    /// Until each resource has this capacity (and allocatable count); absent: 0.
    WaitCapacity {
        #[serde(default)]
        capacity: BTreeMap<String, usize>,
        #[serde(default)]
        allocatable: BTreeMap<String, usize>,
        #[serde(default = "default_timeout")]
        timeout_s: f64,
    },
    /// Null RPCs (GetDevicePluginOptions) to a plugin: the transport's own latency.
    Ping {
        resource: String,
        count: u32,
        #[serde(default = "one")]
        group: u32,
        #[serde(default)]
        gap_ms: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Serves the control socket at `path` until the task is dropped.
pub async fn serve(sim: Arc<Simulator>, listener: tokio::net::UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(connection(sim.clone(), stream));
            }
            Err(e) => {
                warn!("control socket: {e}");
                return;
            }
        }
    }
}

/// Binds the control socket (replacing a stale socket).
pub fn bind(path: &Path) -> Result<tokio::net::UnixListener, SimError> {
    let l = crate::sim::bind(path)?;
    tokio::net::UnixListener::from_std(l)
        .map_err(SimError::io(format!("cannot listen on {}", path.display())))
}

async fn connection(sim: Arc<Simulator>, stream: UnixStream) {
    let (r, mut w) = stream.into_split();
    let mut lines = BufReader::new(r).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(req) => {
                debug!(?req, "control request");
                match handle(&sim, req).await {
                    Ok(v) => Reply {
                        ok: true,
                        result: Some(v),
                        error: None,
                    },
                    Err(e) => Reply {
                        ok: false,
                        result: None,
                        error: Some(e.to_string()),
                    },
                }
            }
            Err(e) => Reply {
                ok: false,
                result: None,
                error: Some(format!(
                    "bad request {line:?}: {e}; send one JSON object per line with an \"op\" of \
                     status, admit, start-container, delete, restart, wait-registered or wait-capacity"
                )),
            },
        };
        let mut out = serde_json::to_vec(&reply).expect("reply serializes");
        out.push(b'\n');
        if w.write_all(&out).await.is_err() {
            return;
        }
    }
}

async fn handle(sim: &Simulator, req: Request) -> Result<serde_json::Value, SimError> {
    fn json<T: Serialize>(v: &T) -> serde_json::Value {
        serde_json::to_value(v).expect("result serializes")
    }
    Ok(match req {
        Request::Status => json(&sim.status()),
        Request::Admit(a) => json(&sim.admit(a).await?),
        Request::StartContainer {
            pod,
            namespace,
            container,
        } => json(&sim.start_container(&namespace, &pod, &container).await?),
        Request::Delete { pod, namespace } => {
            sim.delete(&namespace, &pod).await?;
            serde_json::json!({"deleted": pod, "namespace": namespace})
        }
        Request::Restart => {
            sim.restart().await?;
            json(&sim.status())
        }
        Request::WaitRegistered {
            resource,
            timeout_s,
        } => {
            let timeout = Duration::try_from_secs_f64(timeout_s).unwrap_or(Duration::ZERO);
            json(&sim.wait_registered(&resource, timeout).await?)
        }
        Request::WaitCapacity {
            capacity,
            allocatable,
            timeout_s,
        } => {
            let timeout = Duration::try_from_secs_f64(timeout_s).unwrap_or(Duration::ZERO);
            json(&sim.wait_capacity(&capacity, &allocatable, timeout).await?)
        }
        Request::Ping {
            resource,
            count,
            group,
            gap_ms,
        } => json(
            &sim.ping(&resource, count, group, Duration::from_millis(gap_ms))
                .await?,
        ),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot reach kubelet-sim at {path}: {source}; start it with `kubelet-sim serve --control {path} ...` or pass the --control path it was started with")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("lost the connection to kubelet-sim at {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{0}")]
    Remote(String),
}

/// A control-socket client (one connection per call).
#[derive(Debug, Clone)]
pub struct Client {
    path: PathBuf,
}

impl Client {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Client { path: path.into() }
    }

    /// Sends one request; the `result` on success, the simulator's error otherwise.
    pub async fn call(&self, req: &Request) -> Result<serde_json::Value, ControlError> {
        let path = self.path.display().to_string();
        let stream =
            UnixStream::connect(&self.path)
                .await
                .map_err(|source| ControlError::Connect {
                    path: path.clone(),
                    source,
                })?;
        let io = |reason: String| ControlError::Io {
            path: path.clone(),
            reason,
        };
        let (r, mut w) = stream.into_split();
        let mut line = serde_json::to_vec(req).expect("request serializes");
        line.push(b'\n');
        w.write_all(&line).await.map_err(|e| io(e.to_string()))?;
        let reply = BufReader::new(r)
            .lines()
            .next_line()
            .await
            .map_err(|e| io(e.to_string()))?
            .ok_or_else(|| io("no reply".into()))?;
        let reply: Reply =
            serde_json::from_str(&reply).map_err(|e| io(format!("bad reply: {e}")))?;
        match reply {
            Reply {
                ok: true, result, ..
            } => Ok(result.unwrap_or(serde_json::Value::Null)),
            Reply { error, .. } => Err(ControlError::Remote(
                error.unwrap_or_else(|| "unknown error".into()),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_wire_format() {
        let r: Request =
            serde_json::from_str(r#"{"op":"start-container","pod":"p","container":"c"}"#).unwrap();
        assert_eq!(
            r,
            Request::StartContainer {
                pod: "p".into(),
                namespace: "default".into(),
                container: "c".into()
            }
        );
        let r: Request = serde_json::from_str(
            r#"{"op":"admit","pod":"p","containers":[{"name":"c","resources":[{"resource":"a.com/x","quantity":2}]}]}"#,
        )
        .unwrap();
        assert!(
            matches!(r, Request::Admit(a) if a.start && a.uid.is_none() && a.containers[0].resources[0].quantity == 2)
        );
        let r: Request = serde_json::from_str(
            r#"{"op":"admit","pod":"p","uid":"u-1","containers":[{"name":"c"}]}"#,
        )
        .unwrap();
        assert!(matches!(r, Request::Admit(a) if a.uid.as_deref() == Some("u-1")));
        assert_eq!(
            serde_json::to_string(&Request::WaitRegistered {
                resource: "a.com/x".into(),
                timeout_s: 5.0
            })
            .unwrap(),
            r#"{"op":"wait-registered","resource":"a.com/x","timeout_s":5.0}"#
        );
        let r: Request =
            serde_json::from_str(r#"{"op":"wait-capacity","capacity":{"a.com/x":4}}"#).unwrap();
        assert_eq!(
            r,
            Request::WaitCapacity {
                capacity: [("a.com/x".to_string(), 4)].into(),
                allocatable: BTreeMap::new(),
                timeout_s: 30.0
            }
        );
    }
}
