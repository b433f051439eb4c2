//! What a pod asks for, read from its spec and annotations (pure).
//!
//! Per container, `<domain>/vcuda-core` and `<domain>/vcuda-memory` are read from the limits
//! (falling back to the requests; Kubernetes requires the two to be equal for extended
//! resources and so do we). The domain is a parameter (default [`DEFAULT_DOMAIN`]).
//!
//! - `vcuda-core` 1..=99 → a share of one GPU, with `vcuda-memory` units (256 MiB) on it
//!   (a share needs memory, as the manager does).
//! - `vcuda-core` = 100·n → n whole GPUs; `vcuda-memory`, if any, must fit in them.
//! - With the pod annotation `vcuda.io/gpu-count: N` (N ≥ 2) every container asking for
//!   vcuda-core gets `core/N` and `memory/N` on each of N distinct GPUs, even when `core` is
//!   a multiple of 100 (`100` over 2 GPUs is two halves) (see
//!   [`vcuda_cluster::GPU_COUNT_ANNOTATION`] for the contract).
//!
//! **Sharing modes** (issue 19). Besides shares, a container may ask for whole GPUs through
//! the whole-GPU resource ([`WHOLE_RESOURCE`] unless configured, as NVIDIA's device plugin
//! names it) → [`Need::Exclusive`], or for `<domain>/sgpu` slices → [`Need::Slices`] (n slices
//! on n different GPUs). A container uses one mode ([`RequestError::TwoModes`]) and so does a
//! pod ([`RequestError::PodMixesModes`]): the extender writes no reservation for whole GPUs
//! and slices (the kubelet picks those devices, the manager steers), so a pod mixing a share
//! with slices could see the manager lock the GPU its share was reserved on to slices.
//!
//! **Init containers.** They run one at a time, before the app containers, and the kubelet
//! may reuse their devices for the app containers. The rule (Kubernetes' "max of init vs sum
//! of app containers", per GPU): each init container must fit on the node by itself, and the
//! app containers must fit together. Placement checks exactly that.

use std::collections::BTreeMap;

use thiserror::Error;
use vcuda_cluster::{GpuMode, CORES_PER_GPU, GPU_COUNT_ANNOTATION, MAX_GPU_COUNT, MEMORY_UNIT};

use crate::extender::{Container, Pod, Quantity};

/// The resource domain unless configured otherwise.
pub const DEFAULT_DOMAIN: &str = "tencent.com";

/// The whole-GPU resource unless configured otherwise (NVIDIA's device plugin's name).
pub const WHOLE_RESOURCE: &str = "nvidia.com/gpu";

/// The most GPUs one container may ask for (whole GPUs or slices).
pub const MAX_DEVICE_GPUS: u64 = 1024;

/// The resource names a pod's request is read under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceNames {
    /// `<domain>/vcuda-core`.
    pub core: String,
    /// `<domain>/vcuda-memory`.
    pub memory: String,
    /// `<domain>/sgpu`.
    pub slice: String,
    /// The whole-GPU resource (`nvidia.com/gpu`); `None`: not the extender's business (a
    /// pod asking for it is judged by its other resources only).
    pub whole: Option<String>,
}

impl ResourceNames {
    /// The names under `domain`, whole GPUs as `whole` (empty: not read).
    pub fn new(domain: &str, whole: &str) -> ResourceNames {
        ResourceNames {
            core: format!("{domain}/vcuda-core"),
            memory: format!("{domain}/vcuda-memory"),
            slice: format!("{domain}/sgpu"),
            whole: (!whole.is_empty()).then(|| whole.to_string()),
        }
    }
}

/// What one container needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Need {
    /// `percent` (1..=99) of compute and `memory_bytes` on each of `gpus` distinct GPUs.
    Shares {
        gpus: u32,
        percent: u32,
        memory_bytes: u64,
    },
    /// `gpus` whole GPUs, nothing else on them; `memory_bytes` (may be 0) must fit in them.
    /// Shared mode: `vcuda-core` = 100·n (the GPUs are locked to shared mode).
    Whole { gpus: u32, memory_bytes: u64 },
    /// `gpus` whole GPUs of whole mode (the whole-GPU resource, `nvidia.com/gpu`): unlocked
    /// GPUs with nothing on them; the kubelet picks which.
    Exclusive { gpus: u32 },
    /// One slice (`<domain>/sgpu`) on each of `gpus` different GPUs, each unlocked or
    /// locked to slice mode with a slice free; the kubelet picks which.
    Slices { gpus: u32 },
}

impl Need {
    /// The number of GPUs the container spans.
    pub fn gpus(&self) -> u32 {
        match *self {
            Need::Shares { gpus, .. }
            | Need::Whole { gpus, .. }
            | Need::Exclusive { gpus }
            | Need::Slices { gpus } => gpus,
        }
    }

    /// The sharing mode it uses (and locks its GPUs to).
    pub fn mode(&self) -> GpuMode {
        match self {
            Need::Shares { .. } | Need::Whole { .. } => GpuMode::Shared,
            Need::Exclusive { .. } => GpuMode::Whole,
            Need::Slices { .. } => GpuMode::Slice,
        }
    }

    /// Whole GPUs or slices: devices the kubelet picks, with no reservation by the extender.
    pub fn is_device(&self) -> bool {
        self.mode() != GpuMode::Shared
    }
}

/// A container that asks for vcuda resources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerNeed {
    /// The container's name.
    pub name: String,
    /// What it needs.
    pub need: Need,
}

/// What a pod needs, containers that ask for nothing left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodRequest {
    /// App containers: they run together.
    pub containers: Vec<ContainerNeed>,
    /// Init containers: each runs alone, before the app containers.
    pub init_containers: Vec<ContainerNeed>,
    /// The resource a whole-GPU or slice pod asks for (`nvidia.com/gpu`, `tencent.com/sgpu`),
    /// checked against each node's names; `None` for shares.
    pub device_resource: Option<String>,
}

impl PodRequest {
    /// True when the pod asks for no vcuda resource (every node passes).
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty() && self.init_containers.is_empty()
    }

    /// The sharing mode of the pod (one per pod, see the module documentation); `None`
    /// when it asks for nothing.
    pub fn mode(&self) -> Option<GpuMode> {
        self.containers
            .iter()
            .chain(&self.init_containers)
            .next()
            .map(|c| c.need.mode())
    }
}

/// Why a pod's request is invalid; every message names the container and the fix.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RequestError {
    #[error("container {container}: {resource} = {value:?} is not a whole number; use an integer such as \"50\"")]
    NotANumber {
        container: String,
        resource: String,
        value: String,
    },
    #[error("container {container}: {resource} requests ({request}) differ from limits ({limit}); extended resources need requests equal to limits")]
    RequestsDiffer {
        container: String,
        resource: String,
        request: u64,
        limit: u64,
    },
    #[error("container {container}: vcuda-memory {memory} without vcuda-core; add vcuda-core (1-99 for a share of a GPU, 100 per whole GPU)")]
    MemoryWithoutCore { container: String, memory: u64 },
    #[error("container {container}: vcuda-core {core} is neither a share of one GPU (1 to 99) nor whole GPUs (a multiple of 100); request {lower} or {upper}, or split it over GPUs with the pod annotation {GPU_COUNT_ANNOTATION}")]
    NotShareNorWhole {
        container: String,
        core: u64,
        lower: u64,
        upper: u64,
    },
    #[error("container {container}: a share of a GPU (vcuda-core {core}) needs vcuda-memory too (1 = 256 MiB); add it to the container's limits")]
    ShareWithoutMemory { container: String, core: u64 },
    #[error("pod annotation {GPU_COUNT_ANNOTATION} = {value:?} is not a number from 1 to {MAX_GPU_COUNT}; set it to the number of GPUs to split each container's share over")]
    GpuCountInvalid { value: String },
    #[error("container {container}: {resource} {value} cannot be split evenly over {count} GPUs ({GPU_COUNT_ANNOTATION}); use a multiple of {count}")]
    NotDivisible {
        container: String,
        resource: String,
        value: u64,
        count: u32,
    },
    #[error("container {container}: vcuda-core {core} over {count} GPUs is {per} % per GPU, not a share (1 to 99); raise {GPU_COUNT_ANNOTATION} or lower vcuda-core")]
    PerGpuNotShare {
        container: String,
        core: u64,
        count: u32,
        per: u64,
    },
    #[error("container {container}: asks for both {first} and {second}, two sharing modes; a container uses one (a GPU is locked to the mode that uses it): keep one of them, or move the other to a pod of its own")]
    TwoModes {
        container: String,
        first: String,
        second: String,
    },
    #[error("containers {first_container} ({first}) and {second_container} ({second}) ask for two sharing modes; a pod uses one (whole GPUs and slices get no reservation, so a share could land on a GPU the other mode locks): ask for the same kind of resource in every container, or split the pod into one pod per mode")]
    PodMixesModes {
        first_container: String,
        first: String,
        second_container: String,
        second: String,
    },
    #[error(
        "container {container}: {resource} {value} is too large; nothing on a node can hold it"
    )]
    TooLarge {
        container: String,
        resource: String,
        value: u64,
    },
}

/// Parse an integer Kubernetes quantity: `"100"`, `"1k"`, `"2Ki"`, `"1e3"`, `"2000m"`.
/// `None` when it is not a non-negative whole number (or does not fit in u64).
pub fn parse_integer_quantity(q: &str) -> Option<u64> {
    let q = q.trim();
    let q = q.strip_prefix('+').unwrap_or(q);
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    if num.is_empty() || num.matches('.').count() > 1 || num == "." {
        return None;
    }
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let mut mantissa: u128 = 0;
    for c in int.chars().chain(frac.chars()) {
        mantissa = mantissa
            .checked_mul(10)?
            .checked_add(u128::from(c as u8 - b'0'))?;
    }
    // value = mantissa * 10^exp10 * 2^exp2
    let mut exp10: i64 = -(frac.len() as i64);
    let mut exp2: u32 = 0;
    match suffix {
        "" => {}
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        "Ki" => exp2 = 10,
        "Mi" => exp2 = 20,
        "Gi" => exp2 = 30,
        "Ti" => exp2 = 40,
        "Pi" => exp2 = 50,
        "Ei" => exp2 = 60,
        s if s.starts_with(['e', 'E']) => exp10 += s[1..].parse::<i64>().ok()?,
        _ => return None,
    }
    let mut v = mantissa.checked_mul(1u128.checked_shl(exp2)?)?;
    while exp10 > 0 {
        v = v.checked_mul(10)?;
        exp10 -= 1;
    }
    while exp10 < 0 {
        if v % 10 != 0 {
            return None;
        }
        v /= 10;
        exp10 += 1;
    }
    u64::try_from(v).ok()
}

fn amount(c: &Container, resource: &str) -> Result<u64, RequestError> {
    let parse = |q: Option<&Quantity>| -> Result<Option<u64>, RequestError> {
        q.map(|q| {
            parse_integer_quantity(&q.0).ok_or_else(|| RequestError::NotANumber {
                container: c.name.clone(),
                resource: resource.to_string(),
                value: q.0.clone(),
            })
        })
        .transpose()
    };
    let limit = parse(c.resources.limits.get(resource))?;
    let request = parse(c.resources.requests.get(resource))?;
    match (limit, request) {
        (Some(l), Some(r)) if l != r => Err(RequestError::RequestsDiffer {
            container: c.name.clone(),
            resource: resource.to_string(),
            request: r,
            limit: l,
        }),
        (l, r) => Ok(l.or(r).unwrap_or(0)),
    }
}

/// What one container needs and the resource it names (for messages); `None` when it asks
/// for no vcuda resource.
fn container_need(
    c: &Container,
    names: &ResourceNames,
    gpu_count: u32,
) -> Result<Option<(ContainerNeed, String)>, RequestError> {
    let core_name = &names.core;
    let mem_name = &names.memory;
    let core = amount(c, core_name)?;
    let memory = amount(c, mem_name)?;
    let whole = match &names.whole {
        Some(w) => amount(c, w)?,
        None => 0,
    };
    let slices = amount(c, &names.slice)?;
    let name = c.name.clone();
    let too_large = |resource: &str, value: u64| RequestError::TooLarge {
        container: name.clone(),
        resource: resource.to_string(),
        value,
    };
    let asked: Vec<&String> = [
        (whole > 0, names.whole.as_ref()),
        (slices > 0, Some(&names.slice)),
        (core > 0, Some(core_name)),
        (core == 0 && memory > 0, Some(mem_name)),
    ]
    .into_iter()
    .filter_map(|(yes, r)| r.filter(|_| yes))
    .collect();
    if let [first, second, ..] = asked[..] {
        return Err(RequestError::TwoModes {
            container: name,
            first: first.clone(),
            second: second.clone(),
        });
    }
    for (value, resource, exclusive) in [
        (whole, names.whole.as_ref(), true),
        (slices, Some(&names.slice), false),
    ] {
        let Some(resource) = resource.filter(|_| value > 0) else {
            continue;
        };
        if value > MAX_DEVICE_GPUS {
            return Err(too_large(resource, value));
        }
        let gpus = value as u32;
        let need = if exclusive {
            Need::Exclusive { gpus }
        } else {
            Need::Slices { gpus }
        };
        return Ok(Some((ContainerNeed { name, need }, resource.clone())));
    }
    if core == 0 {
        if memory > 0 {
            return Err(RequestError::MemoryWithoutCore {
                container: name,
                memory,
            });
        }
        return Ok(None);
    }
    // 2^32 memory units is 1 EiB; anything above cannot fit and would overflow the bytes.
    if memory > u64::from(u32::MAX) {
        return Err(too_large(mem_name, memory));
    }
    let per_gpu = u64::from(CORES_PER_GPU);
    if core > per_gpu * 1024 {
        return Err(too_large(core_name, core));
    }
    let need = if gpu_count == 1 && core % per_gpu == 0 {
        Need::Whole {
            gpus: (core / per_gpu) as u32,
            memory_bytes: memory * MEMORY_UNIT,
        }
    } else {
        if core > per_gpu && gpu_count == 1 {
            return Err(RequestError::NotShareNorWhole {
                container: name,
                core,
                lower: core / per_gpu * per_gpu,
                upper: (core / per_gpu + 1) * per_gpu,
            });
        }
        if memory == 0 {
            return Err(RequestError::ShareWithoutMemory {
                container: name,
                core,
            });
        }
        let n = u64::from(gpu_count);
        for (resource, value) in [(core_name, core), (mem_name, memory)] {
            if value % n != 0 {
                return Err(RequestError::NotDivisible {
                    container: name,
                    resource: resource.clone(),
                    value,
                    count: gpu_count,
                });
            }
        }
        let per = core / n;
        if per >= per_gpu {
            return Err(RequestError::PerGpuNotShare {
                container: name,
                core,
                count: gpu_count,
                per,
            });
        }
        Need::Shares {
            gpus: gpu_count,
            percent: per as u32,
            memory_bytes: memory / n * MEMORY_UNIT,
        }
    };
    Ok(Some((ContainerNeed { name, need }, core_name.clone())))
}

/// Read what `pod` asks for under resource `domain` (e.g. [`DEFAULT_DOMAIN`]), whole GPUs
/// as [`WHOLE_RESOURCE`].
pub fn pod_request(pod: &Pod, domain: &str) -> Result<PodRequest, RequestError> {
    pod_request_with(pod, &ResourceNames::new(domain, WHOLE_RESOURCE))
}

/// Read what `pod` asks for under `names`.
pub fn pod_request_with(pod: &Pod, names: &ResourceNames) -> Result<PodRequest, RequestError> {
    let gpu_count = match pod.metadata.annotations.get(GPU_COUNT_ANNOTATION) {
        None => 1,
        Some(v) => v
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX_GPU_COUNT).contains(n))
            .ok_or_else(|| RequestError::GpuCountInvalid { value: v.clone() })?,
    };
    // (container, resource) of the first container asking for something: the pod's mode.
    let mut first: Option<(String, String, GpuMode)> = None;
    let mut read = |cs: &[Container]| -> Result<Vec<ContainerNeed>, RequestError> {
        let mut out = Vec::new();
        for c in cs {
            let Some((need, resource)) = container_need(c, names, gpu_count)? else {
                continue;
            };
            match &first {
                None => first = Some((need.name.clone(), resource, need.need.mode())),
                Some((fc, fr, mode)) if *mode != need.need.mode() => {
                    return Err(RequestError::PodMixesModes {
                        first_container: fc.clone(),
                        first: fr.clone(),
                        second_container: need.name,
                        second: resource,
                    })
                }
                Some(_) => {}
            }
            out.push(need);
        }
        Ok(out)
    };
    let containers = read(&pod.spec.containers)?;
    let init_containers = read(&pod.spec.init_containers)?;
    let device_resource = first
        .filter(|(_, _, mode)| *mode != GpuMode::Shared)
        .map(|(_, resource, _)| resource);
    Ok(PodRequest {
        containers,
        init_containers,
        device_resource,
    })
}

/// Shorthand for tests and tools: a container's limits from `(resource, quantity)` pairs.
pub fn container(name: &str, limits: &[(&str, &str)]) -> Container {
    let mut c = Container {
        name: name.to_string(),
        ..Default::default()
    };
    c.resources.limits = limits
        .iter()
        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
        .collect::<BTreeMap<_, _>>();
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    const CORE: &str = "tencent.com/vcuda-core";
    const MEM: &str = "tencent.com/vcuda-memory";

    fn pod(containers: Vec<Container>, gpu_count: Option<&str>) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = "p".into();
        p.spec.containers = containers;
        if let Some(n) = gpu_count {
            p.metadata
                .annotations
                .insert(GPU_COUNT_ANNOTATION.into(), n.into());
        }
        p
    }

    fn one(limits: &[(&str, &str)], gpu_count: Option<&str>) -> Result<Option<Need>, RequestError> {
        let r = pod_request(
            &pod(vec![container("c", limits)], gpu_count),
            DEFAULT_DOMAIN,
        )?;
        Ok(r.containers.first().map(|c| c.need))
    }

    #[test]
    fn quantities_parse_like_kubernetes() {
        for (q, v) in [
            ("100", Some(100)),
            ("1k", Some(1000)),
            ("2Ki", Some(2048)),
            ("1e3", Some(1000)),
            ("2000m", Some(2)),
            ("1.5k", Some(1500)),
            ("+7", Some(7)),
            ("1500m", None),
            ("-1", None),
            ("abc", None),
            ("1x", None),
            ("", None),
            ("99999999999999999999999", None),
        ] {
            assert_eq!(parse_integer_quantity(q), v, "{q:?}");
        }
    }

    #[test]
    fn shares_whole_gpus_and_nothing() {
        assert_eq!(
            one(&[(CORE, "30"), (MEM, "16")], None).unwrap(),
            Some(Need::Shares {
                gpus: 1,
                percent: 30,
                memory_bytes: 4 << 30
            })
        );
        assert_eq!(
            one(&[(CORE, "200")], None).unwrap(),
            Some(Need::Whole {
                gpus: 2,
                memory_bytes: 0
            })
        );
        assert_eq!(one(&[("cpu", "2")], None).unwrap(), None);
        // another domain is another resource
        let p = pod(
            vec![container(
                "c",
                &[
                    ("example.com/vcuda-core", "30"),
                    ("example.com/vcuda-memory", "4"),
                ],
            )],
            None,
        );
        assert!(pod_request(&p, DEFAULT_DOMAIN).unwrap().is_empty());
        assert_eq!(pod_request(&p, "example.com").unwrap().containers.len(), 1);
    }

    #[test]
    fn gpu_count_splits_evenly_or_is_refused() {
        assert_eq!(
            one(&[(CORE, "120"), (MEM, "32")], Some("2")).unwrap(),
            Some(Need::Shares {
                gpus: 2,
                percent: 60,
                memory_bytes: 4 << 30
            })
        );
        let e = |l: &[(&str, &str)], n| one(l, Some(n)).unwrap_err().to_string();
        assert!(
            e(&[(CORE, "121"), (MEM, "32")], "2").contains("cannot be split evenly over 2 GPUs")
        );
        assert!(e(&[(CORE, "120"), (MEM, "31")], "2").contains("vcuda-memory 31 cannot be split"));
        assert!(e(&[(CORE, "250"), (MEM, "32")], "2").contains("125 % per GPU"));
        let m = e(&[(CORE, "200"), (MEM, "8")], "2");
        assert!(m.contains("100 % per GPU, not a share"), "{m}");
        // with gpu-count, 100 is two halves, not a whole GPU
        assert_eq!(
            one(&[(CORE, "100"), (MEM, "8")], Some("2")).unwrap(),
            Some(Need::Shares {
                gpus: 2,
                percent: 50,
                memory_bytes: 1 << 30
            })
        );
        assert!(e(&[(CORE, "20"), (MEM, "2")], "0").contains("not a number from 1 to 16"));
        assert!(e(&[(CORE, "20"), (MEM, "2")], "x").contains("gpu-count"));
        assert_eq!(
            one(&[(CORE, "20"), (MEM, "2")], Some("1")).unwrap(),
            one(&[(CORE, "20"), (MEM, "2")], None).unwrap()
        );
    }

    #[test]
    fn invalid_requests_have_readable_reasons() {
        let e = |l: &[(&str, &str)]| one(l, None).unwrap_err().to_string();
        let m = e(&[(CORE, "150"), (MEM, "4")]);
        assert!(
            m.contains("vcuda-core 150") && m.contains("request 100 or 200"),
            "{m}"
        );
        assert!(e(&[(MEM, "4")]).contains("without vcuda-core"));
        assert!(e(&[(CORE, "30")]).contains("needs vcuda-memory"));
        assert!(e(&[(CORE, "3.5"), (MEM, "4")]).contains("not a whole number"));
        let mut c = container("c", &[(CORE, "30"), (MEM, "4")]);
        c.resources
            .requests
            .insert(CORE.into(), Quantity("20".into()));
        let m = pod_request(&pod(vec![c], None), DEFAULT_DOMAIN)
            .unwrap_err()
            .to_string();
        assert!(m.contains("requests (20) differ from limits (30)"), "{m}");
        assert!(m.starts_with("container c:"), "{m}");
    }

    const SGPU: &str = "tencent.com/sgpu";
    const GPU: &str = "nvidia.com/gpu";

    #[test]
    fn whole_gpus_and_slices_are_read_under_their_names() {
        assert_eq!(
            one(&[(GPU, "2")], None).unwrap(),
            Some(Need::Exclusive { gpus: 2 })
        );
        assert_eq!(
            one(&[(SGPU, "3")], None).unwrap(),
            Some(Need::Slices { gpus: 3 })
        );
        // gpu-count concerns shares only
        assert_eq!(
            one(&[(SGPU, "2")], Some("2")).unwrap(),
            Some(Need::Slices { gpus: 2 })
        );
        assert_eq!(one(&[(GPU, "0")], None).unwrap(), None);
        let p = pod(vec![container("c", &[(SGPU, "2")])], None);
        let r = pod_request(&p, DEFAULT_DOMAIN).unwrap();
        assert_eq!(r.device_resource.as_deref(), Some(SGPU));
        assert_eq!(r.mode(), Some(GpuMode::Slice));
        // the whole resource is configurable, and empty leaves it alone
        let p = pod(vec![container("c", &[("example.com/gpu", "1")])], None);
        let names = ResourceNames::new(DEFAULT_DOMAIN, "example.com/gpu");
        let r = pod_request_with(&p, &names).unwrap();
        assert_eq!(r.device_resource.as_deref(), Some("example.com/gpu"));
        assert!(pod_request(&p, DEFAULT_DOMAIN).unwrap().is_empty());
        let p = pod(vec![container("c", &[(GPU, "1")])], None);
        let r = pod_request_with(&p, &ResourceNames::new(DEFAULT_DOMAIN, "")).unwrap();
        assert!(r.is_empty());
        // shares name no device resource
        let p = pod(vec![container("c", &[(CORE, "30"), (MEM, "4")])], None);
        let r = pod_request(&p, DEFAULT_DOMAIN).unwrap();
        assert_eq!((r.mode(), r.device_resource), (Some(GpuMode::Shared), None));
        let e = one(&[(SGPU, "5000")], None).unwrap_err().to_string();
        assert!(e.contains("tencent.com/sgpu 5000 is too large"), "{e}");
    }

    #[test]
    fn one_mode_per_container_and_per_pod() {
        let e = |l: &[(&str, &str)]| one(l, None).unwrap_err().to_string();
        let m = e(&[(GPU, "1"), (SGPU, "1")]);
        assert_eq!(m, "container c: asks for both nvidia.com/gpu and tencent.com/sgpu, two sharing modes; a container uses one (a GPU is locked to the mode that uses it): keep one of them, or move the other to a pod of its own");
        assert!(e(&[(SGPU, "1"), (CORE, "30"), (MEM, "4")])
            .contains("both tencent.com/sgpu and tencent.com/vcuda-core"));
        assert!(e(&[(GPU, "1"), (MEM, "4")])
            .contains("both nvidia.com/gpu and tencent.com/vcuda-memory"));
        // across containers (init containers included)
        let mut p = pod(
            vec![
                container("a", &[(SGPU, "2")]),
                container("b", &[(SGPU, "1")]),
            ],
            None,
        );
        assert_eq!(pod_request(&p, DEFAULT_DOMAIN).unwrap().containers.len(), 2);
        p.spec.init_containers = vec![container("i", &[(CORE, "20"), (MEM, "2")])];
        let m = pod_request(&p, DEFAULT_DOMAIN).unwrap_err().to_string();
        assert!(
            m.starts_with("containers a (tencent.com/sgpu) and i (tencent.com/vcuda-core) ask for two sharing modes")
                && m.contains("split the pod into one pod per mode"),
            "{m}"
        );
        p.spec.init_containers = vec![container("i", &[(SGPU, "1")])];
        let r = pod_request(&p, DEFAULT_DOMAIN).unwrap();
        assert_eq!(r.init_containers[0].need, Need::Slices { gpus: 1 });
    }

    #[test]
    fn requests_alone_count_and_init_containers_are_read() {
        let mut c = container("c", &[]);
        c.resources.requests = [(CORE, "40"), (MEM, "8")]
            .iter()
            .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
            .collect();
        let mut p = pod(vec![c], None);
        p.spec.init_containers = vec![container("init", &[(CORE, "100")])];
        let r = pod_request(&p, DEFAULT_DOMAIN).unwrap();
        assert_eq!(r.containers[0].need.gpus(), 1);
        assert_eq!(r.init_containers[0].name, "init");
        assert_eq!(
            r.init_containers[0].need,
            Need::Whole {
                gpus: 1,
                memory_bytes: 0
            }
        );
    }
}
