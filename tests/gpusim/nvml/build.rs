//! Give the library the soname real drivers use, so programs linked with `-lnvidia-ml` record
//! `libnvidia-ml.so.1` as their dependency (and find gpusim's copy through LD_LIBRARY_PATH).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
