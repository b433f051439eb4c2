//! kubelet-sim (being written: issue 5).
fn main() {}
