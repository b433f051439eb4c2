//! The GPU description: parsed from the TOML file `GPUSIM_CONFIG` names, or the built-in
//! default of two GPUs. Every error names the file, the line and what to change.

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::Path;
use toml::Spanned;

use crate::layout::{MAX_GPUS, QUEUE_CAP};

/// The built-in configuration used when `GPUSIM_CONFIG` is unset. `gpusim default-config`
/// prints it; README documents it. `driver_version` is left to follow `cuda_version`
/// ([`default_driver_version`]), so changing `cuda_version` alone gives a consistent driver.
pub const DEFAULT_CONFIG: &str = r#"# gpusim default configuration: two NVLink-connected A100-40GB GPUs on NUMA node 0.
context_overhead_mib = 300
module_overhead_kib = 1024
launch_queue_depth = 1024
timeslice_us = 2000
sample_period_us = 166667
wave_ns = 5000
cuda_version = 12090
# driver_version = "575.57.08"  # unset: follows cuda_version (575.57.08 for 12.x, 580.65.06 for 13.x)

[[gpu]]
name = "NVIDIA A100-SXM4-40GB"
uuid = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401"
memory_mib = 40960
sm_count = 108
max_threads_per_sm = 2048
compute_capability = "8.0"
pci_bus_id = "00000000:07:00.0"
numa_node = 0

[[gpu]]
name = "NVIDIA A100-SXM4-40GB"
uuid = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402"
memory_mib = 40960
sm_count = 108
max_threads_per_sm = 2048
compute_capability = "8.0"
pci_bus_id = "00000000:0F:00.0"
numa_node = 0

[[link]]
gpus = [0, 1]
nvlinks = 12
pcie = "switch"
"#;

/// The CUDA versions `gpusim default-config --cuda-version` and `cuda_version` accept:
/// 1000 * major + 10 * minor. The error is "<version>: <what to write>", for the caller to
/// prefix with the key or option it came from.
pub fn check_cuda_version(cuda: i32) -> Result<(), String> {
    if !(2000..=99_990).contains(&cuda) || cuda % 10 != 0 {
        return Err(format!(
            "{cuda}: write 1000*major + 10*minor, e.g. 12090 for CUDA 12.9 or 13050 for CUDA 13.5"
        ));
    }
    Ok(())
}

/// The driver version NVML reports when the config sets `cuda_version` but no
/// `driver_version`: a release driver of a branch whose CUDA major is `cuda_version`'s, as
/// NVIDIA's compatibility table has it (CUDA 12.x: branches 525 to 579, CUDA 13.x: 580 and
/// later). 13.x: 580.65.06, the driver CUDA 13.0 shipped with (R580, the first CUDA 13
/// branch); anything else: 575.57.08, CUDA 12.9's.
pub fn default_driver_version(cuda_version: i32) -> &'static str {
    if cuda_version / 1000 == 13 {
        "580.65.06"
    } else {
        "575.57.08"
    }
}

/// The built-in configuration with `cuda_version` in place of 12090 (and the matching
/// `driver_version` in its comment), for `gpusim default-config --cuda-version`.
pub fn default_config_text(cuda_version: i32) -> Result<String, String> {
    check_cuda_version(cuda_version)?;
    let text = DEFAULT_CONFIG
        .replace(
            "cuda_version = 12090\n",
            &format!("cuda_version = {cuda_version}\n"),
        )
        .replace(
            "# driver_version = \"575.57.08\"",
            &format!(
                "# driver_version = \"{}\"",
                default_driver_version(cuda_version)
            ),
        );
    Ok(text)
}

/// How two GPUs are connected over PCIe, named after NVML's `nvmlGpuTopologyLevel_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PcieLevel {
    /// Behind the same PCIe switch (`NVML_TOPOLOGY_SINGLE`).
    Switch,
    /// Behind several switches, no host bridge crossed (`NVML_TOPOLOGY_MULTIPLE`).
    MultiSwitch,
    /// Under the same host bridge (`NVML_TOPOLOGY_HOSTBRIDGE`).
    HostBridge,
    /// On the same NUMA node, across host bridges (`NVML_TOPOLOGY_NODE`).
    Node,
    /// Across NUMA nodes (`NVML_TOPOLOGY_SYSTEM`).
    System,
}

impl PcieLevel {
    /// The `nvmlGpuTopologyLevel_t` value.
    pub fn nvml_level(self) -> u32 {
        match self {
            PcieLevel::Switch => 10,
            PcieLevel::MultiSwitch => 20,
            PcieLevel::HostBridge => 30,
            PcieLevel::Node => 40,
            PcieLevel::System => 50,
        }
    }
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuConfig {
    pub name: String,
    pub uuid: String,
    pub memory_mib: u64,
    pub sm_count: u32,
    pub max_threads_per_sm: u32,
    /// "major.minor", e.g. "8.0".
    pub compute_capability: String,
    /// Domain:bus:device.function, e.g. "00000000:07:00.0".
    pub pci_bus_id: String,
    #[serde(default)]
    pub numa_node: i32,
    /// Memory the driver keeps for itself, reported by `nvmlDeviceGetMemoryInfo_v2.reserved`.
    #[serde(default)]
    pub reserved_mib: u64,
    #[serde(default = "default_power_limit")]
    pub power_limit_w: u32,
    #[serde(default = "default_sm_clock")]
    pub max_sm_clock_mhz: u32,
    #[serde(default = "default_mem_clock")]
    pub max_mem_clock_mhz: u32,
}

fn default_power_limit() -> u32 {
    400
}
fn default_sm_clock() -> u32 {
    1410
}
fn default_mem_clock() -> u32 {
    1215
}

/// A connection between two GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkConfig {
    pub gpus: [usize; 2],
    /// NVLink lanes between the two GPUs; 0 means no NVLink.
    #[serde(default)]
    pub nvlinks: u32,
    /// PCIe relation; defaults to `node` on the same NUMA node, else `system`.
    #[serde(default)]
    pub pcie: Option<PcieLevel>,
}

/// The whole simulated machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Config {
    /// Device memory every context costs its process.
    pub context_overhead_mib: u64,
    /// Device memory every loaded module costs its process.
    pub module_overhead_kib: u64,
    /// Kernels a context may have queued before a launch blocks.
    pub launch_queue_depth: u32,
    /// Longest run of one context while another has work (time-slicing).
    pub timeslice_us: u64,
    /// NVML utilization sample period.
    pub sample_period_us: u64,
    /// Cost of one wave of blocks for kernels whose name gives no duration.
    pub wave_ns: u64,
    pub driver_version: String,
    pub cuda_version: i32,
    pub gpu: Vec<GpuConfig>,
    pub link: Vec<LinkConfig>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default = "d_ctx")]
    context_overhead_mib: u64,
    #[serde(default = "d_mod")]
    module_overhead_kib: u64,
    #[serde(default = "d_depth")]
    launch_queue_depth: Spanned<u32>,
    #[serde(default = "d_slice")]
    timeslice_us: Spanned<u64>,
    #[serde(default = "d_period")]
    sample_period_us: Spanned<u64>,
    #[serde(default = "d_wave")]
    wave_ns: u64,
    #[serde(default)]
    driver_version: Option<String>,
    #[serde(default = "d_cuda")]
    cuda_version: Spanned<i32>,
    #[serde(default)]
    gpu: Vec<Spanned<GpuConfig>>,
    #[serde(default)]
    link: Vec<Spanned<LinkConfig>>,
}

fn d_ctx() -> u64 {
    300
}
fn d_mod() -> u64 {
    1024
}
fn d_depth() -> Spanned<u32> {
    Spanned::new(0..0, 1024)
}
fn d_slice() -> Spanned<u64> {
    Spanned::new(0..0, 2000)
}
fn d_period() -> Spanned<u64> {
    Spanned::new(0..0, 166_667)
}
fn d_wave() -> u64 {
    5000
}
fn d_cuda() -> Spanned<i32> {
    Spanned::new(0..0, 12090)
}

/// A configuration problem, located in its file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("gpusim: config {path}: line {line}: {msg}")]
    Invalid {
        path: String,
        line: usize,
        msg: String,
    },
    #[error("gpusim: config {path}: cannot read it ({err}); point GPUSIM_CONFIG at a readable file, or unset it for the default two GPUs")]
    Unreadable { path: String, err: String },
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

impl Config {
    /// The built-in two-GPU machine.
    pub fn default_config() -> Config {
        Config::parse(DEFAULT_CONFIG, "<built-in default>")
            .expect("the built-in default config is valid")
    }

    /// Read and check the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Unreadable {
            path: path.display().to_string(),
            err: e.to_string(),
        })?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Parse and check `text`; `path` names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
        let invalid = |offset: usize, msg: String| ConfigError::Invalid {
            path: path.to_string(),
            line: line_of(text, offset),
            msg,
        };
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let offset = e.span().map(|s| s.start).unwrap_or(0);
            invalid(offset, e.message().trim().replace('\n', " "))
        })?;
        if raw.gpu.is_empty() {
            return Err(invalid(
                text.len(),
                "no [[gpu]] table: describe at least one GPU (see `gpusim default-config`)".into(),
            ));
        }
        if raw.gpu.len() > MAX_GPUS {
            let at = raw.gpu[MAX_GPUS].span().start;
            return Err(invalid(
                at,
                format!(
                    "{} GPUs described; gpusim simulates at most {MAX_GPUS}",
                    raw.gpu.len()
                ),
            ));
        }
        let depth = *raw.launch_queue_depth.get_ref();
        if depth == 0 || depth as usize > QUEUE_CAP {
            return Err(invalid(
                raw.launch_queue_depth.span().start,
                format!("launch_queue_depth = {depth}: must be 1..={QUEUE_CAP}"),
            ));
        }
        if *raw.timeslice_us.get_ref() == 0 {
            return Err(invalid(
                raw.timeslice_us.span().start,
                "timeslice_us must be positive".into(),
            ));
        }
        let period = *raw.sample_period_us.get_ref();
        if !(1000..=1_000_000).contains(&period) {
            return Err(invalid(
                raw.sample_period_us.span().start,
                format!("sample_period_us = {period}: must be 1000..=1000000 (real GPUs sample every 1/6 s to 1 s)"),
            ));
        }
        let cuda = *raw.cuda_version.get_ref();
        check_cuda_version(cuda)
            .map_err(|m| invalid(raw.cuda_version.span().start, format!("cuda_version = {m}")))?;
        let mut gpus = Vec::with_capacity(raw.gpu.len());
        for (i, g) in raw.gpu.iter().enumerate() {
            let at = g.span().start;
            let gpu = g.get_ref().clone();
            check_gpu(i, &gpu).map_err(|m| invalid(at, m))?;
            for (j, other) in gpus.iter().enumerate() {
                let other: &GpuConfig = other;
                if other.uuid.eq_ignore_ascii_case(&gpu.uuid) {
                    return Err(invalid(
                        at,
                        format!("gpu {i}: uuid {} is already used by gpu {j}", gpu.uuid),
                    ));
                }
                if normalize_bus_id(&other.pci_bus_id) == normalize_bus_id(&gpu.pci_bus_id) {
                    return Err(invalid(
                        at,
                        format!(
                            "gpu {i}: pci_bus_id {} is already used by gpu {j}",
                            gpu.pci_bus_id
                        ),
                    ));
                }
            }
            gpus.push(gpu);
        }
        let mut links: Vec<LinkConfig> = Vec::new();
        for l in &raw.link {
            let at = l.span().start;
            let link = l.get_ref().clone();
            let [a, b] = link.gpus;
            if a >= gpus.len() || b >= gpus.len() || a == b {
                return Err(invalid(
                    at,
                    format!(
                        "link gpus = [{a}, {b}]: name two different GPU indices below {}",
                        gpus.len()
                    ),
                ));
            }
            if links
                .iter()
                .any(|o| (o.gpus == [a, b]) || (o.gpus == [b, a]))
            {
                return Err(invalid(
                    at,
                    format!("link between gpu {a} and gpu {b} is described twice"),
                ));
            }
            if link.nvlinks > 18 {
                return Err(invalid(
                    at,
                    format!("nvlinks = {}: a GPU has at most 18 NVLinks", link.nvlinks),
                ));
            }
            links.push(link);
        }
        Ok(Config {
            context_overhead_mib: raw.context_overhead_mib,
            module_overhead_kib: raw.module_overhead_kib,
            launch_queue_depth: depth,
            timeslice_us: *raw.timeslice_us.get_ref(),
            sample_period_us: period,
            wave_ns: raw.wave_ns,
            driver_version: raw
                .driver_version
                .unwrap_or_else(|| default_driver_version(cuda).to_string()),
            cuda_version: cuda,
            gpu: gpus,
            link: links,
        })
    }

    /// The configuration written back as TOML: stored in the state file so every process and
    /// `gpusim status` see the GPUs the state was created for.
    pub fn to_toml(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "context_overhead_mib = {}", self.context_overhead_mib);
        let _ = writeln!(s, "module_overhead_kib = {}", self.module_overhead_kib);
        let _ = writeln!(s, "launch_queue_depth = {}", self.launch_queue_depth);
        let _ = writeln!(s, "timeslice_us = {}", self.timeslice_us);
        let _ = writeln!(s, "sample_period_us = {}", self.sample_period_us);
        let _ = writeln!(s, "wave_ns = {}", self.wave_ns);
        let _ = writeln!(s, "driver_version = {}", toml_str(&self.driver_version));
        let _ = writeln!(s, "cuda_version = {}", self.cuda_version);
        for g in &self.gpu {
            let _ = writeln!(s, "\n[[gpu]]");
            let _ = writeln!(s, "name = {}", toml_str(&g.name));
            let _ = writeln!(s, "uuid = {}", toml_str(&g.uuid));
            let _ = writeln!(s, "memory_mib = {}", g.memory_mib);
            let _ = writeln!(s, "sm_count = {}", g.sm_count);
            let _ = writeln!(s, "max_threads_per_sm = {}", g.max_threads_per_sm);
            let _ = writeln!(
                s,
                "compute_capability = {}",
                toml_str(&g.compute_capability)
            );
            let _ = writeln!(s, "pci_bus_id = {}", toml_str(&g.pci_bus_id));
            let _ = writeln!(s, "numa_node = {}", g.numa_node);
            let _ = writeln!(s, "reserved_mib = {}", g.reserved_mib);
            let _ = writeln!(s, "power_limit_w = {}", g.power_limit_w);
            let _ = writeln!(s, "max_sm_clock_mhz = {}", g.max_sm_clock_mhz);
            let _ = writeln!(s, "max_mem_clock_mhz = {}", g.max_mem_clock_mhz);
        }
        for l in &self.link {
            let _ = writeln!(s, "\n[[link]]");
            let _ = writeln!(s, "gpus = [{}, {}]", l.gpus[0], l.gpus[1]);
            let _ = writeln!(s, "nvlinks = {}", l.nvlinks);
            if let Some(p) = l.pcie {
                let _ = writeln!(s, "pcie = {}", toml_str(pcie_name(p)));
            }
        }
        s
    }

    /// A stable fingerprint of the configuration (FNV-1a over its canonical TOML).
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.to_toml().bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }

    /// The PCIe relation and NVLink lane count between GPUs `a` and `b`.
    pub fn link_between(&self, a: usize, b: usize) -> (PcieLevel, u32) {
        let found = self
            .link
            .iter()
            .find(|l| l.gpus == [a, b] || l.gpus == [b, a]);
        let same_node = self.gpu[a].numa_node == self.gpu[b].numa_node;
        let default = if same_node {
            PcieLevel::Node
        } else {
            PcieLevel::System
        };
        match found {
            Some(l) => (l.pcie.unwrap_or(default), l.nvlinks),
            None => (default, 0),
        }
    }

    /// Context overhead in bytes.
    pub fn context_overhead(&self) -> u64 {
        self.context_overhead_mib << 20
    }

    /// Module overhead in bytes.
    pub fn module_overhead(&self) -> u64 {
        self.module_overhead_kib << 10
    }
}

impl GpuConfig {
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib << 20
    }

    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_mib << 20
    }

    /// (major, minor) compute capability.
    pub fn cc(&self) -> (i32, i32) {
        let mut it = self.compute_capability.split('.');
        let major = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let minor = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        (major, minor)
    }

    /// The 16 UUID bytes parsed from "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
    pub fn uuid_bytes(&self) -> [u8; 16] {
        parse_uuid(&self.uuid).unwrap_or([0; 16])
    }

    /// (domain, bus, device, function) parsed from the bus id.
    pub fn pci_parts(&self) -> (u32, u32, u32, u32) {
        parse_bus_id(&self.pci_bus_id).unwrap_or((0, 0, 0, 0))
    }
}

fn pcie_name(p: PcieLevel) -> &'static str {
    match p {
        PcieLevel::Switch => "switch",
        PcieLevel::MultiSwitch => "multi-switch",
        PcieLevel::HostBridge => "host-bridge",
        PcieLevel::Node => "node",
        PcieLevel::System => "system",
    }
}

fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn check_gpu(i: usize, g: &GpuConfig) -> Result<(), String> {
    if g.name.is_empty() || g.name.len() > 95 {
        return Err(format!("gpu {i}: name must be 1..=95 characters"));
    }
    if parse_uuid(&g.uuid).is_none() {
        return Err(format!(
            "gpu {i}: uuid {:?} is not of the form GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (hex digits)",
            g.uuid
        ));
    }
    if g.memory_mib == 0 || g.memory_mib > (1 << 24) {
        return Err(format!(
            "gpu {i}: memory_mib = {} must be 1..=16777216",
            g.memory_mib
        ));
    }
    if g.reserved_mib >= g.memory_mib {
        return Err(format!(
            "gpu {i}: reserved_mib = {} must be below memory_mib",
            g.reserved_mib
        ));
    }
    if g.sm_count == 0 || g.sm_count > 1024 {
        return Err(format!(
            "gpu {i}: sm_count = {} must be 1..=1024",
            g.sm_count
        ));
    }
    if g.max_threads_per_sm < 32 || g.max_threads_per_sm > 4096 {
        return Err(format!(
            "gpu {i}: max_threads_per_sm = {} must be 32..=4096",
            g.max_threads_per_sm
        ));
    }
    let cc_ok = {
        let mut it = g.compute_capability.split('.');
        let ma = it.next().and_then(|s| s.parse::<u32>().ok());
        let mi = it.next().and_then(|s| s.parse::<u32>().ok());
        matches!((ma, mi, it.next()), (Some(3..=12), Some(0..=9), None))
    };
    if !cc_ok {
        return Err(format!(
            "gpu {i}: compute_capability {:?} must be \"major.minor\" with major 3..=12, e.g. \"8.0\"",
            g.compute_capability
        ));
    }
    if parse_bus_id(&g.pci_bus_id).is_none() {
        return Err(format!(
            "gpu {i}: pci_bus_id {:?} must look like \"00000000:07:00.0\" (domain:bus:device.function, hex)",
            g.pci_bus_id
        ));
    }
    if g.numa_node < -1 || g.numa_node > 63 {
        return Err(format!(
            "gpu {i}: numa_node = {} must be -1..=63",
            g.numa_node
        ));
    }
    Ok(())
}

/// Parse "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" into 16 bytes.
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let rest = s.strip_prefix("GPU-")?;
    let groups: Vec<&str> = rest.split('-').collect();
    if groups.iter().map(|g| g.len()).collect::<Vec<_>>() != [8, 4, 4, 4, 12] {
        return None;
    }
    let hex: String = groups.concat();
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Parse a PCI bus id: "dddddddd:bb:dd.f" or the short "dddd:bb:dd.f" / "bb:dd.f".
pub fn parse_bus_id(s: &str) -> Option<(u32, u32, u32, u32)> {
    let (head, func) = s.rsplit_once('.')?;
    let parts: Vec<&str> = head.split(':').collect();
    let (dom, bus, dev) = match parts.as_slice() {
        [d, b, v] => (u32::from_str_radix(d, 16).ok()?, *b, *v),
        [b, v] => (0, *b, *v),
        _ => return None,
    };
    let bus = u32::from_str_radix(bus, 16).ok()?;
    let dev = u32::from_str_radix(dev, 16).ok()?;
    let func = u32::from_str_radix(func, 16).ok()?;
    if bus > 0xff || dev > 0x1f || func > 7 {
        return None;
    }
    Some((dom, bus, dev, func))
}

/// Canonical form of a bus id ("00000000:07:00.0"), for comparisons.
pub fn normalize_bus_id(s: &str) -> Option<String> {
    parse_bus_id(s).map(|(d, b, v, f)| format!("{d:08X}:{b:02X}:{v:02X}.{f:X}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_has_two_linked_gpus() {
        let c = Config::default_config();
        assert_eq!(c.gpu.len(), 2);
        assert_eq!(c.link_between(0, 1), (PcieLevel::Switch, 12));
        assert_eq!(c.gpu[0].memory_bytes(), 40960 << 20);
        assert_eq!(c.context_overhead(), 300 << 20);
    }

    #[test]
    fn driver_version_follows_cuda_version_unless_set() {
        let c = Config::default_config();
        assert_eq!(
            (c.cuda_version, c.driver_version.as_str()),
            (12090, "575.57.08")
        );
        let c13 = Config::parse(&default_config_text(13050).unwrap(), "x").unwrap();
        assert_eq!(
            (c13.cuda_version, c13.driver_version.as_str()),
            (13050, "580.65.06")
        );
        // only the version changed: same GPUs
        assert_eq!(c13.gpu, c.gpu);
        let text = DEFAULT_CONFIG.replace("cuda_version = 12090", "cuda_version = 13000");
        assert_eq!(
            Config::parse(&text, "x").unwrap().driver_version,
            "580.65.06"
        );
        let text = format!("driver_version = \"590.44.01\"\n{text}");
        assert_eq!(
            Config::parse(&text, "x").unwrap().driver_version,
            "590.44.01"
        );
        let e = default_config_text(13055).unwrap_err();
        assert!(e.contains("1000*major + 10*minor"), "{e}");
        assert!(default_config_text(13050)
            .unwrap()
            .contains("\ncuda_version = 13050\n"));
    }

    #[test]
    fn round_trips_through_toml() {
        let c = Config::default_config();
        let again = Config::parse(&c.to_toml(), "x").unwrap();
        assert_eq!(c, again);
        assert_eq!(c.fingerprint(), again.fingerprint());
    }

    #[test]
    fn syntax_error_names_file_and_line() {
        let text = "context_overhead_mib = 300\n\n[[gpu]]\nname = \"x\"\nuuid = \n";
        let e = Config::parse(text, "/etc/g.toml").unwrap_err().to_string();
        assert!(e.starts_with("gpusim: config /etc/g.toml: line 5:"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn semantic_error_names_the_gpu_table_line() {
        let text = DEFAULT_CONFIG.replace("memory_mib = 40960\nsm_count = 108\nmax_threads_per_sm = 2048\ncompute_capability = \"8.0\"\npci_bus_id = \"00000000:0F:00.0\"", "memory_mib = 40960\nsm_count = 108\nmax_threads_per_sm = 2048\ncompute_capability = \"8.0\"\npci_bus_id = \"00000000:07:00.0\"");
        let e = Config::parse(&text, "c.toml").unwrap_err();
        let ConfigError::Invalid { line, msg, .. } = e else {
            panic!()
        };
        let expected_line = DEFAULT_CONFIG
            .lines()
            .position(|l| l.contains("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402"))
            .unwrap();
        // the table's span starts at its first key, one line after [[gpu]]
        assert!(
            line >= expected_line - 1 && line <= expected_line + 1,
            "line {line} msg {msg}"
        );
        assert!(
            msg.contains("pci_bus_id") && msg.contains("already used by gpu 0"),
            "{msg}"
        );
    }

    #[test]
    fn unknown_key_is_rejected() {
        let text = format!("{DEFAULT_CONFIG}\n[[gpu]]\nname=\"a\"\nbogus = 1\n");
        let e = Config::parse(&text, "c").unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn bad_uuid_and_link_rejected() {
        let t = DEFAULT_CONFIG.replace("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402", "GPU-1234");
        assert!(Config::parse(&t, "c")
            .unwrap_err()
            .to_string()
            .contains("uuid"));
        let t = DEFAULT_CONFIG.replace("gpus = [0, 1]", "gpus = [0, 5]");
        assert!(Config::parse(&t, "c")
            .unwrap_err()
            .to_string()
            .contains("link gpus"));
    }

    #[test]
    fn parses_ids() {
        assert_eq!(parse_bus_id("00000000:0F:00.0"), Some((0, 15, 0, 0)));
        assert_eq!(parse_bus_id("0000:3b:00.1"), Some((0, 0x3b, 0, 1)));
        assert_eq!(
            normalize_bus_id("0000:3b:00.0").unwrap(),
            "00000000:3B:00.0"
        );
        assert!(parse_bus_id("zz").is_none());
        let u = parse_uuid("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401").unwrap();
        assert_eq!(u[0], 0x5a);
        assert_eq!(u[15], 0x01);
    }
}
