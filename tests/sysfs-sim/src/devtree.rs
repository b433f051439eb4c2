//! The simulated `/dev`: a plain directory (`--dev-root`) holding `vfio/vfio` and one
//! regular file `vfio/<n>` per VFIO group node (the manager only checks that they exist).
//! Changed only by the difference a write made, so a node a test deleted to simulate it
//! vanishing stays deleted until the simulated kernel makes it again.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The dev tree could not be laid out or changed.
#[derive(Debug, thiserror::Error)]
#[error("cannot {what} {path}: {source}; --dev-root must be a writable directory")]
pub struct DevTreeError {
    what: &'static str,
    path: PathBuf,
    #[source]
    source: io::Error,
}

fn err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> DevTreeError + 'a {
    move |source| DevTreeError {
        what,
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Debug)]
pub struct DevTree {
    vfio: PathBuf,
}

impl DevTree {
    /// Lay out `<root>/vfio/vfio` and exactly the `groups` nodes (stale numeric entries from
    /// an earlier run are removed).
    pub fn init(root: &Path, groups: &BTreeSet<u32>) -> Result<DevTree, DevTreeError> {
        let vfio = root.join("vfio");
        fs::create_dir_all(&vfio).map_err(err("create", &vfio))?;
        let container = vfio.join("vfio");
        fs::write(&container, "").map_err(err("create", &container))?;
        for e in fs::read_dir(&vfio).map_err(err("list", &vfio))? {
            let e = e.map_err(err("list", &vfio))?;
            let stale = e
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|g| !groups.contains(&g));
            if stale {
                fs::remove_file(e.path()).map_err(err("remove", &e.path()))?;
            }
        }
        let t = DevTree { vfio };
        t.apply(&BTreeSet::new(), groups)?;
        Ok(t)
    }

    /// The group nodes that appeared (`after` less `before`) are made, those that went are
    /// removed (a node already gone is fine).
    pub fn apply(&self, before: &BTreeSet<u32>, after: &BTreeSet<u32>) -> Result<(), DevTreeError> {
        for g in before.difference(after) {
            let p = self.node(*g);
            match fs::remove_file(&p) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(err("remove", &p)(e)),
                _ => {}
            }
        }
        for g in after.difference(before) {
            let p = self.node(*g);
            fs::write(&p, "").map_err(err("create", &p))?;
        }
        Ok(())
    }

    pub fn node(&self, group: u32) -> PathBuf {
        self.vfio.join(group.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(root: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(root.join("vfio"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn follows_the_difference_only() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("dev");
        fs::create_dir_all(root.join("vfio")).unwrap();
        fs::write(root.join("vfio/99"), "").unwrap();
        let t = DevTree::init(&root, &BTreeSet::from([12])).unwrap();
        assert_eq!(names(&root), ["12", "vfio"]);
        // a test deletes node 12: an unrelated change does not bring it back
        fs::remove_file(t.node(12)).unwrap();
        t.apply(&BTreeSet::from([12]), &BTreeSet::from([12, 40]))
            .unwrap();
        assert_eq!(names(&root), ["40", "vfio"]);
        t.apply(&BTreeSet::from([12, 40]), &BTreeSet::new())
            .unwrap();
        assert_eq!(names(&root), ["vfio"]);
    }
}
