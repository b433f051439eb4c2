//! The manager's checkpoint: one append-only file of JSON lines, `<state-dir>/allocations.jsonl`.
//!
//! Each line puts an allocation (its whole record) or removes one; the state is the replay
//! of every line in order. Appending to an open file allocates no inode and writes one
//! small block, so the checkpoint costs Allocate and PreStartContainer a few microseconds
//! (a file-per-record scheme paid ~250 µs per record on a busy ext4: new inodes). The file
//! is rewritten compact (atomically: temporary file + rename) at start and when it grows
//! past a few lines per live allocation, off the RPC path.
//!
//! Invariants:
//! - A line is written with one `write` to an `O_APPEND` file: a crashed manager leaves whole
//!   lines. A write that fails part-way (a full disk) is cut back to the last whole line
//!   (and if that fails too, the next line starts on a line of its own), so a failed record
//!   never swallows the next. A torn last line (power loss) or a line that does not parse
//!   is skipped and counted, never fatal: the allocations it would have named keep running, and the kubelet
//!   and PodResources still know them.
//! - Not fsynced, on purpose: after a power loss every container starts again, and a
//!   PreStartContainer the checkpoint does not know fails with a reason (delete the pod)
//!   rather than guessing.
//! - This module knows nothing of the kubelet or of what an allocation means.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::allocation::Allocation;

/// Format version of a line.
pub const VERSION: u32 = 1;

/// One line of the journal.
#[derive(Debug, Serialize, Deserialize)]
struct Line {
    v: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    put: Option<Allocation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    remove: Option<String>,
}

/// What replaying a journal found.
#[derive(Debug, Default)]
pub struct Replay {
    pub allocations: BTreeMap<String, Allocation>,
    /// Lines that did not parse or are of another version (reported, then dropped by the
    /// compaction that follows).
    pub skipped: usize,
    pub lines: usize,
}

/// Replay journal text (pure).
pub fn replay(text: &str) -> Replay {
    let mut r = Replay::default();
    for raw in text.lines().filter(|l| !l.trim().is_empty()) {
        r.lines += 1;
        match serde_json::from_str::<Line>(raw) {
            Ok(Line {
                v: VERSION,
                put: Some(a),
                remove: None,
            }) => {
                r.allocations.insert(a.id.clone(), a);
            }
            Ok(Line {
                v: VERSION,
                put: None,
                remove: Some(id),
            }) => {
                r.allocations.remove(&id);
            }
            _ => r.skipped += 1,
        }
    }
    r
}

fn line(l: &Line) -> Vec<u8> {
    let mut bytes = serde_json::to_vec(l).expect("an allocation always serializes");
    bytes.push(b'\n');
    bytes
}

/// The open journal.
pub struct Journal {
    path: PathBuf,
    file: File,
    /// Lines in the file now (for deciding when to compact).
    lines: usize,
    /// The file's length after the last whole line.
    len: u64,
    /// A failed append could not be cut back: the next line starts on a line of its own.
    torn: bool,
}

impl Journal {
    /// Replay `path` (absent: empty), rewrite it compact and open it for appending.
    pub fn open(path: &Path) -> Result<(Journal, Replay), String> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => {
                return Err(format!(
                    "cannot read the checkpoint {}: {e}; fix its permissions, or move it away to start empty",
                    path.display()
                ))
            }
        };
        let replay = replay(&text);
        let journal = Journal::rewrite(path, &replay.allocations)?;
        Ok((journal, replay))
    }

    /// Write `allocations` as a fresh journal (atomically) and open it for appending.
    fn rewrite(path: &Path, allocations: &BTreeMap<String, Allocation>) -> Result<Journal, String> {
        let mut bytes = Vec::new();
        for a in allocations.values() {
            bytes.extend(line(&Line {
                v: VERSION,
                put: Some(a.clone()),
                remove: None,
            }));
        }
        crate::core::write_atomic(path, &bytes, 0o600)?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot open the checkpoint {}: {e}", path.display()))?;
        Ok(Journal {
            path: path.to_path_buf(),
            file,
            lines: allocations.len(),
            len: bytes.len() as u64,
            torn: false,
        })
    }

    /// Append one line, whole or not at all: a write that fails part-way (a full disk) is
    /// cut back to the last whole line, so it cannot swallow the next record. Should even
    /// that fail, the next line starts with a newline of its own, and replay skips the
    /// fragment.
    fn append(&mut self, l: &Line) -> Result<(), String> {
        let mut bytes = line(l);
        if self.torn {
            bytes.insert(0, b'\n');
        }
        // One write of a whole line: O_APPEND makes it land after every earlier line.
        if let Err(e) = self.file.write_all(&bytes) {
            self.torn = self.file.set_len(self.len).is_err();
            return Err(format!(
                "cannot append to the checkpoint {}: {e}; free space on its file system",
                self.path.display()
            ));
        }
        self.len += bytes.len() as u64;
        self.torn = false;
        self.lines += 1;
        Ok(())
    }

    /// Record an allocation's current state.
    pub fn put(&mut self, a: &Allocation) -> Result<(), String> {
        self.append(&Line {
            v: VERSION,
            put: Some(a.clone()),
            remove: None,
        })
    }

    /// Record that an allocation is gone.
    pub fn remove(&mut self, id: &str) -> Result<(), String> {
        self.append(&Line {
            v: VERSION,
            put: None,
            remove: Some(id.to_string()),
        })
    }

    /// Rewrite the file compact if it holds more than 2 lines per live allocation (+ 64).
    pub fn compact_if_needed(
        &mut self,
        live: &BTreeMap<String, Allocation>,
    ) -> Result<bool, String> {
        if self.lines <= 2 * live.len() + 64 {
            return Ok(false);
        }
        *self = Journal::rewrite(&self.path, live)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(id: &str, quota: u64) -> Allocation {
        Allocation {
            id: id.into(),
            cores: vec![format!("{id}-core")],
            gpus: vec!["GPU-0".into()],
            percent: 10,
            memory: Vec::new(),
            quota,
            core_limit: None,
            owner: None,
            created: 1,
        }
    }

    #[test]
    fn replay_keeps_the_last_put_and_honours_removes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("j.jsonl");
        {
            let (mut j, r) = Journal::open(&p).unwrap();
            assert!(r.allocations.is_empty());
            j.put(&alloc("a", 1)).unwrap();
            j.put(&alloc("b", 1)).unwrap();
            j.put(&alloc("a", 2)).unwrap();
            j.remove("b").unwrap();
        }
        let (_, r) = Journal::open(&p).unwrap();
        assert_eq!(r.allocations.len(), 1);
        assert_eq!(r.allocations["a"].quota, 2);
        assert_eq!((r.lines, r.skipped), (4, 0));
        // Opening compacted it: one line per live allocation.
        let (_, r) = Journal::open(&p).unwrap();
        assert_eq!(r.lines, 1);
    }

    #[test]
    fn a_torn_or_foreign_line_is_skipped_not_fatal() {
        let good = String::from_utf8(line(&Line {
            v: VERSION,
            put: Some(alloc("a", 1)),
            remove: None,
        }))
        .unwrap();
        let text = format!(
            "{good}{{\"v\":2,\"remove\":\"a\"}}\n{}",
            &good[..good.len() / 2]
        );
        let r = replay(&text);
        assert_eq!(r.allocations.len(), 1, "the v2 remove is not understood");
        assert_eq!(r.skipped, 2);
    }

    #[test]
    fn compaction_happens_only_when_the_file_has_grown() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("j.jsonl");
        let (mut j, _) = Journal::open(&p).unwrap();
        let mut live = BTreeMap::new();
        live.insert("a".to_string(), alloc("a", 1));
        for q in 0..60 {
            j.put(&alloc("a", q)).unwrap();
        }
        assert!(!j.compact_if_needed(&live).unwrap());
        for q in 0..10 {
            j.put(&alloc("a", q)).unwrap();
        }
        assert!(j.compact_if_needed(&live).unwrap());
        j.put(&alloc("a", 99)).unwrap();
        let r = replay(&std::fs::read_to_string(&p).unwrap());
        assert_eq!(r.lines, 2);
        assert_eq!(r.allocations["a"].quota, 99);
    }

    #[test]
    fn a_line_cut_short_by_a_full_disk_swallows_nothing() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("j.jsonl");
        let (mut j, _) = Journal::open(&p).unwrap();
        j.put(&alloc("a", 1)).unwrap();
        let good = std::fs::metadata(&p).unwrap().len();
        let code = crate::core::tests::with_file_limit(good + 20, || {
            // Part of the line fits, the rest does not: refused, and cut back.
            let failed = j.put(&alloc("b", 2)).is_err();
            failed && std::fs::metadata(&p).unwrap().len() == good
        });
        assert_eq!(
            code, 0,
            "the failed append was rolled back to the last whole line"
        );
        j.put(&alloc("c", 3)).unwrap();
        let r = replay(&std::fs::read_to_string(&p).unwrap());
        assert_eq!(r.skipped, 0);
        assert_eq!(r.allocations.keys().collect::<Vec<_>>(), ["a", "c"]);
    }

    #[test]
    fn a_line_that_could_not_be_cut_back_is_set_apart_from_the_next() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("j.jsonl");
        let (mut j, _) = Journal::open(&p).unwrap();
        j.put(&alloc("a", 1)).unwrap();
        // What a failed truncate leaves: a fragment, and the flag.
        j.file.write_all(b"{\"v\":1,\"put\":{\"id\":\"b").unwrap();
        j.torn = true;
        j.put(&alloc("c", 3)).unwrap();
        let r = replay(&std::fs::read_to_string(&p).unwrap());
        assert_eq!(r.skipped, 1, "the fragment alone");
        assert_eq!(r.allocations.keys().collect::<Vec<_>>(), ["a", "c"]);
    }
}
