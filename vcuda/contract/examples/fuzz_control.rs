//! A mutation fuzzer for the control protocol (`vcuda_contract::control`) that runs on stable
//! Rust: cargo-fuzz needs nightly, which this project does not use. Run it with
//! `scripts/fuzz-control [--seconds N] [--seed S]`.
//!
//! It starts from valid frames of every message (and two just over a string limit), mutates
//! them (bit flips, byte sets, truncation, length-field and version edits, splicing, random
//! bytes) with a seeded xorshift generator, and feeds each input to every decoding path: `FrameDecoder` in one push and in
//! random chunks, `read_frame` over a byte stream, and `decode_request` / `decode_reply` on the
//! frames and on raw bytes. Invariants checked on every input:
//!
//! - nothing panics (each input runs under `catch_unwind`; a failure prints the input in hex);
//! - the chunked decoder, the one-push decoder and `read_frame` agree frame for frame, and on
//!   how the input ends (complete, mid-frame, or a length error);
//! - no payload exceeds `MAX_FRAME`;
//! - every decoded message re-encodes to a frame (of at most `LEN_BYTES + MAX_FRAME` bytes)
//!   that decodes to an equal message.
//!
//! Without coverage feedback, novelty is approximated by the sequence of outcome kinds an input
//! produces: an input with an unseen sequence joins the corpus.
//!
//! Every fourth execution fuzzes the manager's region reader instead (`region_file::parse`,
//! which reads a file any process of a container can write): a valid region with live slots,
//! made by the library's and the manager's own code, mutated the same way (sizes included).
//! Invariants: nothing panics; a region that parses has the region's size, at most
//! `MAX_PROCS` slots, and no counter that reads negative.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vcuda_contract::control::{
    decode_reply, decode_request, encode_reply, encode_request, read_frame, ControlError,
    FrameDecoder, Hello, Reply, Request, LEN_BYTES, MAX_ALLOCATION_LEN, MAX_FRAME, MAX_REASON_LEN,
    PROTOCOL_VERSION,
};
use vcuda_contract::region::{Region, MAX_PROCS, REGION_SIZE};
use vcuda_contract::region_file::{parse, RegionFile};

const USAGE: &str =
    "usage: fuzz_control [--seconds N (default 60)] [--seed S (default: from the clock)]";
/// Corpus entries beyond the seeds; a full corpus replaces a random non-seed entry.
const MAX_CORPUS: usize = 4096;
/// Inputs are kept below this so that executions stay fast; a few exceed MAX_FRAME anyway.
const MAX_INPUT: usize = 3 * MAX_FRAME;

/// xorshift64*: small, fast, and reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        // A zero state would stay zero.
        Rng((seed ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform-enough in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

/// Valid frames of every message, and a few multi-frame streams.
fn seeds() -> Vec<Vec<u8>> {
    let hellos = [
        Hello {
            allocation: "alloc-7f3a".into(),
            slot: 3,
            generation: 17,
            pid: 42,
            start_time: 123_456_789,
        },
        Hello {
            allocation: "a".repeat(MAX_ALLOCATION_LEN),
            slot: u32::MAX,
            generation: u32::MAX,
            pid: u32::MAX,
            start_time: u64::MAX,
        },
        Hello {
            allocation: String::new(),
            slot: 0,
            generation: 0,
            pid: 1,
            start_time: 0,
        },
    ];
    let mut out: Vec<Vec<u8>> = hellos
        .into_iter()
        .map(|h| encode_request(&Request::Hello(h)))
        .collect();
    out.push(encode_request(&Request::Ping));
    for r in [
        Reply::Welcome { host_pid: 98_765 },
        Reply::Welcome { host_pid: u32::MAX },
        Reply::refused("unknown allocation alloc-7f3a"),
        Reply::refused("é".repeat(MAX_REASON_LEN)),
        Reply::Pong,
    ] {
        out.push(encode_reply(&r));
    }
    // Well-formed but one byte over a string limit: the limit checks are hard to reach by
    // blind mutation (the string's length prefix and the frame's length must both agree).
    out.push(encode_request(&Request::Hello(Hello {
        allocation: "b".repeat(MAX_ALLOCATION_LEN + 1),
        slot: 1,
        generation: 1,
        pid: 1,
        start_time: 1,
    })));
    out.push(encode_reply(&Reply::Refused {
        reason: "r".repeat(MAX_REASON_LEN + 1),
    }));
    let n = out.len();
    for i in 0..n {
        let mut two = out[i].clone();
        two.extend_from_slice(&out[(i + 1) % n]);
        out.push(two);
    }
    out
}

fn interesting_u32(rng: &mut Rng, current: u32) -> u32 {
    let max = MAX_FRAME as u32;
    let choices = [
        0,
        1,
        2,
        3,
        current.wrapping_sub(1),
        current.wrapping_add(1),
        max - 1,
        max,
        max + 1,
        u32::MAX,
        0x8000_0000,
        rng.next() as u32,
        (rng.next() % 64) as u32,
    ];
    choices[rng.below(choices.len())]
}

fn interesting_byte(rng: &mut Rng) -> u8 {
    let choices = [0u8, 1, 2, 3, 0x0f, 0x10, 0x7f, 0x80, 0xff, 0xc3, 0xe9];
    if rng.below(2) == 0 {
        choices[rng.below(choices.len())]
    } else {
        rng.byte()
    }
}

/// Applies 1 to 4 random mutations to `input`.
fn mutate(rng: &mut Rng, corpus: &[Vec<u8>], input: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        match rng.below(12) {
            // Bit flip.
            0 if !input.is_empty() => {
                let i = rng.below(input.len());
                input[i] ^= 1 << rng.below(8);
            }
            // Byte set.
            1 if !input.is_empty() => {
                let i = rng.below(input.len());
                input[i] = interesting_byte(rng);
            }
            // Truncation.
            2 => {
                let at = rng.below(input.len() + 1);
                input.truncate(at);
            }
            // Length-field edit, at the start or anywhere (a later frame's header).
            3 if input.len() >= LEN_BYTES => {
                let at = if rng.below(2) == 0 {
                    0
                } else {
                    rng.below(input.len() - LEN_BYTES + 1)
                };
                let field = &mut input[at..at + LEN_BYTES];
                let cur = u32::from_le_bytes([field[0], field[1], field[2], field[3]]);
                field.copy_from_slice(&interesting_u32(rng, cur).to_le_bytes());
            }
            // Version edit.
            4 if input.len() >= LEN_BYTES + 2 => {
                let v = match rng.below(4) {
                    0 => PROTOCOL_VERSION.wrapping_add(1),
                    1 => 0,
                    2 => u16::MAX,
                    _ => rng.next() as u16,
                };
                input[LEN_BYTES..LEN_BYTES + 2].copy_from_slice(&v.to_le_bytes());
            }
            // Splice: a prefix of this input, a suffix of another.
            5 => {
                let other = &corpus[rng.below(corpus.len())];
                let a = rng.below(input.len() + 1);
                let b = rng.below(other.len() + 1);
                input.truncate(a);
                input.extend_from_slice(&other[b..]);
            }
            // Append another whole entry (more frames in one stream).
            6 => {
                let other = &corpus[rng.below(corpus.len())];
                input.extend_from_slice(other);
            }
            // Insert a run of random bytes.
            7 => {
                let at = rng.below(input.len() + 1);
                let n = 1 + rng.below(16);
                let run: Vec<u8> = (0..n).map(|_| rng.byte()).collect();
                input.splice(at..at, run);
            }
            // Delete a range.
            8 if !input.is_empty() => {
                let a = rng.below(input.len());
                let b = a + 1 + rng.below((input.len() - a).min(16));
                input.drain(a..b);
            }
            // Grow a string: repeat a range in place (tests the length limits).
            9 if !input.is_empty() => {
                let a = rng.below(input.len());
                let b = a + 1 + rng.below((input.len() - a).min(64));
                let run = input[a..b].repeat(1 + rng.below(8));
                input.splice(b..b, run);
            }
            // Entirely random bytes, sometimes behind a plausible header.
            10 => {
                let n = rng.below(64);
                let mut bytes: Vec<u8> = (0..n).map(|_| rng.byte()).collect();
                if rng.below(2) == 0 {
                    let mut framed = (n as u32 + 2).to_le_bytes().to_vec();
                    framed.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
                    framed.append(&mut bytes);
                    bytes = framed;
                }
                *input = bytes;
            }
            // Make the first length field agree with the bytes that follow, so that the
            // other mutations reach the body decoder instead of ending at the framing.
            11 if input.len() >= LEN_BYTES => {
                let rest = (input.len() - LEN_BYTES) as u32;
                input[..LEN_BYTES].copy_from_slice(&rest.to_le_bytes());
            }
            _ => {}
        }
    }
    input.truncate(MAX_INPUT);
}

/// How a stream of frames ended.
#[derive(Debug, PartialEq)]
enum End {
    /// At a frame boundary.
    Clean,
    /// Inside a frame, with this many bytes of it received.
    MidFrame(usize),
    /// At a bad length field.
    Frame(&'static str),
}

/// FrameDecoder over `input` in the given chunks: the payloads and how the stream ended.
fn by_decoder(input: &[u8], chunks: &[usize]) -> (Vec<Vec<u8>>, End) {
    let mut d = FrameDecoder::new();
    let mut frames = Vec::new();
    let mut at = 0;
    let mut chunk = chunks.iter().cycle();
    loop {
        loop {
            match d.next_frame() {
                Ok(Some(p)) => frames.push(p),
                Ok(None) => break,
                Err(e) => return (frames, End::Frame(e.kind())),
            }
        }
        if at == input.len() {
            break;
        }
        let end = (at + chunk.next().copied().unwrap_or(input.len())).min(input.len());
        d.push(&input[at..end]);
        at = end;
    }
    match d.buffered() {
        0 => (frames, End::Clean),
        n => (frames, End::MidFrame(n)),
    }
}

/// read_frame over `input` as a stream.
fn by_read_frame(input: &[u8]) -> (Vec<Vec<u8>>, End) {
    let mut s = input;
    let mut frames = Vec::new();
    loop {
        match read_frame(&mut s) {
            Ok(p) => frames.push(p),
            Err(ControlError::Closed) => return (frames, End::Clean),
            Err(ControlError::ClosedMidFrame { got, .. }) => return (frames, End::MidFrame(got)),
            Err(ControlError::Frame(e)) => return (frames, End::Frame(e.kind())),
            Err(e) => panic!("read_frame over a byte slice failed with {e}"),
        }
    }
}

#[derive(Default)]
struct Stats {
    execs: u64,
    frames: u64,
    requests: u64,
    replies: u64,
    /// Per decode attempt (a payload is tried as both a Request and a Reply) and per stream
    /// ended by a bad length field.
    rejected: BTreeMap<&'static str, u64>,
}

/// Runs every decoding path over `input`, checks the invariants (panicking if one fails) and
/// returns the sequence of outcomes (for novelty).
fn execute(input: &[u8], chunks: &[usize], stats: &mut Stats) -> Vec<&'static str> {
    let mut outcomes = Vec::new();
    let whole = by_decoder(input, &[input.len().max(1)]);
    let chunked = by_decoder(input, chunks);
    assert_eq!(
        whole, chunked,
        "chunked FrameDecoder disagrees with one push"
    );
    let streamed = by_read_frame(input);
    assert_eq!(whole, streamed, "read_frame disagrees with FrameDecoder");
    let (frames, end) = whole;
    if let End::Frame(kind) = end {
        *stats.rejected.entry(kind).or_default() += 1;
        outcomes.push(kind);
    }

    // Frames, and the raw input and its tail as if they were payloads.
    let raw = [input, input.get(LEN_BYTES..).unwrap_or_default()];
    for (i, payload) in frames.iter().map(Vec::as_slice).chain(raw).enumerate() {
        let framed = i < frames.len();
        if framed {
            stats.frames += 1;
            assert!(
                payload.len() <= MAX_FRAME,
                "payload of {} bytes",
                payload.len()
            );
        }
        match decode_request(payload) {
            Ok(r) => {
                assert!(payload.len() <= MAX_FRAME, "decoded an oversize payload");
                let f = encode_request(&r);
                assert!(
                    f.len() <= LEN_BYTES + MAX_FRAME,
                    "re-encoded Request too big"
                );
                let (again, end) = by_decoder(&f, &[f.len()]);
                assert_eq!(end, End::Clean);
                assert_eq!(again.len(), 1);
                assert_eq!(
                    decode_request(&again[0]),
                    Ok(r),
                    "Request changed on re-encoding"
                );
                if framed {
                    stats.requests += 1;
                }
                outcomes.push("request");
            }
            Err(e) => {
                if framed {
                    *stats.rejected.entry(e.kind()).or_default() += 1;
                }
                outcomes.push(e.kind());
            }
        }
        match decode_reply(payload) {
            Ok(r) => {
                assert!(payload.len() <= MAX_FRAME, "decoded an oversize payload");
                let f = encode_reply(&r);
                assert!(f.len() <= LEN_BYTES + MAX_FRAME, "re-encoded Reply too big");
                let (again, end) = by_decoder(&f, &[f.len()]);
                assert_eq!(end, End::Clean);
                assert_eq!(again.len(), 1);
                assert_eq!(
                    decode_reply(&again[0]),
                    Ok(r),
                    "Reply changed on re-encoding"
                );
                if framed {
                    stats.replies += 1;
                }
                outcomes.push("reply");
            }
            Err(e) => {
                if framed {
                    *stats.rejected.entry(e.kind()).or_default() += 1;
                }
                outcomes.push(e.kind());
            }
        }
    }
    outcomes
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_args() -> Result<(u64, u64), String> {
    let mut seconds = 60;
    let mut seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            v.parse()
                .map_err(|_| format!("{name} {v:?} is not a non-negative integer"))
        };
        match a.as_str() {
            "--seconds" => seconds = value("--seconds")?,
            "--seed" => seed = value("--seed")?,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok((seconds, seed))
}

thread_local! {
    /// The last panic's message and location, captured by the hook instead of printed.
    static PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

/// A valid region's bytes: made by the manager (`RegionFile`), with live slots and counters
/// written by the library (`Region`).
fn region_seed() -> Result<Vec<u8>, String> {
    let dir = std::env::temp_dir().join(format!("vcuda-fuzz-region-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let path = dir.join("region");
    let uuids = [[7u8; 16], [9u8; 16]];
    let made = RegionFile::create_or_open(&path, &uuids).map_err(|e| e.to_string());
    let lib = Region::open_or_create(&path, &uuids).map_err(|e| e.to_string());
    let bytes = made.and_then(|_| {
        let lib = lib?;
        for n in [3u64 << 20, 5 << 30] {
            let me = lib.claim().map_err(|e| e.to_string())?;
            lib.reserve(me, 1, n, u64::MAX);
            lib.set_hidden(me, 0, n / 2);
        }
        std::fs::read(&path).map_err(|e| e.to_string())
    });
    let _ = std::fs::remove_dir_all(&dir);
    bytes
}

/// Parse one region input; `Ok(true)` if it parsed, `Err` if an invariant broke.
fn check_region(bytes: &[u8]) -> Result<bool, String> {
    let Ok(s) = parse(bytes, &[[7u8; 16], [9u8; 16]]) else {
        return Ok(false);
    };
    if bytes.len() != REGION_SIZE {
        return Err(format!("a region of {} bytes parsed", bytes.len()));
    }
    if s.slots.len() > MAX_PROCS {
        return Err(format!("{} slots", s.slots.len()));
    }
    if s.slots.iter().flat_map(|r| &r.api).any(|&v| v >= 1 << 47) {
        return Err("a counter reads negative".into());
    }
    let _ = (s.used(0), s.used(1), s.active().count());
    Ok(true)
}

fn main() -> ExitCode {
    let (seconds, seed) = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fuzz_control: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(non-string panic)".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        PANIC.with(|p| *p.borrow_mut() = format!("{msg}{at}"));
    }));

    let mut rng = Rng::new(seed);
    let region_seed = match region_seed() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fuzz_control: cannot make a region to fuzz: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut region_execs, mut region_parsed) = (0u64, 0u64);
    let mut corpus = seeds();
    let n_seeds = corpus.len();
    let mut seen: HashSet<Vec<&'static str>> = HashSet::new();
    let mut stats = Stats::default();
    let start = Instant::now();
    let budget = Duration::from_secs(seconds);

    // The seeds themselves first, then mutants until the time is up.
    let mut input = Vec::new();
    let mut chunks = Vec::new();
    loop {
        if stats.execs < n_seeds as u64 {
            input.clone_from(&corpus[stats.execs as usize]);
        } else {
            if stats.execs % 256 == 0 && start.elapsed() >= budget {
                break;
            }
            input.clone_from(&corpus[rng.below(corpus.len())]);
            mutate(&mut rng, &corpus, &mut input);
        }
        if stats.execs % 4 == 3 {
            // The region reader's turn.
            let mut bytes = region_seed.clone();
            for _ in 0..1 + rng.below(4) {
                mutate(&mut rng, std::slice::from_ref(&region_seed), &mut bytes);
            }
            let parsed = panic::catch_unwind(AssertUnwindSafe(|| check_region(&bytes)));
            stats.execs += 1;
            region_execs += 1;
            let failure = match parsed {
                Ok(Ok(ok)) => {
                    region_parsed += u64::from(ok);
                    None
                }
                Ok(Err(why)) => Some(why),
                Err(_) => Some(PANIC.with(|p| p.borrow().clone())),
            };
            if let Some(why) = failure {
                eprintln!(
                    "fuzz_control: FAILED in the region reader after {} executions (seed {seed}): {why}\n  input ({} bytes): {}",
                    stats.execs,
                    bytes.len(),
                    hex(&bytes)
                );
                return ExitCode::FAILURE;
            }
            continue;
        }
        chunks.clear();
        for _ in 0..1 + rng.below(8) {
            chunks.push(1 + rng.below(input.len().clamp(1, 64)));
        }
        let result = panic::catch_unwind(AssertUnwindSafe(|| execute(&input, &chunks, &mut stats)));
        stats.execs += 1;
        match result {
            Ok(outcomes) => {
                if !seen.contains(&outcomes) {
                    seen.insert(outcomes);
                    if corpus.len() < n_seeds + MAX_CORPUS {
                        corpus.push(input.clone());
                    } else {
                        let i = n_seeds + rng.below(MAX_CORPUS);
                        corpus[i].clone_from(&input);
                    }
                }
            }
            Err(_) => {
                let why = PANIC.with(|p| p.borrow().clone());
                eprintln!(
                    "fuzz_control: FAILED after {} executions (seed {seed}): {why}\n  input ({} bytes): {}\n  chunks: {chunks:?}",
                    stats.execs,
                    input.len(),
                    hex(&input)
                );
                return ExitCode::FAILURE;
            }
        }
    }

    let secs = start.elapsed().as_secs_f64();
    let rejected: Vec<String> = stats
        .rejected
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    println!(
        "fuzz_control: seed {seed}, {secs:.0} s: {} executions, {:.0} execs/s, {} frames, decoded OK {} ({} Request, {} Reply), rejected by kind: {}; corpus {}; region reader: {region_execs} inputs, {region_parsed} parsed; no invariant violated",
        stats.execs,
        stats.execs as f64 / secs.max(1e-9),
        stats.frames,
        stats.requests + stats.replies,
        stats.requests,
        stats.replies,
        rejected.join(" "),
        corpus.len(),
    );
    ExitCode::SUCCESS
}
