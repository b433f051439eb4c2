//! The FUSE glue: serves [`crate::tree`] so that reads, `readlink` and directory listings see
//! the simulated kernel, and a write gets the kernel's errno from its `write(2)`.
//!
//! As sysfs does: attributes are reported 4096 bytes long and opened in direct I/O (every
//! read and write reaches the simulator, nothing is cached; a short read is the end); nothing
//! is cached by the kernel (zero entry and attribute timeouts: the tree changes on writes);
//! an attribute opened for a direction it does not offer is `EACCES` (`kernfs_fop_open`);
//! files cannot be created (`EACCES`) nor anything removed, renamed or made (`EPERM`).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno as FuseErrno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, WriteFlags,
};

use crate::devtree::DevTree;
use crate::model::{Errno, Node};
use crate::tree::{self, Entry};

const TTL: Duration = Duration::ZERO;

/// Inode numbers, one per path ever looked up (the tree is small; numbers are never reused).
#[derive(Debug, Default)]
struct Inodes {
    paths: Vec<String>,
    by_path: HashMap<String, u64>,
}

impl Inodes {
    fn new() -> Inodes {
        let mut i = Inodes::default();
        i.ino("");
        i
    }

    /// The path's inode (the root, `""`, is 1).
    fn ino(&mut self, path: &str) -> u64 {
        if let Some(&n) = self.by_path.get(path) {
            return n;
        }
        self.paths.push(path.to_string());
        let n = self.paths.len() as u64;
        self.by_path.insert(path.to_string(), n);
        n
    }

    fn path(&self, ino: INodeNo) -> Option<&str> {
        let i = usize::try_from(ino.0).ok()?.checked_sub(1)?;
        self.paths.get(i).map(String::as_str)
    }
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}/{name}")
    }
}

fn parts(path: &str) -> Vec<&str> {
    if path.is_empty() {
        Vec::new()
    } else {
        path.split('/').collect()
    }
}

fn kind(e: &Entry) -> FileType {
    match e {
        Entry::Dir(_) => FileType::Directory,
        Entry::Attr { .. } => FileType::RegularFile,
        Entry::Link(_) => FileType::Symlink,
    }
}

fn errno(e: Errno) -> FuseErrno {
    FuseErrno::from_i32(e.code())
}

struct State {
    node: Node,
    inodes: Inodes,
    dev: DevTree,
}

/// The mounted filesystem.
pub struct SysfsFs {
    state: Mutex<State>,
    started: SystemTime,
}

impl std::fmt::Debug for SysfsFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SysfsFs").finish_non_exhaustive()
    }
}

impl SysfsFs {
    pub fn new(node: Node, dev: DevTree) -> SysfsFs {
        SysfsFs {
            state: Mutex::new(State {
                node,
                inodes: Inodes::new(),
                dev,
            }),
            started: SystemTime::now(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // a panic in one request must not take the others down
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn attr(&self, ino: u64, e: &Entry) -> FileAttr {
        let (size, nlink) = match e {
            Entry::Dir(names) => (0, 2 + names.len() as u32),
            Entry::Attr { .. } => (4096, 1),
            Entry::Link(t) => (t.len() as u64, 1),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: 0,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: kind(e),
            perm: e.mode(),
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// The path and entry of `ino`, or the errno to answer.
    fn entry(&self, st: &State, ino: INodeNo) -> Result<(String, Entry), FuseErrno> {
        let path = st.inodes.path(ino).ok_or(FuseErrno::ENOENT)?.to_string();
        let e = tree::lookup(&st.node, &parts(&path)).ok_or(FuseErrno::ENOENT)?;
        Ok((path, e))
    }
}

impl Filesystem for SysfsFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut st = self.state();
        let Some(parent) = st.inodes.path(parent).map(str::to_string) else {
            return reply.error(FuseErrno::ENOENT);
        };
        let Some(name) = name.to_str() else {
            return reply.error(FuseErrno::ENOENT);
        };
        let path = join(&parent, name);
        match tree::lookup(&st.node, &parts(&path)) {
            Some(e) => {
                let ino = st.inodes.ino(&path);
                reply.entry(&TTL, &self.attr(ino, &e), Generation(0));
            }
            None => reply.error(FuseErrno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let st = self.state();
        match self.entry(&st, ino) {
            Ok((_, e)) => reply.attr(&TTL, &self.attr(ino.0, &e)),
            Err(e) => reply.error(e),
        }
    }

    /// `O_TRUNC` (`echo 1 > remove`) arrives as a size change: accepted and ignored, as
    /// kernfs does.
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        self.getattr(_req, ino, None, reply);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let st = self.state();
        match self.entry(&st, ino) {
            Ok((_, Entry::Link(t))) => reply.data(t.as_bytes()),
            Ok(_) => reply.error(FuseErrno::EINVAL),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let st = self.state();
        let (show, store) = match self.entry(&st, ino) {
            Ok((_, Entry::Attr { show, store })) => (show.is_some(), store.is_some()),
            Ok((_, Entry::Dir(_))) => return reply.error(FuseErrno::EISDIR),
            Ok(_) => return reply.error(FuseErrno::EINVAL),
            Err(e) => return reply.error(e),
        };
        let ok = match flags.acc_mode() {
            OpenAccMode::O_RDONLY => show,
            OpenAccMode::O_WRONLY => store,
            OpenAccMode::O_RDWR => show && store,
        };
        if ok {
            reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
        } else {
            reply.error(FuseErrno::EACCES);
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let st = self.state();
        match self.entry(&st, ino) {
            Ok((_, Entry::Attr { show: Some(t), .. })) => {
                let b = t.as_bytes();
                let start = usize::try_from(offset).unwrap_or(usize::MAX).min(b.len());
                let end = start.saturating_add(size as usize).min(b.len());
                reply.data(&b[start..end]);
            }
            Ok(_) => reply.error(FuseErrno::EIO),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut st = self.state();
        let (path, store) = match self.entry(&st, ino) {
            Ok((path, Entry::Attr { store: Some(s), .. })) => (path, s),
            Ok(_) => return reply.error(FuseErrno::EIO),
            Err(e) => return reply.error(e),
        };
        let before = st.node.vfio_group_nodes();
        let text = String::from_utf8_lossy(data);
        match tree::store(&mut st.node, &store, data) {
            Ok(()) => {
                let after = st.node.vfio_group_nodes();
                if let Err(e) = st.dev.apply(&before, &after) {
                    eprintln!("sysfs-sim: write {text:?} to {path}: {e}");
                    return reply.error(FuseErrno::EIO);
                }
                eprintln!("sysfs-sim: write {text:?} to {path}: ok");
                reply.written(u32::try_from(data.len()).unwrap_or(u32::MAX));
            }
            Err(r) => {
                eprintln!("sysfs-sim: write {text:?} to {path}: {r}");
                reply.error(errno(r.errno));
            }
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let st = self.state();
        match self.entry(&st, ino) {
            Ok((_, Entry::Dir(_))) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Ok(_) => reply.error(FuseErrno::ENOTDIR),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut st = self.state();
        let (path, names) = match self.entry(&st, ino) {
            Ok((path, Entry::Dir(names))) => (path, names),
            Ok(_) => return reply.error(FuseErrno::ENOTDIR),
            Err(e) => return reply.error(e),
        };
        let parent = path.rsplit_once('/').map_or("", |(p, _)| p).to_string();
        let mut all = vec![
            (ino.0, FileType::Directory, ".".to_string()),
            (
                st.inodes.ino(&parent),
                FileType::Directory,
                "..".to_string(),
            ),
        ];
        for n in names {
            let child = join(&path, &n);
            if let Some(e) = tree::lookup(&st.node, &parts(&child)) {
                all.push((st.inodes.ino(&child), kind(&e), n));
            }
        }
        let skip = usize::try_from(offset).unwrap_or(usize::MAX);
        for (i, (child, k, name)) in all.into_iter().enumerate().skip(skip) {
            if reply.add(INodeNo(child), i as u64 + 1, k, name) {
                break;
            }
        }
        reply.ok();
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(FuseErrno::EACCES);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(FuseErrno::EPERM);
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(FuseErrno::EPERM);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(FuseErrno::EPERM);
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(FuseErrno::EPERM);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(FuseErrno::EPERM);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inodes_are_stable_per_path() {
        let mut i = Inodes::new();
        assert_eq!(i.ino(""), 1);
        let a = i.ino("bus");
        assert_eq!(i.ino("bus"), a);
        assert_eq!(i.path(INodeNo(a)), Some("bus"));
        assert_eq!(i.path(INodeNo(0)), None);
        assert_eq!(i.path(INodeNo(99)), None);
        assert_eq!(parts(""), Vec::<&str>::new());
        assert_eq!(parts(&join("bus", "pci")), ["bus", "pci"]);
    }
}
