//! `--kubelet-version`: what kubelet-sim does differently per kubelet release, each test
//! pinning one difference cited in tests/kubelet-sim/README.md ("Kubelet versions"). The
//! fake plugin here is tonic as it comes (h2 refuses an authority containing `/`), so it
//! stands for every tonic device plugin that has no answer to old kubelets.

mod common;

use std::time::Duration;

use common::*;
use kubelet_sim::proto::podresources as pr;
use kubelet_sim::versions::{Profile, Version};

fn at(minor: u32) -> Env {
    Env::with(|c| c.profile = Profile::new(Version(1, minor)))
}

/// Before 1.26 (kubernetes#112597) the kubelet's calls carry the plugin's socket path as
/// `:authority`; a tonic plugin resets them (h2: PROTOCOL_ERROR), so Register, which asks
/// for the options inside the call since 1.25, fails. 1.26 sends `localhost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_1_26_the_socket_path_is_the_authority_and_a_bare_tonic_plugin_refuses_it() {
    let env = at(25);
    let p = env.plugin(CORE, "core.sock", Script::default());
    p.set_devices(devs("c", 2));
    let err = p.register(&env.sim.kubelet_socket()).await.unwrap_err();
    assert!(
        err.message()
            .contains("failed to get device plugin options"),
        "{err:?}"
    );
    assert!(
        env.recorder.of(CORE).is_empty(),
        "the refused call never reached the plugin's service"
    );

    let env = at(26);
    let p = env.plugin(CORE, "core.sock", Script::default());
    p.set_devices(devs("c", 2));
    p.register(&env.sim.kubelet_socket()).await.unwrap();
    env.sim.wait_registered(CORE, T).await.unwrap();
}

/// Before 1.25 Register returns at once (the connect-back happens afterwards) and the
/// options are the RegisterRequest's: GetDevicePluginOptions is never called. So an old
/// kubelet accepts a plugin it then cannot talk to: Register succeeds, the resource never
/// becomes registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_1_25_register_returns_at_once_and_never_asks_for_the_options() {
    let env = at(24);
    let p = env.plugin(CORE, "core.sock", Script::with_options(true, true));
    p.set_devices(devs("c", 2));
    p.register(&env.sim.kubelet_socket()).await.unwrap();
    let waited = env
        .sim
        .wait_registered(CORE, Duration::from_millis(1500))
        .await;
    assert!(
        waited.is_err(),
        "the path authority kept it from registering"
    );
    assert!(
        !env.recorder.of(CORE).contains(&Call::GetOptions),
        "{:?}",
        env.recorder.of(CORE)
    );
}

/// PodResources v1: `GetAllocatableResources` is not in 1.20's API, behind an off gate in
/// 1.21–1.22, on from 1.23; `Get` is absent before 1.27, behind an off gate to 1.33, on
/// from 1.34. `List` is served by every release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_resources_methods_follow_the_release() {
    for (minor, alloc, get) in [
        (
            20,
            Some(tonic::Code::Unimplemented),
            Some(tonic::Code::Unimplemented),
        ),
        (
            22,
            Some(tonic::Code::Unknown),
            Some(tonic::Code::Unimplemented),
        ),
        (23, None, Some(tonic::Code::Unimplemented)),
        (30, None, Some(tonic::Code::Unknown)),
        (34, None, None),
    ] {
        let env = at(minor);
        let mut c = env.pod_resources().await;
        c.list(pr::ListPodResourcesRequest {}).await.unwrap();
        let a = c
            .get_allocatable_resources(pr::AllocatableResourcesRequest {})
            .await;
        assert_eq!(
            a.as_ref().err().map(|s| s.code()),
            alloc,
            "1.{minor}: {a:?}"
        );
        if alloc == Some(tonic::Code::Unknown) {
            assert_eq!(
                a.unwrap_err().message(),
                "Pod Resources API GetAllocatableResources disabled"
            );
        }
        let g = c
            .get(pr::GetPodResourcesRequest {
                pod_name: "p".into(),
                pod_namespace: "default".into(),
            })
            .await;
        let code = g.as_ref().err().map(|s| s.code());
        // 1.34+: served, and this pod does not exist (the kubelet's Unknown "not found")
        let code = if minor >= 34 { None } else { code };
        assert_eq!(code, get, "1.{minor}: {g:?}");
        if get == Some(tonic::Code::Unknown) {
            assert_eq!(
                g.unwrap_err().message(),
                "PodResources API Get method disabled"
            );
        }
    }
}
