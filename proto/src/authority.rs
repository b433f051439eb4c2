//! HTTP/2 `:authority` leniency for gRPC servers on Unix sockets, as a pure byte rewriter.
//!
//! Kubelets 1.20–1.25 (grpc-go dialing a bare socket path) send the socket path as the
//! request's `:authority` (`/var/lib/kubelet/device-plugins/vcuda-core.sock`); `h2`, under
//! tonic, rejects an authority containing `/` as malformed and resets every stream
//! (`RST_STREAM` `PROTOCOL_ERROR`), and its maintainers keep the check (hyperium/h2#487).
//! grpc-go servers accept any authority. [`Rewriter`] sits on the bytes a client sends:
//! it passes every frame through untouched except header blocks (`HEADERS` and its
//! `CONTINUATION`s), which it HPACK-decodes (one decoder per connection, so the client's
//! dynamic table is followed) and re-encodes as literals without indexing (so the server's
//! decoder table stays empty and no block ever depends on another), replacing an
//! `:authority` the `http` crate would refuse (the very parser `h2` uses) with `localhost`,
//! which is what the kubelet itself sends since 1.26 (kubernetes/kubernetes#112597).
//! Responses are not touched. Padding is dropped, priority kept.
//!
//! Bounds: a header block larger than [`MAX_HEADER_BLOCK`], a frame larger than HTTP/2's
//! largest, a `CONTINUATION` out of place or an HPACK error ends the connection with a
//! [`ShimError`] (h2 itself would end it with `COMPRESSION_ERROR` or `PROTOCOL_ERROR`). A
//! client that does not start with the HTTP/2 preface is passed through untouched, for the
//! server to refuse.

use httlib_hpack::{Decoder, Encoder};

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// What an unacceptable `:authority` becomes.
pub const REPLACEMENT: &[u8] = b"localhost";
/// Most bytes a header block (`HEADERS` and its `CONTINUATION`s, before decoding) may
/// reach; beyond it the connection ends. The kubelet's are a few hundred bytes.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// The client's HPACK table size: HTTP/2's initial `SETTINGS_HEADER_TABLE_SIZE`, which
/// tonic's server never changes.
const HEADER_TABLE_SIZE: u32 = 4096;
/// Largest payload of a frame the rewriter emits: HTTP/2's initial (and least)
/// `SETTINGS_MAX_FRAME_SIZE`, which every server accepts.
const MAX_OUT_PAYLOAD: usize = 16_384;
/// Largest frame payload HTTP/2 can express (24-bit length).
const MAX_IN_PAYLOAD: usize = (1 << 24) - 1;
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// Why a connection was ended by the rewriter.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShimError {
    #[error(
        "HTTP/2 header block on stream {stream} passed {MAX_HEADER_BLOCK} bytes: connection closed (a client sending headers this large is not a kubelet)"
    )]
    BlockTooLarge { stream: u32 },
    #[error("HTTP/2 frame from the client is malformed ({0}): connection closed")]
    Malformed(&'static str),
    #[error(
        "HPACK header block on stream {stream} cannot be decoded ({detail}): connection closed"
    )]
    Hpack { stream: u32, detail: String },
}

/// Where in the client's byte stream the rewriter is.
#[derive(Debug)]
enum State {
    /// Matching the preface; this many bytes matched so far.
    Preface(usize),
    /// Frame by frame.
    Frames,
    /// Not HTTP/2 with prior knowledge: everything passes untouched.
    PassThrough,
}

/// A header block being gathered across `CONTINUATION` frames.
struct Block {
    stream: u32,
    /// `END_STREAM` as the `HEADERS` frame carried it.
    end_stream: bool,
    /// The `HEADERS` frame's priority fields, if it had them.
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The client-to-server half of one connection. See the module docs.
pub struct Rewriter {
    state: State,
    decoder: Decoder<'static>,
    /// Used only for literals without indexing: it never changes the server's table.
    encoder: Encoder<'static>,
    block: Option<Block>,
    /// Bytes of an incomplete header frame (or frame header), kept until the rest arrives.
    partial: Vec<u8>,
    /// Payload bytes of the current frame (not a header frame) still to pass through as
    /// they come: other frames are never held back whole.
    through: usize,
    rewritten: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl Rewriter {
    pub fn new() -> Rewriter {
        Rewriter {
            state: State::Preface(0),
            decoder: Decoder::with_dynamic_size(HEADER_TABLE_SIZE),
            encoder: Encoder::default(),
            block: None,
            partial: Vec::new(),
            through: 0,
            rewritten: 0,
        }
    }

    /// How many `:authority` values were replaced on this connection.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Take `input` (bytes as read from the client, split anywhere) and append to `out` what
    /// the server is to read. An incomplete frame is held back until its rest arrives.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), ShimError> {
        if let State::Preface(seen) = self.state {
            let want = &PREFACE[seen..];
            let n = want.len().min(input.len());
            out.extend_from_slice(&input[..n]);
            if input[..n] != want[..n] {
                self.state = State::PassThrough;
                out.extend_from_slice(&input[n..]);
                return Ok(());
            }
            input = &input[n..];
            self.state = if seen + n == PREFACE.len() {
                State::Frames
            } else {
                State::Preface(seen + n)
            };
        }
        match self.state {
            State::PassThrough => {
                out.extend_from_slice(input);
                Ok(())
            }
            State::Preface(_) => Ok(()),
            State::Frames => {
                let n = self.through.min(input.len());
                out.extend_from_slice(&input[..n]);
                self.through -= n;
                input = &input[n..];
                if self.partial.is_empty() {
                    let used = self.frames(input, out)?;
                    self.partial.extend_from_slice(&input[used..]);
                } else {
                    let mut held = std::mem::take(&mut self.partial);
                    held.extend_from_slice(input);
                    let used = self.frames(&held, out)?;
                    held.drain(..used);
                    self.partial = held;
                }
                Ok(())
            }
        }
    }

    /// Handle every complete frame at the start of `buf`; returns the bytes used.
    fn frames(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Result<usize, ShimError> {
        let mut at = 0;
        while let Some(head) = buf.get(at..at + FRAME_HEADER) {
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            if len > MAX_IN_PAYLOAD {
                return Err(ShimError::Malformed("frame length"));
            }
            let header_frame = self.block.is_some() || matches!(head[3], HEADERS | CONTINUATION);
            let Some(payload) = buf.get(at + FRAME_HEADER..at + FRAME_HEADER + len) else {
                if !header_frame {
                    // Pass what there is through now, the rest as it comes.
                    out.extend_from_slice(&buf[at..]);
                    self.through = at + FRAME_HEADER + len - buf.len();
                    return Ok(buf.len());
                }
                // A header block cannot grow past its bound while we wait for the frame.
                if len > MAX_HEADER_BLOCK {
                    return Err(ShimError::BlockTooLarge {
                        stream: stream_id(head),
                    });
                }
                break;
            };
            self.frame(head, payload, &buf[at..at + FRAME_HEADER + len], out)?;
            at += FRAME_HEADER + len;
        }
        Ok(at)
    }

    fn frame(
        &mut self,
        head: &[u8],
        payload: &[u8],
        whole: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), ShimError> {
        let (kind, flags, stream) = (head[3], head[4], stream_id(head));
        if let Some(block) = &mut self.block {
            if kind != CONTINUATION || stream != block.stream {
                return Err(ShimError::Malformed(
                    "a header block not followed by its CONTINUATION",
                ));
            }
            if block.fragment.len() + payload.len() > MAX_HEADER_BLOCK {
                return Err(ShimError::BlockTooLarge { stream });
            }
            block.fragment.extend_from_slice(payload);
            if flags & END_HEADERS != 0 {
                let block = self.block.take().expect("checked above");
                self.emit(block, out)?;
            }
            return Ok(());
        }
        match kind {
            HEADERS => {
                let block = headers_block(flags, stream, payload)?;
                if flags & END_HEADERS != 0 {
                    self.emit(block, out)
                } else {
                    self.block = Some(block);
                    Ok(())
                }
            }
            CONTINUATION => Err(ShimError::Malformed("CONTINUATION without HEADERS")),
            _ => {
                out.extend_from_slice(whole);
                Ok(())
            }
        }
    }

    /// Decode a complete header block and write it out re-encoded, as one `HEADERS` frame
    /// and as many `CONTINUATION`s as its size needs.
    fn emit(&mut self, block: Block, out: &mut Vec<u8>) -> Result<(), ShimError> {
        let stream = block.stream;
        let hpack = |e: &dyn std::fmt::Debug| ShimError::Hpack {
            stream,
            detail: format!("{e:?}"),
        };
        let mut fragment = block.fragment;
        let mut fields = Vec::with_capacity(16);
        self.decoder
            .decode(&mut fragment, &mut fields)
            .map_err(|e| hpack(&e))?;
        let mut encoded = Vec::with_capacity(fragment.capacity() + 64);
        let mut replaced = 0;
        for (name, value, flags) in fields {
            let value = if name == b":authority" && !acceptable(&value) {
                replaced += 1;
                REPLACEMENT.to_vec()
            } else {
                value
            };
            // A literal without indexing, or never indexed as the client marked it.
            let flags = flags & Decoder::NEVER_INDEXED;
            self.encoder
                .encode((name, value, flags), &mut encoded)
                .map_err(|e| hpack(&e))?;
        }
        self.rewritten += replaced;
        let prio = block.priority.map_or(0, |_| 5);
        let first = encoded.len().min(MAX_OUT_PAYLOAD - prio);
        let mut flags = if block.end_stream { END_STREAM } else { 0 };
        if block.priority.is_some() {
            flags |= PRIORITY;
        }
        if first == encoded.len() {
            flags |= END_HEADERS;
        }
        frame_header(out, prio + first, HEADERS, flags, block.stream);
        if let Some(p) = block.priority {
            out.extend_from_slice(&p);
        }
        out.extend_from_slice(&encoded[..first]);
        let mut rest = &encoded[first..];
        while !rest.is_empty() {
            let n = rest.len().min(MAX_OUT_PAYLOAD);
            let flags = if n == rest.len() { END_HEADERS } else { 0 };
            frame_header(out, n, CONTINUATION, flags, block.stream);
            out.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
        }
        Ok(())
    }
}

/// Whether `h2` accepts `value` as an `:authority` (the same parser it uses).
pub fn acceptable(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

fn stream_id(head: &[u8]) -> u32 {
    u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff
}

/// The header block fragment of a `HEADERS` frame, padding removed, priority kept.
fn headers_block(flags: u8, stream: u32, payload: &[u8]) -> Result<Block, ShimError> {
    let mut body = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        let (&n, rest) = body
            .split_first()
            .ok_or(ShimError::Malformed("PADDED HEADERS without a pad length"))?;
        pad = usize::from(n);
        body = rest;
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        let p: [u8; 5] = body
            .get(..5)
            .and_then(|p| p.try_into().ok())
            .ok_or(ShimError::Malformed("HEADERS too short for its priority"))?;
        priority = Some(p);
        body = &body[5..];
    }
    let fragment = body
        .get(
            ..body.len().checked_sub(pad).ok_or(ShimError::Malformed(
                "HEADERS padding longer than the frame",
            ))?,
        )
        .unwrap_or_default();
    if fragment.len() > MAX_HEADER_BLOCK {
        return Err(ShimError::BlockTooLarge { stream });
    }
    Ok(Block {
        stream,
        end_stream: flags & END_STREAM != 0,
        priority,
        fragment: fragment.to_vec(),
    })
}

fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = u32::try_from(len).expect("frame payloads are at most 16 KiB here");
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

#[cfg(test)]
mod tests;
