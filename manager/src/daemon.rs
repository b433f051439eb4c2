//! The daemon's tasks and their lifecycle: device-plugin servers and registration (again
//! whenever the kubelet restarts, never by exiting), XID health, the control socket and the
//! control loop.
//!
//! Order at start: the library's check against the glibc baseline (milliseconds; a refusal
//! ends the process before any pod can be given the library), NVML inventory (fast), then
//! serve both plugin sockets, then register — the kubelet dials back inside Register, so the
//! servers must be up first, and a kubelet may admit pods right after a reboot, so nothing
//! slow stands before registration.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use notify::Watcher;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{error, info, warn};
use vcuda_proto::constants;
use vcuda_proto::deviceplugin::v1beta1 as dp;

use crate::apiserver::ApiError;
use crate::backend::Server;
use crate::baseline::{self, BaselineError};
use crate::core::{Core, CoreError};
use crate::gpus;
use crate::plugin::{self, Shares};
use crate::settings::Settings;
use crate::state::Shared;
use vcuda_manager_core::inventory::Health;
use vcuda_manager_core::modes::Resource;

/// Why the manager cannot start (or keep serving): each ends the process with its message
/// on one line, naming the file, socket or flag and what to do.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("refusing to start: {0}")]
    Library(#[source] BaselineError),
    #[error("cannot load NVML (is the NVIDIA driver installed, or --nvml-library right?): {0}")]
    Nvml(#[source] nvml_wrapper::error::NvmlError),
    #[error("cannot list the GPUs through NVML: {0}")]
    Inventory(#[source] nvml_wrapper::error::NvmlError),
    #[error(transparent)]
    State(#[from] CoreError),
    #[error(transparent)]
    Api(Box<ApiError>),
    #[error("cannot serve metrics on {address}: {source}; pick another --metrics-address, or off")]
    Metrics {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot make the control socket {}: {source}", path.display())]
    ControlSocket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot make the host query socket {}: {source}", path.display())]
    QuerySocket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the control loop's thread: {0}")]
    ControlLoop(#[source] std::io::Error),
    #[error("cannot handle {signal}: {source}")]
    Signal {
        signal: &'static str,
        source: std::io::Error,
    },
    #[error("cannot serve the device plugin on {}: {source}; is --device-plugin-dir the kubelet's plugin directory, and writable?", path.display())]
    PluginSocket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the VM backends (--vm-backends): {0}")]
    Vm(#[source] crate::vm::VmError),
}

impl DaemonError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            DaemonError::Library(_) => "library",
            DaemonError::Nvml(_) => "nvml",
            DaemonError::Inventory(_) => "inventory",
            DaemonError::State(e) => e.kind(),
            DaemonError::Api(e) => e.kind(),
            DaemonError::Metrics { .. } => "metrics",
            DaemonError::ControlSocket { .. } => "control-socket",
            DaemonError::QuerySocket { .. } => "query-socket",
            DaemonError::ControlLoop(_) => "control-loop",
            DaemonError::Signal { .. } => "signal",
            DaemonError::PluginSocket { .. } => "plugin-socket",
            DaemonError::Vm(e) => e.kind(),
        }
    }
}

impl From<ApiError> for DaemonError {
    fn from(e: ApiError) -> DaemonError {
        DaemonError::Api(Box::new(e))
    }
}

/// Registration with the kubelet did not succeed (retried with back-off; a socket of ours
/// that disappeared makes the daemon serve afresh).
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("{} was deleted while registering", path.display())]
    SocketGone { path: PathBuf },
    #[error("cannot reach {} ({source}); is the kubelet running, and --device-plugin-dir its plugin directory?", socket.display())]
    Unreachable {
        socket: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("the kubelet refused to register {resource}: {}", status.message())]
    Refused {
        resource: String,
        status: tonic::Status,
    },
}

impl RegisterError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            RegisterError::SocketGone { .. } => "socket-gone",
            RegisterError::Unreachable { .. } => "unreachable",
            RegisterError::Refused { .. } => "refused",
        }
    }
}

/// Run until SIGTERM / SIGINT.
pub async fn run(settings: Settings) -> Result<(), DaemonError> {
    check_library(&settings)?;
    let vm = if settings.vm.backends.is_empty() {
        None
    } else {
        Some(crate::vm::VmNode::open(&settings).map_err(DaemonError::Vm)?)
    };
    let nvml = match (gpus::open(settings.nvml_library.as_deref()), vm) {
        (Ok(nvml), vm) => (nvml, vm),
        (Err(e), Some((node, plugins))) => {
            warn!(error = %e, "no NVML: serving the VM backends alone (no container modes on this node)");
            return run_vm_only(settings, node, plugins).await;
        }
        (Err(e), None) => return Err(DaemonError::Nvml(e)),
    };
    let (nvml, vm) = nvml;
    let inventory = gpus::discover(nvml).map_err(DaemonError::Inventory)?;
    info!(
        gpus = inventory.gpus.len(),
        "found GPUs: {}",
        inventory
            .gpus
            .iter()
            .map(|g| g.uuid.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    // A GPU NVML lists that is also an mdev parent is the mdev backend's: unhealthy to the
    // container modes for good, so it is in exactly one backend.
    let vm_owned: Vec<bool> = (0..inventory.gpus.len())
        .map(|i| {
            let bus = nvml
                .device_by_index(i as u32)
                .and_then(|d| d.pci_info())
                .map(|p| p.bus_id)
                .unwrap_or_default();
            let owned = vm.as_ref().is_some_and(|(node, _)| {
                node.mdev_parents()
                    .iter()
                    .any(|a| gpus::same_bus(a.as_str(), &bus))
            });
            if owned {
                info!(gpu = %inventory.gpus[i].uuid, %bus, "an mdev parent: given to the mdev backend, unhealthy to the container modes");
            }
            owned
        })
        .collect();
    let core = Core::open(settings.clone(), inventory.clone())?;
    let api = crate::apiserver::connect(&settings).await?.map(Arc::new);
    let (health_tx, _) = watch::channel(vm_owned.iter().map(|o| !o).collect());
    let shared = Arc::new(Shared {
        core: Mutex::new(core),
        health: health_tx,
        pod_resources: tokio::sync::Mutex::new(None),
        lists: Mutex::new(Default::default()),
        listing: tokio::sync::Mutex::new(()),
        prefetch_wanted: tokio::sync::Notify::new(),
        last_allocate: Mutex::new(Instant::now()),
        view: Default::default(),
        api: api.clone(),
    });
    tokio::spawn(shared.clone().prefetch());
    tokio::spawn(shared.clone().release_loop());
    if let Some(api) = api {
        tokio::spawn(crate::lease::keep_alive(api.clone()));
        tokio::spawn(crate::publisher::publish_loop(api, shared.clone()));
    }
    let mut served = served(&shared);
    if let Some((node, plugins)) = vm {
        tokio::spawn(node.refresh_loop());
        served.extend(plugins.into_iter().map(Served::vm));
    }
    let registered = Arc::new(crate::metrics::Registered::new(
        served.iter().map(|s| s.name.clone()),
    ));
    if let Some(addr) = settings.metrics_address {
        let bound = crate::metrics::serve(
            addr,
            shared.view.clone(),
            registered.clone(),
            settings.node_name.clone(),
        )
        .await
        .map_err(|source| DaemonError::Metrics {
            address: addr,
            source,
        })?;
        info!(%bound, "metrics at http://{bound}/metrics");
    }

    let stop = Arc::new(AtomicBool::new(false));
    start_health(
        nvml,
        &settings,
        &inventory.node.uuids,
        vm_owned,
        shared.clone(),
        stop.clone(),
    );

    let listener = crate::control::bind(&settings.socket_path()).map_err(|source| {
        DaemonError::ControlSocket {
            path: settings.socket_path(),
            source,
        }
    })?;
    tokio::spawn(crate::control::serve(
        listener,
        settings.socket_path(),
        shared.clone(),
        crate::control::Scope::Container,
        settings.proc_root.clone(),
    ));
    let host = crate::control::bind_host(&settings.query_socket_path()).map_err(|source| {
        DaemonError::QuerySocket {
            path: settings.query_socket_path(),
            source,
        }
    })?;
    tokio::spawn(crate::control::serve(
        host,
        settings.query_socket_path(),
        shared.clone(),
        crate::control::Scope::Node,
        settings.proc_root.clone(),
    ));
    crate::control_loop::start(nvml, shared.clone(), tokio::runtime::Handle::current())
        .map_err(DaemonError::ControlLoop)?;

    // Signal handlers now, so a SIGTERM at any moment below is seen.
    let mut shutdown = Box::pin(shutdown_signal()?);
    serve_kubelet(&settings, &served, &registered, &mut shutdown).await?;
    info!("shutting down");
    if let Some(api) = &shared.api {
        crate::publisher::withdraw(api, &shared).await;
    }
    stop.store(true, Ordering::Relaxed);
    Ok(())
}

/// A node without NVML serving only its VM backends: registration and the kubelet's
/// restarts as always; no control socket, control loop or metrics (no container is given
/// the library here).
async fn run_vm_only(
    settings: Settings,
    node: Arc<crate::vm::VmNode>,
    plugins: Vec<crate::vm::Plugin>,
) -> Result<(), DaemonError> {
    tokio::spawn(node.refresh_loop());
    let served: Vec<Served> = plugins.into_iter().map(Served::vm).collect();
    let registered = crate::metrics::Registered::new(served.iter().map(|s| s.name.clone()));
    let mut shutdown = Box::pin(shutdown_signal()?);
    serve_kubelet(&settings, &served, &registered, &mut shutdown).await?;
    info!("shutting down");
    Ok(())
}

/// Serve every plugin and register it, again whenever the kubelet restarts; returns once
/// `shutdown` resolves.
async fn serve_kubelet(
    settings: &Settings,
    served: &[Served],
    registered: &crate::metrics::Registered,
    shutdown: &mut std::pin::Pin<Box<impl std::future::Future<Output = ()>>>,
) -> Result<(), DaemonError> {
    let dir = settings.device_plugin_dir.clone();
    loop {
        let plugins = Plugins::start(settings, served).await?;
        let cycle = async {
            let started = Instant::now();
            if let Err(why) = register_all(settings, served, registered).await {
                return why.to_string();
            }
            info!(
                elapsed_ms = started.elapsed().as_millis() as u64,
                "registered with the kubelet"
            );
            watch_kubelet(&dir, served).await
        };
        let outcome = tokio::select! {
            why = cycle => Some(why),
            _ = &mut *shutdown => None,
        };
        // Serving afresh (or stopping): nothing counts as registered until the next Register.
        registered.lost();
        plugins.stop().await;
        let Some(why) = outcome else {
            return Ok(());
        };
        info!(%why, "the kubelet restarted: serving and registering again");
        // The kubelet deletes the plugin sockets before it re-creates kubelet.sock: serve
        // again only once that is done, or it deletes the new sockets too.
        tokio::select! {
            _ = kubelet_ready(&dir) => {}
            _ = &mut *shutdown => return Ok(()),
        }
    }
}

/// The library every container preloads must load in the images at the baseline: else every
/// process of a pod given it fails to start (issue 13). Refused, the manager never registers.
fn check_library(settings: &Settings) -> Result<(), DaemonError> {
    let path = &settings.library;
    let Some(baseline) = settings.library_baseline else {
        warn!(
            "--library-baseline off: the library {} is not checked against a glibc baseline; in an image that cannot load it, every process of the pod fails to start",
            path.display()
        );
        return Ok(());
    };
    let report = std::fs::read(path)
        .map_err(|source| BaselineError::Unreadable {
            path: path.clone(),
            source,
        })
        .and_then(|bytes| baseline::check(path, &bytes, baseline))
        .map_err(DaemonError::Library)?;
    info!(
        "library {} meets the glibc {}.{} baseline ({})",
        path.display(),
        baseline.0,
        baseline.1,
        report.summary()
    );
    Ok(())
}

/// Resolves once `kubelet.sock` exists and accepts connections.
async fn kubelet_ready(dir: &Path) {
    let sock = dir.join("kubelet.sock");
    let mut delay = Duration::from_millis(5);
    loop {
        if tokio::net::UnixStream::connect(&sock).await.is_ok() {
            return;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(200));
    }
}

/// Installs the SIGTERM / SIGINT handlers at once; the future resolves on either.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, DaemonError> {
    use tokio::signal::unix::{signal, SignalKind};
    let handle = |kind, name| {
        signal(kind).map_err(|source| DaemonError::Signal {
            signal: name,
            source,
        })
    };
    let mut term = handle(SignalKind::terminate(), "SIGTERM")?;
    let mut int = handle(SignalKind::interrupt(), "SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// One resource the daemon serves: its socket in the plugin directory, its name, its
/// backend (kept across kubelet restarts).
struct Served {
    socket: String,
    name: String,
    backend: Arc<dyn crate::backend::Backend>,
}

impl Served {
    fn vm(p: crate::vm::Plugin) -> Served {
        Served {
            socket: vm_socket(&p.name),
            name: p.name,
            backend: p.backend,
        }
    }
}

/// A VM resource's socket file: `vcuda-vm-<8 hex digits>.sock`, the digits a hash of the
/// resource name (FNV-1a, 32 bits): stable across restarts and short whatever the name (a
/// model name makes a long one, and a socket path has at most 107 bytes).
fn vm_socket(name: &str) -> String {
    let hash = name.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    format!("vcuda-vm-{hash:08x}.sock")
}

/// The resources this node serves (its enabled modes'), with their full names: the shares
/// first, as before modes.
fn served(shared: &Arc<Shared>) -> Vec<Served> {
    let mut out: Vec<(Resource, String)> = {
        let core = shared.core.lock();
        let names = core.locks.settings();
        Resource::ALL
            .into_iter()
            .filter(|r| names.enabled(r.mode()))
            .map(|r| (r, names.resource_name(r)))
            .collect()
    };
    // (the core's lock released: a backend takes it)
    out.sort_by_key(|(r, _)| !matches!(r, Resource::Shared(_)));
    out.into_iter()
        .map(|(r, name)| Served {
            socket: plugin::socket(r).to_string(),
            name,
            backend: Arc::new(Shares::new(r, shared.clone())),
        })
        .collect()
}

/// The device-plugin servers, one per resource served.
struct Plugins {
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Plugins {
    async fn start(settings: &Settings, served: &[Served]) -> Result<Plugins, DaemonError> {
        let mut p = Plugins {
            stops: Vec::new(),
            tasks: Vec::new(),
        };
        for s in served {
            let path = settings.device_plugin_dir.join(&s.socket);
            let _ = std::fs::remove_file(&path);
            let listener = tokio::net::UnixListener::bind(&path).map_err(|source| {
                DaemonError::PluginSocket {
                    path: path.clone(),
                    source,
                }
            })?;
            let (tx, rx) = oneshot::channel();
            let svc = dp::device_plugin_server::DevicePluginServer::new(Server::shared(
                s.backend.clone(),
            ));
            let task = tokio::spawn(async move {
                let r = tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming_shutdown(vcuda_proto::uds::incoming(listener), async {
                        let _ = rx.await;
                    })
                    .await;
                if let Err(e) = r {
                    error!(error = %e, "device plugin server failed");
                }
            });
            p.stops.push(tx);
            p.tasks.push(task);
        }
        Ok(p)
    }

    async fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
        for t in self.tasks {
            // ListAndWatch streams never end by themselves: do not wait for them long.
            let _ = tokio::time::timeout(Duration::from_millis(200), t).await;
        }
    }
}

/// Register both resources; retry (with back-off, logging) until the kubelet accepts. Gives
/// up (to serve afresh) if one of our sockets is gone meanwhile: the kubelet could never
/// dial it back.
async fn register_all(
    settings: &Settings,
    served: &[Served],
    registered: &crate::metrics::Registered,
) -> Result<(), RegisterError> {
    for s in served {
        let mut delay = Duration::from_millis(50);
        loop {
            let ours = settings.device_plugin_dir.join(&s.socket);
            if !ours.exists() {
                return Err(RegisterError::SocketGone { path: ours });
            }
            match register(settings, s).await {
                Ok(()) => {
                    registered.accepted(&s.name);
                    break;
                }
                Err(e) => {
                    warn!(resource = %s.name, error = %e, kind = e.kind(), "registration failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
    Ok(())
}

async fn register(settings: &Settings, served: &Served) -> Result<(), RegisterError> {
    let sock = settings.device_plugin_dir.join("kubelet.sock");
    let endpoint = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(15));
    let channel = vcuda_proto::uds::connect_with(endpoint, &sock)
        .await
        .map_err(|source| RegisterError::Unreachable {
            socket: sock.clone(),
            source,
        })?;
    let mut client = dp::registration_client::RegistrationClient::new(channel);
    client
        .register(dp::RegisterRequest {
            version: constants::VERSION.into(),
            endpoint: served.socket.clone(),
            resource_name: served.name.clone(),
            options: Some(served.backend.options()),
        })
        .await
        .map_err(|status| RegisterError::Refused {
            resource: served.name.clone(),
            status,
        })?;
    Ok(())
}

/// Resolves when the kubelet restarts: `kubelet.sock` is created again, or one of our
/// sockets is deleted (the kubelet deletes plugin sockets when it starts). Watches the
/// directory (a watched socket inode goes stale), with a 1 s poll as a safety net.
async fn watch_kubelet(dir: &Path, served: &[Served]) -> String {
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let ours: Vec<PathBuf> = served.iter().map(|s| dir.join(&s.socket)).collect();
    let kubelet = dir.join("kubelet.sock");
    let watcher = {
        let tx = tx.clone();
        let (ours, kubelet) = (ours.clone(), kubelet.clone());
        notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
            let Ok(ev) = ev else { return };
            use notify::EventKind::*;
            for p in &ev.paths {
                match ev.kind {
                    Create(_) if *p == kubelet => {
                        let _ = tx.send("kubelet.sock was created".into());
                    }
                    Remove(_) if ours.contains(p) => {
                        let _ = tx.send(format!("{} was deleted", p.display()));
                    }
                    _ => {}
                }
            }
        })
    };
    let _watcher = match watcher {
        Ok(mut w) => match w.watch(dir, notify::RecursiveMode::NonRecursive) {
            Ok(()) => Some(w),
            Err(e) => {
                warn!(error = %e, "cannot watch {}; polling it", dir.display());
                None
            }
        },
        Err(e) => {
            warn!(error = %e, "cannot watch {}; polling it", dir.display());
            None
        }
    };
    let inode = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
    };
    let first = inode(&kubelet);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            Some(why) = rx.recv() => return why,
            _ = tick.tick() => {
                if let Some(p) = ours.iter().find(|p| !p.exists()) {
                    return format!("{} is gone", p.display());
                }
                let now = inode(&kubelet);
                if now.is_some() && now != first {
                    return "kubelet.sock was replaced".into();
                }
            }
        }
    }
}

/// XID events on their own thread; health re-evaluated every second (recovery).
fn start_health(
    nvml: &'static nvml_wrapper::Nvml,
    settings: &Settings,
    uuids: &[String],
    vm_owned: Vec<bool>,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
) {
    let health = Arc::new(Mutex::new(Health::new(
        uuids.len(),
        settings.xid_ignore.clone(),
        Duration::from_secs(settings.recover_after),
    )));
    let publish = {
        let (health, shared) = (health.clone(), shared.clone());
        move || {
            let now = Instant::now();
            let answers = |g: usize| {
                nvml.device_by_index(g as u32)
                    .and_then(|d| d.memory_info())
                    .is_ok()
            };
            let mut h = health.lock().healthy(now, &answers);
            for (g, owned) in h.iter_mut().zip(&vm_owned) {
                *g &= !owned;
            }
            shared.health.send_if_modified(|cur| {
                if *cur != h {
                    info!(health = ?h, "GPU health changed");
                    *cur = h;
                    true
                } else {
                    false
                }
            });
        }
    };
    {
        let (health, publish, uuids, stop) = (
            health.clone(),
            publish.clone(),
            uuids.to_vec(),
            stop.clone(),
        );
        let spawned = std::thread::Builder::new().name("xid".into()).spawn(move || {
            let mut on_xid = |g: usize, xid: Option<u64>| {
                let fatal = health.lock().xid(g, xid, Instant::now());
                warn!(gpu = g, ?xid, fatal, "XID event");
                if fatal {
                    publish();
                }
            };
            if let Err(e) = gpus::watch_xids(nvml, &uuids, Duration::from_millis(500), &|| stop.load(Ordering::Relaxed), &mut on_xid) {
                warn!(error = %e, "cannot watch XID events; GPUs stay healthy as far as the manager knows");
            }
        });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the XID thread");
        }
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            publish();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::vm_socket;

    /// Every VM resource gets a socket of its own whose path fits a `sockaddr_un` in the
    /// kubelet's directory, however long the model name.
    #[test]
    fn vm_sockets_are_short_distinct_and_stable() {
        let long = "nvidia.com/GA102GL_A10_A10G_A10M_THIS_IS_A_LONG_MODEL_NAME_OF_63_CHARS__";
        let a = vm_socket("nvidia.com/TU104GL_TESLA_T4");
        assert_eq!(a, vm_socket("nvidia.com/TU104GL_TESLA_T4"));
        assert_ne!(a, vm_socket("nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"));
        assert_ne!(
            vm_socket("tencent.com/vgpu-222"),
            vm_socket("tencent.com/vgpu-223")
        );
        let path = format!("/var/lib/kubelet/device-plugins/{}", vm_socket(long));
        assert!(path.len() < 108 && vm_socket(long).len() == "vcuda-vm-01234567.sock".len());
    }
}
