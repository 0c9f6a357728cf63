//! The node-local cache directory: whose it is, what is in it, and how files get there and
//! back out safely.
//!
//! Layout (documented in the README):
//! ```text
//! CACHE/                 --cache: created 0700 if missing; otherwise the user's own private
//!                        directory, holding nothing but stagefs/
//!   stagefs/             stagefs's own directory, the only one it ever empties or chmods
//!     manifest.json      format version and the SOURCE this cache holds
//!     lock               flock'ed by the daemon using the cache
//!     index.bin          the catalog of SOURCE, so the next mount need not scan it
//!     stagefs.log        the detached daemon's log (unless --log-file)
//!     tmp/               copies in progress (deleted at start-up)
//!     data/xx/HASH       complete files; HASH = sha256(relative path, 0, identity)[..16] in
//!                        hex (the identity: see `CacheDir::path_for`), xx = its first byte
//! ```
//! CACHE is refused unless nobody but its owner (the daemon's user) could have put anything
//! there or could swap it: stagefs runs as root on shared nodes, and a planted file must never
//! be served nor a planted link followed. Every file inside is opened without following links.
//!
//! A file appears under `data/` only by `rename` after it was copied in full and checked
//! against the catalog (the source file's inode, ctime, size and mtime, after the copy); it
//! carries the source's mtime and, in the `user.stagefs.sum` attribute, the checksum of the
//! bytes copied. So a crash leaves at worst a temporary file, never a partial file that is
//! served, and a remount reuses a cached file only if it is a copy of the file's current
//! version (its name says which) and its bytes still match the checksum (checked when it is
//! first opened).

use std::collections::HashSet;
use std::ffi::{CStr, OsString};
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3;

use crate::catalog::{Catalog, Entry, FileId};
use crate::files::{open_nofollow, write_atomically};
use crate::sys::euid;

/// stagefs's own directory inside CACHE: everything it writes lives there, so a directory
/// it did not create is never emptied or chmod'ed.
const OWN_DIR: &str = "stagefs";
const MANIFEST: &str = "manifest.json";
/// The manifest of the layout before [`OWN_DIR`], named to tell such a cache's user what to do.
const OLD_MANIFEST: &str = "stagefs-cache.json";
const LOCK: &str = "lock";
/// The catalog a mount keeps for the next one (see `catalog::index`).
const INDEX: &str = "index.bin";
const LOG: &str = "stagefs.log";
const DATA: &str = "data";
const TMP: &str = "tmp";
const MANIFEST_FORMAT: u32 = 1;
/// How long to wait for the cache lock: long enough for a previous daemon to finish exiting.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Copy buffer: large enough that a parallel file system sees big sequential reads, small
/// enough that 16–64 concurrent copies stay well under 100 MB of memory.
const COPY_BUFFER: usize = 1 << 20;
/// The attribute holding a cached file's checksum, set on the temporary file before the
/// rename, so a file under `data/` has its checksum from its first instant.
const SUM_XATTR: &CStr = c"user.stagefs.sum";
/// First byte of the attribute's value (then the xxh3-128 of the content, little-endian):
/// a later format is not mistaken for this one.
const SUM_FORMAT: u8 = 1;
const SUM_LEN: usize = 1 + 16;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache directory {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("cache directory {0} is in use by another stagefs; give each mount its own --cache")]
    Locked(PathBuf),
    #[error("cache {0} is a symbolic link; give the directory it points to, if it is yours")]
    Symlink(PathBuf),
    #[error("cache {0} is not a directory; give a new or empty directory")]
    NotADirectory(PathBuf),
    #[error(
        "cache {path} belongs to uid {owner}, not to this stagefs (uid {uid}); use a directory of your own"
    )]
    NotOwned { path: PathBuf, owner: u32, uid: u32 },
    #[error(
        "cache {path} can be written by others (mode {mode:o}); use a private directory (chmod go-w {path}, or a new one)"
    )]
    Shared { path: PathBuf, mode: u32 },
    #[error(
        "cache {path} holds {entry:?}, which is not stagefs's; give an empty or new directory (stagefs keeps its files in {path}/{OWN_DIR})"
    )]
    Foreign { path: PathBuf, entry: OsString },
    #[error(
        "cache {0} has the layout of an older stagefs; remove it (rm -r {0}) or give a new directory"
    )]
    OldLayout(PathBuf),
    #[error(
        "cache {0} is not a valid stagefs cache (no manifest); remove it (rm -r {0}) or give another --cache"
    )]
    NoManifest(PathBuf),
    #[error(
        "cache {cache} is inside {dir}, which others can change (owner uid {owner}, mode {mode:o}) and so swap the cache for their own; put the cache under directories only root or you can write to"
    )]
    UnsafeParent {
        cache: PathBuf,
        dir: PathBuf,
        owner: u32,
        mode: u32,
    },
    #[error("cached copy {0} has no checksum (staged without one)")]
    NoChecksum(PathBuf),
    #[error("cached copy {0} does not match the checksum recorded when it was staged")]
    Corrupt(PathBuf),
}

/// Why one copy into the cache failed. The stager treats the kinds differently: source
/// errors are retried with backoff, a full cache shrinks capacity, a changed source file is
/// not retried at all.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("reading {path}: {source}")]
    Source { path: PathBuf, source: io::Error },
    /// Deleted on the source since it was catalogued.
    #[error("{0} was deleted on the source since it was mounted")]
    SourceGone(PathBuf),
    /// Not the file that was catalogued any more, before or during the copy.
    #[error("{0} changed on the source since it was mounted")]
    SourceChanged(PathBuf),
    #[error("cache file system is full")]
    NoSpace,
    #[error("writing the cache: {0}")]
    Cache(io::Error),
}

/// What `manifest.json` records: which SOURCE the cached files are copies of.
#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub format: u32,
    #[serde(with = "path_bytes")]
    pub source: PathBuf,
}

/// SOURCE in the manifest: a JSON string when it is UTF-8 (as format 1 has always written
/// it), otherwise its bytes as an array of numbers. Linux paths are bytes; serde's own
/// `PathBuf` serialization refuses non-UTF-8 ones.
mod path_bytes {
    use std::ffi::OsString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    use std::path::{Path, PathBuf};

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
        match path.to_str() {
            Some(text) => s.serialize_str(text),
            None => s.collect_seq(path.as_os_str().as_bytes()),
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Text(String),
        Bytes(Vec<u8>),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        Ok(match Repr::deserialize(d)? {
            Repr::Text(text) => PathBuf::from(text),
            Repr::Bytes(bytes) => PathBuf::from(OsString::from_vec(bytes)),
        })
    }
}

impl Manifest {
    /// The manifest of a cache holding copies of `source`.
    pub fn for_source(source: &Path) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT,
            source: source.to_path_buf(),
        }
    }

    /// The file's content.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("a manifest serializes, whatever its path")
    }

    /// Reads a manifest as found on disk; anything that is not one (truncated, foreign,
    /// hand-edited) is `None`.
    pub fn parse(bytes: &[u8]) -> Option<Manifest> {
        serde_json::from_slice(bytes).ok()
    }

    /// Whether the files of a cache with this manifest may be reused for `source`.
    pub fn holds(&self, source: &Path) -> bool {
        self.format == MANIFEST_FORMAT && self.source == source
    }

    /// The manifest in the stagefs directory `own`, if there is a valid one (a link is not).
    fn read(own: &Path) -> Option<Manifest> {
        let mut bytes = Vec::new();
        open_nofollow(&own.join(MANIFEST))
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .ok()?;
        Manifest::parse(&bytes)
    }
}

pub struct CacheDir {
    root: PathBuf,
    data: PathBuf,
    tmp: PathBuf,
    _lock: File,
    temp_seq: AtomicU64,
    /// Set once the cache file system refused the checksum attribute (warned about once).
    no_xattrs: AtomicBool,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates a directory of stagefs's own (0700); one already there must be a real directory.
fn mkdir_private(path: &Path) -> Result<(), CacheError> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let meta = fs::symlink_metadata(path).map_err(io_err(path))?;
            if meta.is_dir() {
                Ok(())
            } else {
                Err(CacheError::NotADirectory(path.to_path_buf()))
            }
        }
        other => other.map_err(io_err(path)),
    }
}

/// Whether others than the owner can write to a directory with this mode (a sticky
/// directory such as /tmp lets them add entries but not replace the owner's).
fn others_can_replace(mode: u32) -> bool {
    mode & 0o022 != 0 && mode & libc::S_ISVTX == 0
}

/// Checks, without changing anything, that the cache `root` (which need not exist yet) is
/// stagefs's to use: see [`CacheDir::open`]. Called before the daemon starts, so a refusal
/// reaches the user at once.
pub fn check_root(root: &Path) -> Result<(), CacheError> {
    check_parents(root)?;
    match fs::symlink_metadata(root) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(root)(e)),
        Ok(meta) => check_existing(root, &meta),
    }
}

/// Every directory above `root`, as written and with links resolved, must be changeable by
/// root or the daemon's user alone: anyone else could rename the cache away and put their
/// own directory in its place between two checks.
fn check_parents(root: &Path) -> Result<(), CacheError> {
    let abs = std::path::absolute(root).map_err(io_err(root))?;
    let mut dirs: Vec<PathBuf> = abs.ancestors().skip(1).map(Path::to_path_buf).collect();
    if let Some(real) = dirs.iter().find_map(|d| fs::canonicalize(d).ok()) {
        dirs.extend(real.ancestors().map(Path::to_path_buf));
    }
    let uid = euid();
    for dir in dirs {
        let meta = match fs::metadata(&dir) {
            Ok(m) => m,
            // Not there yet: created by us, below a directory checked here.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&dir)(e)),
        };
        if (meta.uid() != 0 && meta.uid() != uid) || others_can_replace(meta.mode()) {
            return Err(CacheError::UnsafeParent {
                cache: root.to_path_buf(),
                dir,
                owner: meta.uid(),
                mode: meta.mode() & 0o7777,
            });
        }
    }
    Ok(())
}

/// An existing directory must be the daemon user's, private, and hold nothing but a valid
/// (or empty) stagefs directory.
fn check_existing(path: &Path, meta: &Metadata) -> Result<(), CacheError> {
    check_private_dir(path, meta)?;
    let mut foreign = None;
    for entry in fs::read_dir(path).map_err(io_err(path))? {
        let name = entry.map_err(io_err(path))?.file_name();
        if name == OLD_MANIFEST {
            return Err(CacheError::OldLayout(path.to_path_buf()));
        }
        if name != OWN_DIR {
            foreign.get_or_insert(name);
        }
    }
    if let Some(entry) = foreign {
        return Err(CacheError::Foreign {
            path: path.to_path_buf(),
            entry,
        });
    }
    let own = path.join(OWN_DIR);
    match fs::symlink_metadata(&own) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&own)(e)),
        Ok(meta) => {
            check_private_dir(&own, &meta)?;
            // Empty: created by a stagefs that stopped before writing the manifest.
            let empty = fs::read_dir(&own).map_err(io_err(&own))?.next().is_none();
            if empty || Manifest::read(&own).is_some() {
                Ok(())
            } else {
                Err(CacheError::NoManifest(path.to_path_buf()))
            }
        }
    }
}

/// A real directory (not a link) owned by the daemon's user and writable by no one else.
fn check_private_dir(path: &Path, meta: &Metadata) -> Result<(), CacheError> {
    if meta.file_type().is_symlink() {
        return Err(CacheError::Symlink(path.to_path_buf()));
    }
    if !meta.is_dir() {
        return Err(CacheError::NotADirectory(path.to_path_buf()));
    }
    if meta.uid() != euid() {
        return Err(CacheError::NotOwned {
            path: path.to_path_buf(),
            owner: meta.uid(),
            uid: euid(),
        });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(CacheError::Shared {
            path: path.to_path_buf(),
            mode: meta.mode() & 0o7777,
        });
    }
    Ok(())
}

/// Checks `root` as [`check_root`] does and creates what is missing: CACHE itself (0700) and
/// stagefs's own directory with a manifest for `source`. Returns the own directory. Empties
/// nothing, so it may run before the cache lock is taken (the daemon's log lives there).
pub fn prepare(root: &Path, source: &Path) -> Result<PathBuf, CacheError> {
    check_parents(root)?;
    // A no-op on an existing directory (or link to one: refused just below).
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .map_err(io_err(root))?;
    check_existing(root, &fs::symlink_metadata(root).map_err(io_err(root))?)?;
    let own = root.join(OWN_DIR);
    mkdir_private(&own)?;
    if Manifest::read(&own).is_none() {
        write_manifest(&own, source)?;
    }
    Ok(own)
}

fn write_manifest(own: &Path, source: &Path) -> Result<(), CacheError> {
    let path = own.join(MANIFEST);
    // Private like everything in the cache: it names the dataset.
    write_atomically(&path, &Manifest::for_source(source).to_bytes(), 0o600).map_err(io_err(&path))
}

impl CacheDir {
    /// Opens (creating if needed) the cache for `source`. `root` must be missing, or the daemon
    /// user's own directory, not writable by others, below directories nobody else can change,
    /// and empty or holding only a valid stagefs directory (see [`check_root`]). A stagefs
    /// directory that held another source is emptied; leftovers of interrupted copies are
    /// deleted.
    pub fn open(root: &Path, source: &Path) -> Result<CacheDir, CacheError> {
        let own = prepare(root, source)?;
        let lock_path = own.join(LOCK);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        // A daemon that was just unmounted may still be exiting: give it a moment.
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        // SAFETY: flock on a valid fd we own.
        while unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            if std::time::Instant::now() >= deadline {
                return Err(CacheError::Locked(root.to_path_buf()));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let data = own.join(DATA);
        let tmp = own.join(TMP);
        match Manifest::read(&own) {
            Some(m) if m.holds(source) => {}
            previous => {
                if let Some(m) = previous {
                    log::warn!(
                        "cache {} held {} (format {}); emptying it for {}",
                        root.display(),
                        m.source.display(),
                        m.format,
                        source.display()
                    );
                }
                remove_tree(&data)?;
                let index = own.join(INDEX);
                if let Err(e) = fs::remove_file(&index)
                    && e.kind() != io::ErrorKind::NotFound
                {
                    return Err(io_err(&index)(e));
                }
                write_manifest(&own, source)?;
            }
        }
        remove_tree(&tmp)?;
        mkdir_private(&data)?;
        mkdir_private(&tmp)?;
        for byte in 0..=255u8 {
            mkdir_private(&data.join(format!("{byte:02x}")))?;
        }
        Ok(CacheDir {
            root: root.to_path_buf(),
            data,
            tmp,
            _lock: lock,
            temp_seq: AtomicU64::new(0),
            no_xattrs: AtomicBool::new(false),
        })
    }

    /// Where the cached copy of catalog file `file` lives. The name hashes its path *and* its
    /// identity on SOURCE (inode, ctime): a file rewritten since it was copied, even at the
    /// same size with its mtime put back, names another cache file, so a remount never
    /// mistakes the old copy for the new version.
    pub fn path_for(&self, catalog: &Catalog, file: FileId) -> PathBuf {
        let identity = catalog.entry(file).map_or(0, |e| e.identity);
        let mut hasher = Sha256::new();
        hasher.update(catalog.relative_path(file).as_os_str().as_encoded_bytes());
        hasher.update([0]);
        hasher.update(identity.to_le_bytes());
        let digest = hasher.finalize();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        self.data.join(&hex[..2]).join(hex)
    }

    /// Finds the complete files a previous mount left that still match the catalog, and
    /// deletes everything else under `data/`. Returns (file, size) of those kept; their
    /// content is still to be checked ([`CacheDir::open_verified`]).
    pub fn reuse(&self, catalog: &Catalog) -> Vec<(FileId, u64)> {
        let mut present: HashSet<OsString> = HashSet::new();
        for sub in fs::read_dir(&self.data).into_iter().flatten().flatten() {
            for f in fs::read_dir(sub.path()).into_iter().flatten().flatten() {
                present.insert(f.file_name());
            }
        }
        let mut kept = Vec::new();
        let mut wanted: HashSet<OsString> = HashSet::new();
        if !present.is_empty() {
            for id in catalog.files() {
                let path = self.path_for(catalog, id);
                let name = path.file_name().expect("hash name").to_os_string();
                if !present.contains(&name) {
                    continue;
                }
                let entry = catalog.entry(id).expect("catalog file");
                match fs::symlink_metadata(&path) {
                    Ok(m) if m.is_file() && entry.matches(&m) => {
                        kept.push((id, entry.size));
                        wanted.insert(name);
                    }
                    _ => {}
                }
            }
        }
        let stale = present.len() - wanted.len();
        if stale > 0 {
            for sub in fs::read_dir(&self.data).into_iter().flatten().flatten() {
                for f in fs::read_dir(sub.path()).into_iter().flatten().flatten() {
                    if !wanted.contains(&f.file_name()) {
                        let _ = fs::remove_file(f.path());
                    }
                }
            }
            log::info!("cache: removed {stale} files that no longer match the source");
        }
        kept
    }

    /// Opens the cached copy of `file`, staged by this mount.
    pub fn open_cached(&self, catalog: &Catalog, file: FileId) -> io::Result<File> {
        open_nofollow(&self.path_for(catalog, file))
    }

    /// Opens the cached copy of `file` that a previous mount left, after checking its
    /// bytes against the checksum recorded when it was staged. Reads the whole file: call it
    /// without holding locks others wait on.
    pub fn open_verified(&self, catalog: &Catalog, file: FileId) -> Result<File, CacheError> {
        let path = self.path_for(catalog, file);
        let mut file = open_nofollow(&path).map_err(io_err(&path))?;
        let recorded = read_checksum(&file).ok_or_else(|| CacheError::NoChecksum(path.clone()))?;
        let mut hasher = Xxh3::new();
        let mut buf = vec![0u8; COPY_BUFFER];
        loop {
            match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => hasher.update(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(&path)(e)),
            }
        }
        if hasher.digest128() != recorded {
            return Err(CacheError::Corrupt(path));
        }
        file.rewind().map_err(io_err(&path))?;
        Ok(file)
    }

    /// Copies the source file `src`, opened and checked against the catalog by the caller,
    /// into the cache as the complete, verified copy of catalog file `file`.
    pub fn stage(&self, mut src: File, catalog: &Catalog, file: FileId) -> Result<u64, CopyError> {
        let source = &catalog.source_path(file);
        let entry = catalog.entry(file).expect("a catalog file");
        let tmp_path = self.tmp.join(format!(
            "{}.{}",
            std::process::id(),
            self.temp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let result = self.copy_to_temp(&mut src, source, &tmp_path, entry);
        match result {
            Ok(n) => {
                let dest = self.path_for(catalog, file);
                fs::rename(&tmp_path, &dest).map_err(|e| {
                    let _ = fs::remove_file(&tmp_path);
                    cache_err(e)
                })?;
                Ok(n)
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp_path);
                Err(e)
            }
        }
    }

    fn copy_to_temp(
        &self,
        src: &mut File,
        source: &Path,
        tmp_path: &Path,
        entry: &Entry,
    ) -> Result<u64, CopyError> {
        let src_err = source_err(source);
        let mut out = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(tmp_path)
            .map_err(cache_err)?;
        let mut buf = vec![0u8; COPY_BUFFER.min(entry.size.max(1) as usize)];
        let mut copied = 0u64;
        // Hashed as copied, from the very bytes written: no second read of either file.
        let mut hasher = Xxh3::new();
        loop {
            let n = match src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(src_err(e)),
            };
            out.write_all(&buf[..n]).map_err(cache_err)?;
            hasher.update(&buf[..n]);
            copied += n as u64;
        }
        // The source must still be the file we catalogued, or the copy could mix versions.
        if copied != entry.size || !entry.is_unchanged(&src.metadata().map_err(src_err)?) {
            return Err(CopyError::SourceChanged(source.to_path_buf()));
        }
        self.record_checksum(&out, hasher.digest128())?;
        let mtime = libc::timespec {
            tv_sec: entry.mtime_secs,
            tv_nsec: entry.mtime_nanos as i64,
        };
        let times = [
            libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_OMIT,
            },
            mtime,
        ];
        // SAFETY: valid fd and a two-element timespec array as futimens requires.
        if unsafe { libc::futimens(out.as_raw_fd(), times.as_ptr()) } != 0 {
            return Err(cache_err(io::Error::last_os_error()));
        }
        Ok(copied)
    }

    /// Sets the checksum attribute of a copy. A cache file system without user attributes
    /// still caches, but a remount cannot check those files and stages them again.
    fn record_checksum(&self, out: &File, sum: u128) -> Result<(), CopyError> {
        let mut value = [0u8; SUM_LEN];
        value[0] = SUM_FORMAT;
        value[1..].copy_from_slice(&sum.to_le_bytes());
        // SAFETY: valid fd, NUL-terminated name, and a value buffer of the length given.
        let rc = unsafe {
            libc::fsetxattr(
                out.as_raw_fd(),
                SUM_XATTR.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOTSUP) {
            return Err(cache_err(e));
        }
        if !self.no_xattrs.swap(true, Ordering::Relaxed) {
            log::warn!(
                "the cache file system does not support user extended attributes: files cached now cannot be checked by a later mount, which will stage them again"
            );
        }
        Ok(())
    }

    pub fn remove(&self, catalog: &Catalog, file: FileId) {
        let path = self.path_for(catalog, file);
        if let Err(e) = fs::remove_file(&path)
            && e.kind() != io::ErrorKind::NotFound
        {
            log::warn!("cannot remove cached {}: {e}", path.display());
        }
    }

    /// Bytes the cache's file system can still take, and its total size.
    pub fn filesystem_space(&self) -> io::Result<(u64, u64)> {
        let c = std::ffi::CString::new(self.root.as_os_str().as_encoded_bytes())
            .map_err(io::Error::other)?;
        // SAFETY: statvfs is plain data, for which all zeroes is a valid value.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid C string and out pointer.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((
            st.f_bavail as u64 * st.f_frsize as u64,
            st.f_blocks as u64 * st.f_frsize as u64,
        ))
    }
}

/// Where a mount keeps its catalog index inside the cache directory `root`.
pub fn index_path(root: &Path) -> PathBuf {
    root.join(OWN_DIR).join(INDEX)
}

/// Where the detached daemon logs when not given --log-file.
pub fn log_path(root: &Path) -> PathBuf {
    root.join(OWN_DIR).join(LOG)
}

/// The checksum recorded on a cached file, if it has one in a format this version knows.
fn read_checksum(file: &File) -> Option<u128> {
    let mut value = [0u8; SUM_LEN];
    // SAFETY: valid fd, NUL-terminated name, and a buffer of the length given.
    let n = unsafe {
        libc::fgetxattr(
            file.as_raw_fd(),
            SUM_XATTR.as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    if n != SUM_LEN as isize || value[0] != SUM_FORMAT {
        return None;
    }
    Some(u128::from_le_bytes(value[1..].try_into().ok()?))
}

/// Maps a read error on the source file at `path` (retried by the stager, unlike cache errors).
fn source_err(path: &Path) -> impl Fn(io::Error) -> CopyError + '_ {
    move |source| CopyError::Source {
        path: path.to_path_buf(),
        source,
    }
}

fn cache_err(e: io::Error) -> CopyError {
    if e.raw_os_error() == Some(libc::ENOSPC) || e.raw_os_error() == Some(libc::EDQUOT) {
        CopyError::NoSpace
    } else {
        CopyError::Cache(e)
    }
}

fn remove_tree(path: &Path) -> Result<(), CacheError> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(path)(e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    /// Found by fuzz/cache_manifest: a SOURCE path that is not UTF-8 made `to_bytes` panic,
    /// so mounting such a source killed the daemon at start.
    #[test]
    fn any_source_path_round_trips() {
        for raw in [&b"/data/set"[..], b"/data/caf\xe9", b"\xac", b"/x/\"q\"\n"] {
            let source = Path::new(OsStr::from_bytes(raw));
            let read = Manifest::parse(&Manifest::for_source(source).to_bytes()).unwrap();
            assert!(read.holds(source), "{source:?}");
            assert!(!read.holds(&source.join("x")));
        }
        // Format 1 as written before: a plain string.
        let old = br#"{"format": 1, "source": "/data/set"}"#;
        assert!(Manifest::parse(old).unwrap().holds(Path::new("/data/set")));
        for junk in [
            &b""[..],
            b"{",
            b"[]",
            br#"{"format": 1}"#,
            br#"{"format": -1, "source": "/"}"#,
        ] {
            assert_eq!(Manifest::parse(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn cache_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("cache");
        let _cache = CacheDir::open(&root, Path::new("/src")).unwrap();
        for (name, want) in [
            ("", 0o700),
            (OWN_DIR, 0o700),
            ("stagefs/data", 0o700),
            ("stagefs/lock", 0o600),
            ("stagefs/manifest.json", 0o600),
        ] {
            let mode = fs::metadata(root.join(name)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, want, "{name}: {mode:o}");
        }
        let entries: Vec<_> = fs::read_dir(&root).unwrap().flatten().collect();
        assert_eq!(entries.len(), 1, "everything in CACHE/{OWN_DIR}");
    }

    fn mode_of(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    fn chmod(path: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A directory that is not stagefs's is refused as it is: nothing in it deleted, its mode
    /// unchanged, nothing created in it.
    fn assert_refused(root: &Path, why: &str) -> CacheError {
        let mode = fs::symlink_metadata(root).map(|m| m.mode()).ok();
        let listing = |r: &Path| -> Vec<OsString> {
            let mut v: Vec<_> = fs::read_dir(r)
                .map(|d| d.flatten().map(|e| e.file_name()).collect())
                .unwrap_or_default();
            v.sort();
            v
        };
        let before = listing(root);
        let err = match check_root(root) {
            Ok(()) => panic!("{why}: check_root accepted {}", root.display()),
            Err(e) => e,
        };
        let opened = CacheDir::open(root, Path::new("/src"));
        assert!(opened.is_err(), "{why}: CacheDir::open accepted it");
        assert_eq!(
            fs::symlink_metadata(root).map(|m| m.mode()).ok(),
            mode,
            "{why}"
        );
        assert_eq!(listing(root), before, "{why}");
        err
    }

    #[test]
    fn a_directory_that_is_not_stagefs_is_refused_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        // The user's own files.
        let root = tmp.path().join("mine");
        fs::create_dir_all(root.join("data/ab")).unwrap();
        fs::create_dir(root.join("tmp")).unwrap();
        fs::write(root.join("data/ab/thesis.tex"), b"years of work").unwrap();
        let e = assert_refused(&root, "user's data/ and tmp/");
        assert!(matches!(e, CacheError::Foreign { .. }), "{e}");
        assert!(root.join("data/ab/thesis.tex").exists());
        // World-writable (sticky or not) and group-writable.
        for mode in [0o1777, 0o777, 0o770] {
            let root = tmp.path().join(format!("shared{mode:o}"));
            fs::create_dir(&root).unwrap();
            chmod(&root, mode);
            let e = assert_refused(&root, "writable by others");
            assert!(matches!(e, CacheError::Shared { .. }), "{e}");
            assert_eq!(mode_of(&root), mode);
        }
        // Someone else's (needs root to make, as the daemon runs).
        if euid() == 0 {
            let root = tmp.path().join("theirs");
            fs::create_dir(&root).unwrap();
            std::os::unix::fs::chown(&root, Some(65534), Some(65534)).unwrap();
            let e = assert_refused(&root, "owned by nobody");
            assert!(
                matches!(e, CacheError::NotOwned { owner: 65534, .. }),
                "{e}"
            );
        }
        // A link, even to a good directory, and a file.
        let good = tmp.path().join("good");
        fs::create_dir(&good).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        let e = assert_refused(&link, "symlink");
        assert!(matches!(e, CacheError::Symlink(_)), "{e}");
        assert_eq!(
            fs::read_dir(&good).unwrap().count(),
            0,
            "link target untouched"
        );
        let file = tmp.path().join("file");
        fs::write(&file, b"x").unwrap();
        let e = assert_refused(&file, "file");
        assert!(matches!(e, CacheError::NotADirectory(_)), "{e}");
        // An old stagefs layout, and a stagefs directory without a manifest.
        let old = tmp.path().join("old");
        fs::create_dir_all(old.join("data")).unwrap();
        fs::write(old.join(OLD_MANIFEST), b"{}").unwrap();
        let e = assert_refused(&old, "old layout");
        assert!(matches!(e, CacheError::OldLayout(_)), "{e}");
        let bare = tmp.path().join("bare");
        fs::create_dir_all(bare.join("stagefs/data")).unwrap();
        let e = assert_refused(&bare, "no manifest");
        assert!(matches!(e, CacheError::NoManifest(_)), "{e}");
    }

    #[test]
    fn parents_others_could_change_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let open_parent = tmp.path().join("open");
        fs::create_dir(&open_parent).unwrap();
        chmod(&open_parent, 0o777);
        let root = open_parent.join("sub/cache");
        let e = check_root(&root).unwrap_err();
        assert!(matches!(e, CacheError::UnsafeParent { .. }), "{e}");
        assert!(CacheDir::open(&root, Path::new("/src")).is_err());
        assert!(!open_parent.join("sub").exists(), "nothing created");
        // Through a link from a safe place: the real parent counts.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&open_parent, &link).unwrap();
        assert!(check_root(&link.join("cache")).is_err());
        // Sticky, as /tmp: others cannot replace what is ours.
        chmod(&open_parent, 0o1777);
        check_root(&root).unwrap();
        drop(CacheDir::open(&root, Path::new("/src")).unwrap());
        if euid() == 0 {
            let theirs = tmp.path().join("theirs");
            fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            let e = check_root(&theirs.join("cache")).unwrap_err();
            assert!(
                matches!(e, CacheError::UnsafeParent { owner: 65534, .. }),
                "{e}"
            );
        }
    }

    #[test]
    fn an_empty_or_stagefs_directory_is_accepted_and_keeps_its_mode() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("empty");
        fs::create_dir(&root).unwrap();
        chmod(&root, 0o755);
        drop(CacheDir::open(&root, Path::new("/src")).unwrap());
        assert_eq!(
            mode_of(&root),
            0o755,
            "not chmod'ed: stagefs did not create it"
        );
        // Its own directory, left empty by a stagefs that stopped at once.
        fs::remove_dir_all(root.join(OWN_DIR)).unwrap();
        fs::create_dir(root.join(OWN_DIR)).unwrap();
        drop(CacheDir::open(&root, Path::new("/src")).unwrap());
        check_root(&root).unwrap();
    }

    #[test]
    fn planted_links_are_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("cache");
        drop(CacheDir::open(&root, Path::new("/src")).unwrap());
        let victim = tmp.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        let own = root.join(OWN_DIR);
        fs::remove_file(own.join(LOCK)).unwrap();
        std::os::unix::fs::symlink(&victim, own.join(LOCK)).unwrap();
        assert!(
            CacheDir::open(&root, Path::new("/src")).is_err(),
            "lock link"
        );
        fs::remove_file(own.join(LOCK)).unwrap();
        fs::remove_file(own.join(MANIFEST)).unwrap();
        std::os::unix::fs::symlink(&victim, own.join(MANIFEST)).unwrap();
        assert!(Manifest::read(&own).is_none(), "manifest link");
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
    }

    /// A one-file source and its catalog, for staging.
    fn source_with(content: &[u8]) -> (tempfile::TempDir, Catalog, FileId) {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("src")).unwrap();
        fs::write(tmp.path().join("src/f"), content).unwrap();
        let catalog = Catalog::scan(&tmp.path().join("src"), 1).unwrap();
        let id = catalog.files().next().unwrap();
        (tmp, catalog, id)
    }

    fn stage(cache: &CacheDir, catalog: &Catalog, id: FileId) {
        let path = catalog.source_path(id);
        cache
            .stage(File::open(&path).unwrap(), catalog, id)
            .unwrap();
    }

    #[test]
    fn a_reused_copy_is_served_only_if_its_bytes_match_the_checksum() {
        let (tmp, catalog, id) = source_with(b"the dataset's bytes");
        let root = tmp.path().join("cache");
        let cache = CacheDir::open(&root, catalog.root_path()).unwrap();
        stage(&cache, &catalog, id);
        let mut served = String::new();
        let mut f = cache.open_verified(&catalog, id).unwrap();
        f.read_to_string(&mut served).unwrap();
        assert_eq!(served, "the dataset's bytes", "from the start of the file");
        assert_eq!(cache.reuse(&catalog), vec![(id, 19)]);

        // Changed in place, size kept: the size and mtime check cannot see it.
        let path = cache.path_for(&catalog, id);
        let mut w = OpenOptions::new().write(true).open(&path).unwrap();
        w.write_all(b"THE").unwrap();
        let e = cache.open_verified(&catalog, id).unwrap_err();
        assert!(matches!(e, CacheError::Corrupt(_)), "{e}");

        // No checksum at all (planted, or staged where attributes are not supported).
        stage(&cache, &catalog, id);
        cache.open_verified(&catalog, id).unwrap();
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid C strings.
        let removed = unsafe { libc::removexattr(c.as_ptr(), SUM_XATTR.as_ptr()) };
        assert_eq!(removed, 0);
        let e = cache.open_verified(&catalog, id).unwrap_err();
        assert!(matches!(e, CacheError::NoChecksum(_)), "{e}");

        // Not through a link, whatever it points to.
        fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(catalog.source_path(id), &path).unwrap();
        assert!(cache.open_verified(&catalog, id).is_err());
        assert!(cache.open_cached(&catalog, id).is_err());
        assert_eq!(cache.reuse(&catalog), vec![], "a link is not a cached file");
    }

    #[test]
    fn open_empties_a_cache_of_another_non_utf8_source() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (
            tmp.path().join(OsStr::from_bytes(b"src\xe9")),
            tmp.path().join(OsStr::from_bytes(b"src\xe8")),
        );
        let root = tmp.path().join("cache");
        let cache = CacheDir::open(&root, &a).unwrap();
        let kept = cache.data.join("00/f");
        fs::write(&kept, b"x").unwrap();
        drop(cache);
        drop(CacheDir::open(&root, &a).unwrap());
        assert!(kept.exists(), "same source: files kept");
        drop(CacheDir::open(&root, &b).unwrap());
        assert!(!kept.exists(), "another source: emptied");
    }
}
