use proptest::prelude::*;

use super::*;

type Headers = Vec<(Vec<u8>, Vec<u8>)>;

const SOCKET: &[u8] = b"/var/lib/kubelet/device-plugins/vcuda-core.sock";

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    frame_header(&mut f, payload.len(), kind, flags, stream);
    f.extend_from_slice(payload);
    f
}

/// A gRPC request's headers as grpc-go sends them, with `authority`.
fn request(authority: &[u8]) -> Headers {
    [
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", b"/v1beta1.DevicePlugin/Allocate"),
        (b":authority", authority),
        (b"content-type", b"application/grpc"),
        (b"user-agent", b"grpc-go/1.27.1"),
        (b"te", b"trailers"),
    ]
    .iter()
    .map(|(n, v)| (n.to_vec(), v.to_vec()))
    .collect()
}

/// A client: its own HPACK encoder (which indexes, so later blocks lean on the dynamic
/// table) and the bytes it has sent.
struct Client {
    enc: Encoder<'static>,
    bytes: Vec<u8>,
}

impl Client {
    fn new() -> Client {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        Client {
            enc: Encoder::default(),
            bytes,
        }
    }

    /// Huffman-coded values, every header indexed, as grpc clients send them.
    fn block(&mut self, h: &Headers) -> Vec<u8> {
        let mut out = Vec::new();
        for (n, v) in h {
            let flags = Encoder::HUFFMAN_VALUE | Encoder::WITH_INDEXING | Encoder::BEST_FORMAT;
            self.enc
                .encode((n.clone(), v.clone(), flags), &mut out)
                .unwrap();
        }
        out
    }

    fn headers(&mut self, stream: u32, h: &Headers) -> &mut Self {
        let b = self.block(h);
        self.bytes.extend(frame(HEADERS, END_HEADERS, stream, &b));
        self
    }

    fn data(&mut self, stream: u32, payload: &[u8]) -> &mut Self {
        self.bytes.extend(frame(0x0, END_STREAM, stream, payload));
        self
    }
}

/// What the server reads: each header block (stream, END_STREAM, headers) decoded with
/// a decoder of its own, and every other frame as (type, stream, payload).
#[derive(Debug, Default, PartialEq)]
struct Seen {
    blocks: Vec<(u32, bool, Headers)>,
    others: Vec<(u8, u32, Vec<u8>)>,
}

fn server_reads(out: &[u8]) -> Seen {
    assert!(out.starts_with(PREFACE), "the preface passes first");
    let mut dec = Decoder::with_dynamic_size(4096);
    let mut seen = Seen::default();
    let mut at = PREFACE.len();
    let mut block: Option<(u32, bool, Vec<u8>)> = None;
    while at < out.len() {
        let head = &out[at..at + FRAME_HEADER];
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let payload = &out[at + FRAME_HEADER..at + FRAME_HEADER + len];
        assert!(len <= MAX_OUT_PAYLOAD || !matches!(head[3], HEADERS | CONTINUATION));
        let (kind, flags, stream) = (head[3], head[4], stream_id(head));
        match kind {
            HEADERS => {
                assert!(block.is_none());
                assert_eq!(flags & PADDED, 0, "padding is dropped");
                let skip = if flags & PRIORITY != 0 { 5 } else { 0 };
                block = Some((stream, flags & END_STREAM != 0, payload[skip..].to_vec()));
            }
            CONTINUATION => block
                .as_mut()
                .expect("after HEADERS")
                .2
                .extend_from_slice(payload),
            _ => seen.others.push((kind, stream, payload.to_vec())),
        }
        if matches!(kind, HEADERS | CONTINUATION) && flags & END_HEADERS != 0 {
            let (s, end, b) = block.take().unwrap();
            let (mut b, mut fields) = (b, Vec::new());
            dec.decode(&mut b, &mut fields)
                .expect("the server decodes every block");
            let h = fields.into_iter().map(|(n, v, _)| (n, v)).collect();
            seen.blocks.push((s, end, h));
        }
        at += FRAME_HEADER + len;
    }
    assert!(block.is_none(), "no block left open");
    seen
}

fn rewrite(bytes: &[u8]) -> (Vec<u8>, u64) {
    let mut r = Rewriter::new();
    let mut out = Vec::new();
    r.feed(bytes, &mut out).expect("a well-formed client");
    (out, r.rewritten())
}

fn authority_of(h: &Headers) -> &[u8] {
    &h.iter().find(|(n, _)| n == b":authority").unwrap().1
}

#[test]
fn the_four_authority_forms_reach_the_server_as_ones_h2_accepts() {
    let percent: &[u8] = b"%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fvcuda-core.sock";
    for (sent, expected) in [
        (&b"localhost"[..], &b"localhost"[..]),
        (SOCKET, REPLACEMENT),
        (
            percent,
            if acceptable(percent) {
                percent
            } else {
                REPLACEMENT
            },
        ),
        (b"", REPLACEMENT),
    ] {
        let mut c = Client::new();
        c.headers(1, &request(sent)).data(1, b"\0\0\0\0\0");
        let (out, n) = rewrite(&c.bytes);
        let seen = server_reads(&out);
        let mut want = request(sent);
        want[3].1 = expected.to_vec();
        assert_eq!(
            seen.blocks,
            vec![(1, false, want)],
            "sent {:?}",
            String::from_utf8_lossy(sent)
        );
        assert!(acceptable(authority_of(&seen.blocks[0].2)));
        assert_eq!(n, u64::from(expected != sent));
    }
    assert!(!acceptable(SOCKET) && !acceptable(b""), "what h2 refuses");
}

#[test]
fn later_requests_that_lean_on_the_clients_dynamic_table_decode_on_the_server() {
    let mut c = Client::new();
    for stream in [1, 3, 5] {
        c.headers(stream, &request(SOCKET))
            .data(stream, b"\0\0\0\0\0");
    }
    let fourth = c.block(&request(SOCKET));
    assert!(
        fourth.len() == 7 && fourth.iter().all(|b| b & 0x80 != 0),
        "the client now sends indices only, most into its dynamic table: {fourth:?}"
    );
    c.bytes
        .extend(frame(HEADERS, END_HEADERS | END_STREAM, 7, &fourth));
    let (out, n) = rewrite(&c.bytes);
    let seen = server_reads(&out);
    let mut want = request(SOCKET);
    want[3].1 = REPLACEMENT.to_vec();
    let mut blocks = [1, 3, 5].map(|s| (s, false, want.clone())).to_vec();
    blocks.push((7, true, want));
    assert_eq!(seen.blocks, blocks);
    assert_eq!(n, 4);
    assert_eq!(
        seen.others.len(),
        4,
        "SETTINGS and three DATA frames, untouched"
    );
}

#[test]
fn frames_other_than_headers_pass_byte_for_byte_and_are_not_held_back() {
    let mut c = Client::new();
    c.headers(1, &request(b"localhost"));
    let before = c.bytes.len();
    let body = vec![7u8; 100_000];
    c.data(1, &body);
    c.bytes.extend(frame(0x8, 0, 0, &[0, 0, 0x10, 0])); // WINDOW_UPDATE
    let mut r = Rewriter::new();
    let mut out = Vec::new();
    // the DATA frame arrives in two halves: its first half is passed on at once
    let mid = before + 50_000;
    r.feed(&c.bytes[..mid], &mut out).unwrap();
    let first = out.len();
    assert!(
        first >= mid - 100,
        "half a DATA frame passed through before its end arrived"
    );
    r.feed(&c.bytes[mid..], &mut out).unwrap();
    let seen = server_reads(&out);
    assert_eq!(seen.others[1], (0x0, 1, body));
    assert_eq!(seen.others[2], (0x8, 0, vec![0, 0, 0x10, 0]));
    assert!(
        out.ends_with(&c.bytes[before..]),
        "DATA and WINDOW_UPDATE unchanged"
    );
}

#[test]
fn continuation_padding_and_priority_are_understood() {
    let mut c = Client::new();
    let block = c.block(&request(SOCKET));
    let (a, b) = block.split_at(block.len() / 2);
    // HEADERS padded by 3, with priority, then the rest in a CONTINUATION
    let mut p = vec![3];
    p.extend_from_slice(&[0x80, 0, 0, 0, 16]);
    p.extend_from_slice(a);
    p.extend_from_slice(&[0, 0, 0]);
    c.bytes
        .extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 1, &p));
    c.bytes.extend(frame(CONTINUATION, END_HEADERS, 1, b));
    let (out, n) = rewrite(&c.bytes);
    let mut want = request(SOCKET);
    want[3].1 = REPLACEMENT.to_vec();
    assert_eq!(server_reads(&out).blocks, vec![(1, true, want)]);
    assert_eq!(n, 1);
    // the priority fields survive (the HEADERS frame follows the preface and SETTINGS)
    let at = PREFACE.len() + FRAME_HEADER;
    assert_eq!(out[at + 3], HEADERS);
    assert_eq!(out[at + 4], PRIORITY | END_STREAM | END_HEADERS);
    assert_eq!(
        &out[at + FRAME_HEADER..at + FRAME_HEADER + 5],
        &[0x80, 0, 0, 0, 16]
    );
}

#[test]
fn a_block_too_large_for_one_frame_is_sent_as_headers_and_continuations() {
    let mut h = request(SOCKET);
    h.push((b"x-big".to_vec(), vec![b'a'; 40_000]));
    let mut c = Client::new();
    c.headers(1, &h);
    let (out, _) = rewrite(&c.bytes);
    h[3].1 = REPLACEMENT.to_vec();
    assert_eq!(server_reads(&out).blocks, vec![(1, false, h)]);
}

#[test]
fn a_client_without_the_http2_preface_passes_through_untouched() {
    let req = b"GET / HTTP/1.1\r\nHost: /var/run/x.sock\r\n\r\n";
    let mut r = Rewriter::new();
    let mut out = Vec::new();
    r.feed(&req[..5], &mut out).unwrap();
    r.feed(&req[5..], &mut out).unwrap();
    assert_eq!(out, req);
}

#[test]
fn hostile_clients_end_their_connection_without_being_buffered() {
    let start = || {
        let mut c = Client::new();
        c.headers(1, &request(b"localhost"));
        c.bytes
    };
    let fail = |extra: Vec<u8>| {
        let mut b = start();
        b.extend(extra);
        let mut out = Vec::new();
        Rewriter::new().feed(&b, &mut out).unwrap_err()
    };
    // a HEADERS frame announcing 2 MiB is refused on its 9-byte header, before its payload
    let mut head = Vec::new();
    frame_header(&mut head, MAX_HEADER_BLOCK + 1, HEADERS, 0, 3);
    assert_eq!(fail(head), ShimError::BlockTooLarge { stream: 3 });
    // CONTINUATIONs that never end
    let mut cont = frame(HEADERS, 0, 3, &[0x82]);
    for _ in 0..70 {
        cont.extend(frame(CONTINUATION, 0, 3, &[0x82; 16_000]));
    }
    assert_eq!(fail(cont), ShimError::BlockTooLarge { stream: 3 });
    assert_eq!(
        fail(frame(CONTINUATION, END_HEADERS, 3, &[0x82])),
        ShimError::Malformed("CONTINUATION without HEADERS")
    );
    let mut interleaved = frame(HEADERS, 0, 3, &[0x82]);
    interleaved.extend(frame(0x0, 0, 3, b"x"));
    assert!(matches!(fail(interleaved), ShimError::Malformed(_)));
    assert_eq!(
        fail(frame(HEADERS, PADDED | END_HEADERS, 3, &[9, 0x82])),
        ShimError::Malformed("HEADERS padding longer than the frame")
    );
    // an index the table does not have
    assert!(matches!(
        fail(frame(HEADERS, END_HEADERS, 3, &[0xff, 0x7f])),
        ShimError::Hpack { stream: 3, .. }
    ));
}

proptest! {
    /// However the client's bytes are split into reads, the server reads the same.
    #[test]
    fn the_output_does_not_depend_on_how_the_input_is_split(
        cuts in proptest::collection::vec(0usize..2000, 0..12),
        authority in prop_oneof![Just(SOCKET.to_vec()), Just(b"localhost".to_vec()), "[a-z/%.]{0,40}".prop_map(String::into_bytes)],
    ) {
        let mut c = Client::new();
        for s in [1u32, 3, 5] {
            c.headers(s, &request(&authority)).data(s, &[s as u8; 300]);
        }
        let (whole, n) = rewrite(&c.bytes);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|x| x % c.bytes.len()).collect();
        cuts.sort_unstable();
        let mut r = Rewriter::new();
        let mut out = Vec::new();
        let mut from = 0;
        for cut in cuts.into_iter().chain([c.bytes.len()]) {
            r.feed(&c.bytes[from..cut], &mut out).unwrap();
            from = cut;
        }
        prop_assert_eq!(&out, &whole);
        prop_assert_eq!(r.rewritten(), n);
        let seen = server_reads(&out);
        prop_assert!(seen.blocks.iter().all(|(_, _, h)| acceptable(authority_of(h))));
    }
}
