//! The dataset as a snapshot: every directory, regular file and symlink of SOURCE, scanned
//! once at mount time and immutable afterwards.
//!
//! Training treats its dataset as read-only, so stagefs answers every metadata question
//! (lookup, getattr, readdir) from this table instead of asking the parallel file system,
//! whose metadata round trips are what makes small-file training slow in the first place.
//!
//! Layout is chosen for millions of entries: one fixed-size [`Entry`] per node in a `Vec`
//! addressed by a `u32` id, names packed into one shared byte arena, and the children of a
//! directory stored as a contiguous id range sorted by name, so lookup is a binary search and
//! readdir a slice walk. Ids are assigned breadth-first; the inode number is `id + 1` so the
//! root is FUSE's inode 1.

mod file_set;
pub mod index;
mod layout;
mod maybe_file;
mod scan;

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use file_set::FileSet;
pub use index::IndexError;
pub use layout::{
    DEFAULT_EXTENSIONS, Datasets, Layout, LayoutError, LayoutKind, LayoutSpec, check_list_file,
    dataset_name, list_paths,
};
pub use maybe_file::MaybeFile;
pub use scan::{Lister, ScanError, Scanned};

/// A catalog node id: index into [`Catalog::entries`]. The root is 0.
pub type FileId = u32;

/// Id of the root directory.
pub const ROOT: FileId = 0;

/// How many symlinks a path may pass through before we call it a loop (Linux's own limit).
const MAX_SYMLINK_HOPS: usize = 40;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Directory,
    File,
    Symlink,
    /// FIFOs, sockets and device nodes: never read or staged, but listed, because the dataset
    /// classes count them (torchvision's `os.walk` puts every non-directory among the files),
    /// so leaving them out would shift every sample index after them.
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl Kind {
    /// The kind of a file as `lstat` describes it.
    pub fn of(ft: std::fs::FileType) -> Kind {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_dir() {
            Kind::Directory
        } else if ft.is_file() {
            Kind::File
        } else if ft.is_symlink() {
            Kind::Symlink
        } else if ft.is_fifo() {
            Kind::Fifo
        } else if ft.is_socket() {
            Kind::Socket
        } else if ft.is_char_device() {
            Kind::CharDevice
        } else {
            Kind::BlockDevice
        }
    }

    /// The kind of a file from the type bits of its `st_mode`.
    pub fn of_mode(mode: u32) -> Kind {
        match mode & libc::S_IFMT {
            libc::S_IFDIR => Kind::Directory,
            libc::S_IFREG => Kind::File,
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFIFO => Kind::Fifo,
            libc::S_IFSOCK => Kind::Socket,
            libc::S_IFCHR => Kind::CharDevice,
            _ => Kind::BlockDevice,
        }
    }
}

/// One node of the tree. Kept small: it is paid once per file of the dataset. Packed to
/// 4-byte alignment, so its 52 bytes are not padded to 56 for the 64-bit fields (read by
/// value only; references to them would be unaligned).
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
pub struct Entry {
    pub parent: FileId,
    name_offset: u32,
    /// Linux names are at most 255 bytes (NAME_MAX).
    name_len: u8,
    pub kind: Kind,
    /// Permission bits (`st_mode & 0o7777`).
    pub perm: u16,
    /// Index into [`Catalog::owners`]: datasets have few distinct (uid, gid) pairs.
    owner: u32,
    pub size: u64,
    pub mtime_secs: i64,
    pub mtime_nanos: u32,
    /// [`identity`] of the node as scanned: which inode it was, and its ctime, which the
    /// kernel moves on every change of content, mode, owner, links or (for a directory) its
    /// entries, and which no user can set back.
    pub identity: u64,
    /// For directories: children are ids `first_child .. first_child + child_count`.
    first_child: FileId,
    child_count: u32,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 52);

/// A 64-bit fingerprint of a node's inode and ctime (the parts of `stat` that say *which* file
/// it is and *whether it changed*, and that its owner cannot forge: `touch -r` restores an
/// mtime, never a ctime). Stable across versions: indexes store it. The device number is left
/// out on purpose: a network file system's client gets a new one each time it is remounted,
/// while its inode numbers and ctimes stay (they come from the server).
pub fn identity(m: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    identity_of(m.ino(), m.ctime(), m.ctime_nsec())
}

/// [`identity`] from the fields of a `struct stat`.
pub fn identity_of(ino: u64, ctime: i64, ctime_nsec: i64) -> u64 {
    // SplitMix64's finalizer over each field in turn: cheap and well mixed. A collision needs
    // a change that lands on the same 64-bit value, which a user cannot steer (the kernel
    // picks inode numbers and nanosecond ctimes).
    let mix = |h: u64, v: u64| {
        let mut z = (h ^ v).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    [ino, ctime as u64, ctime_nsec as u64]
        .into_iter()
        .fold(0, mix)
}

impl Entry {
    /// Whether `m` (a stat of a cached copy) carries this entry's size and mtime, which a
    /// copy is given when it is published.
    pub fn matches(&self, m: &std::fs::Metadata) -> bool {
        use std::os::unix::fs::MetadataExt;
        m.len() == self.size
            && m.mtime() == self.mtime_secs
            && m.mtime_nsec() as u32 == self.mtime_nanos
    }

    /// Whether `m` (an `lstat`/`fstat` on SOURCE) is still the node this entry was scanned
    /// from, unchanged: same kind, same inode and ctime, same size and mtime. Anything else
    /// (replaced, rewritten, chmod'ed, swapped for a link or a FIFO) is a changed file.
    pub fn is_unchanged(&self, m: &std::fs::Metadata) -> bool {
        Kind::of(m.file_type()) == self.kind
            && identity(m) == self.identity
            && (self.kind == Kind::Directory || self.matches(m))
    }

    pub fn mtime(&self) -> SystemTime {
        // As in struct stat, the nanoseconds count forward from the (possibly negative) seconds:
        // (-2, 250_000_000) is 1.75 s before the epoch.
        let nanos = Duration::from_nanos(self.mtime_nanos.into());
        if self.mtime_secs >= 0 {
            UNIX_EPOCH + Duration::from_secs(self.mtime_secs as u64) + nanos
        } else {
            UNIX_EPOCH - Duration::from_secs(self.mtime_secs.unsigned_abs()) + nanos
        }
    }
}

pub struct Catalog {
    root_path: PathBuf,
    entries: Vec<Entry>,
    names: Vec<u8>,
    owners: Vec<(u32, u32)>,
    /// Symlink targets, by id; rare enough that a sorted side table beats a field per entry.
    link_targets: Vec<(FileId, OsString)>,
    file_count: u64,
    total_file_bytes: u64,
}

impl Catalog {
    /// Scans `root` with `threads` concurrent metadata workers.
    pub fn scan(root: &Path, threads: usize) -> Result<Catalog, ScanError> {
        scan::scan(root, threads)
    }

    /// A catalog of one directory of files `f000000`, ... of `sizes`, without a file system.
    #[cfg(test)]
    pub(crate) fn flat(sizes: &[u64]) -> Catalog {
        scan::flat(sizes)
    }

    /// Builds the catalog of the tree `lister` describes (see [`Lister`]).
    pub fn scan_with(
        root: &Path,
        lister: &dyn Lister,
        threads: usize,
    ) -> Result<Catalog, ScanError> {
        scan::scan_with(root, lister, threads)
    }

    pub fn root_path(&self) -> &Path {
        &self.root_path
    }

    /// Number of entries (directories, files and links); ids are below it.
    #[allow(clippy::len_without_is_empty)] // the root always exists
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Heap memory the catalog holds, in bytes.
    pub fn heap_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.names.capacity()
            + self.owners.capacity() * 8
            + self
                .link_targets
                .iter()
                .map(|(_, t)| 32 + t.len())
                .sum::<usize>()
    }

    pub fn file_count(&self) -> u64 {
        self.file_count
    }

    pub fn total_file_bytes(&self) -> u64 {
        self.total_file_bytes
    }

    pub fn entry(&self, id: FileId) -> Option<&Entry> {
        self.entries.get(id as usize)
    }

    pub fn name(&self, id: FileId) -> &OsStr {
        let e = &self.entries[id as usize];
        let start = e.name_offset as usize;
        OsStr::from_bytes(&self.names[start..start + e.name_len as usize])
    }

    /// Children of a directory, sorted by name bytes (empty for non-directories).
    pub fn children(&self, dir: FileId) -> std::ops::Range<FileId> {
        match self.entries.get(dir as usize) {
            Some(e) if e.kind == Kind::Directory => e.first_child..e.first_child + e.child_count,
            _ => 0..0,
        }
    }

    pub fn lookup(&self, dir: FileId, name: &OsStr) -> Option<FileId> {
        let range = self.children(dir);
        let (mut lo, mut hi) = (range.start, range.end);
        let wanted = name.as_bytes();
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.name(mid).as_bytes().cmp(wanted) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(mid),
            }
        }
        None
    }

    /// (uid, gid) of an entry.
    pub fn owner(&self, e: &Entry) -> (u32, u32) {
        self.owners.get(e.owner as usize).copied().unwrap_or((0, 0))
    }

    pub fn link_target(&self, id: FileId) -> Option<&OsStr> {
        self.link_targets
            .binary_search_by_key(&id, |(k, _)| *k)
            .ok()
            .map(|i| self.link_targets[i].1.as_os_str())
    }

    /// Path of `id` relative to the root (empty for the root).
    pub fn relative_path(&self, id: FileId) -> PathBuf {
        let mut parts = Vec::new();
        let mut cur = id;
        while cur != ROOT {
            parts.push(self.name(cur));
            cur = self.entries[cur as usize].parent;
        }
        parts.iter().rev().collect()
    }

    /// Absolute path of `id` on SOURCE.
    pub fn source_path(&self, id: FileId) -> PathBuf {
        self.root_path.join(self.relative_path(id))
    }

    /// Looks up a relative path the way the kernel would inside the mount: symlinked
    /// directories on the way are followed (the last component is not), `..` and links never
    /// lead above the root, and absolute paths are refused.
    pub fn lookup_path(&self, relative: &Path) -> Option<FileId> {
        self.lookup_path_from(ROOT, relative)
    }

    /// [`lookup_path`](Self::lookup_path) from directory `dir` instead of the root (`..` may
    /// still climb up to the root, as in the kernel).
    pub fn lookup_path_from(&self, dir: FileId, relative: &Path) -> Option<FileId> {
        if relative.is_absolute() {
            return None;
        }
        self.walk_from(dir, relative, &mut 0)
    }

    /// Follows symlinks (in every component, like the kernel would) until a non-link node.
    /// Returns `None` for dangling links, loops, and links that leave the root: stagefs never
    /// reads anything outside SOURCE.
    pub fn resolve(&self, id: FileId) -> Option<FileId> {
        self.resolve_hops(id, &mut 0)
    }

    fn resolve_hops(&self, mut id: FileId, hops: &mut usize) -> Option<FileId> {
        while self.entries.get(id as usize)?.kind == Kind::Symlink {
            *hops += 1;
            if *hops > MAX_SYMLINK_HOPS {
                return None;
            }
            let target = Path::new(self.link_target(id)?);
            let mut cur = if target.is_absolute() {
                // An absolute target is only inside the dataset if it names SOURCE itself.
                let rest = target.strip_prefix(&self.root_path).ok()?;
                return self.walk_from(ROOT, rest, hops);
            } else {
                self.entries[id as usize].parent
            };
            cur = self.walk_from(cur, target, hops)?;
            id = cur;
        }
        Some(id)
    }

    /// Walks `path` from directory `start`, resolving symlinked directories on the way and
    /// `..` against the tree (never above the root).
    fn walk_from(&self, start: FileId, path: &Path, hops: &mut usize) -> Option<FileId> {
        let mut cur = start;
        for comp in path.components() {
            match comp {
                Component::Normal(name) => {
                    let dir = self.resolve_dir(cur, hops)?;
                    cur = self.lookup(dir, name)?;
                }
                Component::CurDir => cur = self.resolve_dir(cur, hops)?,
                Component::ParentDir => {
                    let dir = self.resolve_dir(cur, hops)?;
                    if dir == ROOT {
                        return None;
                    }
                    cur = self.entries[dir as usize].parent;
                }
                Component::RootDir | Component::Prefix(_) => return None,
            }
        }
        // `components()` drops a trailing `/` or `/.`, but they make the kernel insist on a
        // directory: `file.jpg/` is ENOTDIR, not the file.
        let bytes = path.as_os_str().as_bytes();
        if bytes.ends_with(b"/") || bytes.ends_with(b"/.") {
            cur = self.resolve_dir(cur, hops)?;
        }
        Some(cur)
    }

    /// `id` resolved, if that is a directory (what a path may continue through).
    fn resolve_dir(&self, id: FileId, hops: &mut usize) -> Option<FileId> {
        let dir = self.resolve_hops(id, hops)?;
        (self.entries[dir as usize].kind == Kind::Directory).then_some(dir)
    }

    /// How many directories `id` is below the root.
    pub fn depth(&self, mut id: FileId) -> usize {
        let mut depth = 0;
        while id != ROOT {
            id = self.entries[id as usize].parent;
            depth += 1;
        }
        depth
    }

    /// The deepest directory holding both `a` and `b` (the root at worst).
    pub fn common_ancestor(&self, mut a: FileId, mut b: FileId) -> FileId {
        let parent = |id: FileId| self.entries[id as usize].parent;
        let (mut da, mut db) = (self.depth(a), self.depth(b));
        while da > db {
            (a, da) = (parent(a), da - 1);
        }
        while db > da {
            (b, db) = (parent(b), db - 1);
        }
        while a != b {
            (a, b) = (parent(a), parent(b));
        }
        a
    }

    /// Every regular file id, in id order.
    pub fn files(&self) -> impl Iterator<Item = FileId> + '_ {
        (0..self.entries.len() as FileId).filter(|&id| self.entries[id as usize].kind == Kind::File)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// Found by fuzz/catalog_paths: a link to `y.png/` resolved to the file, where the kernel
    /// says ENOTDIR; so did `y.png/.` and `y.png/..` (it walked to the file's parent).
    #[test]
    fn a_path_through_a_file_resolves_to_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir(root.join("a")).unwrap();
        std::fs::write(root.join("a/y.png"), b"y").unwrap();
        let links = [
            ("slash", "y.png/", false),
            ("dot", "y.png/.", false),
            ("dotdot", "y.png/..", false),
            ("into", "y.png/z", false),
            ("file", "y.png", true),
            ("dir_slash", "../a/", true),
            ("dir_dot", "./.", true),
        ];
        for (name, target, _) in links {
            symlink(target, root.join("a").join(name)).unwrap();
        }
        let catalog = Catalog::scan(root, 1).unwrap();
        for (name, target, resolves) in links {
            let id = catalog.lookup_path(&Path::new("a").join(name)).unwrap();
            let kernel = std::fs::canonicalize(root.join("a").join(name)).is_ok();
            assert_eq!(kernel, resolves, "{target}: the kernel's view");
            assert_eq!(catalog.resolve(id).is_some(), resolves, "{target}");
        }
    }
}
