//! CDI spec files: the thin I/O under [`crate::core`] that writes, replaces and removes one
//! spec per allocation in `--cdi-spec-dir` (contents and names are the pure
//! [`vcuda_manager_core::cdi`]'s).
//!
//! Invariants:
//! - a reader (the runtime scanning the directory) sees an allocation's spec whole or not at
//!   all: it is written to a hidden temporary file (`.<name>.<random>.tmp`, never `.json`) in
//!   the same directory, created exclusively (`O_CREAT|O_EXCL|O_NOFOLLOW`: a file or symlink
//!   planted at that name is never opened, let alone written through), synced, given mode
//!   0644, then renamed over the spec's name — which replaces whatever is there, a symlink
//!   included, without following it — and the directory synced;
//! - only files of ours are removed: names with our vendor prefix
//!   (`vcuda.io-allocation_…json`, and our temporaries), never another vendor's; a removal
//!   unlinks the name (a symlink is removed, not followed);
//! - `--cdi off` writes nothing; leftovers of ours from a run with CDI on are still removed
//!   when their allocation goes (or, stale, at start-up).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use vcuda_manager_core::allocation::Answer;
use vcuda_manager_core::cdi;
use vcuda_manager_core::ids::AllocationId;

use crate::settings::CdiMode;

/// Mode of every spec file: world-readable (runtimes read it), written only by the manager.
pub const SPEC_MODE: u32 = 0o644;

/// A CDI spec could not be written or removed, or its directory made or read. Each names
/// the path and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("cannot create the CDI spec directory {}: {source}; create it (containerd and CRI-O scan /etc/cdi and /var/run/cdi), point --cdi-spec-dir at a writable directory, or set --cdi off", path.display())]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot list the CDI spec directory {}: {source}; check --cdi-spec-dir and its permissions, or set --cdi off", path.display())]
    ReadDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write the CDI spec {}: {source}; check that --cdi-spec-dir is writable and has space, and that nothing but a file is at that path (remove a directory found there); the container gets the mounts answer only", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot remove the CDI spec {}: {source}; remove it by hand (a CDI-aware runtime would still offer its device)", path.display())]
    Remove {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Name(#[from] cdi::NameError),
    #[error("cannot draw a temporary file name from the kernel's random source: {0}; is getrandom(2) available to the manager?")]
    Random(getrandom::Error),
}

impl CdiError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            CdiError::CreateDir { .. } => "cdi-create-dir",
            CdiError::ReadDir { .. } => "cdi-read-dir",
            CdiError::Write { .. } => "cdi-write",
            CdiError::Remove { .. } => "cdi-remove",
            CdiError::Name(_) => "cdi-name",
            CdiError::Random(_) => "cdi-random",
        }
    }
}

/// The CDI spec directory as the manager uses it.
#[derive(Debug, Clone)]
pub struct SpecDir {
    dir: PathBuf,
    /// Whether specs are written and names returned (`--cdi on`, or `auto` with the
    /// directory present at start-up); otherwise the directory is only cleaned of ours.
    writes: bool,
}

impl SpecDir {
    /// Decide what `mode` means here, once, at start-up: `on` makes the directory if
    /// missing; `auto` writes if it exists (a CDI-aware runtime scans it); `off` writes
    /// nothing. `None`: no directory, nothing to write or clean.
    pub fn open(mode: CdiMode, dir: &Path) -> Result<Option<SpecDir>, CdiError> {
        let writes = match mode {
            CdiMode::On => {
                fs::create_dir_all(dir).map_err(|source| CdiError::CreateDir {
                    path: dir.to_path_buf(),
                    source,
                })?;
                true
            }
            CdiMode::Auto => dir.is_dir(),
            CdiMode::Off => false,
        };
        Ok(dir.is_dir().then(|| SpecDir {
            dir: dir.to_path_buf(),
            writes,
        }))
    }

    /// Whether specs are written and their names returned.
    pub fn writes(&self) -> bool {
        self.writes
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where an allocation's spec is.
    pub fn path(&self, id: &AllocationId) -> Result<PathBuf, CdiError> {
        Ok(self.dir.join(cdi::file_name(id)?))
    }

    /// Write (or replace) the spec of allocation `id`, whose Allocate answer is `answer`;
    /// returns its CDI device name. Does nothing, and returns `None`, unless
    /// [`SpecDir::writes`].
    pub fn write(&self, id: &AllocationId, answer: &Answer) -> Result<Option<String>, CdiError> {
        if !self.writes {
            return Ok(None);
        }
        let spec = cdi::spec(id, answer)?;
        let name = cdi::file_name(id)?;
        replace(&self.dir, &name, spec.to_json().as_bytes())?;
        Ok(Some(cdi::device_name(id)?))
    }

    /// Remove the spec of allocation `id` (gone already is fine).
    pub fn remove(&self, id: &AllocationId) -> Result<(), CdiError> {
        let path = self.path(id)?;
        remove(&path)
    }

    /// Remove our spec files whose allocation is not `known`, and our temporary files;
    /// another vendor's files are never touched. Returns the paths removed; a file that
    /// cannot be removed is logged and left.
    pub fn sweep(&self, known: impl Fn(&AllocationId) -> bool) -> Result<Vec<PathBuf>, CdiError> {
        let names: Vec<String> = fs::read_dir(&self.dir)
            .map_err(|source| CdiError::ReadDir {
                path: self.dir.clone(),
                source,
            })?
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        let mut removed = Vec::new();
        for name in cdi::stale(names.iter().map(String::as_str), known) {
            let path = self.dir.join(&name);
            match remove(&path) {
                Ok(()) => removed.push(path),
                Err(e) => {
                    tracing::warn!(error = %e, kind = e.kind(), "cannot remove a stale CDI spec")
                }
            }
        }
        Ok(removed)
    }
}

/// Unlink `path` (a symlink itself, never its target); gone already is fine.
fn remove(path: &Path) -> Result<(), CdiError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(CdiError::Remove {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Put `bytes` at `dir/name` so that a reader sees the old file or the new one, never a
/// part, and nothing at that name or at the temporary's is ever followed (module docs).
fn replace(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), CdiError> {
    let path = dir.join(name);
    let mut r = [0u8; 8];
    getrandom::fill(&mut r).map_err(CdiError::Random)?;
    let tmp = dir.join(format!(
        "{}{}.tmp",
        cdi::temporary_prefix(name),
        r.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ));
    let mut created = false;
    let res = (|| -> std::io::Result<()> {
        // create_new: O_CREAT|O_EXCL, which fails on any existing name, a symlink included.
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(SPEC_MODE)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        created = true;
        f.set_permissions(fs::Permissions::from_mode(SPEC_MODE))?; // whatever the umask
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, &path)?;
        created = false;
        File::open(dir)?.sync_all() // the rename itself, durable
    })();
    res.map_err(|source| {
        if created {
            let _ = fs::remove_file(&tmp);
        }
        CdiError::Write { path, source }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use vcuda_manager_core::allocation::{Answer, Mount};

    const ID: &str = "a0123456789abcdef0123456789abcdef";

    fn answer() -> Answer {
        let mut a = Answer::default();
        a.envs
            .insert("VCUDA_CONFIG".into(), "/etc/vcuda/vcuda.toml".into());
        a.mounts.push(Mount {
            container: "/etc/vcuda".into(),
            host: "/run/vcuda/alloc/x/etc".into(),
            read_only: true,
        });
        a
    }

    fn dir_names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn auto_writes_only_when_the_directory_exists_and_off_never() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("cdi");
        assert!(SpecDir::open(CdiMode::Auto, &missing).unwrap().is_none());
        assert!(SpecDir::open(CdiMode::Off, &missing).unwrap().is_none());
        assert!(!missing.exists(), "auto and off make nothing");
        let on = SpecDir::open(CdiMode::On, &missing).unwrap().unwrap();
        assert!(on.writes() && missing.is_dir(), "on makes the directory");
        assert!(SpecDir::open(CdiMode::Auto, &missing)
            .unwrap()
            .unwrap()
            .writes());
        let off = SpecDir::open(CdiMode::Off, &missing).unwrap().unwrap();
        assert!(!off.writes());
        assert_eq!(off.write(&AllocationId::new(ID), &answer()).unwrap(), None);
        assert!(dir_names(&missing).is_empty(), "off writes nothing");
    }

    #[test]
    fn a_spec_is_written_whole_with_mode_0644_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let s = SpecDir::open(CdiMode::On, d.path()).unwrap().unwrap();
        let id = AllocationId::new(ID);
        let name = s.write(&id, &answer()).unwrap().unwrap();
        assert_eq!(name, format!("vcuda.io/allocation={ID}"));
        let p = s.path(&id).unwrap();
        assert_eq!(
            dir_names(d.path()),
            vec![format!("vcuda.io-allocation_{ID}.json")],
            "no temporary left"
        );
        let meta = fs::symlink_metadata(&p).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o7777, 0o644);
        let spec: cdi::Spec = serde_json::from_str(&fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(spec, cdi::spec(&id, &answer()).unwrap());
        s.remove(&id).unwrap();
        s.remove(&id).unwrap(); // gone already is fine
        assert!(dir_names(d.path()).is_empty());
    }

    /// Someone planted a symlink (to a file they want overwritten) and a file at the spec's
    /// name: both are replaced by a new file, the targets untouched.
    #[test]
    fn a_planted_symlink_or_file_is_replaced_never_written_through() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        let cdi_dir = d.path().join("cdi");
        let s = SpecDir::open(CdiMode::On, &cdi_dir).unwrap().unwrap();
        let id = AllocationId::new(ID);
        let p = s.path(&id).unwrap();
        symlink(&victim, &p).unwrap();
        s.write(&id, &answer()).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        assert!(
            fs::symlink_metadata(&p).unwrap().is_file(),
            "the link itself was replaced"
        );
        // A dangling link, and a link where the removal happens: removed, not followed.
        fs::remove_file(&p).unwrap();
        symlink(d.path().join("nowhere"), &p).unwrap();
        s.write(&id, &answer()).unwrap();
        assert!(!d.path().join("nowhere").exists());
        fs::remove_file(&p).unwrap();
        symlink(&victim, &p).unwrap();
        s.remove(&id).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        assert!(fs::symlink_metadata(&p).is_err());
        // A directory planted there: refused with an error naming the path and the fix.
        fs::create_dir(&p).unwrap();
        fs::write(p.join("x"), "").unwrap();
        let e = s.write(&id, &answer()).unwrap_err();
        assert_eq!(e.kind(), "cdi-write");
        let msg = e.to_string();
        assert!(
            msg.contains(&p.display().to_string()) && msg.contains("remove a directory"),
            "{msg}"
        );
        assert_eq!(
            dir_names(&cdi_dir),
            vec![format!("vcuda.io-allocation_{ID}.json")],
            "no temporary left"
        );
    }

    #[test]
    fn the_sweep_removes_only_our_stale_files() {
        let d = tempfile::tempdir().unwrap();
        let s = SpecDir::open(CdiMode::On, d.path()).unwrap().unwrap();
        let keep = AllocationId::new("akeep");
        let gone = AllocationId::new("agone");
        s.write(&keep, &answer()).unwrap();
        s.write(&gone, &answer()).unwrap();
        fs::write(d.path().join("nvidia.com-gpu.json"), "{}").unwrap();
        fs::write(
            d.path().join(".vcuda.io-allocation_akeep.json.00ff.tmp"),
            "{",
        )
        .unwrap();
        symlink("/etc/passwd", d.path().join("vcuda.io-other.json")).unwrap();
        let removed = s.sweep(|id| *id == keep).unwrap();
        assert_eq!(removed.len(), 2, "{removed:?}");
        assert_eq!(
            dir_names(d.path()),
            vec![
                "nvidia.com-gpu.json".to_string(),
                "vcuda.io-allocation_akeep.json".to_string(),
                "vcuda.io-other.json".to_string(),
            ]
        );
    }

    #[test]
    fn an_unusable_directory_is_named_with_the_fix() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("f");
        fs::write(&file, "").unwrap();
        let e = SpecDir::open(CdiMode::On, &file.join("cdi")).unwrap_err();
        assert_eq!(e.kind(), "cdi-create-dir");
        let msg = e.to_string();
        assert!(msg.contains("f/cdi") && msg.contains("--cdi off"), "{msg}");
    }
}
