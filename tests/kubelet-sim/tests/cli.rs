//! The `kubelet-sim` binary: `serve` and the client subcommands over the control socket.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kubelet-sim");

async fn run(control: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .arg("--control")
        .arg(control)
        .output()
        .await
        .unwrap()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: stdout {:?} stderr {:?}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test]
async fn help_explains_every_subcommand() {
    let o = Command::new(BIN).arg("--help").output().await.unwrap();
    assert!(o.status.success());
    let help = String::from_utf8_lossy(&o.stdout);
    for sub in [
        "serve",
        "status",
        "admit",
        "start-container",
        "delete",
        "restart",
        "wait-registered",
        "ping",
    ] {
        assert!(help.contains(sub), "{sub} missing from:\n{help}");
    }
    let o = Command::new(BIN)
        .args(["admit", "--help"])
        .output()
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("NAME:RESOURCE=QTY"));
}

#[tokio::test]
async fn a_client_without_a_simulator_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let o = run(&dir.path().join("nope.sock"), &["status"]).await;
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("start it with `kubelet-sim serve"),
        "{}",
        stderr(&o)
    );
    let o = run(
        &dir.path().join("nope.sock"),
        &["admit", "--pod", "p", "--container", "main:a.com/x"],
    )
    .await;
    assert_eq!(o.status.code(), Some(2), "usage error");
    assert!(stderr(&o).contains("has no '='"), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_drive_it_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let plugin_dir = dir.path().join("device-plugins");
    let control: PathBuf = dir.path().join("control.sock");
    let mut serve = Command::new(BIN)
        .arg("serve")
        .arg("--plugin-dir")
        .arg(&plugin_dir)
        .arg("--pod-resources-socket")
        .arg(dir.path().join("pod-resources.sock"))
        .arg("--control")
        .arg(&control)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines();
    let ready: serde_json::Value =
        serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
    assert_eq!(ready["ready"], true);
    let kubelet = PathBuf::from(ready["kubelet_socket"].as_str().unwrap());
    assert_eq!(kubelet, plugin_dir.join("kubelet.sock"));

    let recorder = std::sync::Arc::new(Recorder::default());
    let mut plugin = FakePlugin::start(
        &plugin_dir,
        CORE,
        "core.sock",
        &recorder,
        Script::with_options(true, false),
    );
    plugin.set_devices(devs("c", 4));
    plugin.register(&kubelet).await.unwrap();
    let o = run(&control, &["wait-registered", CORE, "--timeout", "10"]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(json(&o)["healthy"].as_array().unwrap().len(), 4);

    let spec = format!("main:{CORE}=2");
    let o = run(&control, &["admit", "--pod", "p", "--container", &spec]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    let a = json(&o);
    assert_eq!(a["admitted"], true);
    let c = &a["containers"][0];
    assert_eq!(c["devices"][CORE], serde_json::json!(["c00", "c01"]));
    assert_eq!(c["allocate_response"]["envs"]["FAKE_VCUDA_CORE"], "c00,c01");
    assert_eq!(c["start"]["started"], true);

    let o = run(&control, &["admit", "--pod", "p", "--container", &spec]).await;
    assert!(!o.status.success());
    assert!(stderr(&o).contains("delete it first"), "{}", stderr(&o));

    let o = run(
        &control,
        &[
            "admit",
            "--pod",
            "u",
            "--uid",
            "0b9d-api-uid",
            "--container",
            "main",
        ],
    )
    .await;
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(json(&o)["uid"], "0b9d-api-uid");
    let o = run(&control, &["delete", "--pod", "u"]).await;
    assert!(o.status.success(), "{}", stderr(&o));

    let big = format!("main:{CORE}=3");
    let o = run(
        &control,
        &["admit", "--pod", "q", "--no-start", "--container", &big],
    )
    .await;
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(json(&o)["rejection"]["reason"], "UnexpectedAdmissionError");

    let o = run(
        &control,
        &["start-container", "--pod", "p", "--container", "main"],
    )
    .await;
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(json(&o)["starts"], 2);
    assert_eq!(recorder.allocates(CORE).len(), 1);

    let o = run(&control, &["status"]).await;
    let s = json(&o);
    assert_eq!(s["resources"][0]["name"], CORE);
    assert_eq!(
        s["resources"][0]["allocated"],
        serde_json::json!(["c00", "c01"])
    );
    assert_eq!(s["pods"][0]["name"], "p");

    let o = run(&control, &["restart"]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(json(&o)["restarts"], 1);
    assert!(!plugin.socket.exists());
    plugin.restart().await;
    plugin.register(&kubelet).await.unwrap();
    let o = run(&control, &["wait-registered", CORE]).await;
    assert!(o.status.success(), "{}", stderr(&o));

    let o = run(&control, &["ping", CORE, "--count", "3"]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        json(&o).as_array().map(Vec::len),
        Some(3),
        "one round trip each"
    );
    let o = run(&control, &["ping", "example.com/none"]).await;
    assert!(!o.status.success());
    assert!(stderr(&o).contains("wait-registered"), "{}", stderr(&o));

    let o = run(&control, &["delete", "--pod", "p"]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&control, &["status"]).await;
    assert_eq!(json(&o)["pods"], serde_json::json!([]));

    let pid = serve.id().unwrap().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    assert!(serve.wait().await.unwrap().success());
    assert!(!control.exists(), "the control socket is removed on exit");
}
