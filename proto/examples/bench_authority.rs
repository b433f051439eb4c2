//! What the `:authority` shim (`uds::incoming`, `authority::Rewriter`) costs a unary gRPC
//! call over a Unix socket: the same tonic server served through `uds::incoming` and on the
//! bare listener, called by one tonic client each, alternating blocks of calls so drift hits
//! both alike. Prints the median and p99 per call of each and the median over blocks of the
//! difference of their medians. Target (issue 15): at most 50 µs added at the median.
//!
//! Usage: cargo run --release -p vcuda-proto --example bench_authority [calls per block] [blocks]

use std::time::Instant;

use tokio::net::UnixListener;
use tonic::transport::Server;
use tonic::{Request, Response, Status};
use vcuda_proto::deviceplugin::v1beta1::{
    registration_client::RegistrationClient,
    registration_server::{Registration, RegistrationServer},
    DevicePluginOptions, Empty, RegisterRequest,
};
use vcuda_proto::uds;

struct Nop;

#[tonic::async_trait]
impl Registration for Nop {
    async fn register(&self, _: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        Ok(Response::new(Empty {}))
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn p99(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let calls: usize = args.next().map_or(Ok(500), |a| a.parse())?;
    let blocks: usize = args.next().map_or(Ok(20), |a| a.parse())?;
    let dir = tempfile::tempdir()?;
    let mut clients = Vec::new();
    for lenient in [false, true] {
        let path = dir
            .path()
            .join(if lenient { "shim.sock" } else { "bare.sock" });
        let listener = UnixListener::bind(&path)?;
        let router = Server::builder().add_service(RegistrationServer::new(Nop));
        tokio::spawn(async move {
            let r = if lenient {
                router.serve_with_incoming(uds::incoming(listener)).await
            } else {
                let bare = tokio_stream::wrappers::UnixListenerStream::new(listener);
                router.serve_with_incoming(bare).await
            };
            r.expect("serve");
        });
        clients.push(RegistrationClient::new(uds::connect(&path).await?));
    }
    let request = RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "vcuda-core.sock".into(),
        resource_name: "tencent.com/vcuda-core".into(),
        options: Some(DevicePluginOptions {
            pre_start_required: true,
            get_preferred_allocation_available: true,
        }),
    };
    // warm up both connections
    for c in &mut clients {
        for _ in 0..200 {
            c.register(request.clone()).await?;
        }
    }
    let mut all: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut diffs = Vec::new();
    for b in 0..blocks {
        let mut med = [0.0; 2];
        // ABBA: alternate which goes first
        let order = if b % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let mut t = Vec::with_capacity(calls);
            for _ in 0..calls {
                let s = Instant::now();
                clients[i].register(request.clone()).await?;
                t.push(s.elapsed().as_secs_f64() * 1e6);
            }
            all[i].extend_from_slice(&t);
            med[i] = median(&mut t);
        }
        diffs.push(med[1] - med[0]);
    }
    println!("unary gRPC call (Registration/Register) over a Unix socket, tonic client and server; {blocks} blocks of {calls} calls per path, alternating");
    println!();
    println!("| server | median µs | p99 µs |");
    println!("|---|---:|---:|");
    for (i, name) in [
        "bare listener (tonic as it comes)",
        "uds::incoming (authority shim)",
    ]
    .iter()
    .enumerate()
    {
        let m = median(&mut all[i]);
        let p = p99(&mut all[i]);
        println!("| {name} | {m:.1} | {p:.1} |");
    }
    let added = median(&mut diffs.clone());
    let (lo, hi) = (
        diffs.iter().copied().fold(f64::INFINITY, f64::min),
        diffs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    println!();
    println!(
        "added by the shim: {added:.1} µs per call at the median (blocks' range {lo:.1} .. {hi:.1}); target 50 µs: {}",
        if added <= 50.0 { "met" } else { "NOT met" }
    );
    println!("RESULT {added:.2}");
    Ok(())
}
