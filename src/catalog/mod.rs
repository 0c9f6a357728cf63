//! The dataset as a listing: every directory, regular file and symlink of SOURCE, with its
//! name and kind, read from SOURCE's directory listings once at mount time (or from an index
//! of them) and immutable afterwards; and each entry's attributes, fetched when first needed
//! and kept (see [`attributes`]).
//!
//! Training treats its dataset as read-only, so stagefs answers lookups and readdir from this
//! table instead of asking the parallel file system, whose metadata round trips are what makes
//! small-file training slow in the first place; a file's attributes cost SOURCE one `lstat`
//! when the file is first looked up, opened or copied, as a direct read would.
//!
//! Layout is chosen for millions of entries: one fixed-size [`Entry`] per node in a `Vec`
//! addressed by a `u32` id, names packed into one shared byte arena, and the children of a
//! directory stored as a contiguous id range sorted by name, so lookup is a binary search and
//! readdir a slice walk. Ids are assigned breadth-first; the inode number is `id + 1` so the
//! root is FUSE's inode 1.

mod attributes;
mod file_set;
pub mod index;
mod layout;
mod maybe_file;
mod scan;
mod walk;

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use attributes::Seen;
pub use attributes::{Attributes, Changed, identity, identity_of};
pub use file_set::FileSet;
pub use index::IndexError;
pub use layout::{
    DEFAULT_EXTENSIONS, Datasets, Layout, LayoutError, LayoutKind, LayoutSpec, check_list_file,
    dataset_name, list_paths,
};
pub use maybe_file::MaybeFile;
pub use scan::{Listed, Lister, Listing, ScanError, source_lister};
pub use walk::{Progress, STALL, Walking};

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
    /// Every kind, in the order the index format numbers them.
    pub const ALL: [Kind; 7] = [
        Kind::Directory,
        Kind::File,
        Kind::Symlink,
        Kind::Fifo,
        Kind::Socket,
        Kind::CharDevice,
        Kind::BlockDevice,
    ];

    /// The kind a directory listing gives (`d_type`), if it gives one (not `DT_UNKNOWN`).
    pub fn of_dirent(d_type: u8) -> Option<Kind> {
        Some(match d_type {
            libc::DT_DIR => Kind::Directory,
            libc::DT_REG => Kind::File,
            libc::DT_LNK => Kind::Symlink,
            libc::DT_FIFO => Kind::Fifo,
            libc::DT_SOCK => Kind::Socket,
            libc::DT_CHR => Kind::CharDevice,
            libc::DT_BLK => Kind::BlockDevice,
            _ => return None,
        })
    }

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

/// One node of the tree, as directory listings describe it: where it is, its name and its
/// kind. Kept small: it is paid once per file of the dataset. Its attributes are fetched when
/// first needed ([`Catalog::attributes`]).
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    pub parent: FileId,
    name_offset: u32,
    /// Linux names are at most 255 bytes (NAME_MAX).
    name_len: u8,
    pub kind: Kind,
    /// For directories: children are ids `first_child .. first_child + child_count`.
    first_child: FileId,
    child_count: u32,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 20);

pub struct Catalog {
    root_path: PathBuf,
    entries: Vec<Entry>,
    names: Vec<u8>,
    /// Symlink targets, by id; rare enough that a sorted side table beats a field per entry.
    link_targets: Vec<(FileId, OsString)>,
    /// The attributes of the entries seen so far.
    seen: Seen,
    file_count: u64,
}

impl Catalog {
    /// Lists `root` with `walking.threads` concurrent listings.
    pub fn scan(root: &Path, walking: Walking) -> Result<Catalog, ScanError> {
        scan::scan(root, walking)
    }

    /// A catalog of one directory of files `f000000`, ... of `sizes` (`None`: not looked at
    /// yet), without a file system: for engine tests and the cluster simulation (`sim`).
    pub fn flat(sizes: &[Option<u64>]) -> Catalog {
        scan::flat(sizes)
    }

    /// What SOURCE shows of a [`flat`](Catalog::flat) catalog's file of `size` bytes.
    #[cfg(test)]
    pub(crate) fn flat_file(size: u64) -> Attributes {
        scan::synthetic(Kind::File, size)
    }

    /// Builds the catalog of the tree `lister` describes (see [`Lister`]).
    pub fn scan_with(
        root: &Path,
        lister: std::sync::Arc<dyn Lister>,
        walking: Walking,
    ) -> Result<Catalog, ScanError> {
        scan::scan_with(root, lister, walking)
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
            + self.seen.heap_bytes()
            + self
                .link_targets
                .iter()
                .map(|(_, t)| 32 + t.len())
                .sum::<usize>()
    }

    pub fn file_count(&self) -> u64 {
        self.file_count
    }

    /// Where `id` is and what kind it is; its attributes are [`Catalog::attributes`].
    pub fn entry(&self, id: FileId) -> Option<&Entry> {
        self.entries.get(id as usize)
    }

    /// `id`'s attributes, if the mount has seen them (they are fetched on first need and
    /// kept: see [`Catalog::observe`]).
    pub fn attributes(&self, id: FileId) -> Option<Attributes> {
        self.seen.get(id)
    }

    /// `id`'s size, if known.
    pub fn size(&self, id: FileId) -> Option<u64> {
        self.attributes(id).map(|a| a.size)
    }

    /// SOURCE shows `now` for `id` (an `lstat`, or the `fstat` of the file opened). The first
    /// sight is kept as its attributes and returned; a later one must still be the node first
    /// seen, unchanged ([`Attributes::is_unchanged`]), and any sight must be of the kind the
    /// listing said.
    pub fn observe(&self, id: FileId, now: Attributes) -> Result<Attributes, Changed> {
        if self.entry(id).map(|e| e.kind) != Some(now.kind) {
            return Err(Changed::Retyped);
        }
        let kept = self.seen.keep(id, now);
        match kept.is_unchanged(&now) {
            true => Ok(kept),
            false => Err(Changed::Rewritten),
        }
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
        let catalog = Catalog::scan(root, Walking::threads(1)).unwrap();
        for (name, target, resolves) in links {
            let id = catalog.lookup_path(&Path::new("a").join(name)).unwrap();
            let kernel = std::fs::canonicalize(root.join("a").join(name)).is_ok();
            assert_eq!(kernel, resolves, "{target}: the kernel's view");
            assert_eq!(catalog.resolve(id).is_some(), resolves, "{target}");
        }
    }
}
