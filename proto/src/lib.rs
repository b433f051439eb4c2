//! The kubelet APIs vcuda-manager speaks (being written: issue 5).
