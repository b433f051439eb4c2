//! A gRPC call to a tonic server on a Unix socket, made with raw HTTP/2 frames the way
//! grpc-go in kubelets 1.20–1.25 makes it: the socket path as `:authority`. Served through
//! `uds::incoming` every authority form works; served on the bare listener (tonic as it
//! comes), h2 resets the stream. The second half is what issue 15 starts from, so the test
//! shows the shim is what makes the difference.

use std::path::Path;
use std::sync::{Arc, Mutex};

use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::Server;
use tonic::{Request, Response, Status};
use vcuda_proto::authority::PREFACE;
use vcuda_proto::constants::VERSION;
use vcuda_proto::deviceplugin::v1beta1::{
    registration_server::{Registration, RegistrationServer},
    Empty, RegisterRequest,
};
use vcuda_proto::uds;

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

#[tonic::async_trait]
impl Registration for Recorder {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        self.0
            .lock()
            .expect("recorder lock")
            .push(request.into_inner().resource_name);
        Ok(Response::new(Empty {}))
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (u32::try_from(payload.len()).unwrap().to_be_bytes()[1..]).to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// How the server answered stream 1.
#[derive(Debug, PartialEq)]
enum Answer {
    /// The trailers' `grpc-status`.
    Status(String),
    /// `RST_STREAM` with this error code (1: PROTOCOL_ERROR).
    Reset(u32),
}

/// One Register call on a fresh connection to `path`, with `authority`.
async fn call(path: &Path, authority: &[u8]) -> Answer {
    let mut s = UnixStream::connect(path).await.expect("connect");
    let mut enc = httlib_hpack::Encoder::default();
    let headers: [(&[u8], &[u8]); 6] = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", b"/v1beta1.Registration/Register"),
        (b":authority", authority),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ];
    let mut block = Vec::new();
    for (n, v) in headers {
        let flags = httlib_hpack::Encoder::HUFFMAN_VALUE | httlib_hpack::Encoder::WITH_INDEXING;
        enc.encode((n.to_vec(), v.to_vec(), flags), &mut block)
            .unwrap();
    }
    let msg = RegisterRequest {
        version: VERSION.into(),
        resource_name: "example.com/thing".into(),
        ..Default::default()
    }
    .encode_to_vec();
    let mut body = vec![0];
    body.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    body.extend_from_slice(&msg);
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    out.extend(frame(0x1, 0x4, 1, &block));
    out.extend(frame(0x0, 0x1, 1, &body));
    s.write_all(&out).await.expect("write");

    let mut dec = httlib_hpack::Decoder::with_dynamic_size(4096);
    let mut buf = Vec::new();
    loop {
        while buf.len() >= 9 {
            let len = usize::from(buf[0]) << 16 | usize::from(buf[1]) << 8 | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (buf[3], buf[4]);
            let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]);
            let payload = buf[9..9 + len].to_vec();
            buf.drain(..9 + len);
            match kind {
                0x4 if flags & 1 == 0 => s.write_all(&frame(0x4, 1, 0, &[])).await.unwrap(),
                0x1 => {
                    let (mut p, mut h) = (payload, Vec::new());
                    dec.decode(&mut p, &mut h).expect("server headers decode");
                    if stream == 1 && flags & 1 != 0 {
                        let status = h
                            .iter()
                            .find(|(n, _, _)| n == b"grpc-status")
                            .expect("grpc-status");
                        return Answer::Status(String::from_utf8(status.1.clone()).unwrap());
                    }
                }
                0x3 if stream == 1 => {
                    return Answer::Reset(u32::from_be_bytes(payload[..4].try_into().unwrap()))
                }
                0x7 => panic!("GOAWAY: {payload:?}"),
                _ => {}
            }
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.expect("read");
        assert!(n > 0, "the server closed the connection");
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn serve(path: &Path, lenient: bool) -> Recorder {
    let recorder = Recorder::default();
    let listener = UnixListener::bind(path).expect("bind");
    let router = Server::builder().add_service(RegistrationServer::new(recorder.clone()));
    tokio::spawn(async move {
        if lenient {
            router.serve_with_incoming(uds::incoming(listener)).await
        } else {
            let bare = tokio_stream::wrappers::UnixListenerStream::new(listener);
            router.serve_with_incoming(bare).await
        }
        .expect("serve")
    });
    recorder
}

const SOCKET: &[u8] = b"/var/lib/kubelet/device-plugins/kubelet.sock";
const PERCENT: &[u8] = b"%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fkubelet.sock";

#[tokio::test]
async fn every_authority_form_is_served_through_uds_incoming() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("plugin.sock");
    let recorder = serve(&path, true);
    for authority in [&b"localhost"[..], SOCKET, PERCENT, b""] {
        assert_eq!(
            call(&path, authority).await,
            Answer::Status("0".into()),
            "authority {:?}",
            String::from_utf8_lossy(authority)
        );
    }
    assert_eq!(
        recorder.0.lock().unwrap().len(),
        4,
        "every call reached the service"
    );
}

#[tokio::test]
async fn without_the_shim_h2_resets_a_path_authority() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("plugin.sock");
    let recorder = serve(&path, false);
    assert_eq!(
        call(&path, SOCKET).await,
        Answer::Reset(1),
        "PROTOCOL_ERROR"
    );
    assert_eq!(call(&path, b"").await, Answer::Reset(1), "PROTOCOL_ERROR");
    assert_eq!(call(&path, b"localhost").await, Answer::Status("0".into()));
    assert_eq!(recorder.0.lock().unwrap().len(), 1);
}
