//! The per-container config: which GPUs, how much memory and compute on each, where the
//! shared region lives. Written by the manager (or by hand for standalone use), mounted
//! read-only into the container, read once by libvcuda at start-up.
//!
//! ```toml
//! version = 1
//! region = "/var/run/vcuda/region"          # shared by all processes of the container
//! # socket = "/var/run/vcuda/vcuda.sock"    # the manager's control socket (optional)
//! # allocation = "a1b2c3"                    # the manager's name for this allocation
//! # cuda_library = "libcuda.so.1"           # the real driver (default shown)
//! # nvml_library = "libnvidia-ml.so.1"
//!
//! [[gpu]]
//! uuid = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401"
//! memory_mib = 4096                          # device-memory quota
//! core = 30                                  # compute share, percent (100 or more: exclusive)
//! # core_limit = 60                          # elastic: may burst to 60 % while the GPU idles
//! ```

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use toml::Spanned;

/// Where libvcuda looks for its config when `VCUDA_CONFIG` is unset.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/vcuda/vcuda.toml";
/// The environment variable naming the config file.
pub const CONFIG_ENV: &str = "VCUDA_CONFIG";
pub const CONFIG_VERSION: u32 = 1;
/// GPUs one container may be given.
pub const MAX_GPUS: usize = 8;

/// One GPU of the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuLimit {
    /// The GPU's UUID as NVML and CUDA report it ("GPU-…").
    pub uuid: String,
    /// Device-memory quota in MiB.
    pub memory_mib: u64,
    /// Compute share in percent of the GPU (100 or more: exclusive, no throttling).
    #[serde(default = "full")]
    pub core: u32,
    /// Elastic upper bound in percent (GPUManager's `vcuda-core-limit`): the container may
    /// use up to this while the GPU has idle capacity, and is guaranteed `core`. Absent or
    /// equal to `core`: a hard limit.
    #[serde(default)]
    pub core_limit: Option<u32>,
}

fn full() -> u32 {
    100
}

/// The whole config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ContainerConfig {
    pub version: u32,
    pub region: PathBuf,
    pub socket: Option<PathBuf>,
    /// The manager's name for this container's allocation (sent when registering over the
    /// socket); at most [`MAX_ALLOCATION_LEN`] characters of `[A-Za-z0-9._-]`.
    pub allocation: Option<String>,
    pub cuda_library: String,
    pub nvml_library: String,
    pub gpu: Vec<GpuLimit>,
}

/// Longest allocation name.
pub const MAX_ALLOCATION_LEN: usize = 128;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    version: Spanned<u32>,
    region: Spanned<PathBuf>,
    #[serde(default)]
    socket: Option<PathBuf>,
    #[serde(default)]
    allocation: Option<Spanned<String>>,
    #[serde(default = "default_cuda")]
    cuda_library: String,
    #[serde(default = "default_nvml")]
    nvml_library: String,
    #[serde(default)]
    gpu: Vec<Spanned<GpuLimit>>,
}

fn default_cuda() -> String {
    "libcuda.so.1".into()
}
fn default_nvml() -> String {
    "libnvidia-ml.so.1".into()
}

/// A config that cannot be used. The message is one line naming the file and the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("vcuda: config {path}: cannot read it ({err}); GPU use is refused until it exists (set {CONFIG_ENV} or create {DEFAULT_CONFIG_PATH})")]
    Unreadable { path: String, err: String },
    #[error("vcuda: config {path}: line {line}: {msg}; GPU use is refused until it is fixed")]
    Invalid {
        path: String,
        line: usize,
        msg: String,
    },
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Which config to obey. In a container vcuda-manager set up, the default path is its
/// read-only mount and is the only one: `$VCUDA_CONFIG` is the container's own environment,
/// which a tenant may set to a config of its own making (issue 11). Elsewhere (a process
/// limited by hand, the tests) `$VCUDA_CONFIG` names the config, else the default.
pub fn config_path(default_exists: bool, env: Option<std::ffi::OsString>) -> PathBuf {
    match env.filter(|v| !v.is_empty()) {
        Some(v) if !default_exists => PathBuf::from(v),
        _ => PathBuf::from(DEFAULT_CONFIG_PATH),
    }
}

impl ContainerConfig {
    /// The config file path: see [`config_path`].
    pub fn path_from_env() -> PathBuf {
        config_path(
            Path::new(DEFAULT_CONFIG_PATH).exists(),
            std::env::var_os(CONFIG_ENV),
        )
    }

    pub fn load(path: &Path) -> Result<ContainerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Unreadable {
            path: path.display().to_string(),
            err: e.to_string(),
        })?;
        ContainerConfig::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, path: &str) -> Result<ContainerConfig, ConfigError> {
        let invalid = |offset: usize, msg: String| ConfigError::Invalid {
            path: path.to_string(),
            line: line_of(text, offset),
            msg,
        };
        let raw: Raw = toml::from_str(text).map_err(|e| {
            let at = e.span().map_or(0, |s| s.start);
            invalid(at, e.message().trim().replace('\n', " "))
        })?;
        if *raw.version.get_ref() != CONFIG_VERSION {
            return Err(invalid(
                raw.version.span().start,
                format!(
                    "version = {} but this libvcuda reads version {CONFIG_VERSION}",
                    raw.version.get_ref()
                ),
            ));
        }
        if raw.region.get_ref().as_os_str().is_empty() || !raw.region.get_ref().is_absolute() {
            return Err(invalid(
                raw.region.span().start,
                "region must be an absolute file path".into(),
            ));
        }
        if let Some(a) = &raw.allocation {
            let name = a.get_ref();
            if name.is_empty()
                || name.len() > MAX_ALLOCATION_LEN
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            {
                return Err(invalid(
                    a.span().start,
                    format!("allocation {name:?} must be 1 to {MAX_ALLOCATION_LEN} characters of A-Z a-z 0-9 . _ -"),
                ));
            }
        }
        if raw.gpu.is_empty() {
            return Err(invalid(
                text.len(),
                "no [[gpu]] table: name at least one GPU by UUID".into(),
            ));
        }
        if raw.gpu.len() > MAX_GPUS {
            return Err(invalid(
                raw.gpu[MAX_GPUS].span().start,
                format!("at most {MAX_GPUS} GPUs per container"),
            ));
        }
        let mut gpus: Vec<GpuLimit> = Vec::new();
        for (i, g) in raw.gpu.iter().enumerate() {
            let at = g.span().start;
            let g = g.get_ref().clone();
            if parse_uuid(&g.uuid).is_none() {
                return Err(invalid(at, format!("gpu {i}: uuid {:?} is not of the form GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", g.uuid)));
            }
            if gpus.iter().any(|o| o.uuid.eq_ignore_ascii_case(&g.uuid)) {
                return Err(invalid(
                    at,
                    format!("gpu {i}: uuid {} is listed twice", g.uuid),
                ));
            }
            if g.memory_mib == 0 {
                return Err(invalid(
                    at,
                    format!("gpu {i}: memory_mib must be at least 1"),
                ));
            }
            if g.core == 0 {
                return Err(invalid(
                    at,
                    format!("gpu {i}: core must be 1..=100 (percent; 100 or more is exclusive)"),
                ));
            }
            if let Some(l) = g.core_limit {
                if l < g.core || l > 100 {
                    return Err(invalid(
                        at,
                        format!(
                            "gpu {i}: core_limit = {l} must be between core ({}) and 100",
                            g.core
                        ),
                    ));
                }
            }
            gpus.push(g);
        }
        Ok(ContainerConfig {
            version: CONFIG_VERSION,
            region: raw.region.into_inner(),
            socket: raw.socket,
            allocation: raw.allocation.map(Spanned::into_inner),
            cuda_library: raw.cuda_library,
            nvml_library: raw.nvml_library,
            gpu: gpus,
        })
    }

    /// The GPUs' UUIDs as 16 bytes each, in config order.
    pub fn uuids(&self) -> Vec<[u8; 16]> {
        self.gpu
            .iter()
            .map(|g| parse_uuid(&g.uuid).unwrap_or([0; 16]))
            .collect()
    }

    /// Write the config as TOML (the manager writes configs with this).
    pub fn to_toml(&self) -> String {
        let mut s = format!(
            "version = {}\nregion = {}\n",
            self.version,
            quote(&self.region.display().to_string())
        );
        if let Some(sock) = &self.socket {
            s += &format!("socket = {}\n", quote(&sock.display().to_string()));
        }
        if let Some(a) = &self.allocation {
            s += &format!("allocation = {}\n", quote(a));
        }
        s += &format!(
            "cuda_library = {}\nnvml_library = {}\n",
            quote(&self.cuda_library),
            quote(&self.nvml_library)
        );
        for g in &self.gpu {
            s += &format!(
                "\n[[gpu]]\nuuid = {}\nmemory_mib = {}\ncore = {}\n",
                quote(&g.uuid),
                g.memory_mib,
                g.core
            );
            if let Some(l) = g.core_limit {
                s += &format!("core_limit = {l}\n");
            }
        }
        s
    }
}

fn quote(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// Parse "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" into 16 bytes.
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let rest = s.strip_prefix("GPU-").or_else(|| s.strip_prefix("gpu-"))?;
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

/// Format 16 UUID bytes as "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
pub fn format_uuid(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
version = 1
region = "/run/vcuda/region"

[[gpu]]
uuid = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401"
memory_mib = 4096
core = 30
"#;

    #[test]
    fn the_mounted_config_wins_over_the_environment() {
        let env = |s: &str| Some(std::ffi::OsString::from(s));
        let default = Path::new(DEFAULT_CONFIG_PATH);
        assert_eq!(
            config_path(true, env("/tmp/mine.toml")),
            default,
            "a managed container"
        );
        assert_eq!(config_path(true, None), default);
        assert_eq!(
            config_path(false, env("/tmp/mine.toml")),
            Path::new("/tmp/mine.toml")
        );
        assert_eq!(config_path(false, env("")), default);
        assert_eq!(config_path(false, None), default);
    }

    #[test]
    fn parses_and_round_trips() {
        let c = ContainerConfig::parse(GOOD, "c.toml").unwrap();
        assert_eq!(c.gpu[0].memory_mib, 4096);
        assert_eq!(c.gpu[0].core, 30);
        assert_eq!(c.gpu[0].core_limit, None);
        let e = ContainerConfig::parse(
            &GOOD.replace("core = 30", "core = 30\ncore_limit = 20"),
            "c",
        )
        .unwrap_err();
        assert!(e.to_string().contains("core_limit"), "{e}");
        let el = ContainerConfig::parse(
            &GOOD.replace("core = 30", "core = 30\ncore_limit = 80"),
            "c",
        )
        .unwrap();
        assert_eq!(ContainerConfig::parse(&el.to_toml(), "x").unwrap(), el);
        assert_eq!(c.cuda_library, "libcuda.so.1");
        assert_eq!(ContainerConfig::parse(&c.to_toml(), "x").unwrap(), c);
        let named = ContainerConfig::parse(
            &GOOD.replace("[[gpu]]", "allocation = \"a-17.x_y\"\n\n[[gpu]]"),
            "c",
        )
        .unwrap();
        assert_eq!(named.allocation.as_deref(), Some("a-17.x_y"));
        assert_eq!(
            ContainerConfig::parse(&named.to_toml(), "x").unwrap(),
            named
        );
        for bad in ["", "a/b", "a b", &"x".repeat(129)] {
            let e = ContainerConfig::parse(
                &GOOD.replace("[[gpu]]", &format!("allocation = {bad:?}\n\n[[gpu]]")),
                "c",
            )
            .unwrap_err();
            assert!(e.to_string().contains("allocation"), "{e}");
        }
        assert_eq!(
            format_uuid(&c.uuids()[0]),
            "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401"
        );
    }

    #[test]
    fn errors_name_file_and_line() {
        let e = ContainerConfig::parse(
            &GOOD.replace("memory_mib = 4096", "memory_mib = -3"),
            "/etc/vcuda/vcuda.toml",
        )
        .unwrap_err();
        let s = e.to_string();
        assert!(
            s.starts_with("vcuda: config /etc/vcuda/vcuda.toml: line 7:"),
            "{s}"
        );
        assert!(!s.contains('\n'));
        let e =
            ContainerConfig::parse(&GOOD.replace("uuid = \"GPU-5a1c", "uuid = \"GPU-zz1c"), "c")
                .unwrap_err();
        assert!(
            e.to_string().contains("line 5") && e.to_string().contains("uuid"),
            "{e}"
        );
        let e =
            ContainerConfig::parse(&GOOD.replace("version = 1", "version = 7"), "c").unwrap_err();
        assert!(e.to_string().contains("version = 7"), "{e}");
        let e = ContainerConfig::parse("version = 1\nregion = \"/r\"\n", "c").unwrap_err();
        assert!(e.to_string().contains("no [[gpu]]"), "{e}");
        let e = ContainerConfig::parse(&GOOD.replace("/run/vcuda/region", "relative/region"), "c")
            .unwrap_err();
        assert!(e.to_string().contains("absolute"), "{e}");
        let e = ContainerConfig::parse(&format!("{GOOD}bogus = 1\n"), "c").unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    #[test]
    fn unreadable_file_says_what_to_do() {
        let e = ContainerConfig::load(Path::new("/nonexistent/vcuda.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent/vcuda.toml")
                && e.contains("VCUDA_CONFIG")
                && e.contains("refused"),
            "{e}"
        );
    }
}
