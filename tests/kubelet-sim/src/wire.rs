//! What kubelets before 1.26 put on the wire when they call a device plugin: grpc-go,
//! dialing the plugin's socket path with a custom dialer and no `WithAuthority`, sends that
//! path as the HTTP/2 `:authority` (kubernetes#112597 set `localhost` in 1.26). A tonic
//! client cannot send such an authority (its `Uri` refuses a `/`), so [`SendsPath`] sits
//! between kubelet-sim's tonic client and the socket and rewrites the request headers it
//! writes: each header block is HPACK-decoded (following the client's dynamic table) and
//! re-encoded as literals without indexing, its `:authority` replaced by the socket path.
//! Everything else, and everything read, passes untouched. So the plugin sees the bytes a
//! 1.20–1.25 kubelet sends, through its real HTTP/2 stack.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use httlib_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE_LEN: usize = 24;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// HTTP/2's least `SETTINGS_MAX_FRAME_SIZE`: every server accepts frames this large.
const MAX_FRAME: usize = 16_384;

/// A client connection whose request headers carry `path` as `:authority`.
pub struct SendsPath<S> {
    inner: S,
    /// `None`: write through untouched (1.26+, which send `localhost` themselves).
    path: Option<Vec<u8>>,
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    /// Bytes written by the client and not yet turned into frames.
    pending: Vec<u8>,
    /// Frames ready for the socket, from `sent`.
    out: Vec<u8>,
    sent: usize,
    preface_left: usize,
    /// A header block waiting for its CONTINUATIONs: stream, HEADERS flags, fragment.
    block: Option<(u32, u8, Vec<u8>)>,
}

impl<S> SendsPath<S> {
    pub fn new(inner: S, path: &str) -> SendsPath<S> {
        SendsPath {
            inner,
            path: Some(path.as_bytes().to_vec()),
            decoder: Decoder::with_dynamic_size(4096),
            encoder: Encoder::default(),
            pending: Vec::new(),
            out: Vec::new(),
            sent: 0,
            preface_left: PREFACE_LEN,
            block: None,
        }
    }

    /// A connection written through unchanged.
    pub fn untouched(inner: S) -> SendsPath<S> {
        SendsPath {
            path: None,
            ..SendsPath::new(inner, "")
        }
    }

    /// Turn every complete frame in `pending` into output.
    fn frames(&mut self) -> io::Result<()> {
        let n = self.preface_left.min(self.pending.len());
        self.out.extend_from_slice(&self.pending[..n]);
        self.preface_left -= n;
        let mut at = n;
        while let Some(head) = self.pending.get(at..at + 9) {
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let Some(payload) = self.pending.get(at + 9..at + 9 + len) else {
                break;
            };
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            match kind {
                HEADERS => {
                    let mut body = payload;
                    if flags & PADDED != 0 {
                        let pad = usize::from(body[0]);
                        body = &body[1..body.len() - pad];
                    }
                    if flags & PRIORITY != 0 {
                        body = &body[5..];
                    }
                    self.block = Some((stream, flags & !(PADDED | PRIORITY), body.to_vec()));
                }
                CONTINUATION => {
                    if let Some(b) = &mut self.block {
                        b.2.extend_from_slice(payload);
                    }
                }
                _ => self.out.extend_from_slice(&self.pending[at..at + 9 + len]),
            }
            at += 9 + len;
            if matches!(kind, HEADERS | CONTINUATION) && flags & END_HEADERS != 0 {
                if let Some((stream, flags, fragment)) = self.block.take() {
                    self.rewrite(stream, flags, fragment)?;
                }
            }
        }
        self.pending.drain(..at);
        Ok(())
    }

    fn rewrite(&mut self, stream: u32, flags: u8, mut fragment: Vec<u8>) -> io::Result<()> {
        let bad = |e| io::Error::other(format!("HPACK: {e:?}"));
        let mut fields = Vec::new();
        self.decoder
            .decode(&mut fragment, &mut fields)
            .map_err(bad)?;
        let mut block = Vec::new();
        for (name, value, _) in fields {
            let value = match &self.path {
                Some(p) if name == b":authority" => p.clone(),
                _ => value,
            };
            self.encoder
                .encode((name, value, 0), &mut block)
                .map_err(|e| io::Error::other(format!("HPACK: {e:?}")))?;
        }
        let mut chunks = block.chunks(MAX_FRAME).peekable();
        let mut kind = HEADERS;
        let mut first_flags = flags & !END_HEADERS;
        while let Some(c) = chunks.next() {
            let last = chunks.peek().is_none();
            let f = first_flags | if last { END_HEADERS } else { 0 };
            let len = u32::try_from(c.len()).expect("a chunk is at most 16 KiB");
            self.out.extend_from_slice(&len.to_be_bytes()[1..]);
            self.out.extend_from_slice(&[kind, f]);
            self.out.extend_from_slice(&stream.to_be_bytes());
            self.out.extend_from_slice(c);
            kind = CONTINUATION;
            first_flags = 0;
        }
        Ok(())
    }
}

impl<S: AsyncWrite + Unpin> SendsPath<S> {
    /// Write out what is ready.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.out[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.out.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SendsPath<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if me.path.is_none() {
            return Pin::new(&mut me.inner).poll_write(cx, buf);
        }
        ready!(me.drain(cx))?;
        me.pending.extend_from_slice(buf);
        me.frames()?;
        // Whatever the socket does not take now goes out at the next write or flush.
        if let Poll::Ready(Err(e)) = me.drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.drain(cx))?;
        Pin::new(&mut me.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.drain(cx))?;
        Pin::new(&mut me.inner).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SendsPath<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = u32::try_from(payload.len()).unwrap().to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// The bytes on the wire carry the socket path as `:authority`, whatever the client's
    /// encoder did (Huffman, dynamic table), and the other frames unchanged.
    #[tokio::test]
    async fn the_wire_carries_the_socket_path() {
        let (a, mut b) = tokio::io::duplex(1 << 20);
        let mut w = SendsPath::new(a, "/var/lib/kubelet/device-plugins/vcuda-core.sock");
        let mut enc = Encoder::default();
        let mut sent = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        sent.extend(frame(0x4, 0, 0, &[]));
        for stream in [1u32, 3] {
            let mut block = Vec::new();
            for (n, v) in [
                (&b":method"[..], &b"POST"[..]),
                (b":authority", b"localhost"),
                (b"te", b"trailers"),
            ] {
                let f = Encoder::HUFFMAN_VALUE | Encoder::WITH_INDEXING | Encoder::BEST_FORMAT;
                enc.encode((n.to_vec(), v.to_vec(), f), &mut block).unwrap();
            }
            sent.extend(frame(HEADERS, END_HEADERS, stream, &block));
            sent.extend(frame(0x0, 0x1, stream, b"\0\0\0\0\0"));
        }
        // written in awkward pieces
        for piece in sent.chunks(7) {
            w.write_all(piece).await.unwrap();
        }
        w.flush().await.unwrap();
        drop(w);
        let mut wire = Vec::new();
        b.read_to_end(&mut wire).await.unwrap();
        let mut dec = Decoder::with_dynamic_size(4096);
        let mut at = 24 + 9;
        let mut seen = Vec::new();
        while at < wire.len() {
            let len = usize::from(wire[at]) << 16
                | usize::from(wire[at + 1]) << 8
                | usize::from(wire[at + 2]);
            let mut p = wire[at + 9..at + 9 + len].to_vec();
            if wire[at + 3] == HEADERS {
                let mut h = Vec::new();
                dec.decode(&mut p, &mut h).unwrap();
                seen.push(h.into_iter().map(|(n, v, _)| (n, v)).collect::<Vec<_>>());
            } else {
                assert_eq!(p, b"\0\0\0\0\0");
            }
            at += 9 + len;
        }
        let want: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (
                b":authority".to_vec(),
                b"/var/lib/kubelet/device-plugins/vcuda-core.sock".to_vec(),
            ),
            (b"te".to_vec(), b"trailers".to_vec()),
        ];
        assert_eq!(seen, vec![want.clone(), want]);
    }
}
