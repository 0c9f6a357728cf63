//! The node-local cache directory: where staged files live and how they get there safely.
//!
//! Layout (documented in the README):
//! ```text
//! CACHE/
//!   stagefs-cache.json   manifest: format version and the SOURCE this cache holds
//!   lock                 flock'ed by the daemon using the cache
//!   index.bin            the catalog of SOURCE, so the next mount need not scan it
//!   tmp/                 copies in progress (deleted at start-up)
//!   data/xx/HASH         complete files; HASH = sha256(relative path)[..16] in hex, xx = its first byte
//! ```
//! A file appears under `data/` only by `rename` after it was copied in full and checked
//! against the catalog (size, and the source's mtime before and after the copy), and it carries
//! the source's mtime. So a crash leaves at worst a temporary file, never a partial file that is
//! served, and a remount can reuse every cached file whose size and mtime still match SOURCE.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::catalog::{Catalog, Entry, FileId};

const MANIFEST: &str = "stagefs-cache.json";
/// The catalog a mount keeps for the next one (see `catalog::index`).
const INDEX: &str = "index.bin";
const MANIFEST_FORMAT: u32 = 1;
/// How long to wait for the cache lock: long enough for a previous daemon to finish exiting.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Copy buffer: large enough that a parallel file system sees big sequential reads, small
/// enough that 16–64 concurrent copies stay well under 100 MB of memory.
const COPY_BUFFER: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache directory {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("cache directory {0} is in use by another stagefs; give each mount its own --cache")]
    Locked(PathBuf),
}

/// Why one copy into the cache failed. The stager treats the kinds differently: source
/// errors are retried with backoff, a full cache shrinks capacity, a changed source file is
/// not retried at all.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("reading {path}: {source}")]
    Source { path: PathBuf, source: io::Error },
    /// Not the file that was catalogued any more, before or during the copy; `errno` is what
    /// its readers get (ENOENT when it was deleted, ESTALE otherwise).
    #[error("{path} changed on the source since it was mounted")]
    SourceChanged { path: PathBuf, errno: i32 },
    #[error("cache file system is full")]
    NoSpace,
    #[error("writing the cache: {0}")]
    Cache(io::Error),
}

/// What `stagefs-cache.json` records: which SOURCE the cached files are copies of.
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
    /// hand-edited) is `None`, and the cache is then emptied rather than trusted.
    pub fn parse(bytes: &[u8]) -> Option<Manifest> {
        serde_json::from_slice(bytes).ok()
    }

    /// Whether the files of a cache with this manifest may be reused for `source`.
    pub fn holds(&self, source: &Path) -> bool {
        self.format == MANIFEST_FORMAT && self.source == source
    }
}

pub struct CacheDir {
    root: PathBuf,
    data: PathBuf,
    tmp: PathBuf,
    _lock: File,
    temp_seq: AtomicU64,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn mkdir_private(path: &Path) -> Result<(), CacheError> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(io_err(path)(e)),
        _ => Ok(()),
    }
}

impl CacheDir {
    /// Opens (creating if needed) the cache for `source`. A cache that held another source is
    /// emptied; leftovers of interrupted copies are deleted.
    pub fn open(root: &Path, source: &Path) -> Result<CacheDir, CacheError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .map_err(io_err(root))?;
        fs::set_permissions(root, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(io_err(root))?;
        let lock_path = root.join("lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
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
        let data = root.join("data");
        let tmp = root.join("tmp");
        let manifest_path = root.join(MANIFEST);
        let previous = fs::read(&manifest_path)
            .ok()
            .and_then(|b| Manifest::parse(&b));
        match previous {
            Some(m) if m.holds(source) => {}
            Some(m) => {
                log::warn!(
                    "cache {} held {} (format {}); emptying it for {}",
                    root.display(),
                    m.source.display(),
                    m.format,
                    source.display()
                );
                remove_tree(&data)?;
            }
            None if data.exists() => {
                log::warn!(
                    "cache {} has no valid manifest; emptying it",
                    root.display()
                );
                remove_tree(&data)?;
            }
            None => {}
        }
        remove_tree(&tmp)?;
        mkdir_private(&data)?;
        mkdir_private(&tmp)?;
        for byte in 0..=255u8 {
            mkdir_private(&data.join(format!("{byte:02x}")))?;
        }
        let manifest = Manifest::for_source(source).to_bytes();
        // Private like everything in the cache: it names the dataset.
        write_atomically(&manifest_path, &manifest, 0o600).map_err(io_err(&manifest_path))?;
        Ok(CacheDir {
            root: root.to_path_buf(),
            data,
            tmp,
            _lock: lock,
            temp_seq: AtomicU64::new(0),
        })
    }

    /// Where the cached copy of `relative` lives.
    pub fn path_for(&self, relative: &Path) -> PathBuf {
        let digest = Sha256::digest(relative.as_os_str().as_encoded_bytes());
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        self.data.join(&hex[..2]).join(hex)
    }

    /// Finds the complete files a previous mount left that still match the catalog, and
    /// deletes everything else under `data/`. Returns (file, size) of those kept.
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
                let path = self.path_for(&catalog.relative_path(id));
                let name = path.file_name().expect("hash name").to_os_string();
                if !present.contains(&name) {
                    continue;
                }
                let entry = catalog.entry(id).expect("catalog file");
                match fs::metadata(&path) {
                    Ok(m) if entry.matches(&m) => {
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

    /// Copies the source file `src` (at `source`, for messages), opened and checked against
    /// `entry` by the caller, into the cache as the complete, verified copy of `entry`.
    pub fn stage(
        &self,
        mut src: File,
        source: &Path,
        relative: &Path,
        entry: &Entry,
    ) -> Result<u64, CopyError> {
        let tmp_path = self.tmp.join(format!(
            "{}.{}",
            std::process::id(),
            self.temp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let result = self.copy_to_temp(&mut src, source, &tmp_path, entry);
        match result {
            Ok(n) => {
                let dest = self.path_for(relative);
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
        loop {
            let n = match src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(src_err(e)),
            };
            out.write_all(&buf[..n]).map_err(cache_err)?;
            copied += n as u64;
        }
        // The source must still be the file we catalogued, or the copy could mix versions.
        if copied != entry.size || !entry.is_unchanged(&src.metadata().map_err(src_err)?) {
            return Err(CopyError::SourceChanged {
                path: source.to_path_buf(),
                errno: libc::ESTALE,
            });
        }
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

    pub fn remove(&self, relative: &Path) {
        let path = self.path_for(relative);
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
    root.join(INDEX)
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

/// Writes `bytes` to `path` via a temporary file and rename, so readers see the old or the
/// new content, never a mix. `mode` is the new file's permission bits (before the umask).
pub fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_atomically_with(path, mode, |mut f| f.write_all(bytes))
}

/// [`write_atomically`] for content that `write` streams into the temporary file.
pub fn write_atomically_with(
    path: &Path,
    mode: u32,
    write: impl FnOnce(&File) -> io::Result<()>,
) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let result = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|f| write(&f))
        .and_then(|_| fs::rename(&tmp, path));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
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
            ("data", 0o700),
            ("lock", 0o600),
            (MANIFEST, 0o600),
        ] {
            let mode = fs::metadata(root.join(name)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, want, "{name}: {mode:o}");
        }
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
        let kept = cache.path_for(Path::new("f"));
        fs::write(&kept, b"x").unwrap();
        drop(cache);
        drop(CacheDir::open(&root, &a).unwrap());
        assert!(kept.exists(), "same source: files kept");
        drop(CacheDir::open(&root, &b).unwrap());
        assert!(!kept.exists(), "another source: emptied");
    }
}
