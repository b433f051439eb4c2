//! A tiny stderr logger, silent unless `VCUDA_LOG` is set (`error`, `warn`, `info`,
//! `debug`). Never used per call on a hot path. Fail-closed messages bypass it: they are
//! printed once whatever the level.

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

pub const ERROR: u8 = 1;
pub const WARN: u8 = 2;
pub const INFO: u8 = 3;
pub const DEBUG: u8 = 4;

/// 0 = off; 255 = not read yet.
static LEVEL: AtomicU8 = AtomicU8::new(255);

pub fn level() -> u8 {
    let l = LEVEL.load(Relaxed);
    if l != 255 {
        return l;
    }
    let l = match std::env::var("VCUDA_LOG")
        .unwrap_or_default()
        .to_ascii_lowercase()
        .as_str()
    {
        "error" => ERROR,
        "warn" | "warning" => WARN,
        "info" => INFO,
        "debug" | "trace" => DEBUG,
        _ => 0,
    };
    LEVEL.store(l, Relaxed);
    l
}

/// Write one line to stderr, unbuffered, ignoring errors.
pub fn line(msg: &str) {
    let mut s = String::with_capacity(msg.len() + 1);
    s.push_str(msg);
    s.push('\n');
    // SAFETY: writing a valid buffer to fd 2; a short or failed write is acceptable.
    unsafe { libc::write(2, s.as_ptr().cast(), s.len()) };
}

macro_rules! log {
    ($lvl:expr, $($arg:tt)*) => {
        if $crate::log::level() >= $lvl {
            $crate::log::line(&format!("vcuda[{}]: {}", std::process::id(), format_args!($($arg)*)));
        }
    };
}
pub(crate) use log;
