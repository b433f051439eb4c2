//! Compiles kubelet-sim's own verbatim copies of the upstream kubelet protos (device plugin
//! v1beta1 and PodResources v1, Kubernetes 1.36.3) with protox: no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/deviceplugin-v1beta1-api.proto",
        "proto/podresources-v1-api.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
