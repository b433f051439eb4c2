//! The manager's settings: a TOML file (`--config`, optional) overlaid by flags. Every key
//! has a flag of the same name with dashes, and a safe default for a standard kubelet.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

/// XIDs that do not make a GPU unhealthy by default: application errors (13 graphics
/// engine exception, 31 memory page fault, 43 GPU stopped processing, 45 preemptive
/// cleanup, 68 video processor exception, 109 context switch timeout) — NVIDIA's device
/// plugin's list, which an application triggers without the GPU being broken.
pub const DEFAULT_XID_IGNORE: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// `vcuda-manager`: the vcuda node daemon. A kubelet device plugin for `<domain>/vcuda-core`
/// (100 per GPU, 1 % each) and `<domain>/vcuda-memory` (one per 256 MiB), which mounts
/// libvcuda.so into the containers given them and holds them to their share; a control
/// socket the library registers over; a control loop that samples the GPUs, writes shares,
/// reclaims and watches for bypass.
///
/// Settings come from `--config FILE` (TOML, keys as the flags without dashes: e.g.
/// `device_plugin_dir = "/var/lib/kubelet/device-plugins"`) and then from flags, which win.
#[derive(Debug, Parser, Default)]
#[command(name = "vcuda-manager", version, about, long_about)]
pub struct Flags {
    /// TOML settings file; flags override it. Missing is an error only if given explicitly.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The kubelet's device-plugin directory (kubelet.sock lives there; our sockets go there).
    #[arg(long, value_name = "DIR")]
    pub device_plugin_dir: Option<PathBuf>,
    /// The kubelet's PodResources socket.
    #[arg(long, value_name = "PATH")]
    pub pod_resources_socket: Option<PathBuf>,
    /// The kubelet's device-manager checkpoint (read only, to learn pod UIDs).
    #[arg(long, value_name = "PATH")]
    pub kubelet_checkpoint: Option<PathBuf>,
    /// Resource domain: resources are `<domain>/vcuda-core` and `<domain>/vcuda-memory`.
    #[arg(long)]
    pub domain: Option<String>,
    /// Where the manager's checkpoint (allocations.jsonl) and the preload file are kept:
    /// on disk, surviving reboots [default: /var/lib/vcuda].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Where each allocation's config and shared region, and the control socket, are made
    /// (mounted into containers). Should be a tmpfs: the regions are shared memory written
    /// thousands of times a second [default: /run/vcuda].
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// libvcuda.so on the host, mounted read-only into every container.
    #[arg(long, value_name = "PATH")]
    pub library: Option<PathBuf>,
    /// The oldest glibc that --library must load with. Every container preloads it, so the
    /// manager refuses to start if it requires a newer GLIBC_ symbol version or a shared
    /// object that is not glibc's own (as libgcc_s.so.1): in an image it could not load in,
    /// every process of the pod would fail to start. A newer version is for nodes whose
    /// images are all that new; `off` skips the check [default: 2.17, what
    /// scripts/build-portable builds for].
    #[arg(long, value_name = "VERSION|off")]
    pub library_baseline: Option<String>,
    /// NVML library to load (default: the system's libnvidia-ml.so.1).
    #[arg(long, value_name = "PATH")]
    pub nvml_library: Option<PathBuf>,
    /// XIDs that do not mark a GPU unhealthy (comma-separated).
    #[arg(long, value_delimiter = ',', value_name = "XID,...")]
    pub xid_ignore: Option<Vec<u64>>,
    /// Seconds without a new fatal XID after which an unhealthy GPU that answers NVML is
    /// advertised healthy again.
    #[arg(long, value_name = "SECONDS")]
    pub recover_after: Option<u64>,
    /// Where host processes' /proc entries are read (for checking a registering process's
    /// cgroup); tests point it at a fake tree.
    #[arg(long, value_name = "DIR")]
    pub proc_root: Option<PathBuf>,
    /// Kill the processes of a container the watchdog finds in violation: driver-reported
    /// memory over its quota, or compute over its limit (see --watchdog-compute-window).
    /// Default: report only, with a log line and a metric.
    #[arg(long)]
    pub watchdog_kill: bool,
    /// The compute watchdog's window: a container whose driver-reported utilization,
    /// averaged over this many seconds, exceeds its limit (its elastic limit, else its
    /// share) by more than --watchdog-compute-margin is in violation [default: 10].
    #[arg(long, value_name = "SECONDS")]
    pub watchdog_compute_window: Option<u64>,
    /// The compute watchdog's margin over the limit, in percentage points [default: 10].
    #[arg(long, value_name = "PERCENT")]
    pub watchdog_compute_margin: Option<u32>,
    /// Elastic limits without an API server: `NAMESPACE/POD/CONTAINER=PERCENT` (repeatable);
    /// the container may use up to PERCENT while the GPU idles (GPUManager's
    /// `vcuda-core-limit`).
    #[arg(long = "core-limit", value_name = "NS/POD/CONTAINER=PERCENT")]
    pub core_limit: Vec<String>,
    /// Where to serve Prometheus metrics (`GET /metrics`), `HOST:PORT`; `off` serves none
    /// [default: 0.0.0.0:9395]. Port 0 picks a free port (the log says which).
    #[arg(long, value_name = "ADDR")]
    pub metrics_address: Option<String>,
    /// Log filter (tracing's env-filter syntax), e.g. `info` or `vcuda_manager=debug`.
    #[arg(long, value_name = "FILTER")]
    pub log: Option<String>,
    /// Whether to use the Kubernetes API server: `auto` uses it when a kubeconfig is given
    /// or found (--kubeconfig, $KUBECONFIG, the in-cluster service account) and runs
    /// without it otherwise; `on` refuses to start without it; `off` never uses it.
    /// With it the manager publishes the node's GPUs (vcuda.io/gpus), follows the
    /// scheduler's vcuda.io/assignment and allows vcuda.io/gpu-count splits [default: auto].
    #[arg(long, value_name = "auto|on|off")]
    pub api: Option<String>,
    /// Kubeconfig file for the API server (default: in-cluster service account, then
    /// $KUBECONFIG).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name in the API server [default: $NODE_NAME, else the host name].
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
}

/// The settings file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    device_plugin_dir: Option<PathBuf>,
    pod_resources_socket: Option<PathBuf>,
    kubelet_checkpoint: Option<PathBuf>,
    domain: Option<String>,
    state_dir: Option<PathBuf>,
    run_dir: Option<PathBuf>,
    library: Option<PathBuf>,
    library_baseline: Option<String>,
    nvml_library: Option<PathBuf>,
    xid_ignore: Option<Vec<u64>>,
    recover_after: Option<u64>,
    proc_root: Option<PathBuf>,
    watchdog_kill: Option<bool>,
    watchdog_compute_window: Option<u64>,
    watchdog_compute_margin: Option<u32>,
    #[serde(default)]
    core_limit: BTreeMap<String, u32>,
    metrics_address: Option<String>,
    log: Option<String>,
    api: Option<String>,
    kubeconfig: Option<PathBuf>,
    node_name: Option<String>,
}

/// Whether the manager talks to the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiMode {
    /// When a kubeconfig is found.
    Auto,
    /// Always; no API server is a start-up error.
    On,
    /// Never.
    Off,
}

/// The effective settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub device_plugin_dir: PathBuf,
    pub pod_resources_socket: PathBuf,
    pub kubelet_checkpoint: PathBuf,
    pub domain: String,
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    pub library: PathBuf,
    /// The glibc (major, minor) the library must load with; None: not checked.
    pub library_baseline: Option<(u32, u32)>,
    pub nvml_library: Option<PathBuf>,
    pub xid_ignore: Vec<u64>,
    pub recover_after: u64,
    pub proc_root: PathBuf,
    pub watchdog_kill: bool,
    pub watchdog_compute_window: Duration,
    pub watchdog_compute_margin: u32,
    /// "namespace/pod/container" → elastic limit, percent.
    pub core_limit: BTreeMap<String, u32>,
    /// None: no metrics endpoint.
    pub metrics_address: Option<std::net::SocketAddr>,
    pub log: String,
    pub api: ApiMode,
    pub kubeconfig: Option<PathBuf>,
    /// This node's name (for its Node object and the `node` metric label).
    pub node_name: String,
}

/// A setting the manager cannot start with. Each names the flag (or the file's line) and
/// what it accepts.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("settings file {}: {source}; fix --config", path.display())]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("settings file {}: line {line}: {message}", path.display())]
    ParseFile {
        path: PathBuf,
        /// From 1; 0 when the parser names no place.
        line: usize,
        message: String,
    },
    #[error("--core-limit {spec:?}: expected NAMESPACE/POD/CONTAINER=PERCENT")]
    CoreLimitSyntax { spec: String },
    #[error("--core-limit {spec:?}: {value:?} is not a percentage")]
    CoreLimitPercent { spec: String, value: String },
    #[error("core_limit {key:?} = {percent}: expected \"namespace/pod/container\" = 1..100")]
    CoreLimitEntry { key: String, percent: u32 },
    #[error(
        "domain {domain:?} is not usable: resources are <domain>/vcuda-core, outside kubernetes.io"
    )]
    Domain { domain: String },
    #[error(
        "--library-baseline {value:?}: expected a glibc version such as 2.17 (MAJOR.MINOR), or off"
    )]
    LibraryBaseline { value: String },
    #[error("--metrics-address {value:?}: {source}; give HOST:PORT such as 0.0.0.0:9395, or off")]
    MetricsAddress {
        value: String,
        source: std::net::AddrParseError,
    },
    #[error(
        "--api {value:?}: expected auto (use the API server when a kubeconfig is found), on or off"
    )]
    Api { value: String },
}

impl SettingsError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            SettingsError::ReadFile { .. } => "read-file",
            SettingsError::ParseFile { .. } => "parse-file",
            SettingsError::CoreLimitSyntax { .. } => "core-limit-syntax",
            SettingsError::CoreLimitPercent { .. } => "core-limit-percent",
            SettingsError::CoreLimitEntry { .. } => "core-limit-entry",
            SettingsError::Domain { .. } => "domain",
            SettingsError::LibraryBaseline { .. } => "library-baseline",
            SettingsError::MetricsAddress { .. } => "metrics-address",
            SettingsError::Api { .. } => "api",
        }
    }
}

/// Where the control socket sits inside `run_dir` (and, mounted, inside containers).
pub use vcuda_manager_core::allocation::SOCKET_NAME;
/// The host-only query socket inside `run_dir`.
pub const QUERY_SOCKET_NAME: &str = "query.sock";

impl Settings {
    /// Flags over the file over defaults.
    pub fn load(flags: &Flags) -> Result<Settings, SettingsError> {
        let file = match &flags.config {
            Some(p) => read_file(p)?,
            None => File::default(),
        };
        let plugin_dir = pick(
            &flags.device_plugin_dir,
            &file.device_plugin_dir,
            "/var/lib/kubelet/device-plugins",
        );
        let mut core_limit = file.core_limit.clone();
        for spec in &flags.core_limit {
            let (key, pct) = parse_core_limit(spec)?;
            core_limit.insert(key, pct);
        }
        for (k, v) in &core_limit {
            if k.split('/').count() != 3 || !(1..=100).contains(v) {
                return Err(SettingsError::CoreLimitEntry {
                    key: k.clone(),
                    percent: *v,
                });
            }
        }
        let domain = flags
            .domain
            .clone()
            .or(file.domain)
            .unwrap_or_else(|| "tencent.com".into());
        if domain.is_empty() || domain.contains('/') || domain.ends_with("kubernetes.io") {
            return Err(SettingsError::Domain { domain });
        }
        Ok(Settings {
            kubelet_checkpoint: flags
                .kubelet_checkpoint
                .clone()
                .or(file.kubelet_checkpoint)
                .unwrap_or_else(|| plugin_dir.join("kubelet_internal_checkpoint")),
            device_plugin_dir: plugin_dir,
            pod_resources_socket: pick(
                &flags.pod_resources_socket,
                &file.pod_resources_socket,
                "/var/lib/kubelet/pod-resources/kubelet.sock",
            ),
            domain,
            state_dir: pick(&flags.state_dir, &file.state_dir, "/var/lib/vcuda"),
            run_dir: pick(&flags.run_dir, &file.run_dir, "/run/vcuda"),
            library: pick(
                &flags.library,
                &file.library,
                "/usr/local/vcuda/lib64/libvcuda.so",
            ),
            library_baseline: match flags
                .library_baseline
                .clone()
                .or(file.library_baseline)
                .as_deref()
            {
                None => Some(crate::baseline::DEFAULT),
                Some("off") => None,
                Some(v) => Some(crate::baseline::parse_version(v).ok_or_else(|| {
                    SettingsError::LibraryBaseline {
                        value: v.to_string(),
                    }
                })?),
            },
            nvml_library: flags.nvml_library.clone().or(file.nvml_library),
            xid_ignore: flags
                .xid_ignore
                .clone()
                .or(file.xid_ignore)
                .unwrap_or_else(|| DEFAULT_XID_IGNORE.to_vec()),
            recover_after: flags.recover_after.or(file.recover_after).unwrap_or(300),
            proc_root: pick(&flags.proc_root, &file.proc_root, "/proc"),
            watchdog_kill: flags.watchdog_kill || file.watchdog_kill.unwrap_or(false),
            watchdog_compute_window: Duration::from_secs(
                flags
                    .watchdog_compute_window
                    .or(file.watchdog_compute_window)
                    .unwrap_or(10)
                    .max(1),
            ),
            watchdog_compute_margin: flags
                .watchdog_compute_margin
                .or(file.watchdog_compute_margin)
                .unwrap_or(10),
            core_limit,
            metrics_address: match flags
                .metrics_address
                .clone()
                .or(file.metrics_address)
                .as_deref()
            {
                Some("off") => None,
                Some(a) => Some(a.parse().map_err(|source| SettingsError::MetricsAddress {
                    value: a.to_string(),
                    source,
                })?),
                None => Some(std::net::SocketAddr::from(([0, 0, 0, 0], 9395))),
            },
            log: flags
                .log
                .clone()
                .or(file.log)
                .unwrap_or_else(|| "info".into()),
            api: match flags.api.clone().or(file.api).as_deref() {
                None | Some("auto") => ApiMode::Auto,
                Some("on") => ApiMode::On,
                Some("off") => ApiMode::Off,
                Some(other) => {
                    return Err(SettingsError::Api {
                        value: other.to_string(),
                    })
                }
            },
            kubeconfig: flags.kubeconfig.clone().or(file.kubeconfig),
            node_name: flags
                .node_name
                .clone()
                .or(file.node_name)
                .or_else(|| std::env::var("NODE_NAME").ok())
                .filter(|n| !n.is_empty())
                .or_else(|| {
                    std::fs::read_to_string("/proc/sys/kernel/hostname")
                        .ok()
                        .map(|h| h.trim().to_string())
                })
                .unwrap_or_default(),
        })
    }

    /// The control socket's path on the host.
    pub fn socket_path(&self) -> PathBuf {
        self.run_dir.join("sock").join(SOCKET_NAME)
    }

    /// The host's query socket (`vcuda-smi` on the node): in `run_dir` itself, which no
    /// container is given, so only the host (and the manager's own pod) reach it.
    pub fn query_socket_path(&self) -> PathBuf {
        self.run_dir.join(QUERY_SOCKET_NAME)
    }
}

fn pick(flag: &Option<PathBuf>, file: &Option<PathBuf>, default: &str) -> PathBuf {
    flag.clone()
        .or_else(|| file.clone())
        .unwrap_or_else(|| PathBuf::from(default))
}

fn read_file(p: &Path) -> Result<File, SettingsError> {
    let text = std::fs::read_to_string(p).map_err(|source| SettingsError::ReadFile {
        path: p.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| {
        let line = e
            .span()
            .map_or(0, |s| text[..s.start].matches('\n').count() + 1);
        SettingsError::ParseFile {
            path: p.to_path_buf(),
            line,
            message: e.message().trim().to_string(),
        }
    })
}

/// `ns/pod/container=80` → ("ns/pod/container", 80).
pub fn parse_core_limit(spec: &str) -> Result<(String, u32), SettingsError> {
    let (key, pct) = spec
        .split_once('=')
        .ok_or_else(|| SettingsError::CoreLimitSyntax {
            spec: spec.to_string(),
        })?;
    let pct: u32 = pct
        .trim()
        .parse()
        .map_err(|_| SettingsError::CoreLimitPercent {
            spec: spec.to_string(),
            value: pct.to_string(),
        })?;
    Ok((key.trim().to_string(), pct))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings file the shipped DaemonSet mounts (its ConfigMap) is one this manager
    /// reads, and it enforces the watchdog (manager/README.md, "Security model").
    #[test]
    fn the_shipped_configmap_is_read_and_enforces_the_watchdog() {
        let manifest = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/vcuda-manager.yaml"),
        )
        .unwrap();
        let (_, rest) = manifest.split_once("manager.toml: |\n").unwrap();
        let toml: String = rest
            .lines()
            .take_while(|l| l.starts_with("    ") || l.is_empty())
            .map(|l| format!("{}\n", l.trim_start()))
            .collect();
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("manager.toml");
        std::fs::write(&path, toml).unwrap();
        let s = Settings::load(&Flags {
            config: Some(path),
            ..Flags::default()
        })
        .unwrap();
        assert!(s.watchdog_kill);
        assert_eq!(s.watchdog_compute_window, Duration::from_secs(10));
        assert_eq!(s.watchdog_compute_margin, 10);
    }

    #[test]
    fn defaults_are_the_kubelets_standard_paths() {
        let s = Settings::load(&Flags::default()).unwrap();
        assert_eq!(
            s.device_plugin_dir,
            Path::new("/var/lib/kubelet/device-plugins")
        );
        assert_eq!(
            s.kubelet_checkpoint,
            Path::new("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")
        );
        assert_eq!(
            s.pod_resources_socket,
            Path::new("/var/lib/kubelet/pod-resources/kubelet.sock")
        );
        assert_eq!(s.domain, "tencent.com");
        assert_eq!(s.xid_ignore, DEFAULT_XID_IGNORE);
        assert!(!s.watchdog_kill);
        assert_eq!(s.library_baseline, Some((2, 17)));
    }

    #[test]
    fn the_library_baseline_is_a_glibc_version_or_off() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("m.toml");
        std::fs::write(&f, "library_baseline = \"2.28\"\n").unwrap();
        let file = f.to_str().unwrap();
        let load = |args: &[&str]| {
            Settings::load(&Flags::parse_from(
                ["vcuda-manager"].iter().chain(args).copied(),
            ))
        };
        assert_eq!(
            load(&["--config", file]).unwrap().library_baseline,
            Some((2, 28))
        );
        assert_eq!(
            load(&["--config", file, "--library-baseline", "2.34"])
                .unwrap()
                .library_baseline,
            Some((2, 34))
        );
        assert_eq!(
            load(&["--library-baseline", "off"])
                .unwrap()
                .library_baseline,
            None
        );
        let e = load(&["--library-baseline", "GLIBC_2.34"]).unwrap_err();
        assert!(
            matches!(&e, SettingsError::LibraryBaseline { value } if value == "GLIBC_2.34"),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(
            e.contains("--library-baseline") && e.contains("2.17"),
            "{e}"
        );
    }

    #[test]
    fn flags_override_the_file() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("m.toml");
        std::fs::write(
            &f,
            "domain = \"example.com\"\nstate_dir = \"/srv/v\"\nxid_ignore = [1]\n[core_limit]\n\"ns/p/c\" = 60\n",
        )
        .unwrap();
        let flags = Flags::parse_from([
            "vcuda-manager",
            "--config",
            f.to_str().unwrap(),
            "--state-dir",
            "/tmp/s",
            "--core-limit",
            "ns/q/c=80",
        ]);
        let s = Settings::load(&flags).unwrap();
        assert_eq!(s.domain, "example.com");
        assert_eq!(s.state_dir, Path::new("/tmp/s"));
        assert_eq!(s.xid_ignore, vec![1]);
        assert_eq!(s.core_limit.get("ns/p/c"), Some(&60));
        assert_eq!(s.core_limit.get("ns/q/c"), Some(&80));
    }

    #[test]
    fn bad_settings_say_what_is_wrong() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("m.toml");
        std::fs::write(&f, "domian = \"x\"\n").unwrap();
        let flags = Flags::parse_from(["vcuda-manager", "--config", f.to_str().unwrap()]);
        let e = Settings::load(&flags).unwrap_err();
        assert!(
            matches!(&e, SettingsError::ParseFile { line: 1, .. }),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(e.contains("line 1") && e.contains("domian"), "{e}");
        let flags = Flags::parse_from(["vcuda-manager", "--core-limit", "ns/p/c=abc"]);
        let e = Settings::load(&flags).unwrap_err();
        assert!(
            matches!(&e, SettingsError::CoreLimitPercent { value, .. } if value == "abc"),
            "{e:?}"
        );
        assert!(e.to_string().contains("percentage"), "{e}");
        let flags = Flags::parse_from(["vcuda-manager", "--core-limit", "ns/p/c"]);
        assert!(matches!(
            Settings::load(&flags),
            Err(SettingsError::CoreLimitSyntax { .. })
        ));
        let flags = Flags::parse_from(["vcuda-manager", "--core-limit", "ns/p=50"]);
        assert!(matches!(
            Settings::load(&flags),
            Err(SettingsError::CoreLimitEntry { percent: 50, .. })
        ));
        let flags = Flags::parse_from(["vcuda-manager", "--domain", "kubernetes.io"]);
        let e = Settings::load(&flags).unwrap_err();
        assert!(matches!(e, SettingsError::Domain { .. }), "{e:?}");
        assert!(e.to_string().contains("kubernetes.io"), "{e}");
        let flags = Flags::parse_from(["vcuda-manager", "--config", "/nonexistent/m.toml"]);
        let e = Settings::load(&flags).unwrap_err();
        assert!(
            matches!(&e, SettingsError::ReadFile { path, .. } if path.ends_with("m.toml")),
            "{e:?}"
        );
    }
}
