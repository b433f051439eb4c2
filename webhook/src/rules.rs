//! What the webhook refuses (pure: a pod, its previous version and who writes it in; a
//! verdict out).
//!
//! **At CREATE** a pod is judged by the rules the extender and the manager apply later:
//! - its request shape, by the extender's own reading ([`vcuda_scheduler::request`]: shares
//!   1–99 or multiples of 100, memory needs cores, a share needs memory, the
//!   `vcuda.io/gpu-count` split divides evenly into shares, one sharing mode per container
//!   and per pod), so the words are the extender's, which are the manager's
//!   (`tests` compares them with vcuda-manager-core's refusals);
//! - its vGPUs (VM pods, [`ResourcePatterns`]): whole numbers, a type some node offers
//!   (when the node list is known), and no container-sharing resource beside them.
//!
//! **At CREATE and UPDATE**, by anyone but vcuda's own service accounts
//! ([`Policy::system_users`]): the pod's `vcuda.io/` annotations other than
//! [`GPU_COUNT_ANNOTATION`] are vcuda's (today [`vcuda_cluster::ASSIGNMENT_ANNOTATION`],
//! which vcuda-scheduler writes through the Binding, a subresource no rule here sees): a pod
//! may not be created with one, nor have one added, changed or removed. `vcuda.io/gpu-count`
//! may be set at creation and never changed (the extender reserved for the count at bind).
//!
//! An UPDATE is never judged by the request shape: a pod created before the webhook was
//! installed must still be updatable (its finalizers removed, say), and the resources of a
//! pod's containers cannot change by an update anyway.

use std::collections::BTreeSet;

use thiserror::Error;
use vcuda_cluster::GPU_COUNT_ANNOTATION;
use vcuda_scheduler::extender::{Container, Pod, Quantity};
use vcuda_scheduler::request::{
    parse_integer_quantity, pod_request_with, RequestError, ResourceNames,
};

/// The annotation prefix vcuda owns on pods.
pub const SYSTEM_PREFIX: &str = "vcuda.io/";

/// The `vcuda.io/` annotations a pod's author may set (at creation only).
pub const USER_ANNOTATIONS: &[&str] = &[GPU_COUNT_ANNOTATION];

/// The service accounts vcuda runs as, unless configured otherwise.
pub const DEFAULT_SYSTEM_USERS: &[&str] = &[
    "system:serviceaccount:vcuda-system:vcuda-scheduler",
    "system:serviceaccount:vcuda-system:vcuda-manager",
];

/// Which resource names are vGPUs: exact names, or prefixes (written with a trailing `*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourcePatterns(Vec<String>);

impl ResourcePatterns {
    /// Patterns as written in the configuration (`tencent.com/vgpu-*`, `nvidia.com/GRID_T4_16Q`).
    pub fn new(patterns: impl IntoIterator<Item = impl Into<String>>) -> ResourcePatterns {
        ResourcePatterns(patterns.into_iter().map(Into::into).collect())
    }

    /// vcuda-manager's own vGPU names under `domain` (`--mdev-naming tencent`).
    pub fn default_for(domain: &str) -> ResourcePatterns {
        ResourcePatterns::new([format!("{domain}/vgpu-*")])
    }

    /// True when `resource` is one of them.
    pub fn matches(&self, resource: &str) -> bool {
        self.0.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => resource.starts_with(prefix) && resource.len() > prefix.len(),
            None => resource == p,
        })
    }

    /// The patterns, as written.
    pub fn as_slice(&self) -> &[String] {
        &self.0
    }
}

/// What the rules depend on besides the pod.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The resource names of the container modes (the extender's `--domain`,
    /// `--whole-resource`).
    pub names: ResourceNames,
    /// Which resources are vGPUs.
    pub vgpu: ResourcePatterns,
    /// Users who may write vcuda's own annotations (vcuda's service accounts).
    pub system_users: Vec<String>,
}

impl Policy {
    /// The defaults: `tencent.com`, `nvidia.com/gpu`, `tencent.com/vgpu-*`, vcuda's two
    /// service accounts.
    pub fn new(domain: &str, whole: &str) -> Policy {
        Policy {
            names: ResourceNames::new(domain, whole),
            vgpu: ResourcePatterns::default_for(domain),
            system_users: DEFAULT_SYSTEM_USERS.iter().map(|s| s.to_string()).collect(),
        }
    }
}

/// The operations judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
}

/// The vGPU resources the cluster's nodes offer, as far as the webhook knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offered<'a> {
    /// Not checked (`--api off`).
    NotChecked,
    /// The node list could not be read (recently enough); the reason, for the warning.
    Unknown(&'a str),
    /// The resources some node has in its capacity.
    Known(&'a BTreeSet<String>),
}

/// Why a pod is refused; every message names the thing and the fix.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Refusal {
    /// The extender's own refusal of the request shape, in its words.
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("annotation {key} is vcuda's own (vcuda-scheduler writes it when it binds the pod; vcuda-manager trusts it): a pod may not be created with it. Remove it from metadata.annotations (the vcuda.io/ annotations a pod may set: {})", USER_ANNOTATIONS.join(", "))]
    SystemAnnotationSet { key: String },
    #[error("annotation {key} is vcuda's own: only vcuda's service accounts may add, change or remove it ({user} may not). Leave it as it is; to place the pod again, delete it and create it anew")]
    SystemAnnotationChanged { key: String, user: String },
    #[error("annotation {GPU_COUNT_ANNOTATION} cannot change once the pod exists ({} → {}): its GPUs were reserved for the count it had. Delete the pod and create it with the count you want", show(.old), show(.new))]
    GpuCountChanged {
        old: Option<String>,
        new: Option<String>,
    },
    #[error("container {container}: {resource} = {value:?} is not a whole number of vGPUs; use an integer such as \"1\"")]
    VgpuNotANumber {
        container: String,
        resource: String,
        value: String,
    },
    #[error("container {container}: {resource} is not a vGPU type any node offers ({}); ask for one of those, or serve this type on a node (vcuda-manager --vm-backends mdev on a node whose GPUs offer it: manager/VM.md)", offered_list(.offered))]
    UnknownVgpu {
        container: String,
        resource: String,
        offered: Vec<String>,
    },
    #[error("containers {vm_container} ({vgpu}) and {other_container} ({other}): a pod with a vGPU runs as a virtual machine, which vcuda's container sharing (vcuda-core, vcuda-memory, sgpu, whole GPUs) does not reach; move {other_container} into a pod of its own")]
    VgpuWithContainerModes {
        vm_container: String,
        vgpu: String,
        other_container: String,
        other: String,
    },
}

fn show(v: &Option<String>) -> String {
    match v {
        Some(v) => format!("{v:?}"),
        None => "none".to_string(),
    }
}

fn offered_list(offered: &[String]) -> String {
    if offered.is_empty() {
        "no node offers a vGPU".to_string()
    } else {
        format!("offered: {}", offered.join(", "))
    }
}

impl Refusal {
    /// A short stable name of the refusal's kind (for logs and tests).
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Request(_) => "request",
            Refusal::SystemAnnotationSet { .. } => "system-annotation-set",
            Refusal::SystemAnnotationChanged { .. } => "system-annotation-changed",
            Refusal::GpuCountChanged { .. } => "gpu-count-changed",
            Refusal::VgpuNotANumber { .. } => "vgpu-not-a-number",
            Refusal::UnknownVgpu { .. } => "unknown-vgpu",
            Refusal::VgpuWithContainerModes { .. } => "vgpu-with-container-modes",
        }
    }

    /// The HTTP status the API server answers with: 403 Forbidden for what the writer may
    /// not do, 422 Unprocessable Entity (Kubernetes' "Invalid") for a request that cannot be
    /// served.
    pub fn code(&self) -> u16 {
        match self {
            Refusal::SystemAnnotationSet { .. }
            | Refusal::SystemAnnotationChanged { .. }
            | Refusal::GpuCountChanged { .. } => 403,
            _ => 422,
        }
    }

    /// The Kubernetes `StatusReason` of [`Refusal::code`].
    pub fn reason(&self) -> &'static str {
        if self.code() == 403 {
            "Forbidden"
        } else {
            "Invalid"
        }
    }
}

/// The webhook's answer about one pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Why it is refused; `None`: allowed.
    pub refusal: Option<Refusal>,
    /// What the writer should know even so (shown by kubectl as `Warning:`).
    pub warnings: Vec<String>,
}

/// Judge `pod` written by `user` (`old`: its previous version, for UPDATE).
pub fn judge(
    policy: &Policy,
    op: Operation,
    user: &str,
    pod: &Pod,
    old: Option<&Pod>,
    offered: Offered<'_>,
) -> Verdict {
    let mut verdict = Verdict::default();
    if let Err(r) = annotations(policy, op, user, pod, old) {
        verdict.refusal = Some(r);
        return verdict;
    }
    if op == Operation::Create {
        if let Err(r) = request(policy, pod, offered, &mut verdict.warnings) {
            verdict.refusal = Some(r);
        }
    }
    verdict
}

fn is_system(key: &str) -> bool {
    key.starts_with(SYSTEM_PREFIX) && !USER_ANNOTATIONS.contains(&key)
}

fn annotations(
    policy: &Policy,
    op: Operation,
    user: &str,
    pod: &Pod,
    old: Option<&Pod>,
) -> Result<(), Refusal> {
    if policy.system_users.iter().any(|u| u == user) {
        return Ok(());
    }
    let new = &pod.metadata.annotations;
    match (op, old) {
        (Operation::Create, _) | (Operation::Update, None) => {
            if let Some(key) = new.keys().find(|k| is_system(k)) {
                return Err(Refusal::SystemAnnotationSet { key: key.clone() });
            }
        }
        (Operation::Update, Some(old)) => {
            let old = &old.metadata.annotations;
            let changed = old
                .iter()
                .filter(|(k, v)| is_system(k) && new.get(*k) != Some(*v))
                .map(|(k, _)| k)
                .chain(new.keys().filter(|k| is_system(k) && !old.contains_key(*k)))
                .next();
            if let Some(key) = changed {
                return Err(Refusal::SystemAnnotationChanged {
                    key: key.clone(),
                    user: user.to_string(),
                });
            }
            let (o, n) = (old.get(GPU_COUNT_ANNOTATION), new.get(GPU_COUNT_ANNOTATION));
            if o != n {
                return Err(Refusal::GpuCountChanged {
                    old: o.cloned(),
                    new: n.cloned(),
                });
            }
        }
    }
    Ok(())
}

/// The first vGPU resource a container asks for, with its quantity.
fn vgpu_of<'c>(policy: &Policy, c: &'c Container) -> Option<(&'c String, &'c Quantity)> {
    c.resources
        .limits
        .iter()
        .chain(&c.resources.requests)
        .find(|(k, _)| policy.vgpu.matches(k))
}

/// The first container-sharing resource a container asks for (non-zero).
fn container_mode_of<'c>(policy: &Policy, c: &'c Container) -> Option<&'c String> {
    let n = &policy.names;
    c.resources
        .limits
        .iter()
        .chain(&c.resources.requests)
        .filter(|(_, q)| parse_integer_quantity(&q.0) != Some(0))
        .map(|(k, _)| k)
        .find(|k| {
            **k == n.core || **k == n.memory || **k == n.slice || n.whole.as_ref() == Some(*k)
        })
}

fn request(
    policy: &Policy,
    pod: &Pod,
    offered: Offered<'_>,
    warnings: &mut Vec<String>,
) -> Result<(), Refusal> {
    let all: Vec<&Container> = pod
        .spec
        .containers
        .iter()
        .chain(&pod.spec.init_containers)
        .collect();
    // vGPUs: whole numbers, of an offered type, nothing of the container modes beside them
    let mut vm: Option<(&String, &String)> = None;
    for c in &all {
        for (resource, q) in c
            .resources
            .limits
            .iter()
            .chain(&c.resources.requests)
            .filter(|(k, _)| policy.vgpu.matches(k))
        {
            if parse_integer_quantity(&q.0).is_none() {
                return Err(Refusal::VgpuNotANumber {
                    container: c.name.clone(),
                    resource: resource.clone(),
                    value: q.0.clone(),
                });
            }
            match offered {
                Offered::Known(known) if !known.contains(resource) => {
                    return Err(Refusal::UnknownVgpu {
                        container: c.name.clone(),
                        resource: resource.clone(),
                        offered: known.iter().cloned().collect(),
                    })
                }
                Offered::Unknown(why) => {
                    let w = format!(
                        "{resource} was not checked against the vGPU types the nodes offer: {why}"
                    );
                    if !warnings.contains(&w) {
                        warnings.push(w);
                    }
                }
                _ => {}
            }
        }
        if vm.is_none() {
            vm = vgpu_of(policy, c).map(|(r, _)| (&c.name, r));
        }
    }
    if let Some((vm_container, vgpu)) = vm {
        if let Some((c, other)) = all
            .iter()
            .find_map(|c| container_mode_of(policy, c).map(|r| (c, r)))
        {
            return Err(Refusal::VgpuWithContainerModes {
                vm_container: vm_container.clone(),
                vgpu: vgpu.clone(),
                other_container: c.name.clone(),
                other: other.clone(),
            });
        }
    }
    pod_request_with(pod, &policy.names)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use vcuda_cluster::ASSIGNMENT_ANNOTATION;
    use vcuda_scheduler::request::container;

    const TENANT: &str = "alice";
    const SCHEDULER: &str = "system:serviceaccount:vcuda-system:vcuda-scheduler";

    fn pod(containers: Vec<Container>, annotations: &[(&str, &str)]) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = "p".into();
        p.metadata.namespace = "default".into();
        p.metadata.annotations = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>();
        p.spec.containers = containers;
        p
    }

    fn create(p: &Pod) -> Verdict {
        judge(
            &Policy::new("tencent.com", "nvidia.com/gpu"),
            Operation::Create,
            TENANT,
            p,
            None,
            Offered::NotChecked,
        )
    }

    fn refusal(v: Verdict) -> Refusal {
        v.refusal.expect("refused")
    }

    #[test]
    fn the_extenders_request_rules_refuse_at_creation_in_its_words() {
        type Pairs<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(Pairs, Pairs, &str)] = &[
            (
                &[("tencent.com/vcuda-core", "150")],
                &[],
                "vcuda-core 150 is neither a share of one GPU (1 to 99) nor whole GPUs (a multiple of 100); request 100 or 200",
            ),
            (
                &[("tencent.com/vcuda-memory", "4")],
                &[],
                "vcuda-memory 4 without vcuda-core; add vcuda-core",
            ),
            (
                &[("tencent.com/vcuda-core", "30")],
                &[],
                "a share of a GPU (vcuda-core 30) needs vcuda-memory too (1 = 256 MiB)",
            ),
            (
                &[("tencent.com/vcuda-core", "50"), ("tencent.com/vcuda-memory", "3")],
                &[(GPU_COUNT_ANNOTATION, "2")],
                "tencent.com/vcuda-memory 3 cannot be split evenly over 2 GPUs",
            ),
            (
                &[("tencent.com/vcuda-core", "50"), ("tencent.com/vcuda-memory", "4")],
                &[(GPU_COUNT_ANNOTATION, "x")],
                "is not a number from 1 to 16",
            ),
            (
                &[("tencent.com/vcuda-core", "50"), ("tencent.com/vcuda-memory", "4"), ("nvidia.com/gpu", "1")],
                &[],
                "two sharing modes; a container uses one",
            ),
            (
                &[("tencent.com/vcuda-core", "5.5")],
                &[],
                "is not a whole number",
            ),
        ];
        for (limits, ann, words) in cases {
            let r = refusal(create(&pod(vec![container("c", limits)], ann)));
            assert_eq!(r.kind(), "request", "{r}");
            assert_eq!(r.code(), 422);
            assert!(r.to_string().contains(words), "{limits:?}: {r}");
        }
    }

    #[test]
    fn two_modes_in_one_pod_are_refused_naming_both_containers() {
        let p = pod(
            vec![
                container(
                    "a",
                    &[
                        ("tencent.com/vcuda-core", "50"),
                        ("tencent.com/vcuda-memory", "4"),
                    ],
                ),
                container("b", &[("tencent.com/sgpu", "1")]),
            ],
            &[],
        );
        let r = refusal(create(&p)).to_string();
        assert!(
            r.contains("containers a (tencent.com/vcuda-core) and b (tencent.com/sgpu)"),
            "{r}"
        );
    }

    #[test]
    fn valid_requests_and_pods_asking_for_nothing_pass() {
        for limits in [
            &[
                ("tencent.com/vcuda-core", "50"),
                ("tencent.com/vcuda-memory", "4"),
            ][..],
            &[("tencent.com/vcuda-core", "200")],
            &[("nvidia.com/gpu", "2")],
            &[("tencent.com/sgpu", "1")],
            &[("cpu", "2")],
            &[],
        ] {
            let v = create(&pod(vec![container("c", limits)], &[]));
            assert_eq!(v, Verdict::default(), "{limits:?}");
        }
        let split = pod(
            vec![container(
                "c",
                &[
                    ("tencent.com/vcuda-core", "100"),
                    ("tencent.com/vcuda-memory", "8"),
                ],
            )],
            &[(GPU_COUNT_ANNOTATION, "2")],
        );
        assert_eq!(create(&split), Verdict::default());
    }

    #[test]
    fn another_domain_is_read_as_configured() {
        let policy = Policy::new("example.com", "nvidia.com/gpu");
        let p = pod(
            vec![container("c", &[("example.com/vcuda-core", "150")])],
            &[],
        );
        let v = judge(
            &policy,
            Operation::Create,
            TENANT,
            &p,
            None,
            Offered::NotChecked,
        );
        assert!(refusal(v).to_string().contains("vcuda-core 150"));
        // tencent.com is then not vcuda's: not judged
        let p = pod(
            vec![container("c", &[("tencent.com/vcuda-core", "150")])],
            &[],
        );
        let v = judge(
            &policy,
            Operation::Create,
            TENANT,
            &p,
            None,
            Offered::NotChecked,
        );
        assert_eq!(v, Verdict::default());
    }

    #[test]
    fn a_tenant_cannot_create_a_pod_with_vcudas_own_annotations() {
        for key in [
            ASSIGNMENT_ANNOTATION,
            "vcuda.io/reservations",
            "vcuda.io/anything",
        ] {
            let p = pod(vec![container("c", &[("cpu", "1")])], &[(key, "{}")]);
            let r = refusal(create(&p));
            assert_eq!((r.kind(), r.code()), ("system-annotation-set", 403));
            assert!(
                r.to_string().contains(key) && r.to_string().contains("vcuda.io/gpu-count"),
                "{r}"
            );
        }
        // the scheduler may (it never needs to: the Binding carries it)
        let p = pod(vec![], &[(ASSIGNMENT_ANNOTATION, "{}")]);
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let v = judge(
            &policy,
            Operation::Create,
            SCHEDULER,
            &p,
            None,
            Offered::NotChecked,
        );
        assert_eq!(v, Verdict::default());
    }

    #[test]
    fn a_tenant_cannot_add_change_or_remove_them_later_nor_change_the_gpu_count() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let bound = pod(
            vec![],
            &[(ASSIGNMENT_ANNOTATION, "A"), (GPU_COUNT_ANNOTATION, "2")],
        );
        let update = |new: &Pod, user: &str| {
            judge(
                &policy,
                Operation::Update,
                user,
                new,
                Some(&bound),
                Offered::NotChecked,
            )
        };
        let edited = pod(
            vec![],
            &[(ASSIGNMENT_ANNOTATION, "B"), (GPU_COUNT_ANNOTATION, "2")],
        );
        let removed = pod(vec![], &[(GPU_COUNT_ANNOTATION, "2")]);
        let added = pod(
            vec![],
            &[
                (ASSIGNMENT_ANNOTATION, "A"),
                (GPU_COUNT_ANNOTATION, "2"),
                ("vcuda.io/x", "1"),
            ],
        );
        for new in [&edited, &removed, &added] {
            let r = refusal(update(new, TENANT));
            assert_eq!(r.kind(), "system-annotation-changed", "{r}");
            assert!(r.to_string().contains("alice may not"), "{r}");
            assert_eq!(update(new, SCHEDULER), Verdict::default());
        }
        let recounted = pod(
            vec![],
            &[(ASSIGNMENT_ANNOTATION, "A"), (GPU_COUNT_ANNOTATION, "4")],
        );
        let r = refusal(update(&recounted, TENANT));
        assert_eq!(r.kind(), "gpu-count-changed");
        assert!(r.to_string().contains("\"2\" → \"4\""), "{r}");
        // anything else may change; the request shape is not judged on update
        let mut labelled = bound.clone();
        labelled.metadata.labels.insert("team".into(), "a".into());
        labelled
            .metadata
            .annotations
            .insert("example.com/x".into(), "1".into());
        labelled.spec.containers = vec![container("c", &[("tencent.com/vcuda-core", "150")])];
        assert_eq!(update(&labelled, TENANT), Verdict::default());
    }

    #[test]
    fn vgpus_are_whole_numbers_of_offered_types_alone_in_their_pod() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let offered: BTreeSet<String> = ["tencent.com/vgpu-492".to_string()].into();
        let judge_vm = |limits: &[(&str, &str)], offered: Offered| {
            let p = pod(vec![container("vm", limits)], &[]);
            judge(&policy, Operation::Create, TENANT, &p, None, offered)
        };
        let ok = judge_vm(&[("tencent.com/vgpu-492", "1")], Offered::Known(&offered));
        assert_eq!(ok, Verdict::default());
        let r = refusal(judge_vm(
            &[("tencent.com/vgpu-999", "1")],
            Offered::Known(&offered),
        ));
        assert_eq!(r.kind(), "unknown-vgpu");
        assert!(r.to_string().contains("tencent.com/vgpu-999 is not a vGPU type any node offers (offered: tencent.com/vgpu-492)"), "{r}");
        let none = BTreeSet::new();
        let r = refusal(judge_vm(
            &[("tencent.com/vgpu-492", "1")],
            Offered::Known(&none),
        ));
        assert!(r.to_string().contains("no node offers a vGPU"), "{r}");
        let r = refusal(judge_vm(
            &[("tencent.com/vgpu-492", "0.5")],
            Offered::Known(&offered),
        ));
        assert_eq!(r.kind(), "vgpu-not-a-number");
        let r = refusal(judge_vm(
            &[
                ("tencent.com/vgpu-492", "1"),
                ("tencent.com/vcuda-core", "50"),
            ],
            Offered::Known(&offered),
        ));
        assert_eq!(r.kind(), "vgpu-with-container-modes");
        // not known: allowed, with a warning saying why it was not checked
        let v = judge_vm(
            &[("tencent.com/vgpu-999", "1")],
            Offered::Unknown("the API server did not answer"),
        );
        assert_eq!(v.refusal, None);
        assert_eq!(v.warnings, vec!["tencent.com/vgpu-999 was not checked against the vGPU types the nodes offer: the API server did not answer".to_string()]);
        // --api off: nothing checked, nothing said
        assert_eq!(
            judge_vm(&[("tencent.com/vgpu-999", "1")], Offered::NotChecked),
            Verdict::default()
        );
    }

    #[test]
    fn a_vgpu_beside_a_share_in_another_container_is_refused() {
        let policy = Policy::new("tencent.com", "nvidia.com/gpu");
        let p = pod(
            vec![
                container("vm", &[("tencent.com/vgpu-492", "1")]),
                container(
                    "side",
                    &[
                        ("tencent.com/vcuda-core", "10"),
                        ("tencent.com/vcuda-memory", "1"),
                    ],
                ),
            ],
            &[],
        );
        let r = refusal(judge(
            &policy,
            Operation::Create,
            TENANT,
            &p,
            None,
            Offered::NotChecked,
        ));
        assert!(
            r.to_string()
                .contains("containers vm (tencent.com/vgpu-492) and side (tencent.com/vcuda-core)"),
            "{r}"
        );
    }

    #[test]
    fn patterns_match_exact_names_and_prefixes() {
        let p = ResourcePatterns::new(["tencent.com/vgpu-*", "nvidia.com/GRID_T4_16Q"]);
        assert!(p.matches("tencent.com/vgpu-492"));
        assert!(!p.matches("tencent.com/vgpu-"));
        assert!(!p.matches("tencent.com/vcuda-core"));
        assert!(p.matches("nvidia.com/GRID_T4_16Q"));
        assert!(!p.matches("nvidia.com/GRID_T4_16Q2"));
    }
}
