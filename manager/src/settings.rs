//! The manager's settings: a TOML file (`--config`, optional) overlaid by flags. Every key
//! has a flag of the same name with dashes, and a safe default for a standard kubelet.
//!
//! Each setting is declared once, as a field of [`Layer`]: its flag and help (clap), its
//! file key (serde, the field's name) and how a flag given overlays the file (its type's
//! [`Overlay`]). [`Settings::load`] reads the file into a `Layer`, overlays the flags'
//! `Layer` on it, and [`Settings::resolve`] alone fills in defaults and validates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser};
use serde::{Deserialize, Deserializer};
use vcuda_manager_core::modes::{self, Mode, SliceCompute};

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
    /// Every setting, as given on the command line.
    #[command(flatten)]
    pub settings: Layer,
}

/// How a value given on the command line goes over the file's (the one merge rule, by type).
pub trait Overlay {
    /// `self` (the file's) with `over` (the command line's) on top.
    fn overlay(self, over: Self) -> Self;
}

/// A value given wins.
impl<T> Overlay for Option<T> {
    fn overlay(self, over: Self) -> Self {
        over.or(self)
    }
}

/// A switch set wins (a flag can only set it).
impl Overlay for bool {
    fn overlay(self, over: Self) -> Self {
        self || over
    }
}

/// A repeatable flag's entries come after the file's: [`Settings::resolve`] reads them in
/// order, so for the same key the command line's wins.
impl<T> Overlay for Vec<T> {
    fn overlay(mut self, over: Self) -> Self {
        self.extend(over);
        self
    }
}

/// Declares [`Layer`] from its fields and derives [`Layer::overlay`] from them: each field's
/// own [`Overlay`], so no key has a merge of its own.
macro_rules! layer {
    ($(#[$meta:meta])* pub struct Layer { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        pub struct Layer { $($(#[$fmeta])* pub $field: $ty,)* }

        impl Layer {
            /// `self` (the file's) with `over` (the command line's) on top, key by key.
            pub fn overlay(self, over: Layer) -> Layer {
                Layer { $($field: Overlay::overlay(self.$field, over.$field),)* }
            }
        }
    };
}

layer! {
    /// The settings as one source gives them — the command line (clap) or the settings file
    /// (serde: keys are the field names, the flags with underscores). `None`, `false` or
    /// empty: not given there.
    #[derive(Debug, Clone, Default, Args, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    pub struct Layer {
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
        #[serde(deserialize_with = "core_limit_table")]
        pub core_limit: Vec<CoreLimit>,
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
        /// Whether to write a CDI (Container Device Interface) spec per allocation into
        /// --cdi-spec-dir and return its device name (`vcuda.io/allocation=<id>`) in
        /// Allocate's `cdi_devices`, for kubelets (1.29+, DevicePluginCDIDevices) and
        /// runtimes (containerd 1.7+, CRI-O) that apply CDI: `auto` does when --cdi-spec-dir
        /// exists at start-up (a CDI-aware runtime scans it); `on` always (making the
        /// directory); `off` never. The mounts, devices and env of the answer are returned
        /// in every mode, for runtimes without CDI [default: auto].
        #[arg(long, value_name = "auto|on|off")]
        pub cdi: Option<String>,
        /// Where CDI specs are written (one file per allocation,
        /// `vcuda.io-allocation_<id>.json`, removed with its allocation): a directory
        /// containerd and CRI-O scan, host-only [default: /var/run/cdi].
        #[arg(long, value_name = "DIR")]
        pub cdi_spec_dir: Option<PathBuf>,
        /// Namespace of the Lease (`coordination.k8s.io/v1`, `vcuda-manager-<node>`) the
        /// manager renews while it runs with the API server, so the scheduler stops placing
        /// pods on a node that died or lost the API server [default: $POD_NAMESPACE, else
        /// vcuda-system].
        #[arg(long, value_name = "NAMESPACE")]
        pub lease_namespace: Option<String>,
        /// How long one renewal of the Lease counts (renewed every quarter of it): a node
        /// whose Lease the scheduler has seen unchanged for longer is refused pods. Whole
        /// seconds: 40s, 1m, 3 (bare number: seconds) [default: 40s].
        #[arg(long, value_name = "DURATION")]
        pub lease_duration: Option<String>,
        /// The sharing modes this node serves, comma-separated: `whole` (whole GPUs as
        /// --whole-resource, exclusive, no library), `slice` (K equal slices per GPU as
        /// <domain>/sgpu), `shared` (<domain>/vcuda-core + vcuda-memory). A GPU is locked
        /// to the mode of its first allocation until its last one ends [default: shared].
        #[arg(long, value_delimiter = ',', value_name = "MODE,...")]
        pub modes: Option<Vec<String>>,
        /// Slices per GPU (K, 2 to 99) in slice mode: each slice has a GPU's memory / K
        /// [default: 2].
        #[arg(long, value_name = "K")]
        pub slices: Option<u32>,
        /// The whole-GPU resource's name [default: nvidia.com/gpu, NVIDIA's device plugin's,
        /// so pod specs written for it run unchanged].
        #[arg(long, value_name = "NAME")]
        pub whole_resource: Option<String>,
        /// A slice's compute: `unlimited` (only memory is divided) or `hard` (100/K % each)
        /// [default: unlimited].
        #[arg(long, value_name = "unlimited|hard")]
        pub slice_compute: Option<String>,
        /// GPUs for virtual machines, comma-separated (manager/VM.md): `passthrough` (NVIDIA
        /// GPUs bound to vfio-pci, one resource per model as KubeVirt names them) and `mdev`
        /// (one resource per mediated-device type, the vGPU created at Allocate and removed
        /// when its pod is gone). Off unless given; with it, a node without NVML serves the
        /// VM backends alone.
        #[arg(long, value_delimiter = ',', value_name = "passthrough,mdev")]
        pub vm_backends: Option<Vec<String>>,
        /// Where the host's /sys is seen (the VM backends read PCI devices and IOMMU groups
        /// there, and create and remove mdevs) [default: /sys].
        #[arg(long, value_name = "DIR")]
        pub sysfs_root: Option<PathBuf>,
        /// Where the host's /dev is seen (the VM backends check /dev/vfio/<group>); the
        /// Allocate answer names the host's /dev paths whatever this is [default: /dev].
        #[arg(long, value_name = "DIR")]
        pub dev_root: Option<PathBuf>,
        /// The PCI ID database naming passthrough models (when not given: the first of
        /// /usr/share/misc/pci.ids, /usr/share/hwdata/pci.ids that exists; without one a
        /// model is named by its device id).
        #[arg(long, value_name = "FILE")]
        pub pci_ids: Option<PathBuf>,
        /// How mdev types are named as resources: `vgpu` (<domain>/vgpu-<n> for type
        /// nvidia-<n>, as Tencent's vGPU plugin) or `kubevirt` (nvidia.com/<type name>, as
        /// NVIDIA's kubevirt-gpu-device-plugin) [default: vgpu].
        #[arg(long, value_name = "vgpu|kubevirt")]
        pub mdev_naming: Option<String>,
        /// Seconds an mdev created at Allocate is kept while PodResources lists no pod for
        /// it; past that, with no pod, it is removed [default: 60].
        #[arg(long, value_name = "SECONDS")]
        pub mdev_grace: Option<u64>,
    }
}

/// One elastic limit: a `--core-limit` as typed (checked by [`Settings::resolve`], so a bad
/// one is a [`SettingsError`]), or an entry of the file's `[core_limit]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreLimit {
    /// `NAMESPACE/POD/CONTAINER=PERCENT`, from the command line.
    Spec(String),
    /// `"namespace/pod/container" = percent`, from the file.
    Entry { key: String, percent: u32 },
}

impl From<String> for CoreLimit {
    fn from(spec: String) -> Self {
        CoreLimit::Spec(spec)
    }
}

/// The file's `[core_limit]` table, `"namespace/pod/container" = percent`.
fn core_limit_table<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<CoreLimit>, D::Error> {
    Ok(BTreeMap::<String, u32>::deserialize(d)?
        .into_iter()
        .map(|(key, percent)| CoreLimit::Entry { key, percent })
        .collect())
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

/// Whether the manager writes CDI specs and returns CDI device names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CdiMode {
    /// When the CDI spec directory exists at start-up.
    Auto,
    /// Always; the directory is made if missing.
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
    pub cdi: CdiMode,
    pub cdi_spec_dir: PathBuf,
    /// The Lease's namespace (`--lease-namespace`).
    pub lease_namespace: String,
    /// How long one renewal counts, seconds (`--lease-duration`).
    pub lease_duration_seconds: u32,
    /// The sharing modes served (`--modes`), in [`Mode::ALL`]'s order.
    pub modes: Vec<Mode>,
    /// Slices per GPU (`--slices`).
    pub slices: u32,
    /// The whole-GPU resource's name (`--whole-resource`).
    pub whole_resource: String,
    /// A slice's compute (`--slice-compute`).
    pub slice_compute: SliceCompute,
    /// The VM backends (`--vm-backends` and their flags).
    pub vm: VmSettings,
}

/// A VM backend (`--vm-backends`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum VmBackend {
    /// GPUs bound to vfio-pci, whole, to KubeVirt VMs.
    Passthrough,
    /// Mediated vGPUs, to KubeVirt and Kata VMs.
    Mdev,
}

/// The VM backends' settings.
#[derive(Debug, Clone)]
pub struct VmSettings {
    /// The backends served, sorted; empty: none.
    pub backends: Vec<VmBackend>,
    pub sysfs_root: PathBuf,
    pub dev_root: PathBuf,
    /// `--pci-ids`, else the first system database that exists; None: none.
    pub pci_ids: Option<PathBuf>,
    pub mdev_naming: vcuda_vm::naming::MdevNaming,
    /// Seconds (`--mdev-grace`).
    pub mdev_grace: u64,
}

impl VmSettings {
    pub fn serves(&self, b: VmBackend) -> bool {
        self.backends.contains(&b)
    }
}

/// Where a system keeps its PCI ID database (Debian's pciutils / hwdata).
pub const PCI_IDS_PATHS: [&str; 2] = ["/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids"];

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
    #[error(
        "--cdi {value:?}: expected auto (CDI when --cdi-spec-dir exists at start-up), on or off"
    )]
    Cdi { value: String },
    #[error("--lease-duration {value:?}: expected whole seconds from 1s to 1h, e.g. 40s, 1m or 3")]
    LeaseDuration { value: String },
    #[error("--lease-namespace {value:?}: expected a namespace name (lowercase letters, digits, '-'; at most 63)")]
    LeaseNamespace { value: String },
    #[error("--modes / --slices / --whole-resource: {0}")]
    Modes(#[from] modes::SettingsError),
    #[error("--slice-compute {value:?}: expected unlimited (only memory is divided) or hard (100/K % per slice)")]
    SliceCompute { value: String },
    #[error("--vm-backends {value:?}: expected passthrough (GPUs bound to vfio-pci) or mdev (mediated vGPUs), comma-separated")]
    VmBackend { value: String },
    #[error("--mdev-naming {value:?}: expected vgpu (<domain>/vgpu-<n>) or kubevirt (nvidia.com/<type name>)")]
    MdevNaming { value: String },
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
            SettingsError::Cdi { .. } => "cdi",
            SettingsError::LeaseDuration { .. } => "lease-duration",
            SettingsError::LeaseNamespace { .. } => "lease-namespace",
            SettingsError::Modes(e) => e.kind(),
            SettingsError::SliceCompute { .. } => "slice-compute",
            SettingsError::VmBackend { .. } => "vm-backends",
            SettingsError::MdevNaming { .. } => "mdev-naming",
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
            None => Layer::default(),
        };
        Settings::resolve(file.overlay(flags.settings.clone()))
    }

    /// The one place defaults are filled in and values checked.
    pub fn resolve(given: Layer) -> Result<Settings, SettingsError> {
        let mut core_limit = BTreeMap::new();
        for limit in given.core_limit {
            let (key, percent) = match limit {
                CoreLimit::Spec(spec) => parse_core_limit(&spec)?,
                CoreLimit::Entry { key, percent } => (key, percent),
            };
            core_limit.insert(key, percent);
        }
        for (k, v) in &core_limit {
            if k.split('/').count() != 3 || !(1..=100).contains(v) {
                return Err(SettingsError::CoreLimitEntry {
                    key: k.clone(),
                    percent: *v,
                });
            }
        }
        let domain = given.domain.unwrap_or_else(|| "tencent.com".into());
        if domain.is_empty() || domain.contains('/') || domain.ends_with("kubernetes.io") {
            return Err(SettingsError::Domain { domain });
        }
        let mut modes = match &given.modes {
            None => vec![Mode::Shared],
            Some(names) => names
                .iter()
                .map(|n| n.trim().parse::<Mode>())
                .collect::<Result<Vec<_>, _>>()?,
        };
        modes.sort();
        modes.dedup();
        let slices = given.slices.unwrap_or(2);
        let whole_resource = given
            .whole_resource
            .unwrap_or_else(|| modes::WHOLE_RESOURCE.into());
        let slice_compute = match given.slice_compute.as_deref() {
            None | Some("unlimited") => SliceCompute::Unlimited,
            Some("hard") => SliceCompute::Hard,
            Some(other) => {
                return Err(SettingsError::SliceCompute {
                    value: other.to_string(),
                })
            }
        };
        let mut backends = Vec::new();
        for name in given.vm_backends.iter().flatten() {
            backends.push(match name.trim() {
                "passthrough" => VmBackend::Passthrough,
                "mdev" => VmBackend::Mdev,
                other => {
                    return Err(SettingsError::VmBackend {
                        value: other.to_string(),
                    })
                }
            });
        }
        backends.sort();
        backends.dedup();
        let mdev_naming = match given.mdev_naming.as_deref() {
            None | Some("vgpu") => vcuda_vm::naming::MdevNaming::Vgpu {
                domain: domain.clone(),
            },
            Some("kubevirt") => vcuda_vm::naming::MdevNaming::KubeVirt,
            Some(other) => {
                return Err(SettingsError::MdevNaming {
                    value: other.to_string(),
                })
            }
        };
        // Checked now (without GPUs), so that a bad value stops the start with its reason.
        modes::Settings::new(&domain, &modes, slices, Vec::new())?
            .with_whole_resource(&whole_resource)?;
        let device_plugin_dir = given
            .device_plugin_dir
            .unwrap_or_else(|| "/var/lib/kubelet/device-plugins".into());
        Ok(Settings {
            kubelet_checkpoint: given
                .kubelet_checkpoint
                .unwrap_or_else(|| device_plugin_dir.join("kubelet_internal_checkpoint")),
            device_plugin_dir,
            pod_resources_socket: given
                .pod_resources_socket
                .unwrap_or_else(|| "/var/lib/kubelet/pod-resources/kubelet.sock".into()),
            domain,
            state_dir: given.state_dir.unwrap_or_else(|| "/var/lib/vcuda".into()),
            run_dir: given.run_dir.unwrap_or_else(|| "/run/vcuda".into()),
            library: given
                .library
                .unwrap_or_else(|| "/usr/local/vcuda/lib64/libvcuda.so".into()),
            library_baseline: match given.library_baseline.as_deref() {
                None => Some(crate::baseline::DEFAULT),
                Some("off") => None,
                Some(v) => Some(crate::baseline::parse_version(v).ok_or_else(|| {
                    SettingsError::LibraryBaseline {
                        value: v.to_string(),
                    }
                })?),
            },
            nvml_library: given.nvml_library,
            xid_ignore: given
                .xid_ignore
                .unwrap_or_else(|| DEFAULT_XID_IGNORE.to_vec()),
            recover_after: given.recover_after.unwrap_or(300),
            proc_root: given.proc_root.unwrap_or_else(|| "/proc".into()),
            watchdog_kill: given.watchdog_kill,
            watchdog_compute_window: Duration::from_secs(
                given.watchdog_compute_window.unwrap_or(10).max(1),
            ),
            watchdog_compute_margin: given.watchdog_compute_margin.unwrap_or(10),
            core_limit,
            metrics_address: match given.metrics_address.as_deref() {
                Some("off") => None,
                Some(a) => Some(a.parse().map_err(|source| SettingsError::MetricsAddress {
                    value: a.to_string(),
                    source,
                })?),
                None => Some(std::net::SocketAddr::from(([0, 0, 0, 0], 9395))),
            },
            log: given.log.unwrap_or_else(|| "info".into()),
            api: match given.api.as_deref() {
                None | Some("auto") => ApiMode::Auto,
                Some("on") => ApiMode::On,
                Some("off") => ApiMode::Off,
                Some(other) => {
                    return Err(SettingsError::Api {
                        value: other.to_string(),
                    })
                }
            },
            kubeconfig: given.kubeconfig,
            node_name: given
                .node_name
                .or_else(|| std::env::var("NODE_NAME").ok())
                .filter(|n| !n.is_empty())
                .or_else(|| {
                    std::fs::read_to_string("/proc/sys/kernel/hostname")
                        .ok()
                        .map(|h| h.trim().to_string())
                })
                .unwrap_or_default(),
            cdi: match given.cdi.as_deref() {
                None | Some("auto") => CdiMode::Auto,
                Some("on") => CdiMode::On,
                Some("off") => CdiMode::Off,
                Some(other) => {
                    return Err(SettingsError::Cdi {
                        value: other.to_string(),
                    })
                }
            },
            cdi_spec_dir: given.cdi_spec_dir.unwrap_or_else(|| "/var/run/cdi".into()),
            lease_namespace: match given
                .lease_namespace
                .or_else(|| std::env::var("POD_NAMESPACE").ok())
                .filter(|n| !n.is_empty())
            {
                None => vcuda_manager_core::lease::DEFAULT_NAMESPACE.to_string(),
                Some(n) if is_namespace_name(&n) => n,
                Some(value) => return Err(SettingsError::LeaseNamespace { value }),
            },
            lease_duration_seconds: match given.lease_duration {
                None => vcuda_manager_core::lease::DEFAULT_DURATION_SECONDS,
                Some(v) => {
                    parse_lease_duration(&v).ok_or(SettingsError::LeaseDuration { value: v })?
                }
            },
            modes,
            slices,
            whole_resource,
            slice_compute,
            vm: VmSettings {
                backends,
                sysfs_root: given.sysfs_root.unwrap_or_else(|| "/sys".into()),
                dev_root: given.dev_root.unwrap_or_else(|| "/dev".into()),
                pci_ids: given
                    .pci_ids
                    .or_else(|| PCI_IDS_PATHS.iter().map(PathBuf::from).find(|p| p.exists())),
                mdev_naming,
                mdev_grace: given.mdev_grace.unwrap_or(60),
            },
        })
    }

    /// The modes' settings for these GPUs ([`modes::Settings`]; the values were checked by
    /// [`Settings::resolve`], the GPUs are NVML's, unique).
    pub fn mode_settings(
        &self,
        gpus: Vec<modes::GpuSpec>,
    ) -> Result<modes::Settings, SettingsError> {
        Ok(
            modes::Settings::new(&self.domain, &self.modes, self.slices, gpus)?
                .with_whole_resource(&self.whole_resource)?
                .with_slice_compute(self.slice_compute),
        )
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

/// A namespace's name: an RFC 1123 label.
fn is_namespace_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 63
        && n.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !n.starts_with('-')
        && !n.ends_with('-')
}

/// `--lease-duration`: `N`, `Ns` or `Nm` (whole seconds, 1 s ..= 1 h), in seconds.
pub fn parse_lease_duration(text: &str) -> Option<u32> {
    let t = text.trim();
    let (digits, per) = if let Some(n) = t.strip_suffix('m') {
        (n, 60)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1)
    } else {
        (t, 1)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let secs = digits.parse::<u32>().ok()?.checked_mul(per)?;
    (1..=vcuda_manager_core::lease::MAX_DURATION_SECONDS)
        .contains(&secs)
        .then_some(secs)
}

fn read_file(p: &Path) -> Result<Layer, SettingsError> {
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
    use clap::CommandFactory;
    use std::collections::BTreeSet;

    /// The settings file the shipped DaemonSet mounts (its ConfigMap) is one this manager
    /// reads, and it enforces the watchdog (manager/README.md, "Security model").
    #[test]
    fn the_shipped_configmap_is_read_and_enforces_the_watchdog() {
        let manifest = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/base/manager/vcuda-manager.yaml"),
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
        assert_eq!(s.cdi, CdiMode::Auto);
        assert_eq!(s.cdi_spec_dir, Path::new("/var/run/cdi"));
    }

    #[test]
    fn cdi_is_auto_on_or_off() {
        let load = |args: &[&str]| {
            Settings::load(&Flags::parse_from(
                ["vcuda-manager"].iter().chain(args).copied(),
            ))
        };
        for (v, mode) in [
            ("auto", CdiMode::Auto),
            ("on", CdiMode::On),
            ("off", CdiMode::Off),
        ] {
            assert_eq!(load(&["--cdi", v]).unwrap().cdi, mode);
        }
        let e = load(&["--cdi", "yes"]).unwrap_err();
        assert!(
            matches!(&e, SettingsError::Cdi { value } if value == "yes"),
            "{e:?}"
        );
        assert_eq!(e.kind(), "cdi");
        let e = e.to_string();
        assert!(
            e.contains("--cdi") && e.contains("auto") && e.contains("off"),
            "{e}"
        );
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
        // The sharing modes: each bad value is refused at start with what it accepts.
        for (args, kind, says) in [
            (
                &["--modes", "whole,exclusive"][..],
                "unknown-mode",
                "whole, slice and shared",
            ),
            (
                &["--modes", "slice", "--slices", "1"][..],
                "slice-count",
                "2 to 99",
            ),
            (
                &["--whole-resource", "gpu"][..],
                "whole-resource",
                "domain/name",
            ),
            (
                &["--whole-resource", "tencent.com/sgpu"][..],
                "whole-resource",
                "choose another",
            ),
            (
                &["--slice-compute", "soft"][..],
                "slice-compute",
                "unlimited",
            ),
        ] {
            let flags = Flags::parse_from(["vcuda-manager"].iter().chain(args));
            let e = Settings::load(&flags).unwrap_err();
            assert_eq!(e.kind(), kind, "{args:?}: {e}");
            assert!(e.to_string().contains(says), "{args:?}: {e}");
        }
        let s = Settings::load(&Flags::parse_from(["vcuda-manager"])).unwrap();
        assert_eq!(
            s.modes,
            [Mode::Shared],
            "a node is unchanged unless configured"
        );
        let flags = Flags::parse_from(["vcuda-manager", "--config", "/nonexistent/m.toml"]);
        let e = Settings::load(&flags).unwrap_err();
        assert!(
            matches!(&e, SettingsError::ReadFile { path, .. } if path.ends_with("m.toml")),
            "{e:?}"
        );
    }

    /// Every key, as (key, value x in TOML, x on the command line, another value y in TOML).
    const EVERY_KEY: &[(&str, &str, &[&str], &str)] = &[
        ("device_plugin_dir", "\"/a\"", &["/a"], "\"/b\""),
        ("pod_resources_socket", "\"/a\"", &["/a"], "\"/b\""),
        ("kubelet_checkpoint", "\"/a\"", &["/a"], "\"/b\""),
        ("domain", "\"a.example\"", &["a.example"], "\"b.example\""),
        ("state_dir", "\"/a\"", &["/a"], "\"/b\""),
        ("run_dir", "\"/a\"", &["/a"], "\"/b\""),
        ("library", "\"/a.so\"", &["/a.so"], "\"/b.so\""),
        ("library_baseline", "\"2.28\"", &["2.28"], "\"off\""),
        ("nvml_library", "\"/a.so\"", &["/a.so"], "\"/b.so\""),
        ("xid_ignore", "[1, 2]", &["1,2"], "[3]"),
        ("recover_after", "7", &["7"], "8"),
        ("proc_root", "\"/a\"", &["/a"], "\"/b\""),
        ("watchdog_kill", "true", &[], "false"),
        ("watchdog_compute_window", "3", &["3"], "4"),
        ("watchdog_compute_margin", "3", &["3"], "4"),
        (
            "core_limit",
            "{ \"ns/p/c\" = 60 }",
            &["ns/p/c=60"],
            "{ \"ns/p/c\" = 70 }",
        ),
        (
            "metrics_address",
            "\"127.0.0.1:1\"",
            &["127.0.0.1:1"],
            "\"off\"",
        ),
        ("log", "\"debug\"", &["debug"], "\"warn\""),
        ("api", "\"on\"", &["on"], "\"off\""),
        ("kubeconfig", "\"/a\"", &["/a"], "\"/b\""),
        ("node_name", "\"n1\"", &["n1"], "\"n2\""),
        ("cdi", "\"on\"", &["on"], "\"off\""),
        ("cdi_spec_dir", "\"/a\"", &["/a"], "\"/b\""),
        ("lease_namespace", "\"a\"", &["a"], "\"b\""),
        ("lease_duration", "\"3s\"", &["3s"], "\"1m\""),
        (
            "modes",
            "[\"whole\", \"shared\"]",
            &["whole,shared"],
            "[\"slice\"]",
        ),
        ("slices", "3", &["3"], "4"),
        (
            "whole_resource",
            "\"a.example/gpu\"",
            &["a.example/gpu"],
            "\"b.example/gpu\"",
        ),
        ("slice_compute", "\"hard\"", &["hard"], "\"unlimited\""),
        (
            "vm_backends",
            "[\"mdev\", \"passthrough\"]",
            &["passthrough,mdev"],
            "[\"mdev\"]",
        ),
        ("sysfs_root", "\"/a\"", &["/a"], "\"/b\""),
        ("dev_root", "\"/a\"", &["/a"], "\"/b\""),
        ("pci_ids", "\"/a\"", &["/a"], "\"/b\""),
        ("mdev_naming", "\"kubevirt\"", &["kubevirt"], "\"vgpu\""),
        ("mdev_grace", "5", &["5"], "6"),
    ];

    /// The keys the flags accept: their long names with underscores (`--config` aside).
    fn flag_keys() -> BTreeSet<String> {
        Flags::command()
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|l| !["config", "help", "version"].contains(l))
            .map(|l| l.replace('-', "_"))
            .collect()
    }

    /// The keys the file accepts: the fields `Layer`'s `Deserialize` asks for, recorded by a
    /// deserializer that only answers "which fields?".
    fn file_keys() -> BTreeSet<String> {
        use serde::de::{value::Error, Error as _, Visitor};
        struct Fields;
        impl<'de> Deserializer<'de> for Fields {
            type Error = Error;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
                Err(Error::custom("not a struct"))
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Error> {
                Err(Error::custom(fields.join(" ")))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
                byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
                enum identifier ignored_any
            }
        }
        let fields = Layer::deserialize(Fields).unwrap_err().to_string();
        fields.split(' ').map(str::to_string).collect()
    }

    /// The file and the flags accept the same keys (they are one declaration), the file not
    /// `config`; and the table below covers every one.
    #[test]
    fn the_file_and_the_flags_take_the_same_keys() {
        let flags = flag_keys();
        assert_eq!(flags.len(), 35, "{flags:?}");
        assert_eq!(file_keys(), flags);
        let table: BTreeSet<String> = EVERY_KEY.iter().map(|r| r.0.to_string()).collect();
        assert_eq!(table, flags, "EVERY_KEY needs a row per key");
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("m.toml");
        std::fs::write(&f, "config = \"/etc/other.toml\"\n").unwrap();
        let e =
            Settings::load(&Flags::parse_from(["m", "--config", f.to_str().unwrap()])).unwrap_err();
        assert_eq!(e.kind(), "parse-file");
        let e = e.to_string();
        assert!(e.contains("config") && e.contains("m.toml"), "{e}");
    }

    /// For every key: the file's value and the flag's mean the same, the file's wins over
    /// the default, and the flag's wins over the file's.
    #[test]
    fn for_every_key_the_flag_wins_over_the_file_over_the_default() {
        let d = tempfile::tempdir().unwrap();
        let load = |file: Option<String>, flag: Option<(&str, &[&str])>| {
            let mut args = vec!["m".to_string()];
            if let Some(text) = file {
                let f = d.path().join("m.toml");
                std::fs::write(&f, text).unwrap();
                args.extend(["--config".into(), f.to_str().unwrap().into()]);
            }
            if let Some((key, values)) = flag {
                args.push(format!("--{}", key.replace('_', "-")));
                args.extend(values.iter().map(|v| v.to_string()));
            }
            format!("{:?}", Settings::load(&Flags::parse_from(&args)).unwrap())
        };
        let default = load(None, None);
        for &(key, x, x_flag, y) in EVERY_KEY {
            let file_x = load(Some(format!("{key} = {x}\n")), None);
            let flag_x = load(None, Some((key, x_flag)));
            assert_eq!(
                file_x, flag_x,
                "{key}: the file's {x} and the flag's differ"
            );
            assert_ne!(file_x, default, "{key}: the file's {x} made no difference");
            let file_y = load(Some(format!("{key} = {y}\n")), None);
            assert_ne!(file_y, flag_x, "{key}: pick a y unlike {x}");
            let both = load(Some(format!("{key} = {y}\n")), Some((key, x_flag)));
            assert_eq!(both, flag_x, "{key}: the flag did not win over the file");
        }
    }

    #[test]
    fn lease_durations_are_whole_seconds_and_namespaces_names() {
        assert_eq!(parse_lease_duration("40s"), Some(40));
        assert_eq!(parse_lease_duration("3"), Some(3));
        assert_eq!(parse_lease_duration("1m"), Some(60));
        for bad in ["", "0s", "250ms", "1.5s", "-3s", "2h", "61m", "s", "x"] {
            assert_eq!(parse_lease_duration(bad), None, "{bad}");
            let flags = Flags::parse_from(["m".to_string(), format!("--lease-duration={bad}")]);
            let e = Settings::load(&flags).unwrap_err();
            assert_eq!(e.kind(), "lease-duration", "{bad}");
            assert!(e.to_string().contains("e.g. 40s"), "{e}");
        }
        let flags = Flags::parse_from(["m", "--lease-namespace", "Vcuda_System"]);
        let e = Settings::load(&flags).unwrap_err();
        assert_eq!(e.kind(), "lease-namespace");
        assert!(e.to_string().contains("Vcuda_System"), "{e}");
    }

    /// The VM backends' names are checked at start, each refusal naming what is accepted.
    #[test]
    fn vm_settings_refuse_what_they_do_not_know() {
        for (args, kind, says) in [
            (
                ["m", "--vm-backends", "passthrough,sriov"],
                "vm-backends",
                "sriov",
            ),
            (["m", "--mdev-naming", "nvidia"], "mdev-naming", "kubevirt"),
        ] {
            let e = Settings::load(&Flags::parse_from(args)).unwrap_err();
            assert_eq!(e.kind(), kind);
            assert!(e.to_string().contains(says), "{e}");
        }
        let s = Settings::load(&Flags::parse_from([
            "m",
            "--vm-backends",
            "mdev,passthrough,mdev",
        ]))
        .unwrap();
        assert_eq!(s.vm.backends, [VmBackend::Passthrough, VmBackend::Mdev]);
        assert!(
            Settings::load(&Flags::default())
                .unwrap()
                .vm
                .backends
                .is_empty(),
            "off by default"
        );
    }

    /// A `[default: V]` in a flag's help is the default: giving `--flag V` changes nothing.
    #[test]
    fn the_defaults_in_the_help_are_true() {
        let default = format!("{:?}", Settings::load(&Flags::default()).unwrap());
        let command = Flags::command();
        let mut checked = Vec::new();
        for arg in command.get_arguments() {
            let help = arg
                .get_long_help()
                .or(arg.get_help())
                .map(|h| h.to_string());
            let Some((_, shown)) = help.as_deref().and_then(|h| h.split_once("[default: ")) else {
                continue;
            };
            let value = shown.split([']', ',']).next().unwrap();
            if value.starts_with('$') {
                continue; // from the environment ($NODE_NAME)
            }
            let long = arg.get_long().unwrap();
            let flags = Flags::parse_from(["m", &format!("--{long}"), value]);
            let given = format!("{:?}", Settings::load(&flags).unwrap());
            assert_eq!(given, default, "--{long}: its help says [default: {value}]");
            checked.push(long);
        }
        assert!(checked.len() >= 7, "{checked:?}");
    }
}
