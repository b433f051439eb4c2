//! The control socket between libvcuda and vcuda-manager: a Unix stream socket (the config's
//! `socket`) carrying length-prefixed, versioned frames.
//!
//! ```text
//! 0   u32 LE   length of the rest: 2..=MAX_FRAME
//! 4   u16 LE   PROTOCOL_VERSION
//! 6   …        postcard body: a Request (library → manager) or a Reply (manager → library)
//! ```
//!
//! The conversation: the library sends [`Request::Hello`] naming its allocation and region
//! slot; the manager answers [`Reply::Welcome`] (with the process's pid on the host) or
//! [`Reply::Refused`]. Either side may then [`Request::Ping`] / [`Reply::Pong`] to tell a live
//! peer from a dead one. `vcuda-smi` sends [`Request::Query`] and reads the
//! [`crate::view::View`] back in [`Reply::ViewChunk`]s (a view can be larger than a frame). What the manager does with a Hello is its business; this module fixes
//! only the bytes.
//!
//! **Neither side trusts the other's bytes.** The manager reads from containers, which may be
//! hostile; the library runs inside applications, which must not crash because a manager
//! misbehaved. So the length is checked before a body is read or allocated (a frame never
//! costs more than [`MAX_FRAME`] bytes), and decoding is total: every input is either a
//! message within its documented limits or a typed error — unknown variants, trailing bytes,
//! a foreign version and overlong strings included. Nothing here panics on any input.
//!
//! **Why a version in every frame.** A library and a manager from different releases then
//! fail with "speaks protocol version N" instead of misreading each other's fields. Variants
//! and fields are never reordered or removed without bumping [`PROTOCOL_VERSION`]: postcard
//! identifies them by position, not name.
//!
//! Plain std, no threads, no async: this module is linked into every CUDA process. The
//! blocking helpers ([`write_frame`], [`read_reply`]) are for the library; the manager feeds
//! its async reads into a [`FrameDecoder`].

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Bumped by any change to the frame layout or to a message's encoding.
pub const PROTOCOL_VERSION: u16 = 1;
/// The largest length field accepted (version + body), 16 KiB. Messages are a few hundred
/// bytes at most; the headroom leaves room for new messages within one version, the bound
/// caps what a peer can make the other allocate.
pub const MAX_FRAME: usize = 16 * 1024;
/// Bytes of the length field in front of every frame.
pub const LEN_BYTES: usize = 4;
/// Bytes of the protocol version at the start of every payload.
pub const VERSION_BYTES: usize = 2;
/// Longest [`Hello::allocation`] accepted, in bytes.
pub use crate::config::MAX_ALLOCATION_LEN;
/// Longest [`Reply::Refused`] reason accepted, in bytes.
pub const MAX_REASON_LEN: usize = 256;
/// Most view bytes in one [`Reply::ViewChunk`].
pub const VIEW_CHUNK: usize = 12 * 1024;
/// Most view bytes a reader assembles (a node of 8 GPUs × hundreds of containers is far
/// below this).
pub const MAX_VIEW: usize = 16 << 20;

/// How a process introduces itself, once per connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The allocation id from the container config, at most [`MAX_ALLOCATION_LEN`] bytes: which
    /// container (and so which region) the manager should check the rest against.
    pub allocation: String,
    /// The process's slot index in the region.
    pub slot: u32,
    /// The slot's generation at claim time: tells this claim from an earlier holder's.
    pub generation: u32,
    /// The pid in the container's pid namespace (as stored in the slot).
    pub pid: u32,
    /// Field 22 of `/proc/self/stat` (start time in clock ticks since boot): with the pid, names
    /// the process unambiguously even after pid reuse.
    pub start_time: u64,
}

/// Library → manager.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Tag 0: the first message on a connection.
    Hello(Hello),
    /// Tag 1: are you there? Answered by [`Reply::Pong`].
    Ping,
    /// Tag 2: what does the node look like (`vcuda-smi`)? Answered by [`Reply::ViewChunk`]s
    /// or [`Reply::Refused`]. `allocation`: only that container (which the asking process
    /// must belong to, on a container's socket); None: the whole node (the host's socket
    /// only).
    Query {
        /// At most [`MAX_ALLOCATION_LEN`] bytes.
        allocation: Option<String>,
    },
}

/// Manager → library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Tag 0: the Hello was accepted.
    Welcome {
        /// The process's pid on the host (what NVML reports), for the slot's `host_pid`.
        host_pid: u32,
    },
    /// Tag 1: the Hello was not accepted; the manager closes the connection after this.
    Refused {
        /// Why, for the library's log: at most [`MAX_REASON_LEN`] bytes.
        reason: String,
    },
    /// Tag 2: the answer to [`Request::Ping`].
    Pong,
    /// Tag 3: part of the answer to [`Request::Query`]: postcard bytes of a
    /// [`crate::view::View`], at most [`VIEW_CHUNK`] per frame, in order; `last` ends it.
    ViewChunk { data: Vec<u8>, last: bool },
}

/// Variant counts, for naming an unknown tag in errors. Kept honest by a test that encodes the
/// last variant of each enum.
const REQUEST_VARIANTS: u32 = 3;
const REPLY_VARIANTS: u32 = 4;

impl Reply {
    /// A [`Reply::Refused`] whose reason is cut (at a character boundary) to
    /// [`MAX_REASON_LEN`], so that a long error message cannot make the reply undecodable.
    pub fn refused(reason: impl Into<String>) -> Reply {
        let mut reason = reason.into();
        if reason.len() > MAX_REASON_LEN {
            let mut cut = MAX_REASON_LEN;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        Reply::Refused { reason }
    }
}

/// The length field of a frame cannot be accepted. The stream cannot be resynchronised after
/// this: close the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("control frame claims {len} bytes, more than the {max}-byte maximum", max = MAX_FRAME)]
    Oversize { len: u32 },
    #[error("control frame claims {len} bytes, too few to hold the {VERSION_BYTES}-byte protocol version")]
    Undersize { len: u32 },
}

impl FrameError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            FrameError::Oversize { .. } => "frame-oversize",
            FrameError::Undersize { .. } => "frame-undersize",
        }
    }
}

/// A frame payload that is not a message of this protocol version. `message` is "Request" or
/// "Reply": what the payload was decoded as.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("control payload of {len} bytes is more than the {max}-byte maximum", max = MAX_FRAME)]
    Oversize { len: usize },
    #[error("control payload of {len} bytes is too short to hold the {VERSION_BYTES}-byte protocol version")]
    NoVersion { len: usize },
    #[error("control frame speaks protocol version {got}, this side speaks {PROTOCOL_VERSION}")]
    Version { got: u16 },
    #[error("control {message} of unknown variant {tag}")]
    UnknownVariant { message: &'static str, tag: u32 },
    #[error("control {message} truncated: the body ends inside a field")]
    Truncated { message: &'static str },
    #[error("control {message} followed by {count} trailing bytes in its frame")]
    Trailing { message: &'static str, count: usize },
    #[error("control {message}: a string is not valid UTF-8")]
    BadUtf8 { message: &'static str },
    #[error("control {message}: {field} is {len} bytes, more than the {max} allowed")]
    TooLong {
        message: &'static str,
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("control {message} malformed: {error}")]
    Malformed {
        message: &'static str,
        error: postcard::Error,
    },
}

impl DecodeError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::Oversize { .. } => "oversize",
            DecodeError::NoVersion { .. } => "no-version",
            DecodeError::Version { .. } => "version",
            DecodeError::UnknownVariant { .. } => "unknown-variant",
            DecodeError::Truncated { .. } => "truncated",
            DecodeError::Trailing { .. } => "trailing",
            DecodeError::BadUtf8 { .. } => "bad-utf8",
            DecodeError::TooLong { .. } => "too-long",
            DecodeError::Malformed { .. } => "malformed",
        }
    }
}

/// What the blocking helpers report. After any of these the connection is unusable (a frame
/// may be half read): close it.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Includes timeouts (`WouldBlock` / `TimedOut`, from the caller's socket timeouts).
    #[error("vcuda: control socket: {0}")]
    Io(#[from] io::Error),
    #[error("vcuda: control socket closed by the peer")]
    Closed,
    #[error("vcuda: control socket closed by the peer mid-frame, after {got} of {want} bytes")]
    ClosedMidFrame { got: usize, want: usize },
    #[error("vcuda: control socket: {0}")]
    Frame(#[from] FrameError),
    #[error("vcuda: control socket: {0}")]
    Decode(#[from] DecodeError),
}

/// The whole frame for `req`, ready to write.
pub fn encode_request(req: &Request) -> Vec<u8> {
    encode(req)
}

/// The whole frame for `reply`, ready to write.
pub fn encode_reply(reply: &Reply) -> Vec<u8> {
    encode(reply)
}

fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut frame = Vec::with_capacity(64);
    frame.extend_from_slice(&[0; LEN_BYTES]);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    let header = frame.clone();
    // postcard fails only on a full fixed-size buffer or a sequence of unknown length, neither
    // of which a Vec and these types produce. Should it ever, the peer gets an empty body and
    // rejects it as truncated: better than a panic inside the application.
    let mut frame = postcard::to_extend(msg, frame).unwrap_or(header);
    // A message over the 4 GiB a u32 holds (only possible with strings far over their
    // limits) gets a length the peer rejects as oversize.
    let len = u32::try_from(frame.len() - LEN_BYTES).unwrap_or(u32::MAX);
    frame[..LEN_BYTES].copy_from_slice(&len.to_le_bytes());
    frame
}

/// The frames answering a [`Request::Query`] with `view` (at least one, the last marked).
pub fn view_frames(view: &crate::view::View) -> Vec<Vec<u8>> {
    let bytes = view.to_bytes();
    let mut chunks: Vec<&[u8]> = bytes.chunks(VIEW_CHUNK).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            encode_reply(&Reply::ViewChunk {
                data: c.to_vec(),
                last: i + 1 == n,
            })
        })
        .collect()
}

/// What reading a view can fail with, beyond the socket's own errors.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error("{0}")]
    Control(#[from] ControlError),
    #[error("the manager refused: {0}")]
    Refused(String),
    #[error("the manager answered {0:?} to a query")]
    Unexpected(Box<Reply>),
    #[error("the view is larger than {MAX_VIEW} bytes")]
    TooLarge,
    #[error("the view does not decode ({0}); are vcuda-smi and vcuda-manager the same release?")]
    Decode(postcard::Error),
}

/// Read the [`Reply::ViewChunk`]s answering a query (blocking) and decode the view.
pub fn read_view(r: &mut impl Read) -> Result<crate::view::View, ViewError> {
    let mut bytes = Vec::new();
    loop {
        match read_reply(r)? {
            Reply::ViewChunk { data, last } => {
                if bytes.len() + data.len() > MAX_VIEW {
                    return Err(ViewError::TooLarge);
                }
                bytes.extend_from_slice(&data);
                if last {
                    break;
                }
            }
            Reply::Refused { reason } => return Err(ViewError::Refused(reason)),
            other => return Err(ViewError::Unexpected(Box::new(other))),
        }
    }
    crate::view::View::from_bytes(&bytes).map_err(ViewError::Decode)
}

/// The payload length a length field announces, if acceptable. Checked before any byte of the
/// body is read or allocated.
fn payload_len(field: u32) -> Result<usize, FrameError> {
    match usize::try_from(field) {
        Ok(n) if n > MAX_FRAME => Err(FrameError::Oversize { len: field }),
        Ok(n) if n < VERSION_BYTES => Err(FrameError::Undersize { len: field }),
        Ok(n) => Ok(n),
        Err(_) => Err(FrameError::Oversize { len: field }),
    }
}

/// Decodes a payload (what [`FrameDecoder::next_frame`] or [`read_frame`] returns: version and
/// body) as a [`Request`].
pub fn decode_request(payload: &[u8]) -> Result<Request, DecodeError> {
    const MESSAGE: &str = "Request";
    let req: Request = decode(payload, MESSAGE, REQUEST_VARIANTS)?;
    match &req {
        Request::Hello(h) => check_len(
            MESSAGE,
            "Hello.allocation",
            &h.allocation,
            MAX_ALLOCATION_LEN,
        )?,
        Request::Query {
            allocation: Some(a),
        } => check_len(MESSAGE, "Query.allocation", a, MAX_ALLOCATION_LEN)?,
        _ => {}
    }
    Ok(req)
}

/// Decodes a payload (version and body) as a [`Reply`].
pub fn decode_reply(payload: &[u8]) -> Result<Reply, DecodeError> {
    const MESSAGE: &str = "Reply";
    let reply: Reply = decode(payload, MESSAGE, REPLY_VARIANTS)?;
    match &reply {
        Reply::Refused { reason } => check_len(MESSAGE, "Refused.reason", reason, MAX_REASON_LEN)?,
        Reply::ViewChunk { data, .. } if data.len() > VIEW_CHUNK => {
            return Err(DecodeError::TooLong {
                message: MESSAGE,
                field: "ViewChunk.data",
                len: data.len(),
                max: VIEW_CHUNK,
            })
        }
        _ => {}
    }
    Ok(reply)
}

fn check_len(
    message: &'static str,
    field: &'static str,
    s: &str,
    max: usize,
) -> Result<(), DecodeError> {
    if s.len() > max {
        return Err(DecodeError::TooLong {
            message,
            field,
            len: s.len(),
            max,
        });
    }
    Ok(())
}

fn decode<T: DeserializeOwned>(
    payload: &[u8],
    message: &'static str,
    variants: u32,
) -> Result<T, DecodeError> {
    if payload.len() > MAX_FRAME {
        return Err(DecodeError::Oversize { len: payload.len() });
    }
    let Some((version, body)) = payload.split_first_chunk::<VERSION_BYTES>() else {
        return Err(DecodeError::NoVersion { len: payload.len() });
    };
    let got = u16::from_le_bytes(*version);
    if got != PROTOCOL_VERSION {
        return Err(DecodeError::Version { got });
    }
    // postcard would reject an unknown tag too, but as an anonymous serde error; reading the
    // tag here names it. (A tag that is not a valid varint is left to postcard.)
    if let Some(tag) = leading_tag(body) {
        if tag >= variants {
            return Err(DecodeError::UnknownVariant { message, tag });
        }
    }
    // Strings are allocated only once their bytes are present, so a body never allocates
    // more than its own length.
    match postcard::take_from_bytes::<T>(body) {
        Ok((msg, [])) => Ok(msg),
        Ok((_, rest)) => Err(DecodeError::Trailing {
            message,
            count: rest.len(),
        }),
        Err(postcard::Error::DeserializeUnexpectedEnd) => Err(DecodeError::Truncated { message }),
        Err(postcard::Error::DeserializeBadUtf8) => Err(DecodeError::BadUtf8 { message }),
        Err(error) => Err(DecodeError::Malformed { message, error }),
    }
}

/// The enum tag postcard writes first: a LEB128 varint u32 (at most 5 bytes, the last
/// carrying 4 bits). `None` if absent or invalid.
fn leading_tag(body: &[u8]) -> Option<u32> {
    let mut tag = 0u32;
    for (i, &b) in body.iter().take(5).enumerate() {
        if i == 4 && b > 0x0f {
            return None;
        }
        tag |= u32::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some(tag);
        }
    }
    None
}

/// Splits a byte stream into frame payloads, for readers that get bytes in arbitrary chunks
/// (the manager's async reads). Push what was read, then call [`FrameDecoder::next_frame`]
/// until it returns `Ok(None)`; the buffer then holds at most one incomplete frame
/// (≤ [`LEN_BYTES`] + [`MAX_FRAME`] bytes) beyond the last push.
///
/// A bad length field is an error before any of the body is buffered for it, and it sticks:
/// the stream cannot be resynchronised, so every later call returns the same error.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already returned as frames.
    start: usize,
    failed: Option<FrameError>,
}

impl FrameDecoder {
    pub fn new() -> FrameDecoder {
        FrameDecoder::default()
    }

    /// Appends bytes read from the stream. Ignored once the decoder has failed.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        // Drop consumed frames before growing, so the buffer does not grow with the
        // connection's lifetime.
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame's payload (version and body, ≤ [`MAX_FRAME`] bytes; decode it
    /// with [`decode_request`] or [`decode_reply`]), `Ok(None)` if more bytes are needed, or the
    /// (sticky) error of an unacceptable length field.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let pending = self.buf.get(self.start..).unwrap_or_default();
        let Some((field, rest)) = pending.split_first_chunk::<LEN_BYTES>() else {
            return Ok(None);
        };
        let len = match payload_len(u32::from_le_bytes(*field)) {
            Ok(len) => len,
            Err(e) => {
                self.failed = Some(e);
                self.buf = Vec::new();
                self.start = 0;
                return Err(e);
            }
        };
        let Some(payload) = rest.get(..len) else {
            return Ok(None);
        };
        let payload = payload.to_vec();
        self.start += LEN_BYTES + len;
        Ok(Some(payload))
    }

    /// Bytes received and not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }
}

/// Writes one whole frame (from [`encode_request`] or [`encode_reply`]) and flushes.
///
/// Give it a `UnixStream`, not a `File` made from the socket's descriptor: std writes to a
/// `UnixStream` with `MSG_NOSIGNAL`, so a manager that has gone away yields `EPIPE` instead
/// of a SIGPIPE that would kill the application.
pub fn write_frame<W: Write>(stream: &mut W, frame: &[u8]) -> Result<(), ControlError> {
    stream.write_all(frame)?;
    stream.flush()?;
    Ok(())
}

/// Reads exactly one frame and returns its payload (version and body). Reads no byte beyond
/// the frame, and allocates only once the length field has been checked. Blocks; the caller
/// sets socket timeouts.
pub fn read_frame<R: Read>(stream: &mut R) -> Result<Vec<u8>, ControlError> {
    let mut field = [0u8; LEN_BYTES];
    fill(stream, &mut field, 0)?;
    let len = payload_len(u32::from_le_bytes(field))?;
    let mut payload = vec![0u8; len];
    fill(stream, &mut payload, LEN_BYTES)?;
    Ok(payload)
}

/// Reads one frame and decodes it as a [`Reply`] (the library's side).
pub fn read_reply<R: Read>(stream: &mut R) -> Result<Reply, ControlError> {
    Ok(decode_reply(&read_frame(stream)?)?)
}

/// Reads one frame and decodes it as a [`Request`] (for blocking managers and tests).
pub fn read_request<R: Read>(stream: &mut R) -> Result<Request, ControlError> {
    Ok(decode_request(&read_frame(stream)?)?)
}

/// Fills `buf` from `stream`; `before` is how many bytes of the frame were read earlier, so
/// that an end of stream is reported as a clean close only at a frame boundary.
fn fill<R: Read>(stream: &mut R, buf: &mut [u8], before: usize) -> Result<(), ControlError> {
    let mut got = 0;
    while got < buf.len() {
        let Some(rest) = buf.get_mut(got..) else {
            break;
        };
        match stream.read(rest) {
            Ok(0) if before + got == 0 => return Err(ControlError::Closed),
            Ok(0) => {
                return Err(ControlError::ClosedMidFrame {
                    got: before + got,
                    want: before + buf.len(),
                })
            }
            Ok(n) => got += n.min(rest.len()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello() -> Hello {
        Hello {
            allocation: "alloc-7f3a".into(),
            slot: 3,
            generation: 17,
            pid: 42,
            start_time: 123_456_789,
        }
    }

    fn requests() -> Vec<Request> {
        vec![
            Request::Hello(hello()),
            Request::Hello(Hello {
                allocation: "a".repeat(MAX_ALLOCATION_LEN),
                slot: u32::MAX,
                generation: u32::MAX,
                pid: u32::MAX,
                start_time: u64::MAX,
            }),
            Request::Hello(Hello {
                allocation: String::new(),
                slot: 0,
                generation: 0,
                pid: 0,
                start_time: 0,
            }),
            Request::Ping,
            Request::Query { allocation: None },
            Request::Query {
                allocation: Some("a1".into()),
            },
        ]
    }

    fn replies() -> Vec<Reply> {
        vec![
            Reply::Welcome { host_pid: 98765 },
            Reply::Welcome { host_pid: u32::MAX },
            Reply::Refused {
                reason: "unknown allocation".into(),
            },
            Reply::Refused {
                reason: "é".repeat(MAX_REASON_LEN / 2),
            },
            Reply::Pong,
            Reply::ViewChunk {
                data: vec![7; VIEW_CHUNK],
                last: true,
            },
        ]
    }

    /// The payload of a frame: everything after the length field.
    fn payload(frame: &[u8]) -> &[u8] {
        &frame[LEN_BYTES..]
    }

    /// A frame around a hand-made payload.
    fn frame_of(payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(payload);
        f
    }

    /// A version-1 payload with a hand-made body.
    fn versioned(body: &[u8]) -> Vec<u8> {
        let mut p = PROTOCOL_VERSION.to_le_bytes().to_vec();
        p.extend_from_slice(body);
        p
    }

    #[test]
    fn every_message_round_trips() {
        for r in requests() {
            let f = encode_request(&r);
            assert_eq!(
                u32::from_le_bytes(f[..4].try_into().unwrap()) as usize,
                f.len() - 4
            );
            assert_eq!(&f[4..6], &PROTOCOL_VERSION.to_le_bytes());
            assert_eq!(decode_request(payload(&f)).unwrap(), r);
            assert_eq!(read_request(&mut &f[..]).unwrap(), r);
        }
        for r in replies() {
            let f = encode_reply(&r);
            assert_eq!(decode_reply(payload(&f)).unwrap(), r);
            assert_eq!(read_reply(&mut &f[..]).unwrap(), r);
        }
    }

    #[test]
    fn wire_format_is_stable() {
        // Ping is tag 1, Pong tag 2, Welcome tag 0 with a varint: changing these is a
        // protocol change.
        assert_eq!(encode_request(&Request::Ping), [3, 0, 0, 0, 1, 0, 1]);
        assert_eq!(encode_reply(&Reply::Pong), [3, 0, 0, 0, 1, 0, 2]);
        assert_eq!(
            encode_reply(&Reply::Welcome { host_pid: 300 }),
            [5, 0, 0, 0, 1, 0, 0, 0xac, 0x02]
        );
        // The variant counts used to name unknown tags match the enums.
        assert_eq!(
            leading_tag(&payload(&encode_request(&Request::Query { allocation: None }))[2..]),
            Some(REQUEST_VARIANTS - 1)
        );
        assert_eq!(
            leading_tag(
                &payload(&encode_reply(&Reply::ViewChunk {
                    data: vec![],
                    last: true
                }))[2..]
            ),
            Some(REPLY_VARIANTS - 1)
        );
    }

    #[test]
    fn oversize_and_undersize_lengths_are_rejected_before_the_body() {
        for len in [MAX_FRAME as u32 + 1, u32::MAX] {
            let mut d = FrameDecoder::new();
            d.push(&len.to_le_bytes());
            assert_eq!(d.next_frame(), Err(FrameError::Oversize { len }));
            // Sticky: later bytes do not resynchronise.
            d.push(&encode_request(&Request::Ping));
            assert_eq!(d.next_frame(), Err(FrameError::Oversize { len }));
            assert_eq!(d.buffered(), 0);
            let e = read_frame(&mut &len.to_le_bytes()[..]).unwrap_err();
            assert!(matches!(
                e,
                ControlError::Frame(FrameError::Oversize { .. })
            ));
            assert!(
                e.to_string().contains("more than the 16384-byte maximum"),
                "{e}"
            );
        }
        for len in [0u32, 1] {
            let mut d = FrameDecoder::new();
            d.push(&len.to_le_bytes());
            assert_eq!(d.next_frame(), Err(FrameError::Undersize { len }));
        }
        // Exactly MAX_FRAME is a frame (whose body is then rejected as trailing garbage).
        let mut p = versioned(&[1]);
        p.resize(MAX_FRAME, 0);
        let mut d = FrameDecoder::new();
        d.push(&frame_of(&p));
        let got = d.next_frame().unwrap().unwrap();
        assert_eq!(got.len(), MAX_FRAME);
        assert_eq!(
            decode_request(&got),
            Err(DecodeError::Trailing {
                message: "Request",
                count: MAX_FRAME - 3
            })
        );
        assert_eq!(
            decode_request(&vec![0; MAX_FRAME + 1]),
            Err(DecodeError::Oversize { len: MAX_FRAME + 1 })
        );
    }

    #[test]
    fn truncated_input_is_rejected() {
        // Every strict prefix of every body: truncated (or, for an empty payload, no version).
        for f in requests().iter().map(encode_request) {
            let p = payload(&f);
            for cut in 0..p.len() {
                let e = decode_request(&p[..cut]).unwrap_err();
                match cut {
                    0 | 1 => assert_eq!(e, DecodeError::NoVersion { len: cut }),
                    _ => assert_eq!(
                        e,
                        DecodeError::Truncated { message: "Request" },
                        "cut {cut}"
                    ),
                }
            }
        }
        for f in replies().iter().map(encode_reply) {
            let p = payload(&f);
            for cut in 2..p.len() {
                assert_eq!(
                    decode_reply(&p[..cut]),
                    Err(DecodeError::Truncated { message: "Reply" })
                );
            }
        }
        // A stream that ends mid-frame, or before any frame.
        let f = encode_reply(&Reply::Welcome { host_pid: 7 });
        for cut in 1..f.len() {
            match read_reply(&mut &f[..cut]) {
                Err(ControlError::ClosedMidFrame { got, want }) => {
                    assert_eq!(got, cut);
                    assert_eq!(want, if cut < 4 { 4 } else { f.len() });
                }
                other => panic!("cut {cut}: {other:?}"),
            }
        }
        assert!(matches!(
            read_reply(&mut &[][..]),
            Err(ControlError::Closed)
        ));
    }

    #[test]
    fn wrong_version_is_rejected() {
        for v in [0u16, 2, u16::MAX] {
            let mut f = encode_request(&Request::Ping);
            f[4..6].copy_from_slice(&v.to_le_bytes());
            let e = decode_request(payload(&f)).unwrap_err();
            assert_eq!(e, DecodeError::Version { got: v });
            assert!(e.to_string().contains(&format!("version {v}")), "{e}");
            assert!(matches!(
                read_reply(&mut &f[..]),
                Err(ControlError::Decode(DecodeError::Version { .. }))
            ));
        }
    }

    #[test]
    fn a_view_larger_than_a_frame_travels_in_chunks() {
        let mut v = crate::view::View {
            schema: crate::view::SCHEMA,
            scope: "node".into(),
            ..Default::default()
        };
        for i in 0..2000 {
            v.containers.push(crate::view::ContainerView {
                pod: format!("pod-{i}"),
                allocation: format!("a{i}"),
                ..Default::default()
            });
        }
        let frames = view_frames(&v);
        assert!(frames.len() > 1, "{} bytes", v.to_bytes().len());
        assert!(frames.iter().all(|f| f.len() <= LEN_BYTES + MAX_FRAME));
        let wire: Vec<u8> = frames.concat();
        assert_eq!(read_view(&mut &wire[..]).unwrap(), v);
        // A refusal instead of a view is an error naming the reason.
        let refused = encode_reply(&Reply::refused("not yours"));
        let e = read_view(&mut &refused[..]).unwrap_err();
        assert!(e.to_string().contains("not yours"), "{e}");
        // An empty view is one (last) frame.
        assert_eq!(view_frames(&crate::view::View::default()).len(), 1);
    }

    #[test]
    fn unknown_variants_are_rejected() {
        assert_eq!(
            decode_request(&versioned(&[REQUEST_VARIANTS as u8])),
            Err(DecodeError::UnknownVariant {
                message: "Request",
                tag: REQUEST_VARIANTS
            })
        );
        assert_eq!(
            decode_reply(&versioned(&[REPLY_VARIANTS as u8])),
            Err(DecodeError::UnknownVariant {
                message: "Reply",
                tag: REPLY_VARIANTS
            })
        );
        // A large tag as a multi-byte varint.
        let e = decode_reply(&versioned(&[0xff, 0xff, 0xff, 0xff, 0x0f])).unwrap_err();
        assert_eq!(
            e,
            DecodeError::UnknownVariant {
                message: "Reply",
                tag: u32::MAX
            }
        );
        assert!(e.to_string().contains("unknown variant 4294967295"), "{e}");
        // A tag that is not a varint at all.
        assert!(matches!(
            decode_reply(&versioned(&[0xff; 6])),
            Err(DecodeError::Malformed { .. })
        ));
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        for r in requests() {
            let mut p = payload(&encode_request(&r)).to_vec();
            p.extend_from_slice(&[0, 0]);
            assert_eq!(
                decode_request(&p),
                Err(DecodeError::Trailing {
                    message: "Request",
                    count: 2
                })
            );
        }
        let mut p = payload(&encode_reply(&Reply::Pong)).to_vec();
        p.push(0xaa);
        assert_eq!(
            decode_reply(&p),
            Err(DecodeError::Trailing {
                message: "Reply",
                count: 1
            })
        );
    }

    #[test]
    fn overlong_strings_are_rejected() {
        let mut h = hello();
        h.allocation = "x".repeat(MAX_ALLOCATION_LEN + 1);
        let f = encode_request(&Request::Hello(h));
        let e = decode_request(payload(&f)).unwrap_err();
        assert_eq!(
            e,
            DecodeError::TooLong {
                message: "Request",
                field: "Hello.allocation",
                len: MAX_ALLOCATION_LEN + 1,
                max: MAX_ALLOCATION_LEN
            }
        );
        assert!(
            e.to_string().contains("Hello.allocation is 129 bytes"),
            "{e}"
        );

        let f = encode_reply(&Reply::Refused {
            reason: "y".repeat(MAX_REASON_LEN + 1),
        });
        assert!(matches!(
            decode_reply(payload(&f)),
            Err(DecodeError::TooLong {
                field: "Refused.reason",
                ..
            })
        ));
        // A string longer than the frame allows: the peer refuses the frame itself.
        let f = encode_reply(&Reply::Refused {
            reason: "z".repeat(MAX_FRAME),
        });
        assert!(matches!(
            read_reply(&mut &f[..]),
            Err(ControlError::Frame(FrameError::Oversize { .. }))
        ));
        // Reply::refused cuts at a character boundary to fit.
        let r = Reply::refused("é".repeat(MAX_REASON_LEN));
        let Reply::Refused { reason } = &r else {
            unreachable!()
        };
        assert_eq!(reason.len(), MAX_REASON_LEN);
        assert_eq!(decode_reply(payload(&encode_reply(&r))).unwrap(), r);
        let r = Reply::refused("é".repeat(MAX_REASON_LEN / 2) + "x");
        let Reply::Refused { reason } = &r else {
            unreachable!()
        };
        assert_eq!(reason.len(), MAX_REASON_LEN);
        assert!(reason.ends_with('é'));
    }

    #[test]
    fn bad_utf8_is_rejected() {
        // Hello: tag 0, allocation of length 2 holding an invalid sequence, then the integers.
        let body = [0, 2, 0xc3, 0x28, 1, 1, 1, 1];
        assert_eq!(
            decode_request(&versioned(&body)),
            Err(DecodeError::BadUtf8 { message: "Request" })
        );
    }

    #[test]
    fn split_at_every_byte_boundary_decodes_the_same() {
        let frames: Vec<Vec<u8>> = requests()
            .iter()
            .map(encode_request)
            .chain(replies().iter().map(encode_reply))
            .collect();
        for f in &frames {
            for cut in 0..=f.len() {
                let mut d = FrameDecoder::new();
                d.push(&f[..cut]);
                if cut < f.len() {
                    assert_eq!(d.next_frame(), Ok(None), "cut {cut}");
                }
                d.push(&f[cut..]);
                assert_eq!(d.next_frame().unwrap().as_deref(), Some(payload(f)));
                assert_eq!(d.next_frame(), Ok(None));
                assert_eq!(d.buffered(), 0);
            }
            // One byte at a time.
            let mut d = FrameDecoder::new();
            let mut got = Vec::new();
            for b in f {
                d.push(&[*b]);
                while let Some(p) = d.next_frame().unwrap() {
                    got.push(p);
                }
            }
            assert_eq!(got, vec![payload(f).to_vec()]);
        }
    }

    #[test]
    fn two_frames_in_one_buffer() {
        let a = encode_request(&Request::Hello(hello()));
        let b = encode_request(&Request::Ping);
        let mut both = a.clone();
        both.extend_from_slice(&b);
        let mut d = FrameDecoder::new();
        d.push(&both[..both.len() - 1]);
        assert_eq!(
            decode_request(&d.next_frame().unwrap().unwrap()).unwrap(),
            Request::Hello(hello())
        );
        assert_eq!(d.next_frame(), Ok(None));
        d.push(&both[both.len() - 1..]);
        assert_eq!(
            decode_request(&d.next_frame().unwrap().unwrap()).unwrap(),
            Request::Ping
        );
        assert_eq!(d.next_frame(), Ok(None));
        // read_frame takes one frame and leaves the next in the stream.
        let mut s = &both[..];
        assert_eq!(read_request(&mut s).unwrap(), Request::Hello(hello()));
        assert_eq!(s, &b[..]);
        assert_eq!(read_request(&mut s).unwrap(), Request::Ping);
        assert!(matches!(read_request(&mut s), Err(ControlError::Closed)));
    }

    #[test]
    fn write_frame_writes_the_whole_frame() {
        let f = encode_reply(&Reply::Welcome { host_pid: 1 });
        let mut out = Vec::new();
        write_frame(&mut out, &f).unwrap();
        assert_eq!(out, f);
    }

    /// A reader that returns at most one byte per call, with interruptions.
    struct Trickle<'a>(&'a [u8], bool);
    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.1 = !self.1;
            if self.1 {
                return Err(io::ErrorKind::Interrupted.into());
            }
            (&mut self.0).take(1).read(buf)
        }
    }

    #[test]
    fn read_reply_survives_short_reads_and_interruptions() {
        for r in replies() {
            let f = encode_reply(&r);
            assert_eq!(read_reply(&mut Trickle(&f, false)).unwrap(), r);
        }
    }

    fn arb_string(max: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(any::<char>(), 0..=max / 4).prop_map(|v| v.into_iter().collect())
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        prop_oneof![
            (
                arb_string(MAX_ALLOCATION_LEN),
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                any::<u64>()
            )
                .prop_map(|(allocation, slot, generation, pid, start_time)| {
                    Request::Hello(Hello {
                        allocation,
                        slot,
                        generation,
                        pid,
                        start_time,
                    })
                }),
            Just(Request::Ping),
            proptest::option::of(arb_string(MAX_ALLOCATION_LEN))
                .prop_map(|allocation| Request::Query { allocation }),
        ]
    }

    fn arb_reply() -> impl Strategy<Value = Reply> {
        prop_oneof![
            any::<u32>().prop_map(|host_pid| Reply::Welcome { host_pid }),
            arb_string(MAX_REASON_LEN).prop_map(|reason| Reply::Refused { reason }),
            Just(Reply::Pong),
            (proptest::collection::vec(any::<u8>(), 0..64), any::<bool>())
                .prop_map(|(data, last)| Reply::ViewChunk { data, last }),
        ]
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_nor_exceed_max_frame(
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            chunks in proptest::collection::vec(1usize..64, 1..32),
            // Sometimes a plausible length field, so bodies are reached often.
            len in prop_oneof![Just(None), (0u32..64).prop_map(Some)],
        ) {
            let mut input = bytes.clone();
            if let Some(len) = len {
                input.splice(0..0, len.to_le_bytes());
            }
            let _ = decode_request(&input);
            let _ = decode_reply(&input);
            let _ = read_frame(&mut &input[..]);
            let mut d = FrameDecoder::new();
            let mut at = 0;
            for c in chunks.iter().cycle() {
                if at >= input.len() {
                    break;
                }
                let end = (at + c).min(input.len());
                d.push(&input[at..end]);
                at = end;
                while let Ok(Some(p)) = d.next_frame() {
                    prop_assert!(p.len() <= MAX_FRAME);
                    if let Ok(r) = decode_request(&p) {
                        prop_assert_eq!(decode_request(payload(&encode_request(&r))), Ok(r));
                    }
                    if let Ok(r) = decode_reply(&p) {
                        prop_assert_eq!(decode_reply(payload(&encode_reply(&r))), Ok(r));
                    }
                }
                prop_assert!(d.buffered() <= LEN_BYTES + MAX_FRAME);
            }
        }

        #[test]
        fn arbitrary_messages_round_trip(req in arb_request(), reply in arb_reply()) {
            let mut stream = encode_request(&req);
            stream.extend(encode_reply(&reply));
            let mut s = &stream[..];
            prop_assert_eq!(read_request(&mut s).unwrap(), req);
            prop_assert_eq!(read_reply(&mut s).unwrap(), reply);
        }
    }
}
