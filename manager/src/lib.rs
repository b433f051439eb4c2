//! vcuda-manager (being written: issue 5).
