//! An index's listing checked against SOURCE before a mount uses it: one `lstat` per
//! directory, and a new listing of those that changed, nothing per file.
//!
//! A directory's ctime moves with every entry added, removed or renamed in it (even when
//! `cp -a` or `rsync -a` put its mtime back), and no user can set it back: a directory whose
//! inode and ctime are those it had when the index listed it still has the entries the index
//! lists. A changed one is listed again through the scan, which takes the index's listing for
//! every directory found unchanged, so the catalog comes out as a scan of SOURCE now would
//! make it.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use super::Loaded;
use crate::catalog::attributes::Attributes;
use crate::catalog::scan::{self, Listed, Lister, Listing, ScanError, scan_with, source_lister};
use crate::catalog::walk::{Progress, WalkError, Walking, walk};
use crate::catalog::{Catalog, FileId, Kind};

impl Loaded {
    /// The index's catalog, checked against SOURCE and listed again where it changed; and how
    /// many directories were listed again (none: the index is as good as a new one).
    pub fn refresh(self, walking: Walking) -> Result<(Catalog, usize), ScanError> {
        let lister = source_lister(self.catalog.root_path())?;
        self.refresh_with(lister, walking)
    }

    /// [`Loaded::refresh`] with SOURCE as `lister` describes it.
    pub fn refresh_with(
        self,
        lister: Arc<dyn Lister>,
        walking: Walking,
    ) -> Result<(Catalog, usize), ScanError> {
        let root = self.catalog.root_path().to_path_buf();
        let dirs: Vec<(FileId, u64, PathBuf)> = (self.listed.iter())
            .map(|&(id, identity)| (id, identity, self.catalog.relative_path(id)))
            .collect();
        let now = stat_all(
            &root,
            &lister,
            dirs.iter().map(|d| d.2.clone()).collect(),
            walking,
        )?;
        let mut unchanged = HashMap::new();
        for (id, identity, path) in dirs.iter().cloned() {
            if let Some(Ok(a)) = now.get(&path)
                && a.kind == Kind::Directory
                && a.identity == identity
            {
                self.catalog.seen.keep(id, *a);
                unchanged.insert(path, id);
            }
        }
        let changed = dirs.len() - unchanged.len();
        if changed == 0 {
            return Ok((self.catalog, 0));
        }
        log::info!(
            "{changed} of {} directories changed since the index was written: listing them again",
            dirs.len()
        );
        let reuse = Reuse {
            index: self.catalog,
            unchanged,
            fresh: lister,
        };
        Ok((scan_with(&root, Arc::new(reuse), walking)?, changed))
    }
}

/// What `lstat` says of each of `paths` now, `walking.threads` at a time.
fn stat_all(
    root: &Path,
    lister: &Arc<dyn Lister>,
    paths: Vec<PathBuf>,
    walking: Walking,
) -> Result<HashMap<PathBuf, io::Result<Attributes>>, ScanError> {
    let found: Arc<Mutex<HashMap<PathBuf, io::Result<Attributes>>>> = Arc::default();
    let (into, lister) = (found.clone(), lister.clone());
    let visit = move |path: &PathBuf, _: &Progress| {
        let now = lister.lstat(path);
        into.lock().insert(path.clone(), now);
        Ok(Vec::new())
    };
    let what = format!("checking the index of {}", root.display());
    walk::<ScanError>(paths, walking, &what, visit).map_err(|e| match e {
        WalkError::Failed(e) => e,
        WalkError::Stalled(waiting) => scan::stalled(root, waiting, walking),
    })?;
    Ok(std::mem::take(&mut *found.lock()))
}

/// SOURCE as the scan sees it after the check: the index's listing of each directory found
/// unchanged (by its relative path), SOURCE itself for the rest.
struct Reuse {
    index: Catalog,
    unchanged: HashMap<PathBuf, FileId>,
    fresh: Arc<dyn Lister>,
}

impl Lister for Reuse {
    fn list(&self, dir: &Path, progress: &Progress) -> io::Result<Listing> {
        let known =
            (self.unchanged.get(dir)).and_then(|&id| Some((id, self.index.attributes(id)?)));
        let Some((id, itself)) = known else {
            return self.fresh.list(dir, progress);
        };
        let entries = (self.index.children(id))
            .map(|child| Listed {
                name: self.index.name(child).to_os_string(),
                kind: self.index.entry(child).map(|e| e.kind),
            })
            .collect();
        Ok(Listing {
            dir: itself,
            entries,
        })
    }

    fn lstat(&self, path: &Path) -> io::Result<Attributes> {
        self.fresh.lstat(path)
    }

    fn readlink(&self, path: &Path) -> io::Result<OsString> {
        let listed = (path.parent())
            .and_then(|dir| self.unchanged.get(dir))
            .and_then(|&dir| self.index.lookup(dir, path.file_name()?))
            .and_then(|link| self.index.link_target(link));
        match listed {
            Some(target) => Ok(target.to_os_string()),
            None => self.fresh.readlink(path),
        }
    }
}
