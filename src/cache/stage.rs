//! Copying a file into the cache and reading a previous mount's copy back: the copy goes to
//! `tmp/`, is checked against the source file's attributes, gets its checksum attribute (with
//! the source's identity) and the source's mtime, and only then is renamed under `data/`; a
//! reused copy is served only if it is of the source file's version now and its bytes still
//! match.

use std::ffi::CStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use xxhash_rust::xxh3::Xxh3;

use super::{CacheDir, CacheError, CopyError, OpenCopy, io_err};
use crate::catalog::{Attributes, Catalog, FileId};
use crate::files::open_nofollow;
use crate::sys;

/// Copy buffer: large enough that a parallel file system sees big sequential reads, small
/// enough that 16–64 concurrent copies stay well under 100 MB of memory.
const COPY_BUFFER: usize = 1 << 20;
/// The attribute holding a cached file's checksum, set on the temporary file before the
/// rename, so a file under `data/` has its checksum from its first instant.
pub(super) const SUM_XATTR: &CStr = c"user.stagefs.sum";
/// First byte of the attribute's value (then the xxh3-128 of the content and the source
/// file's identity, little-endian): a later format is not mistaken for this one.
/// 2: the source's identity added.
const SUM_FORMAT: u8 = 2;
const SUM_LEN: usize = 1 + 16 + 8;

/// What a copy records of itself: the checksum of its bytes, and the identity of the source
/// file they were copied from.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Recorded {
    sum: u128,
    identity: u64,
}

impl CacheDir {
    /// Opens the cached copy of `file` that a previous mount left, after checking that it is
    /// a copy of the version `source` describes (the source file's attributes now: identity,
    /// size, mtime) and its bytes against the checksum recorded when it was staged. Reads the
    /// whole file: call it without holding locks others wait on.
    pub fn open_verified(
        &self,
        catalog: &Catalog,
        file: FileId,
        source: &Attributes,
    ) -> Result<Arc<OpenCopy>, CacheError> {
        let path = self.path_for(catalog, file);
        let mut copy = open_nofollow(&path).map_err(io_err(&path))?;
        let recorded = read_record(&copy).ok_or_else(|| CacheError::NoChecksum(path.clone()))?;
        let copied = copy.metadata().map_err(io_err(&path))?;
        if recorded.identity != source.identity || !source.matches(&copied) {
            return Err(CacheError::OtherVersion(path));
        }
        let mut hasher = Xxh3::new();
        let mut buf = vec![0u8; COPY_BUFFER];
        loop {
            match copy.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => hasher.update(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(&path)(e)),
            }
        }
        if hasher.digest128() != recorded.sum {
            return Err(CacheError::Corrupt(path));
        }
        copy.rewind().map_err(io_err(&path))?;
        Ok(self.open_copies.keep(file, OpenCopy::new(copy)))
    }

    /// Copies the source file `src`, opened and checked by the caller to be the version
    /// `attributes` describe, into the cache as the complete, verified copy of catalog file
    /// `file`. Setting `stop` ends the copy at its next chunk ([`CopyError::Stopped`], nothing
    /// left behind): a mount being unmounted must not keep copying large files from a slow
    /// source for minutes.
    pub fn stage(
        &self,
        mut src: File,
        attributes: &Attributes,
        catalog: &Catalog,
        file: FileId,
        stop: &AtomicBool,
    ) -> Result<u64, CopyError> {
        let source = catalog.source_path(file);
        self.stage_with(catalog, file, attributes, |out| {
            copy_source(&mut src, &source, out, attributes, stop)
        })
    }

    /// Makes the copy of catalog file `file`, of the source version `attributes` describe,
    /// from the bytes `fill` writes into a new temporary file (returning their count and
    /// checksum): recorded with its checksum and the source's identity and mtime, then renamed
    /// into place. A copy from a peer comes in this way too, exactly as one from SOURCE.
    pub fn stage_with<E: From<CopyError>>(
        &self,
        catalog: &Catalog,
        file: FileId,
        attributes: &Attributes,
        fill: impl FnOnce(&mut File) -> Result<(u64, u128), E>,
    ) -> Result<u64, E> {
        let tmp_path = self.tmp.join(format!(
            "{}.{}",
            std::process::id(),
            self.temp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let mut out = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp_path)
            .map_err(cache_err)?;
        let result = fill(&mut out).and_then(|(bytes, sum)| {
            self.finish(&out, attributes, sum)?;
            let dest = self.path_for(catalog, file);
            fs::rename(&tmp_path, &dest).map_err(cache_err)?;
            Ok(bytes)
        });
        match result {
            Ok(n) => {
                // A copy kept open from before (replaced by this one) is not served again.
                self.open_copies.forget(file);
                Ok(n)
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp_path);
                Err(e)
            }
        }
    }

    /// Records a complete copy's checksum and source identity, and gives it the source's mtime.
    fn finish(&self, out: &File, version: &Attributes, sum: u128) -> Result<(), CopyError> {
        let recorded = Recorded {
            sum,
            identity: version.identity,
        };
        self.record(out, recorded)?;
        let mtime = libc::timespec {
            tv_sec: version.mtime_secs,
            tv_nsec: version.mtime_nanos as i64,
        };
        sys::set_mtime(out.as_fd(), mtime).map_err(cache_err)
    }

    /// The copy of `file` this mount staged, for a peer: open, with its size and what it
    /// recorded of itself (checksum, source identity). A copy without a record is not served.
    pub fn open_for_peer(
        &self,
        catalog: &Catalog,
        file: FileId,
    ) -> io::Result<(File, u64, u128, u64)> {
        let copy = open_nofollow(&self.path_for(catalog, file))?;
        let recorded =
            read_record(&copy).ok_or_else(|| io::Error::from_raw_os_error(libc::ENODATA))?;
        let size = copy.metadata()?.len();
        Ok((copy, size, recorded.sum, recorded.identity))
    }

    /// Sets the checksum attribute of a copy. A cache file system without user attributes
    /// still caches, but a remount cannot check those files and stages them again.
    fn record(&self, out: &File, recorded: Recorded) -> Result<(), CopyError> {
        let mut value = [0u8; SUM_LEN];
        value[0] = SUM_FORMAT;
        value[1..17].copy_from_slice(&recorded.sum.to_le_bytes());
        value[17..].copy_from_slice(&recorded.identity.to_le_bytes());
        let Err(e) = sys::fsetxattr(out.as_fd(), SUM_XATTR, &value) else {
            return Ok(());
        };
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
}

/// Copies `src` (the source file at `source`, of the version `version` describes) into `out`;
/// returns the bytes copied and their checksum.
fn copy_source(
    src: &mut File,
    source: &Path,
    out: &mut File,
    version: &Attributes,
    stop: &AtomicBool,
) -> Result<(u64, u128), CopyError> {
    let src_err = source_err(source);
    let mut buf = vec![0u8; COPY_BUFFER.min(version.size.max(1) as usize)];
    let mut copied = 0u64;
    // Hashed as copied, from the very bytes written: no second read of either file.
    let mut hasher = Xxh3::new();
    // Read up to the file's size and one byte more, which tells a file that grew: a file
    // written to while copied must not fill the cache (nor take a copy thread for as long as
    // its writer goes on).
    let limit = version.size.saturating_add(1);
    while copied < limit {
        if stop.load(Ordering::Relaxed) {
            return Err(CopyError::Stopped);
        }
        let want = buf
            .len()
            .min((limit - copied).try_into().unwrap_or(usize::MAX));
        let n = match src.read(&mut buf[..want]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(src_err(e)),
        };
        copied += n as u64;
        if copied > version.size {
            break; // grew: not the version opened, nothing of it is kept
        }
        out.write_all(&buf[..n]).map_err(cache_err)?;
        hasher.update(&buf[..n]);
    }
    // The source must still be the version opened, or the copy could mix versions.
    let now = Attributes::of_metadata(&src.metadata().map_err(src_err)?);
    if copied != version.size || !version.is_unchanged(&now) {
        return Err(CopyError::SourceChanged(source.to_path_buf()));
    }
    Ok((copied, hasher.digest128()))
}

/// What a cached file records of itself, if it does in a format this version knows.
fn read_record(file: &File) -> Option<Recorded> {
    let mut value = [0u8; SUM_LEN];
    let n = sys::fgetxattr(file.as_fd(), SUM_XATTR, &mut value);
    if n.ok() != Some(SUM_LEN) || value[0] != SUM_FORMAT {
        return None;
    }
    Some(Recorded {
        sum: u128::from_le_bytes(value[1..17].try_into().ok()?),
        identity: u64::from_le_bytes(value[17..].try_into().ok()?),
    })
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
