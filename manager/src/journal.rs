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

use crate::files::{write_atomic, FileError};
use vcuda_manager_core::allocation::Allocation;
use vcuda_manager_core::ids::AllocationId;

/// Format version of a line.
pub const VERSION: u32 = 1;

/// The checkpoint cannot be read or written. Reading it failing stops the manager at start
/// (it would otherwise forget every allocation); a failed write refuses the RPC that needed
/// it, so nothing runs that a restarted manager would not know.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("cannot read the checkpoint {}: {source}; fix its permissions, or move it away to start empty", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot rewrite the checkpoint: {0}")]
    Rewrite(#[source] FileError),
    #[error("cannot open the checkpoint {} to append to it: {source}; fix its permissions", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot append to the checkpoint {}: {source}; free space on its file system", path.display())]
    Append {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl JournalError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            JournalError::Read { .. } => "checkpoint-read",
            JournalError::Rewrite(_) => "checkpoint-rewrite",
            JournalError::Open { .. } => "checkpoint-open",
            JournalError::Append { .. } => "checkpoint-append",
        }
    }
}

/// Why a line of the checkpoint was skipped at replay (never fatal: see the module's
/// invariants). `line` counts from 1, blank lines included.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("line {line} is not a checkpoint record ({source}); torn by a power loss or written by hand")]
    Unparsable {
        line: usize,
        source: serde_json::Error,
    },
    #[error("line {line} is a record of format version {version}, this vcuda-manager reads {VERSION}; written by another release")]
    Version { line: usize, version: u32 },
    #[error("line {line} neither puts nor removes exactly one allocation")]
    Shape { line: usize },
}

impl RecordError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            RecordError::Unparsable { .. } => "record-unparsable",
            RecordError::Version { .. } => "record-version",
            RecordError::Shape { .. } => "record-shape",
        }
    }
}

/// One line of the journal.
#[derive(Debug, Serialize, Deserialize)]
struct Line {
    v: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    put: Option<Allocation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    remove: Option<AllocationId>,
}

/// What replaying a journal found.
#[derive(Debug, Default)]
pub struct Replay {
    pub allocations: BTreeMap<AllocationId, Allocation>,
    /// Lines that did not parse or are of another version (reported, then dropped by the
    /// compaction that follows).
    pub skipped: usize,
    pub lines: usize,
    /// Why the first skipped line was skipped (for the log; the rest are counted).
    pub first_skipped: Option<RecordError>,
}

/// Replay journal text (pure).
pub fn replay(text: &str) -> Replay {
    let mut r = Replay::default();
    for (n, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        r.lines += 1;
        if let Err(e) = apply(&mut r.allocations, n + 1, raw) {
            r.skipped += 1;
            r.first_skipped.get_or_insert(e);
        }
    }
    r
}

/// Apply line number `line` (`raw`) to `allocations`, or say why it cannot be.
fn apply(
    allocations: &mut BTreeMap<AllocationId, Allocation>,
    line: usize,
    raw: &str,
) -> Result<(), RecordError> {
    match serde_json::from_str::<Line>(raw) {
        Err(source) => Err(RecordError::Unparsable { line, source }),
        Ok(Line { v, .. }) if v != VERSION => Err(RecordError::Version { line, version: v }),
        Ok(Line {
            put: Some(a),
            remove: None,
            ..
        }) => {
            allocations.insert(a.id.clone(), a);
            Ok(())
        }
        Ok(Line {
            put: None,
            remove: Some(id),
            ..
        }) => {
            allocations.remove(&id);
            Ok(())
        }
        Ok(_) => Err(RecordError::Shape { line }),
    }
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
    pub fn open(path: &Path) -> Result<(Journal, Replay), JournalError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(source) => {
                return Err(JournalError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let replay = replay(&text);
        let journal = Journal::rewrite(path, &replay.allocations)?;
        Ok((journal, replay))
    }

    /// Write `allocations` as a fresh journal (atomically) and open it for appending.
    fn rewrite(
        path: &Path,
        allocations: &BTreeMap<AllocationId, Allocation>,
    ) -> Result<Journal, JournalError> {
        let mut bytes = Vec::new();
        for a in allocations.values() {
            bytes.extend(line(&Line {
                v: VERSION,
                put: Some(a.clone()),
                remove: None,
            }));
        }
        write_atomic(path, &bytes, 0o600).map_err(JournalError::Rewrite)?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|source| JournalError::Open {
                path: path.to_path_buf(),
                source,
            })?;
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
    fn append(&mut self, l: &Line) -> Result<(), JournalError> {
        let mut bytes = line(l);
        if self.torn {
            bytes.insert(0, b'\n');
        }
        // One write of a whole line: O_APPEND makes it land after every earlier line.
        if let Err(source) = self.file.write_all(&bytes) {
            self.torn = self.file.set_len(self.len).is_err();
            return Err(JournalError::Append {
                path: self.path.clone(),
                source,
            });
        }
        self.len += bytes.len() as u64;
        self.torn = false;
        self.lines += 1;
        Ok(())
    }

    /// Record an allocation's current state.
    pub fn put(&mut self, a: &Allocation) -> Result<(), JournalError> {
        self.append(&Line {
            v: VERSION,
            put: Some(a.clone()),
            remove: None,
        })
    }

    /// Record that an allocation is gone.
    pub fn remove(&mut self, id: &AllocationId) -> Result<(), JournalError> {
        self.append(&Line {
            v: VERSION,
            put: None,
            remove: Some(id.clone()),
        })
    }

    /// Rewrite the file compact if it holds more than 2 lines per live allocation (+ 64).
    pub fn compact_if_needed(
        &mut self,
        live: &BTreeMap<AllocationId, Allocation>,
    ) -> Result<bool, JournalError> {
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
            slice: false,
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
            j.remove(&"b".into()).unwrap();
        }
        let (_, r) = Journal::open(&p).unwrap();
        assert_eq!(r.allocations.len(), 1);
        assert_eq!(r.allocations["a"].quota, 2);
        assert_eq!((r.lines, r.skipped), (4, 0));
        // Opening compacted it: one line per live allocation.
        let (_, r) = Journal::open(&p).unwrap();
        assert_eq!(r.lines, 1);
    }

    /// Lines as the previous release wrote them (ids were bare strings then, as they are
    /// on disk now: the id types serialize transparently) load, and are written back
    /// byte for byte.
    #[test]
    fn a_line_in_the_existing_format_round_trips() {
        let put = concat!(
            r#"{"v":1,"put":{"id":"a5f3c2e1d0b9a8f7e6d5c4b3a2918070","#,
            r#""cores":["GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401-core-0000"],"#,
            r#""gpus":["GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401"],"percent":30,"#,
            r#""memory":["GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401-mem-0000"],"#,
            r#""quota":1073741824,"core_limit":60,"#,
            r#""owner":{"namespace":"ns","pod":"p","container":"c","uid":"0f6c7d3e-1b2a-4c5d-8e9f-001122334455"},"#,
            r#""created":1700000000}}"#
        );
        let remove = r#"{"v":1,"remove":"a00000000000000000000000000000001"}"#;
        let r = replay(&format!("{put}\n{remove}\n"));
        assert_eq!((r.lines, r.skipped), (2, 0), "{:?}", r.first_skipped);
        let id = AllocationId::from("a5f3c2e1d0b9a8f7e6d5c4b3a2918070");
        let a = &r.allocations[&id];
        assert_eq!(a.id, id);
        let owner = a.owner.as_ref().unwrap();
        assert_eq!(
            owner.uid.as_ref().map(|u| u.as_str()),
            Some("0f6c7d3e-1b2a-4c5d-8e9f-001122334455")
        );
        let written = |l: &Line| String::from_utf8(line(l)).unwrap();
        assert_eq!(
            written(&Line {
                v: VERSION,
                put: Some(a.clone()),
                remove: None,
            }),
            format!("{put}\n")
        );
        assert_eq!(
            written(&Line {
                v: VERSION,
                put: None,
                remove: Some("a00000000000000000000000000000001".into()),
            }),
            format!("{remove}\n")
        );
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
        let first = r.first_skipped.expect("the first skipped line is named");
        assert!(
            matches!(
                first,
                RecordError::Version {
                    line: 2,
                    version: 2
                }
            ),
            "{first:?}"
        );
        assert!(first.to_string().contains("line 2"), "{first}");
    }

    #[test]
    fn a_corrupt_record_is_named_by_its_line_and_why() {
        let good = String::from_utf8(line(&Line {
            v: VERSION,
            put: Some(alloc("a", 1)),
            remove: None,
        }))
        .unwrap();
        let r = replay(&format!("{good}\n{{\"v\":1,\"put\":{{\"id\":\n"));
        assert_eq!((r.lines, r.skipped), (2, 1));
        let e = r.first_skipped.unwrap();
        assert!(
            matches!(e, RecordError::Unparsable { line: 3, .. }),
            "blank lines count: {e:?}"
        );
        assert_eq!(e.kind(), "record-unparsable");
        let r = replay("{\"v\":1}\n");
        assert!(
            matches!(r.first_skipped, Some(RecordError::Shape { line: 1 })),
            "{:?}",
            r.first_skipped
        );
    }

    #[test]
    fn an_unreadable_checkpoint_is_an_error_naming_it_not_an_empty_state() {
        let d = tempfile::tempdir().unwrap();
        // A directory where the file should be: reading it fails with EISDIR.
        let p = d.path().join("j.jsonl");
        std::fs::create_dir(&p).unwrap();
        let e = Journal::open(&p).err().expect("refused");
        assert!(
            matches!(&e, JournalError::Read { path, .. } if path == &p),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains(&p.display().to_string()) && text.contains("move it away"),
            "{text}"
        );
    }

    #[test]
    fn compaction_happens_only_when_the_file_has_grown() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("j.jsonl");
        let (mut j, _) = Journal::open(&p).unwrap();
        let mut live = BTreeMap::new();
        live.insert(AllocationId::from("a"), alloc("a", 1));
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
        let code = crate::files::tests::with_file_limit(good + 20, || {
            // Part of the line fits, the rest does not: refused, and cut back.
            let failed = matches!(j.put(&alloc("b", 2)), Err(JournalError::Append { .. }));
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
