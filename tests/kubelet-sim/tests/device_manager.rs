//! kubelet-sim against a scripted fake device plugin. Each test names the kubelet.md fact
//! (shared/reference/kubelet.md, §N) it pins down.

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::sync::Arc;

use common::*;
use kubelet_sim::proto::deviceplugin as dp;
use kubelet_sim::proto::podresources as pr;
use kubelet_sim::{AdmitRequest, ContainerRequest};
use prost::Message;

fn pod(name: &str, containers: &[(&str, &[(&str, u64)])]) -> AdmitRequest {
    AdmitRequest::new(
        name,
        containers
            .iter()
            .map(|(c, r)| ContainerRequest::new(c, r))
            .collect(),
    )
}

fn allocate_calls(rpcs: &[(String, Call)]) -> usize {
    rpcs.iter()
        .filter(|(_, c)| matches!(c, Call::Allocate(_)))
        .count()
}

/// §1.2–1.5: Register connects back inside the call (GetDevicePluginOptions has happened when
/// Register returns), then ListAndWatch is opened and read; the options come from
/// GetDevicePluginOptions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_connects_back_inside_the_call_then_reads_list_and_watch() {
    let env = Env::new();
    let p = env.plugin(CORE, "core.sock", Script::with_options(true, false));
    p.set_devices(devs("c", 3));
    assert!(env.recorder.all().is_empty());
    p.register(&env.sim.kubelet_socket()).await.unwrap();
    assert_eq!(
        env.recorder.of(CORE).first(),
        Some(&Call::GetOptions),
        "GetDevicePluginOptions must be called inside Register"
    );
    let r = env.sim.wait_registered(CORE, T).await.unwrap();
    assert_eq!(
        env.recorder.of(CORE),
        vec![Call::GetOptions, Call::ListAndWatch]
    );
    assert_eq!(r.state, "registered");
    assert_eq!(r.endpoint.as_deref(), Some("core.sock"));
    let o = r.options.unwrap();
    assert!(o.pre_start_required && !o.get_preferred_allocation_available);
    assert_eq!(r.devices, ids(&["c00", "c01", "c02"]));
    assert_eq!(r.healthy, r.devices);
}

/// §3: capacity and allocatable follow each ListAndWatch message; `wait_capacity` (the
/// control socket's `wait-capacity`) returns once they match, counts a resource never
/// registered as 0, and on timeout says what it last saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_capacity_follows_list_and_watch_and_reports_what_it_saw() {
    let env = Env::new();
    let p = env
        .registered(CORE, "core.sock", Script::default(), devs("c", 4))
        .await;
    let want = |n: usize| [(CORE.to_string(), n)].into();
    let none = std::collections::BTreeMap::new();
    let s = env.sim.wait_capacity(&want(4), &want(4), T).await.unwrap();
    assert_eq!(s.resource(CORE).unwrap().capacity, 4);
    let (two, one) = (want(2), want(1));
    let waiter = env.sim.wait_capacity(&two, &one, T);
    p.set_devices(vec![dev("c00", true), dev("c01", false)]);
    let s = waiter.await.unwrap();
    let r = s.resource(CORE).unwrap();
    assert_eq!((r.capacity, r.allocatable), (2, 1));
    let absent = [("example.com/never".to_string(), 0)].into();
    env.sim.wait_capacity(&absent, &none, T).await.unwrap();
    let e = env
        .sim
        .wait_capacity(&want(3), &none, std::time::Duration::from_millis(200))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("capacity {{{CORE}=3}}; last seen {{{CORE}=2}}")),
        "{e}"
    );
}

/// §1.3–1.4: unsupported version and invalid resource names are rejected before any
/// connect-back; a GetDevicePluginOptions error or an unreachable endpoint fails Register.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_rejects_bad_requests_and_fails_when_the_connect_back_fails() {
    let env = Env::with(|c| c.dial_timeout = std::time::Duration::from_millis(300));
    let kubelet = env.sim.kubelet_socket();
    let p = env.plugin(CORE, "core.sock", Script::default());
    let opts = dp::DevicePluginOptions::default();

    let e = p
        .register_as(&kubelet, "v1alpha", CORE, opts)
        .await
        .unwrap_err();
    assert!(e.message().contains("not supported"), "{e:?}");
    for bad in [
        "vcuda-core",
        "kubernetes.io/gpu",
        "requests.example.com/gpu",
        "Tencent.com/x",
    ] {
        let e = p
            .register_as(&kubelet, "v1beta1", bad, opts)
            .await
            .unwrap_err();
        assert!(e.message().contains("is invalid"), "{bad}: {e:?}");
    }
    assert!(
        env.recorder.all().is_empty(),
        "no connect-back for a rejected request"
    );

    p.script(|s| s.fail_options = true);
    let e = p.register(&kubelet).await.unwrap_err();
    assert!(
        e.message().contains("failed to get device plugin options"),
        "{e:?}"
    );
    assert_eq!(env.recorder.of(CORE), vec![Call::GetOptions]);

    let ghost = env.plugin(MEM, "ghost.sock", Script::default());
    let mut ghost_stopped = ghost;
    ghost_stopped.stop().await;
    std::fs::remove_file(&ghost_stopped.socket).ok();
    let e = ghost_stopped.register(&kubelet).await.unwrap_err();
    assert!(
        e.message().contains("failed to dial device plugin"),
        "{e:?}"
    );
    assert!(
        env.sim.status().resources.is_empty(),
        "{:?}",
        env.sim.status()
    );
}

/// §1.6: registering a resource again replaces the endpoint; the newest wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_again_replaces_the_endpoint() {
    let env = Env::new();
    let mut old = env
        .registered(CORE, "core-old.sock", Script::default(), devs("o", 2))
        .await;
    let new = env.plugin(CORE, "core-new.sock", Script::default());
    new.set_devices(devs("n", 3));
    new.register(&env.sim.kubelet_socket()).await.unwrap();
    let s = env
        .sim
        .wait_for(T, "new device list", |s| {
            s.resource(CORE)
                .is_some_and(|r| r.devices == ids(&["n00", "n01", "n02"]))
        })
        .await
        .unwrap();
    let r = s.resource(CORE).unwrap();
    assert_eq!(r.endpoint.as_deref(), Some("core-new.sock"));
    assert_eq!(r.registrations, 2);

    // The old plugin going away does not take the new endpoint down in kubelet-sim (and is
    // flagged: a real kubelet would mark the resource unhealthy here).
    old.stop().await;
    let s = env
        .sim
        .wait_for(T, "warning", |s| !s.warnings.is_empty())
        .await
        .unwrap();
    assert!(
        s.warnings[0].contains("replaced endpoint"),
        "{:?}",
        s.warnings
    );
    let r = s.resource(CORE).unwrap();
    assert_eq!((r.state.as_str(), r.healthy.len()), ("registered", 3));
    let a = env
        .sim
        .admit(pod("p", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert!(a.admitted);
    assert_eq!(env.recorder.allocates(CORE), vec![vec![ids(&["n00"])]]);
}

/// §3: each ListAndWatch message is the complete list (missing devices are deleted);
/// capacity = all, allocatable = healthy; unhealthy devices are not allocated; sending
/// Healthy again restores a device. The checkpoint's RegisteredDevices holds healthy IDs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_watch_messages_are_complete_lists_and_health_changes_apply() {
    let env = Env::new();
    let p = env
        .registered(CORE, "core.sock", Script::default(), devs("c", 3))
        .await;

    p.set_devices(vec![dev("c00", true), dev("c01", false)]);
    let s = env
        .sim
        .wait_for(T, "second list", |s| {
            s.resource(CORE).unwrap().devices.len() == 2
        })
        .await
        .unwrap();
    let r = s.resource(CORE).unwrap();
    assert_eq!(
        r.devices,
        ids(&["c00", "c01"]),
        "c02 was missing from the list: deleted"
    );
    assert_eq!(r.healthy, ids(&["c00"]));
    assert_eq!((r.capacity, r.allocatable), (2, 1));
    let cp: serde_json::Value =
        serde_json::from_slice(&std::fs::read(env.sim.checkpoint_path()).unwrap()).unwrap();
    assert_eq!(
        cp["Data"]["RegisteredDevices"][CORE],
        serde_json::json!(["c00"])
    );

    let a = env
        .sim
        .admit(pod("p1", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert_eq!(a.containers[0].devices[CORE], ids(&["c00"]));
    let b = env
        .sim
        .admit(pod("p2", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert!(!b.admitted, "the only other device is unhealthy");
    let rej = b.rejection.unwrap();
    assert_eq!(rej.reason, "UnexpectedAdmissionError");
    assert!(
        rej.message
            .contains("requested number of devices unavailable for tencent.com/vcuda-core. Requested: 1, Available: 0"),
        "{}",
        rej.message
    );
    assert_eq!(
        env.recorder.allocates(CORE).len(),
        1,
        "no Allocate for a pod that cannot fit"
    );

    p.set_devices(vec![dev("c00", true), dev("c01", true)]);
    env.sim
        .wait_for(T, "recovery", |s| {
            s.resource(CORE).unwrap().healthy.len() == 2
        })
        .await
        .unwrap();
    let c = env
        .sim
        .admit(pod("p2", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert_eq!(
        c.containers[0].devices[CORE],
        ids(&["c01"]),
        "recovered device is allocatable"
    );
}

/// §3: when the stream ends every device of the resource becomes unhealthy (capacity stays,
/// allocatable 0); running pods keep their devices; new pods are rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_end_marks_every_device_unhealthy() {
    let env = Env::new();
    let mut p = env
        .registered(CORE, "core.sock", Script::default(), devs("c", 2))
        .await;
    assert!(
        env.sim
            .admit(pod("p1", &[("main", &[(CORE, 1)])]))
            .await
            .unwrap()
            .admitted
    );
    p.stop().await;
    let s = env
        .sim
        .wait_for(T, "stream end", |s| {
            s.resource(CORE).unwrap().state == "stopped"
        })
        .await
        .unwrap();
    let r = s.resource(CORE).unwrap();
    assert_eq!((r.capacity, r.allocatable), (2, 0));
    assert!(r.healthy.is_empty());
    assert_eq!(
        s.pod("default", "p1").unwrap().containers[0].devices[CORE],
        ids(&["c00"])
    );
    let b = env
        .sim
        .admit(pod("p2", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert!(!b.admitted);
    assert!(b
        .rejection
        .unwrap()
        .message
        .contains("no healthy devices present"),);
}

/// §5: GetPreferredAllocation gets (available, must_include, size); its answer is a hint,
/// intersected with the available set, and the kubelet fills any shortfall itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_hint_is_used_and_the_shortfall_filled() {
    let env = Env::new();
    let mut script = Script::with_options(false, true);
    script.hint = Some(ids(&["c04", "bogus", "c01"]));
    let p = env
        .registered(CORE, "core.sock", script, devs("c", 6))
        .await;

    let a = env
        .sim
        .admit(pod("p1", &[("main", &[(CORE, 3)])]))
        .await
        .unwrap();
    assert!(a.admitted);
    assert_eq!(
        env.recorder.rpcs(),
        vec![
            (
                CORE.to_string(),
                Call::Preferred {
                    available: ids(&["c00", "c01", "c02", "c03", "c04", "c05"]),
                    must_include: vec![],
                    size: 3
                }
            ),
            (
                CORE.to_string(),
                Call::Allocate(vec![ids(&["c04", "c01", "c00"])])
            ),
        ]
    );
    assert_eq!(a.containers[0].devices[CORE], ids(&["c00", "c01", "c04"]));

    // A hint naming an allocated device is ignored for that device.
    env.recorder.clear();
    p.script(|s| s.hint = Some(ids(&["c04", "c05"])));
    let b = env
        .sim
        .admit(pod("p2", &[("main", &[(CORE, 2)])]))
        .await
        .unwrap();
    assert_eq!(
        env.recorder.rpcs()[0].1,
        Call::Preferred {
            available: ids(&["c02", "c03", "c05"]),
            must_include: vec![],
            size: 2
        }
    );
    assert_eq!(b.containers[0].devices[CORE], ids(&["c02", "c05"]));
}

/// §4: Allocate is called once per resource per container, each RPC with exactly one
/// ContainerAllocateRequest, containers in order; the responses of a container's resources
/// are merged with the first writer winning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_allocate_per_resource_per_container_with_one_request_each() {
    let env = Env::new();
    let _core = env
        .registered(
            CORE,
            "core.sock",
            Script::with_options(false, true),
            devs("c", 10),
        )
        .await;
    let _mem = env
        .registered(MEM, "mem.sock", Script::default(), devs("m", 10))
        .await;

    let a = env
        .sim
        .admit(pod(
            "p",
            &[("a", &[(CORE, 2), (MEM, 1)]), ("b", &[(MEM, 2), (CORE, 1)])],
        ))
        .await
        .unwrap();
    assert!(a.admitted);
    let kinds: Vec<(String, &str, usize)> = env
        .recorder
        .rpcs()
        .iter()
        .map(|(r, c)| match c {
            Call::Preferred { size, .. } => (r.clone(), "preferred", *size as usize),
            Call::Allocate(reqs) => {
                assert_eq!(reqs.len(), 1, "one ContainerAllocateRequest per Allocate");
                (r.clone(), "allocate", reqs[0].len())
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    let k = |r: &str, what: &'static str, n: usize| (r.to_string(), what, n);
    assert_eq!(
        kinds,
        vec![
            k(CORE, "preferred", 2),
            k(CORE, "allocate", 2),
            k(MEM, "allocate", 1),
            k(MEM, "allocate", 2),
            k(CORE, "preferred", 1),
            k(CORE, "allocate", 1),
        ]
    );
    let (ca, cb) = (&a.containers[0], &a.containers[1]);
    assert_eq!(ca.devices[CORE].len() + cb.devices[CORE].len(), 3);
    let all_core: BTreeSet<_> = ca.devices[CORE].iter().chain(&cb.devices[CORE]).collect();
    assert_eq!(all_core.len(), 3, "containers get distinct devices");
    let ra = &ca.allocate_response;
    assert_eq!(ra.envs["FAKE_VCUDA_CORE"], ca.devices[CORE].join(","));
    assert_eq!(ra.envs["FAKE_VCUDA_MEMORY"], ca.devices[MEM].join(","));
    assert_eq!(
        ra.envs["FAKE_SHARED"], CORE,
        "first writer (core) wins in container a"
    );
    assert_eq!(
        cb.allocate_response.envs["FAKE_SHARED"], MEM,
        "mem came first in b"
    );
    assert_eq!(
        ra.mounts
            .iter()
            .filter(|m| m.container_path == "/fake/shared")
            .count(),
        1
    );
    assert_eq!(ra.devices.len(), 1);
    assert_eq!(ra.devices[0].host_path, "/dev/fake-vcuda_core");
    assert_eq!(ra.annotations.len(), 2);
    assert!(
        ra.conflicts.iter().any(|c| c.contains("FAKE_SHARED")),
        "{:?}",
        ra.conflicts
    );
}

/// §6: PreStartContainer comes after Allocate with the container's devices, and again at
/// every (re)start, with no new Allocate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_start_after_allocate_and_again_on_restart_without_allocate() {
    let env = Env::new();
    let _p = env
        .registered(
            CORE,
            "core.sock",
            Script::with_options(true, false),
            devs("c", 4),
        )
        .await;
    let a = env
        .sim
        .admit(pod("p", &[("main", &[(CORE, 2)])]))
        .await
        .unwrap();
    let start = a.containers[0].start.clone().unwrap();
    assert!(start.started, "{start:?}");
    assert_eq!(start.pre_start_called, vec![CORE.to_string()]);
    let d = a.containers[0].devices[CORE].clone();
    assert_eq!(
        env.recorder.rpcs(),
        vec![
            (CORE.to_string(), Call::Allocate(vec![d.clone()])),
            (CORE.to_string(), Call::PreStart(d.clone())),
        ]
    );
    let again = env
        .sim
        .start_container("default", "p", "main")
        .await
        .unwrap();
    assert!(again.started);
    assert_eq!(again.starts, 2);
    let rpcs = env.recorder.rpcs();
    assert_eq!(rpcs.len(), 3);
    assert_eq!(rpcs[2], (CORE.to_string(), Call::PreStart(d)));
    assert_eq!(
        allocate_calls(&rpcs),
        1,
        "a container restart reuses the allocation"
    );

    // --no-start: admission alone makes no PreStartContainer call.
    let b = env
        .sim
        .admit(pod("q", &[("main", &[(CORE, 1)])]).no_start())
        .await
        .unwrap();
    assert!(b.containers[0].start.is_none());
    assert!(matches!(
        env.recorder.rpcs().last(),
        Some((_, Call::Allocate(_)))
    ));
}

/// §6: a PreStartContainer error fails the container start, not the admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_start_error_fails_the_start_not_the_admission() {
    let env = Env::new();
    let mut script = Script::with_options(true, false);
    script.fail_pre_start = Some("device reset failed".into());
    let p = env
        .registered(CORE, "core.sock", script, devs("c", 2))
        .await;
    let a = env
        .sim
        .admit(pod("p", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert!(a.admitted);
    let start = a.containers[0].start.clone().unwrap();
    assert!(!start.started);
    let err = start.error.unwrap();
    assert!(
        err.contains("PreStartContainer rpc failed") && err.contains("device reset failed"),
        "{err}"
    );
    let s = env.sim.status();
    let c = &s.pod("default", "p").unwrap().containers[0];
    assert_eq!(c.devices[CORE], ids(&["c00"]), "the allocation stays");
    assert_eq!(c.starts, 0);
    assert!(c.last_start_error.is_some());

    p.script(|s| s.fail_pre_start = None);
    let again = env
        .sim
        .start_container("default", "p", "main")
        .await
        .unwrap();
    assert!(again.started && again.starts == 1, "{again:?}");
}

/// §4: an Allocate error fails the pod with UnexpectedAdmissionError and frees what it took;
/// PodResources no longer lists it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_error_fails_the_pod_and_frees_its_devices() {
    let env = Env::new();
    let _core = env
        .registered(CORE, "core.sock", Script::default(), devs("c", 4))
        .await;
    let script = Script {
        fail_allocate: Some("GPU fell off the bus".into()),
        ..Default::default()
    };
    let mem = env.registered(MEM, "mem.sock", script, devs("m", 4)).await;

    let a = env
        .sim
        .admit(pod("p", &[("main", &[(CORE, 2), (MEM, 1)])]))
        .await
        .unwrap();
    assert!(!a.admitted);
    let rej = a.rejection.unwrap();
    assert_eq!(rej.reason, "UnexpectedAdmissionError");
    assert!(
        rej.message.starts_with(
            "Allocate failed due to rpc error: code = Internal desc = GPU fell off the bus"
        ),
        "{}",
        rej.message
    );
    let s = env.sim.status();
    assert!(s.pods.is_empty());
    assert!(
        s.resource(CORE).unwrap().allocated.is_empty(),
        "core devices freed"
    );
    let list = env
        .pod_resources()
        .await
        .list(pr::ListPodResourcesRequest {})
        .await
        .unwrap();
    assert!(list.into_inner().pod_resources.is_empty());

    mem.script(|s| s.fail_allocate = None);
    let b = env
        .sim
        .admit(pod("p", &[("main", &[(CORE, 2), (MEM, 1)])]))
        .await
        .unwrap();
    assert!(b.admitted);
    assert_eq!(
        b.containers[0].devices[CORE],
        ids(&["c00", "c01"]),
        "the freed devices again"
    );
}

/// Pod deletion frees the devices; PodResources stops listing the pod at once; the
/// checkpoint keeps its entries until the next write (§9: entries linger).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_pod_frees_its_devices() {
    let env = Env::new();
    let _p = env
        .registered(CORE, "core.sock", Script::default(), devs("c", 1))
        .await;
    let a = env
        .sim
        .admit(pod("p1", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    env.sim.delete("default", "p1").await.unwrap();
    assert!(env.sim.delete("default", "p1").await.is_err());
    let cp = std::fs::read_to_string(env.sim.checkpoint_path()).unwrap();
    assert!(cp.contains(&a.uid), "entries linger until the next write");
    let list = env
        .pod_resources()
        .await
        .list(pr::ListPodResourcesRequest {})
        .await
        .unwrap();
    assert!(list.into_inner().pod_resources.is_empty());
    let b = env
        .sim
        .admit(pod("p2", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert_eq!(b.containers[0].devices[CORE], ids(&["c00"]));
    let cp = std::fs::read_to_string(env.sim.checkpoint_path()).unwrap();
    assert!(!cp.contains(&a.uid) && cp.contains(&b.uid));
}

/// §8: List (pods, containers, one ContainerDevices per device and NUMA node), Get, and
/// GetAllocatableResources (healthy devices only, not minus allocations).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_resources_list_get_and_allocatable() {
    let env = Env::new();
    let _core = env
        .registered(
            CORE,
            "core.sock",
            Script::default(),
            vec![
                dev_numa("c0", 0),
                dev_numa("c1", 1),
                dev("c2", true),
                dev("c3", false),
            ],
        )
        .await;
    let _mem = env
        .registered(MEM, "mem.sock", Script::default(), devs("m", 2))
        .await;
    let a = env
        .sim
        .admit(pod(
            "p1",
            &[("main", &[(CORE, 2), (MEM, 1)]), ("side", &[])],
        ))
        .await
        .unwrap();
    assert!(a.admitted);

    let cd = |r: &str, id: &str, numa: Option<i64>| pr::ContainerDevices {
        resource_name: r.to_string(),
        device_ids: vec![id.to_string()],
        topology: numa.map(|n| pr::TopologyInfo {
            nodes: vec![pr::NumaNode { id: n }],
        }),
    };
    let expected = pr::PodResources {
        name: "p1".into(),
        namespace: "default".into(),
        containers: vec![
            pr::ContainerResources {
                name: "main".into(),
                devices: vec![
                    cd(CORE, "c0", Some(0)),
                    cd(CORE, "c1", Some(1)),
                    cd(MEM, "m00", None),
                ],
                ..Default::default()
            },
            pr::ContainerResources {
                name: "side".into(),
                ..Default::default()
            },
        ],
    };
    let mut client = env.pod_resources().await;
    let list = client
        .list(pr::ListPodResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.pod_resources, vec![expected.clone()]);
    let get = client
        .get(pr::GetPodResourcesRequest {
            pod_name: "p1".into(),
            pod_namespace: "default".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(get.pod_resources, Some(expected));
    let e = client
        .get(pr::GetPodResourcesRequest {
            pod_name: "nope".into(),
            pod_namespace: "default".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.message(), "pod nope in namespace default not found");

    let alloc = client
        .get_allocatable_resources(pr::AllocatableResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        alloc.devices,
        vec![
            cd(CORE, "c0", Some(0)),
            cd(CORE, "c1", Some(1)),
            cd(CORE, "c2", None),
            cd(MEM, "m00", None),
            cd(MEM, "m01", None),
        ],
        "healthy devices, allocated ones included, unhealthy c3 excluded"
    );
}

/// §8 (verify items): a container's devices are absent from PodResources while its Allocate
/// runs (the pod itself is listed), and present by PreStartContainer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_resources_shows_devices_only_after_allocate_returned() {
    let env = Env::new();
    let (gate_a, mut entered_a) = Gate::new();
    let (gate_p, mut entered_p) = Gate::new();
    let mut script = Script::with_options(true, false);
    script.gate_allocate = Some(gate_a.clone());
    script.gate_pre_start = Some(gate_p.clone());
    let _p = env
        .registered(CORE, "core.sock", script, devs("c", 2))
        .await;
    let sim = Arc::new(env.sim);
    let admit = tokio::spawn({
        let sim = sim.clone();
        async move { sim.admit(pod("p", &[("main", &[(CORE, 1)])])).await }
    });
    let mut client = pr::pod_resources_lister_client::PodResourcesListerClient::new(
        kubelet_sim::grpc::connect_unix(&env.pod_resources)
            .await
            .unwrap(),
    );
    entered_a.recv().await.unwrap();
    let during = client
        .list(pr::ListPodResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        during.pod_resources.len(),
        1,
        "the pod is listed during admission"
    );
    assert!(during.pod_resources[0].containers[0].devices.is_empty());
    gate_a.release.add_permits(1);

    entered_p.recv().await.unwrap();
    let at_pre_start = client
        .list(pr::ListPodResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        at_pre_start.pod_resources[0].containers[0].devices[0].device_ids,
        ids(&["c00"])
    );
    gate_p.release.add_permits(1);
    assert!(admit.await.unwrap().unwrap().admitted);
}

/// §2: a kubelet restart deletes every socket in the plugin directory (not the checkpoint,
/// not other files), re-creates kubelet.sock; resources read 0 healthy devices and have no
/// options until the plugin registers again; running pods keep their allocations and get
/// no new Allocate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_keeps_pods_and_waits_for_re_registration() {
    let env = Env::new();
    let mut p = env
        .registered(
            CORE,
            "core.sock",
            Script::with_options(true, false),
            devs("c", 4),
        )
        .await;
    let a = env
        .sim
        .admit(pod("p1", &[("main", &[(CORE, 2)])]))
        .await
        .unwrap();
    let held = a.containers[0].devices[CORE].clone();
    std::fs::write(env.plugin_dir.join("notes.txt"), "keep me").unwrap();
    std::fs::create_dir(env.plugin_dir.join("subdir")).unwrap();
    let kubelet = env.sim.kubelet_socket();
    // A hard link elsewhere keeps the old inode alive, so a re-created socket has another.
    std::fs::hard_link(&kubelet, env.dir.path().join("old-kubelet.sock")).unwrap();
    let before = std::fs::metadata(&kubelet).unwrap().ino();

    env.sim.restart().await.unwrap();
    assert!(!p.socket.exists(), "the plugin's socket is deleted");
    let m = std::fs::metadata(&kubelet).unwrap();
    assert!(
        m.file_type().is_socket() && m.ino() != before,
        "kubelet.sock re-created"
    );
    assert!(env.sim.checkpoint_path().exists(), "the checkpoint is kept");
    assert!(env.plugin_dir.join("notes.txt").exists() && env.plugin_dir.join("subdir").is_dir());

    let s = env.sim.status();
    let r = s.resource(CORE).unwrap();
    assert_eq!(
        (r.state.as_str(), r.healthy.len(), r.options),
        ("stopped", 0, None)
    );
    assert_eq!(
        s.pod("default", "p1").unwrap().containers[0].devices[CORE],
        held
    );
    let b = env
        .sim
        .admit(pod("p2", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert!(!b.admitted, "no healthy devices until the plugin is back");
    // Options are unknown after a restart: the kubelet skips PreStartContainer.
    let early = env
        .sim
        .start_container("default", "p1", "main")
        .await
        .unwrap();
    assert!(
        early.started && early.pre_start_called.is_empty(),
        "{early:?}"
    );

    // The plugin notices, serves again and re-registers.
    p.restart().await;
    p.register(&kubelet).await.unwrap();
    env.sim.wait_registered(CORE, T).await.unwrap();
    let s = env.sim.status();
    assert_eq!(
        s.pod("default", "p1").unwrap().containers[0].devices[CORE],
        held
    );
    assert_eq!(s.resource(CORE).unwrap().allocated, held);
    assert_eq!(
        env.recorder.allocates(CORE).len(),
        1,
        "no Allocate for running pods"
    );
    let restarted = env
        .sim
        .start_container("default", "p1", "main")
        .await
        .unwrap();
    assert!(restarted.started);
    assert_eq!(
        env.recorder.rpcs().last().unwrap().1,
        Call::PreStart(held.clone())
    );
    let c = env
        .sim
        .admit(pod("p2", &[("main", &[(CORE, 2)])]))
        .await
        .unwrap();
    assert!(c.admitted);
    assert!(c.containers[0].devices[CORE]
        .iter()
        .all(|d| !held.contains(d)));

    let list = env
        .pod_resources()
        .await
        .list(pr::ListPodResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.pod_resources.len(), 2, "PodResources is served again");
}

/// §4 + admission serialization: 20 identical replicas admitted at once each get distinct
/// devices and their own Allocate; the RPCs of two admissions never interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_replicas_in_a_burst_get_distinct_devices() {
    let env = Env::new();
    let _p = env
        .registered(
            CORE,
            "core.sock",
            Script::with_options(false, true),
            devs("c", 100),
        )
        .await;
    let sim = Arc::new(env.sim);
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let sim = sim.clone();
            tokio::spawn(async move {
                sim.admit(pod(&format!("replica-{i}"), &[("main", &[(CORE, 5)])]))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for t in tasks {
        let a = t.await.unwrap();
        assert!(a.admitted, "{:?}", a.rejection);
        let d = &a.containers[0].devices[CORE];
        assert_eq!(d.len(), 5);
        seen.extend(d.iter().cloned());
    }
    assert_eq!(seen.len(), 100, "every replica got its own devices");
    let allocs = env.recorder.allocates(CORE);
    assert_eq!(allocs.len(), 20);
    assert!(allocs.iter().all(|a| a.len() == 1 && a[0].len() == 5));
    let rpcs = env.recorder.rpcs();
    for pair in rpcs.chunks(2) {
        assert!(
            matches!(pair, [(_, Call::Preferred { .. }), (_, Call::Allocate(_))]),
            "admissions interleaved: {pair:?}"
        );
    }
}

/// §9: the checkpoint has the kubelet's ≥ 1.20 JSON shape: DeviceIDs per NUMA node ("-1" for
/// none), AllocResp = base64 of the protobuf ContainerAllocateResponse, RegisteredDevices =
/// healthy IDs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_has_the_kubelet_json_shape() {
    let env = Env::new();
    let _core = env
        .registered(
            CORE,
            "core.sock",
            Script::default(),
            vec![dev_numa("c0", 1), dev("c1", false)],
        )
        .await;
    let _mem = env
        .registered(MEM, "mem.sock", Script::default(), devs("m", 1))
        .await;
    let a = env
        .sim
        .admit(pod("p1", &[("main", &[(CORE, 1), (MEM, 1)])]))
        .await
        .unwrap();
    let cp: serde_json::Value =
        serde_json::from_slice(&std::fs::read(env.sim.checkpoint_path()).unwrap()).unwrap();
    let top: BTreeSet<&str> = cp.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    assert!(
        top == BTreeSet::from(["Data", "Checksum"])
            || top == BTreeSet::from(["Data", "Checksum", "BootID"]),
        "{top:?}"
    );
    assert_eq!(cp["Checksum"], 0);
    assert_eq!(
        cp["Data"]["RegisteredDevices"],
        serde_json::json!({CORE: ["c0"], MEM: ["m00"]})
    );
    let entries = cp["Data"]["PodDeviceEntries"].as_array().unwrap();
    assert_eq!(entries.len(), 2);
    for e in entries {
        let keys: BTreeSet<&str> = e.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        assert_eq!(
            keys,
            BTreeSet::from([
                "PodUID",
                "ContainerName",
                "ResourceName",
                "DeviceIDs",
                "AllocResp"
            ])
        );
        assert_eq!(e["PodUID"], a.uid.as_str());
        assert_eq!(e["ContainerName"], "main");
        let resource = e["ResourceName"].as_str().unwrap();
        let (numa, id) = if resource == CORE {
            ("1", "c0")
        } else {
            ("-1", "m00")
        };
        assert_eq!(e["DeviceIDs"], serde_json::json!({numa: [id]}));
        let bytes =
            kubelet_sim::checkpoint::decode_alloc_resp(e["AllocResp"].as_str().unwrap()).unwrap();
        let resp = dp::ContainerAllocateResponse::decode(&bytes[..]).unwrap();
        assert_eq!(resp, fake_response(resource, &ids(&[id])));
    }
}

/// §6: the container runtime creates the pod sandbox between admission and the first
/// container start; `sandbox_time` models it (a restart of the container does not wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_time_separates_admission_from_start() {
    let sandbox = std::time::Duration::from_millis(200);
    let env = Env::with(|c| c.sandbox_time = sandbox);
    let _p = env
        .registered(
            CORE,
            "core.sock",
            Script::with_options(true, false),
            devs("c", 4),
        )
        .await;
    let t = std::time::Instant::now();
    let a = env
        .sim
        .admit(pod("p", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert!(a.containers[0].start.as_ref().unwrap().started);
    assert!(
        t.elapsed() >= sandbox,
        "admit returned after {:?}",
        t.elapsed()
    );
    let kinds: Vec<_> = env
        .recorder
        .rpcs()
        .into_iter()
        .map(|(_, c)| matches!(c, Call::PreStart(_)))
        .collect();
    assert_eq!(kinds, [false, true], "Allocate, then PreStartContainer");
}

/// The pod's uid comes from the API server (`metadata.uid`) when the admission names it: the
/// checkpoint, the status and a kubelet restart all keep that uid; another pod cannot take it.
/// Without one kubelet-sim makes one up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_servers_pod_uid_is_used_when_given() {
    const UID: &str = "5f0e8a36-1c2b-4d7e-9a41-0b6c3d2e1f70";
    let env = Env::new();
    let _core = env
        .registered(
            CORE,
            "core.sock",
            Script::with_options(true, false),
            devs("c", 4),
        )
        .await;
    let a = env
        .sim
        .admit(pod("p1", &[("main", &[(CORE, 1)])]).with_uid(UID))
        .await
        .unwrap();
    assert!(a.admitted && a.containers[0].start.as_ref().unwrap().started);
    assert_eq!(a.uid, UID);
    let made_up = env
        .sim
        .admit(pod("p2", &[("main", &[(CORE, 1)])]))
        .await
        .unwrap();
    assert_ne!(made_up.uid, UID);
    assert!(!made_up.uid.is_empty());

    let cp: serde_json::Value =
        serde_json::from_slice(&std::fs::read(env.sim.checkpoint_path()).unwrap()).unwrap();
    let uids: BTreeSet<&str> = cp["Data"]["PodDeviceEntries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["PodUID"].as_str().unwrap())
        .collect();
    assert_eq!(uids, BTreeSet::from([UID, made_up.uid.as_str()]));

    let dup = env
        .sim
        .admit(pod("p3", &[("main", &[(CORE, 1)])]).with_uid(UID))
        .await
        .unwrap_err();
    assert!(dup.to_string().contains("already pod default/p1"), "{dup}");
    let bad = env
        .sim
        .admit(pod("p4", &[("main", &[(CORE, 1)])]).with_uid("../x"))
        .await
        .unwrap_err();
    assert!(bad.to_string().contains("uid"), "{bad}");
    assert_eq!(env.sim.status().pods.len(), 2, "refused pods are not kept");

    env.sim.restart().await.unwrap();
    assert_eq!(env.sim.status().pod("default", "p1").unwrap().uid, UID);
}
