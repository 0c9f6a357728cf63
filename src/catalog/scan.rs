//! Building the catalog from directory listings alone: names and types (`d_type`), one
//! listing per directory, and nothing asked about any file.
//!
//! On a parallel file system every metadata call is a request to a metadata server that every
//! job of the cluster shares: a scan that `lstat`ed each file cost one request per file per
//! node. A listing already says what the dataset class needs (torchvision's ImageFolder never
//! stats a file either), so the scan reads each directory's entries with their types, and the
//! directory's own attributes (one `fstat` of the descriptor it lists), and nothing more;
//! only an entry whose type the file system does not give (`DT_UNKNOWN`) is `lstat`ed, and a
//! symlink's target read. A file's attributes are fetched when it is first used (see
//! `attributes`). Directories are listed by several threads at once (see `walk`); the tree is
//! then laid out breadth-first on one thread so ids, and children ranges, come out
//! deterministic.
//!
//! Each directory is opened beneath SOURCE's root descriptor through no symlink: no call is
//! given a full path, so a tree deeper than PATH_MAX is catalogued whole, and a directory
//! swapped for a link during the scan is not followed out of SOURCE.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::attributes::{Attributes, Seen};
use super::walk::{Progress, WalkError, Walking, walk};
use super::{Catalog, Entry, FileId, Kind, ROOT};
use crate::sys;

#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("cannot read source directory {path}: {source}")]
    Root { path: PathBuf, source: io::Error },
    #[error("source {0} is not a directory")]
    NotADirectory(PathBuf),
    #[error("source has more entries (or longer names in total) than stagefs can index: at most {max} of each", max = u32::MAX)]
    TooManyEntries,
    #[error(
        "SOURCE has not answered for {secs} s (reading {path}): its file system seems hung; check it (ls {path}) and mount again"
    )]
    Stalled { path: PathBuf, secs: u64 },
}

/// One entry of a directory listing.
pub struct Listed {
    pub name: OsString,
    /// Its type as the listing gives it; `None` where the file system does not say
    /// (`DT_UNKNOWN`), which costs the entry one `lstat`.
    pub kind: Option<Kind>,
}

/// A directory as one listing describes it.
pub struct Listing {
    /// The directory itself, as it was when its entries were read.
    pub dir: Attributes,
    pub entries: Vec<Listed>,
}

/// SOURCE's metadata as a scan reads it: directory listings, and the few calls on single
/// entries a scan makes. The file system is the real one; the seam lets the scale benchmark
/// build catalogs of 14 M synthetic entries without creating them, and tests count (or fake)
/// what a mount asks SOURCE. Paths are relative to SOURCE's root (empty for the root).
pub trait Lister: Send + Sync {
    /// The entries of directory `dir`, with the directory's own attributes taken before they
    /// were read. `progress` ticks as entries come, so a slow listing is not taken for a hung
    /// one.
    fn list(&self, dir: &Path, progress: &Progress) -> io::Result<Listing>;
    /// What `lstat` says of `path` (a link is described, not followed).
    fn lstat(&self, path: &Path) -> io::Result<Attributes>;
    /// The target of the symlink `path`.
    fn readlink(&self, path: &Path) -> io::Result<OsString>;
}

/// Reads a real directory tree, beneath its root's descriptor.
struct FsLister {
    root: File,
}

impl Lister for FsLister {
    fn list(&self, dir: &Path, progress: &Progress) -> io::Result<Listing> {
        let fd = sys::open_beneath(self.root.as_fd(), dir, libc::O_RDONLY | libc::O_DIRECTORY)?;
        // Before the entries: a change made while they are read moves the ctime past this.
        let itself = Attributes::of_stat(&sys::lstat_at(fd.as_fd(), "".as_ref())?);
        let mut entries = Vec::new();
        sys::read_entries(fd.as_fd(), |name, d_type| {
            progress.tick();
            entries.push(Listed {
                name,
                kind: Kind::of_dirent(d_type),
            });
        })?;
        Ok(Listing {
            dir: itself,
            entries,
        })
    }

    fn lstat(&self, path: &Path) -> io::Result<Attributes> {
        sys::lstat_beneath(self.root.as_fd(), path).map(|st| Attributes::of_stat(&st))
    }

    fn readlink(&self, path: &Path) -> io::Result<OsString> {
        sys::readlink_beneath(self.root.as_fd(), path)
    }
}

/// The lister of the real tree at `root` (SOURCE's path itself may be a link, to the file
/// system's mount say; nothing below it is followed).
pub fn source_lister(root: &Path) -> Result<Arc<dyn Lister>, ScanError> {
    let root_dir = File::open(root).map_err(|source| ScanError::Root {
        path: root.to_path_buf(),
        source,
    })?;
    Ok(Arc::new(FsLister { root: root_dir }))
}

/// A directory as the scan keeps it until the tree is laid out: its attributes (unknown if it
/// could not be listed) and its children.
struct Scanned {
    attributes: Option<Attributes>,
    children: Vec<Child>,
}

/// One child of a listed directory.
struct Child {
    name: OsString,
    kind: Kind,
    /// Known only for an entry the scan had to `lstat` (its type unknown).
    attributes: Option<Attributes>,
    link_target: Option<OsString>,
}

/// Scans the real tree at `root`.
pub(super) fn scan(root: &Path, walking: Walking) -> Result<Catalog, ScanError> {
    scan_with(root, source_lister(root)?, walking)
}

/// Scans the tree `lister` describes, as rooted at `root`.
pub fn scan_with(
    root: &Path,
    lister: Arc<dyn Lister>,
    walking: Walking,
) -> Result<Catalog, ScanError> {
    let started = Instant::now();
    let scanned: Arc<Mutex<HashMap<PathBuf, Scanned>>> = Arc::default();
    let into = scanned.clone();
    let shown = root.to_path_buf();
    let visit = move |dir: &PathBuf, progress: &Progress| {
        let listed = list_directory(&*lister, dir, progress, &shown)?;
        let subdirs = (listed.children.iter())
            .filter(|c| c.kind == Kind::Directory)
            .map(|c| dir.join(&c.name))
            .collect();
        into.lock().insert(dir.clone(), listed);
        Ok(subdirs)
    };
    let what = format!("scanning {}", root.display());
    walk(vec![PathBuf::new()], walking, &what, visit).map_err(|e| match e {
        WalkError::Failed(e) => e,
        WalkError::Stalled(waiting) => stalled(root, waiting, walking),
    })?;
    let scanned = std::mem::take(&mut *scanned.lock());
    let catalog = assemble(root, scanned)?;
    log::info!(
        "scanned {}: {} entries, {} files in {:.2?}",
        root.display(),
        catalog.len(),
        catalog.file_count,
        started.elapsed()
    );
    Ok(catalog)
}

/// The error of a walk of `root` that gave up waiting for `waiting`.
pub(super) fn stalled(root: &Path, waiting: Vec<PathBuf>, walking: Walking) -> ScanError {
    ScanError::Stalled {
        path: root.join(waiting.into_iter().next().unwrap_or_default()),
        secs: walking.stall.as_secs(),
    }
}

/// Lists directory `dir` (relative to SOURCE `root`). An unreadable subdirectory shows up
/// empty with a warning (one bad folder should not stop a mount of millions of files); an
/// unreadable root is an error, not an empty mount.
fn list_directory(
    lister: &dyn Lister,
    dir: &Path,
    progress: &Progress,
    root: &Path,
) -> Result<Scanned, ScanError> {
    let shown = root.join(dir);
    let listing = match lister.list(dir, progress) {
        Ok(listing) => listing,
        Err(e) if dir.as_os_str().is_empty() => {
            return Err(match e.raw_os_error() {
                Some(libc::ENOTDIR) => ScanError::NotADirectory(root.to_path_buf()),
                _ => ScanError::Root {
                    path: root.to_path_buf(),
                    source: e,
                },
            });
        }
        Err(e) => {
            log::warn!(
                "cannot list {}: {e}; it appears empty in the mount",
                shown.display()
            );
            return Ok(Scanned {
                attributes: None,
                children: Vec::new(),
            });
        }
    };
    let mut children = Vec::with_capacity(listing.entries.len());
    for Listed { name, kind } in listing.entries {
        let path = dir.join(&name);
        let left_out = |what: &str, e: io::Error| {
            log::warn!(
                "cannot {what} {}: {e}; left out of the mount",
                root.join(&path).display()
            )
        };
        let (kind, attributes) = match kind {
            Some(kind) => (kind, None),
            None => match lister.lstat(&path) {
                Ok(a) => (a.kind, Some(a)),
                Err(e) => {
                    left_out("stat", e);
                    continue;
                }
            },
        };
        let link_target = match kind {
            Kind::Symlink => match lister.readlink(&path) {
                Ok(target) => Some(target),
                Err(e) => {
                    left_out("read link", e);
                    continue;
                }
            },
            _ => None,
        };
        children.push(Child {
            name,
            kind,
            attributes,
            link_target,
        });
    }
    Ok(Scanned {
        attributes: Some(listing.dir),
        children,
    })
}

/// A catalog of one directory holding files `f000000`, `f000001`, ... of `sizes` (`None`: not
/// looked at yet), built without touching any file system (for the engine core's tests).
pub(crate) fn flat(sizes: &[Option<u64>]) -> Catalog {
    let files = (sizes.iter().enumerate())
        .map(|(i, &size)| Child {
            name: format!("f{i:06}").into(),
            kind: Kind::File,
            attributes: size.map(|size| synthetic(Kind::File, size)),
            link_target: None,
        })
        .collect();
    let root = Scanned {
        attributes: Some(synthetic(Kind::Directory, 0)),
        children: files,
    };
    let scanned = HashMap::from([(PathBuf::new(), root)]);
    assemble(Path::new("/synthetic"), scanned).expect("a small catalog")
}

/// The attributes of a [`flat`] catalog's entries (a file's as its SOURCE shows them).
pub(crate) fn synthetic(kind: Kind, size: u64) -> Attributes {
    Attributes {
        kind,
        perm: 0o644,
        uid: 0,
        gid: 0,
        size,
        mtime_secs: 0,
        mtime_nanos: 0,
        identity: 0,
    }
}

/// Lays the listings out breadth-first: the children of each directory get consecutive ids
/// in name order, which is what makes lookup a binary search.
fn assemble(root: &Path, mut scanned: HashMap<PathBuf, Scanned>) -> Result<Catalog, ScanError> {
    let total: usize = 1 + scanned.values().map(|s| s.children.len()).sum::<usize>();
    let name_bytes: usize = (scanned.values())
        .flat_map(|s| &s.children)
        .map(|c| c.name.len())
        .sum();
    if total > u32::MAX as usize || name_bytes > u32::MAX as usize {
        return Err(ScanError::TooManyEntries);
    }
    let mut catalog = Catalog {
        root_path: root.to_path_buf(),
        entries: Vec::with_capacity(total),
        names: Vec::with_capacity(name_bytes),
        link_targets: Vec::new(),
        seen: Seen::new(total),
        file_count: 0,
    };
    let root_child = Child {
        name: OsString::new(),
        kind: Kind::Directory,
        attributes: None,
        link_target: None,
    };
    push_entry(&mut catalog, ROOT, root_child);

    // (directory id, its relative path), in id order.
    let mut frontier: VecDeque<(FileId, PathBuf)> = VecDeque::from([(ROOT, PathBuf::new())]);
    while let Some((dir_id, dir_path)) = frontier.pop_front() {
        let Scanned {
            attributes,
            mut children,
        } = scanned.remove(&dir_path).unwrap_or(Scanned {
            attributes: None,
            children: Vec::new(),
        });
        if let Some(a) = attributes {
            catalog.seen.keep(dir_id, a);
        }
        children.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        let first = catalog.entries.len() as FileId;
        catalog.entries[dir_id as usize].first_child = first;
        catalog.entries[dir_id as usize].child_count = children.len() as u32;
        for child in children {
            let id = catalog.entries.len() as FileId;
            if child.kind == Kind::Directory {
                frontier.push_back((id, dir_path.join(&child.name)));
            }
            push_entry(&mut catalog, dir_id, child);
        }
    }
    catalog.link_targets.sort_by_key(|(id, _)| *id);
    Ok(catalog)
}

fn push_entry(catalog: &mut Catalog, parent: FileId, child: Child) {
    let id = catalog.entries.len() as FileId;
    let name = child.name.as_bytes();
    if child.kind == Kind::File {
        catalog.file_count += 1;
    }
    if let Some(target) = child.link_target {
        catalog.link_targets.push((id, target));
    }
    if let Some(a) = child.attributes {
        catalog.seen.keep(id, a);
    }
    catalog.entries.push(Entry {
        parent,
        name_offset: catalog.names.len() as u32,
        name_len: name.len() as u8,
        kind: child.kind,
        first_child: 0,
        child_count: 0,
    });
    catalog.names.extend_from_slice(name);
}
