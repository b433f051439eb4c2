//! The webhook refuses at creation with the words vcuda-manager uses when the same request
//! reaches a node without the webhook (its Allocate / PreStartContainer refusals, which the
//! kubelet shows on the pod): the sentence that says what is wrong and what to ask instead
//! is the same.

use vcuda_manager_core::allocation::FinishError;
use vcuda_manager_core::assign::AssignError;
use vcuda_manager_core::placement::PlacementError;
use vcuda_scheduler::extender::Pod;
use vcuda_scheduler::request::container;
use vcuda_webhook::rules::{judge, Offered, Operation, Policy};

fn refused(limits: &[(&str, &str)], annotations: &[(&str, &str)]) -> String {
    let mut pod = Pod::default();
    pod.spec.containers = vec![container("c", limits)];
    pod.metadata.annotations = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let policy = Policy::new("tencent.com", "nvidia.com/gpu");
    let v = judge(
        &policy,
        Operation::Create,
        "alice",
        &pod,
        None,
        Offered::NotChecked,
    );
    v.refusal.expect("refused").to_string()
}

/// The longest run of words `a` and `b` share (at least `min` words).
fn shared_sentence(a: &str, b: &str, min: usize) -> String {
    let (wa, wb): (Vec<&str>, Vec<&str>) = (
        a.split_whitespace().collect(),
        b.split_whitespace().collect(),
    );
    let mut best: &[&str] = &[];
    for i in 0..wa.len() {
        for j in 0..wb.len() {
            let n = wa[i..]
                .iter()
                .zip(&wb[j..])
                .take_while(|(x, y)| x == y)
                .count();
            if n > best.len() {
                best = &wa[i..i + n];
            }
        }
    }
    assert!(
        best.len() >= min,
        "no common sentence of {min} words:\n  webhook: {a}\n  manager: {b}"
    );
    best.join(" ")
}

#[test]
fn a_core_count_neither_share_nor_whole() {
    let webhook = refused(&[("tencent.com/vcuda-core", "150")], &[]);
    let manager = PlacementError::CoresNotShareOrWhole { total: 150 }.to_string();
    let s = shared_sentence(&webhook, &manager, 18);
    assert!(s.starts_with("vcuda-core 150 is neither a share of one GPU (1 to 99) nor whole GPUs (a multiple of 100); request"), "{s}");
}

#[test]
fn a_share_without_memory() {
    let webhook = refused(&[("tencent.com/vcuda-core", "30")], &[]);
    let manager = FinishError::NoMemory {
        container: "default/p c".into(),
        cores: 30,
    }
    .to_string();
    let s = shared_sentence(&webhook, &manager, 14);
    assert!(s.contains("a share of a GPU (vcuda-core 30) needs vcuda-memory too (1 = 256 MiB); add it to the container's"), "{s}");
}

#[test]
fn a_gpu_count_out_of_range() {
    let webhook = refused(
        &[
            ("tencent.com/vcuda-core", "50"),
            ("tencent.com/vcuda-memory", "4"),
        ],
        &[("vcuda.io/gpu-count", "40")],
    );
    let manager = AssignError::GpuCount {
        pod: "default/p".into(),
        value: "40".into(),
    }
    .to_string();
    let s = shared_sentence(&webhook, &manager, 20);
    assert!(s.starts_with("pod annotation vcuda.io/gpu-count = \"40\" is not a number from 1 to 16; set it to the number of GPUs"), "{s}");
}
