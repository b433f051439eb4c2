//! Compiles the kubelet protos with protox (pure Rust) and generates prost messages plus tonic
//! clients and servers from the resulting descriptor set, so building needs no system `protoc`.

/// Our verbatim copies of the upstream protos, relative to this crate (also the include root, so
/// each file's name in the descriptor set is its path here).
const PROTOS: [&str; 2] = [
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    let fds = protox::compile(PROTOS, ["."])?;
    // Client and server for both services: the manager serves DevicePlugin and calls
    // Registration / PodResourcesLister; kubelet-sim and the tests play the other side.
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
