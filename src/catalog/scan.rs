//! Building the catalog: a parallel walk of SOURCE.
//!
//! Each metadata call to a parallel file system costs a network round trip, so directories
//! are listed and their entries stat'ed by several workers at once; the tree is then laid
//! out breadth-first on one thread so ids, and children ranges, come out deterministic.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{Catalog, Entry, FileId, Kind, ROOT};

/// How often the scan reports progress: often enough to show it is alive on a slow file
/// system, rarely enough not to flood a log.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("cannot read source directory {path}: {source}")]
    Root { path: PathBuf, source: io::Error },
    #[error("source {0} is not a directory")]
    NotADirectory(PathBuf),
    #[error("source has more entries (or longer names in total) than stagefs can index: at most {max} of each", max = u32::MAX)]
    TooManyEntries,
}

/// What one directory listing yields for one child.
pub struct Scanned {
    pub name: OsString,
    pub kind: Kind,
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime_secs: i64,
    pub mtime_nanos: u32,
    /// See [`super::identity`].
    pub identity: u64,
    pub link_target: Option<OsString>,
}

/// Lists directories for a scan. The file system is the real one; the seam lets the scale
/// benchmark build catalogs of 14 M synthetic entries without creating 14 M files.
pub trait Lister: Sync {
    /// The root directory itself.
    fn root(&self) -> Scanned;
    /// The children of `dir` (relative to the root; empty for the root).
    fn list(&self, dir: &Path) -> Vec<Scanned>;
}

/// Lists a real directory tree.
struct FsLister<'a> {
    root: &'a Path,
    root_meta: fs::Metadata,
}

impl Lister for FsLister<'_> {
    fn root(&self) -> Scanned {
        Scanned::from_metadata(OsString::new(), &self.root_meta, None)
    }

    fn list(&self, dir: &Path) -> Vec<Scanned> {
        list_directory(&self.root.join(dir))
    }
}

impl Scanned {
    pub fn from_metadata(
        name: OsString,
        meta: &fs::Metadata,
        link_target: Option<OsString>,
    ) -> Self {
        let kind = Kind::of(meta.file_type());
        Scanned {
            name,
            kind,
            perm: (meta.mode() & 0o7777) as u16,
            uid: meta.uid(),
            gid: meta.gid(),
            // What the mount shows and the copy checks: directories' sizes are file-system
            // specific, special files have no content to stage.
            size: if matches!(kind, Kind::File | Kind::Symlink) {
                meta.size()
            } else {
                0
            },
            mtime_secs: meta.mtime(),
            mtime_nanos: meta.mtime_nsec() as u32,
            identity: super::identity(meta),
            link_target,
        }
    }
}

struct WorkQueue {
    pending: VecDeque<PathBuf>,
    /// Directories queued or being listed; the walk is over when this reaches zero.
    outstanding: usize,
}

pub(super) fn scan(root: &Path, threads: usize) -> Result<Catalog, ScanError> {
    let root_meta = fs::metadata(root).map_err(|source| ScanError::Root {
        path: root.to_path_buf(),
        source,
    })?;
    if !root_meta.is_dir() {
        return Err(ScanError::NotADirectory(root.to_path_buf()));
    }
    // Listing the root up front turns "unreadable SOURCE" into an error instead of an empty mount.
    fs::read_dir(root).map_err(|source| ScanError::Root {
        path: root.to_path_buf(),
        source,
    })?;
    scan_with(root, &FsLister { root, root_meta }, threads)
}

/// Scans the tree `lister` describes, with `threads` concurrent listings, as rooted at `root`.
pub fn scan_with(root: &Path, lister: &dyn Lister, threads: usize) -> Result<Catalog, ScanError> {
    let queue = Mutex::new(WorkQueue {
        pending: VecDeque::from([PathBuf::new()]),
        outstanding: 1,
    });
    let wake = Condvar::new();
    let listings: Mutex<HashMap<PathBuf, Vec<Scanned>>> = Mutex::new(HashMap::new());
    let seen = AtomicU64::new(0);
    let started = Instant::now();
    let last_report = Mutex::new(Instant::now());

    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let dir = {
                        let mut q = queue.lock();
                        loop {
                            if let Some(d) = q.pending.pop_front() {
                                break d;
                            }
                            if q.outstanding == 0 {
                                return;
                            }
                            wake.wait(&mut q);
                        }
                    };
                    let children = lister.list(&dir);
                    let subdirs: Vec<PathBuf> = children
                        .iter()
                        .filter(|c| c.kind == Kind::Directory)
                        .map(|c| dir.join(&c.name))
                        .collect();
                    let total = seen.fetch_add(children.len() as u64, Ordering::Relaxed)
                        + children.len() as u64;
                    listings.lock().insert(dir, children);
                    {
                        let mut q = queue.lock();
                        q.outstanding += subdirs.len();
                        q.outstanding -= 1;
                        q.pending.extend(subdirs);
                    }
                    wake.notify_all();
                    let mut last = last_report.lock();
                    if last.elapsed() >= PROGRESS_INTERVAL {
                        *last = Instant::now();
                        log::info!(
                            "scanning {}: {} entries in {:.0?}",
                            root.display(),
                            total,
                            started.elapsed()
                        );
                    }
                }
            });
        }
    });

    let catalog = assemble(root, lister.root(), listings.into_inner())?;
    log::info!(
        "scanned {}: {} entries, {} files, {} bytes in {:.2?}",
        root.display(),
        catalog.len(),
        catalog.file_count,
        catalog.total_file_bytes,
        started.elapsed()
    );
    Ok(catalog)
}

/// Lists one directory. An unreadable subdirectory shows up empty with a warning: one bad
/// folder should not stop a mount of millions of files.
fn list_directory(dir: &Path) -> Vec<Scanned> {
    let reader = match fs::read_dir(dir) {
        Ok(r) => r,
        Err(e) => {
            log::warn!(
                "cannot list {}: {e}; it appears empty in the mount",
                dir.display()
            );
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for item in reader {
        let item = match item {
            Ok(i) => i,
            Err(e) => {
                log::warn!("error listing {}: {e}", dir.display());
                continue;
            }
        };
        let path = item.path();
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) => {
                log::warn!("cannot stat {}: {e}; left out of the mount", path.display());
                continue;
            }
        };
        let target = if meta.file_type().is_symlink() {
            match fs::read_link(&path) {
                Ok(t) => Some(t.into_os_string()),
                Err(e) => {
                    log::warn!(
                        "cannot read link {}: {e}; left out of the mount",
                        path.display()
                    );
                    continue;
                }
            }
        } else {
            None
        };
        out.push(Scanned::from_metadata(item.file_name(), &meta, target));
    }
    out
}

/// Lays the listings out breadth-first: the children of each directory get consecutive ids
/// in name order, which is what makes lookup a binary search.
fn assemble(
    root: &Path,
    root_scanned: Scanned,
    mut listings: HashMap<PathBuf, Vec<Scanned>>,
) -> Result<Catalog, ScanError> {
    let total: usize = 1 + listings.values().map(Vec::len).sum::<usize>();
    let name_bytes: usize = listings.values().flatten().map(|s| s.name.len()).sum();
    if total > u32::MAX as usize || name_bytes > u32::MAX as usize {
        return Err(ScanError::TooManyEntries);
    }
    let mut catalog = Catalog {
        root_path: root.to_path_buf(),
        entries: Vec::with_capacity(total),
        names: Vec::new(),
        owners: Vec::new(),
        link_targets: Vec::new(),
        file_count: 0,
        total_file_bytes: 0,
    };
    let mut owner_ids = HashMap::new();
    push_entry(&mut catalog, &mut owner_ids, ROOT, root_scanned);

    // (directory id, its relative path), in id order.
    let mut frontier: VecDeque<(FileId, PathBuf)> = VecDeque::from([(ROOT, PathBuf::new())]);
    while let Some((dir_id, dir_path)) = frontier.pop_front() {
        let mut children = listings.remove(&dir_path).unwrap_or_default();
        children.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        let first = catalog.entries.len() as FileId;
        catalog.entries[dir_id as usize].first_child = first;
        catalog.entries[dir_id as usize].child_count = children.len() as u32;
        for child in children {
            let id = catalog.entries.len() as FileId;
            if child.kind == Kind::Directory {
                frontier.push_back((id, dir_path.join(&child.name)));
            }
            push_entry(&mut catalog, &mut owner_ids, dir_id, child);
        }
    }
    catalog.link_targets.sort_by_key(|(id, _)| *id);
    catalog.entries.shrink_to_fit();
    catalog.names.shrink_to_fit();
    Ok(catalog)
}

fn push_entry(
    catalog: &mut Catalog,
    owner_ids: &mut HashMap<(u32, u32), u32>,
    parent: FileId,
    s: Scanned,
) {
    let id = catalog.entries.len() as FileId;
    let name = s.name.as_bytes();
    if s.kind == Kind::File {
        catalog.file_count += 1;
        catalog.total_file_bytes += s.size;
    }
    if let Some(target) = s.link_target {
        catalog.link_targets.push((id, target));
    }
    let owner = *owner_ids.entry((s.uid, s.gid)).or_insert_with(|| {
        catalog.owners.push((s.uid, s.gid));
        catalog.owners.len() as u32 - 1
    });
    catalog.entries.push(Entry {
        parent,
        name_offset: catalog.names.len() as u32,
        name_len: name.len() as u8,
        kind: s.kind,
        perm: s.perm,
        owner,
        size: s.size,
        mtime_secs: s.mtime_secs,
        mtime_nanos: s.mtime_nanos,
        identity: s.identity,
        first_child: 0,
        child_count: 0,
    });
    catalog.names.extend_from_slice(name);
}
