//! A saved listing of SOURCE, so a mount starts without listing every directory again: the
//! one a mount keeps as `CACHE/stagefs/index.bin` for the next, or one `stagefs index` writes
//! once for every node of a job (`--index`).
//!
//! It holds what the scan reads, names and kinds and link targets, and each directory's
//! identity (inode and ctime) when it was listed; no file's attributes (a mount fetches those
//! when first needed, from SOURCE). It is trusted as the listing: a mount re-checks each
//! directory with one `lstat` (a directory's ctime moves with every entry added, removed or
//! renamed in it, even when `cp -a` or `rsync -a` put its mtime back) and lists again only
//! those that changed ([`Loaded::refresh`]), so a mount from an index costs SOURCE one request
//! per directory, and none per file. Whoever can write the index decides what the mount lists,
//! so a file is used only if it belongs to the daemon's user or root and nobody else may write
//! it, as the descriptor read from says; what a user may read is still decided by SOURCE at
//! open time.
//!
//! The file carries a SHA-256 of its contents and is checked structurally (a tree, names
//! sorted, ranges in bounds) on load. Format (little endian): magic, version, header (source
//! path, counts), entries of [`ENTRY_BYTES`] each, the name arena, symlink targets, each
//! directory's identity in id order, then the SHA-256 of all before.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::attributes::Seen;
use super::{Catalog, Entry, FileId, Kind, ROOT};

mod refresh;

const MAGIC: &[u8; 16] = b"STAGEFS-INDEX\0\0\0";
/// Bumped whenever the layout below changes; older files are refused, not misread.
/// 2: entries carry their node's identity (inode and ctime), and special files are listed.
/// 3: a listing only (names, kinds, links) and each directory's identity; no attributes.
const VERSION: u32 = 3;
const ENTRY_BYTES: usize = 18;
const DIGEST_BYTES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("cannot read index {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write index {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is not a stagefs index (or is corrupt: {reason}); rebuild it with `stagefs index`"
    )]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "index {path} has format version {found}, this stagefs reads version {VERSION}; rebuild it with `stagefs index`"
    )]
    Version { path: PathBuf, found: u32 },
    #[error("index {path} was made for {indexed}, not {source_dir}")]
    OtherSource {
        path: PathBuf,
        indexed: PathBuf,
        source_dir: PathBuf,
    },
    #[error(
        "index {path} {why}: whoever can write it decides what the mount lists; use an index that only you or root can write (`stagefs index` writes one)"
    )]
    Untrusted { path: PathBuf, why: String },
}

/// A loaded index: the catalog it lists, and each directory's identity when it was listed,
/// to check against SOURCE before the listing is used ([`Loaded::refresh`]).
pub struct Loaded {
    catalog: Catalog,
    /// (directory id, its identity when listed), in id order.
    listed: Vec<(FileId, u64)>,
}

impl Loaded {
    /// The catalog as the index lists it, not checked against SOURCE yet.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }
}

/// Writes `catalog` in the index format to `out`, streaming: the index of 14 M files is
/// hundreds of MB, which must not be built in memory next to the catalog.
fn encode_to(catalog: &Catalog, out: impl Write) -> io::Result<()> {
    let mut w = Hashing {
        inner: out,
        hasher: Sha256::new(),
    };
    w.write_all(MAGIC)?;
    w.write_all(&VERSION.to_le_bytes())?;
    let source = catalog.root_path.as_os_str().as_bytes();
    w.write_all(&(source.len() as u32).to_le_bytes())?;
    w.write_all(source)?;
    w.write_all(&(catalog.entries.len() as u32).to_le_bytes())?;
    w.write_all(&(catalog.names.len() as u64).to_le_bytes())?;
    w.write_all(&(catalog.link_targets.len() as u32).to_le_bytes())?;
    for e in &catalog.entries {
        w.write_all(&entry_bytes(e))?;
    }
    w.write_all(&catalog.names)?;
    for (id, target) in &catalog.link_targets {
        w.write_all(&id.to_le_bytes())?;
        w.write_all(&(target.len() as u32).to_le_bytes())?;
        w.write_all(target.as_bytes())?;
    }
    // A directory not listed (unreadable) has no identity: 0 never matches, so the next mount
    // lists it again.
    for dir in directories(&catalog.entries) {
        let identity = catalog.attributes(dir).map_or(0, |a| a.identity);
        w.write_all(&identity.to_le_bytes())?;
    }
    let digest = w.hasher.finalize();
    w.inner.write_all(&digest)?;
    w.inner.flush()
}

/// The ids of the directories among `entries`, in id order.
fn directories(entries: &[Entry]) -> impl Iterator<Item = FileId> + '_ {
    (0..entries.len() as FileId).filter(|&id| entries[id as usize].kind == Kind::Directory)
}

/// One entry as [`ENTRY_BYTES`] bytes.
fn entry_bytes(e: &Entry) -> [u8; ENTRY_BYTES] {
    let mut b = [0u8; ENTRY_BYTES];
    b[0..4].copy_from_slice(&e.parent.to_le_bytes());
    b[4..8].copy_from_slice(&e.name_offset.to_le_bytes());
    b[8] = e.name_len;
    b[9] = Kind::ALL
        .iter()
        .position(|&k| k == e.kind)
        .expect("every kind is listed") as u8;
    b[10..14].copy_from_slice(&e.first_child.to_le_bytes());
    b[14..18].copy_from_slice(&e.child_count.to_le_bytes());
    b
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the index for `catalog` to `path` atomically (temp file + rename), readable and
/// writable by its owner only.
pub fn save(catalog: &Catalog, path: &Path) -> Result<(), IndexError> {
    crate::files::write_atomically_with(path, 0o600, |file| {
        encode_to(catalog, BufWriter::new(file))
    })
    .map_err(|source| IndexError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Loads and verifies an index file made for `source` (its canonical path), streaming: peak
/// memory is the catalog itself, not the file next to it. The file must be one only the
/// daemon's user or root can write ([`trusted`]).
pub fn load(path: &Path, source: &Path) -> Result<Loaded, IndexError> {
    let read_err = |e| IndexError::Read {
        path: path.to_path_buf(),
        source: e,
    };
    // Never through a link, and never waiting on a FIFO put in its place; what is checked is
    // what the descriptor reads, whatever the path names by then.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(read_err)?;
    let len = trusted(&file).map_err(|why| IndexError::Untrusted {
        path: path.to_path_buf(),
        why,
    })?;
    let loaded = decode_from(BufReader::new(file), len).map_err(|reason| match reason {
        DecodeError::Version(found) => IndexError::Version {
            path: path.to_path_buf(),
            found,
        },
        DecodeError::Corrupt(reason) => IndexError::Corrupt {
            path: path.to_path_buf(),
            reason,
        },
        DecodeError::Io(e) => read_err(e),
    })?;
    if loaded.catalog.root_path != source {
        return Err(IndexError::OtherSource {
            path: path.to_path_buf(),
            indexed: loaded.catalog.root_path,
            source_dir: source.to_path_buf(),
        });
    }
    Ok(loaded)
}

/// The length of the opened index `file` if it may be trusted: a regular file of the daemon's
/// user or root that neither its group nor others can write (an ACL granting anyone else
/// write shows in the group bits, its mask). Otherwise why not.
fn trusted(file: &File) -> Result<u64, String> {
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot be checked ({e})"))?;
    let me = crate::sys::euid();
    if !meta.is_file() {
        Err("is not a regular file".into())
    } else if meta.uid() != me && meta.uid() != 0 {
        Err(format!(
            "belongs to uid {}, not to this stagefs's user (uid {me}) or root",
            meta.uid()
        ))
    } else if meta.mode() & 0o022 != 0 {
        Err(format!(
            "can be written by others (mode {:o})",
            meta.mode() & 0o7777
        ))
    } else {
        Ok(meta.len())
    }
}

#[derive(Debug)]
pub enum DecodeError {
    Version(u32),
    Corrupt(String),
    Io(io::Error),
}

fn corrupt(reason: &str) -> DecodeError {
    DecodeError::Corrupt(reason.to_string())
}

/// Parses and structurally validates an index of `len` bytes read from `input`. Never panics
/// on any input; allocates only what the file's length can back. Parsing runs while the
/// checksum accumulates, so a corrupt file may be refused for what it contains before its
/// checksum is compared at the end: either way nothing of it is used.
pub fn decode_from(input: impl Read, len: u64) -> Result<Loaded, DecodeError> {
    if len < (MAGIC.len() + 4 + DIGEST_BYTES) as u64 {
        return Err(corrupt("no stagefs index header"));
    }
    let mut r = Checked {
        inner: input,
        hasher: Sha256::new(),
        left: len - DIGEST_BYTES as u64,
    };
    if &r.array::<16>()? != MAGIC {
        return Err(corrupt("no stagefs index header"));
    }
    let version = r.u32()?;
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    let source_len = r.u32()? as usize;
    let root_path = PathBuf::from(OsString::from_vec(r.take(source_len)?));
    let count = r.u32()? as usize;
    let names_len = usize::try_from(r.u64()?).map_err(|_| corrupt("name arena too large"))?;
    let links_count = r.u32()? as usize;
    if count == 0
        || count
            .checked_mul(ENTRY_BYTES)
            .is_none_or(|b| b > r.remaining())
    {
        return Err(corrupt("entry count does not fit the file"));
    }
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        entries.push(parse_entry(&r.array::<ENTRY_BYTES>()?)?);
    }
    let names = r.take(names_len)?;
    let mut link_targets = Vec::with_capacity(links_count.min(r.remaining() / 8));
    for _ in 0..links_count {
        let id = r.u32()?;
        let len = r.u32()? as usize;
        link_targets.push((id, OsString::from_vec(r.take(len)?)));
    }
    let dirs: Vec<FileId> = directories(&entries).collect();
    if dirs.len().saturating_mul(8) > r.remaining() {
        return Err(corrupt("directory identities do not fit the file"));
    }
    let mut listed = Vec::with_capacity(dirs.len());
    for dir in dirs {
        listed.push((dir, r.u64()?));
    }
    if r.remaining() != 0 {
        return Err(corrupt("trailing bytes"));
    }
    r.check_digest()?;
    let mut catalog = Catalog {
        root_path,
        seen: Seen::new(entries.len()),
        entries,
        names,
        link_targets,
        file_count: 0,
    };
    validate(&mut catalog).map_err(DecodeError::Corrupt)?;
    Ok(Loaded { catalog, listed })
}

fn parse_entry(b: &[u8; ENTRY_BYTES]) -> Result<Entry, DecodeError> {
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    Ok(Entry {
        parent: u32_at(0),
        name_offset: u32_at(4),
        name_len: b[8],
        kind: *Kind::ALL
            .get(b[9] as usize)
            .ok_or_else(|| corrupt("unknown entry kind"))?,
        first_child: u32_at(10),
        child_count: u32_at(14),
    })
}

/// Checks the invariants lookup and readdir rely on, and counts the files.
fn validate(c: &mut Catalog) -> Result<(), String> {
    let n = c.entries.len();
    let root = &c.entries[ROOT as usize];
    if root.kind != Kind::Directory || root.parent != ROOT || root.name_len != 0 {
        return Err("bad root entry".into());
    }
    let mut children_total = 0usize;
    for (id, e) in c.entries.iter().enumerate() {
        let name_end = e.name_offset as usize + e.name_len as usize;
        if name_end > c.names.len() {
            return Err(format!("entry {id}: name out of range"));
        }
        if id != ROOT as usize {
            let name = &c.names[e.name_offset as usize..name_end];
            if name.is_empty()
                || name == b"."
                || name == b".."
                || name.iter().any(|&b| b == b'/' || b == 0)
            {
                return Err(format!("entry {id}: invalid name"));
            }
        }
        if e.kind != Kind::Directory {
            if e.child_count != 0 {
                return Err(format!("entry {id}: a non-directory with children"));
            }
            continue;
        }
        let (first, count) = (e.first_child as usize, e.child_count as usize);
        if count > 0 && (first <= id || first.checked_add(count).is_none_or(|end| end > n)) {
            return Err(format!("entry {id}: children out of range"));
        }
        children_total += count;
        for child in first..first + count {
            if c.entries[child].parent as usize != id {
                return Err(format!("entry {child}: parent does not list it"));
            }
        }
    }
    // Every entry but the root is the child of exactly one directory: the ranges are
    // disjoint (each child names one parent) and together cover n - 1 entries.
    if children_total != n - 1 {
        return Err("entries do not form one tree".into());
    }
    for id in 0..n as FileId {
        let kids = c.children(id);
        if kids
            .clone()
            .zip(kids.skip(1))
            .any(|(a, b)| c.name(a).as_bytes() >= c.name(b).as_bytes())
        {
            return Err(format!("directory {id}: names not sorted"));
        }
    }
    if c.link_targets.windows(2).any(|w| w[0].0 >= w[1].0) {
        return Err("symlink table not sorted".into());
    }
    let links = c.entries.iter().filter(|e| e.kind == Kind::Symlink).count();
    if links != c.link_targets.len()
        || c.link_targets.iter().any(|(id, _)| {
            c.entries
                .get(*id as usize)
                .is_none_or(|e| e.kind != Kind::Symlink)
        })
    {
        return Err("symlink table does not match the entries".into());
    }
    c.file_count = c.entries.iter().filter(|e| e.kind == Kind::File).count() as u64;
    Ok(())
}

/// Reads the index body from a stream, hashing it, never past the digest at its end.
struct Checked<R> {
    inner: R,
    hasher: Sha256,
    /// Body bytes not read yet.
    left: u64,
}

impl<R: Read> Checked<R> {
    fn remaining(&self) -> usize {
        usize::try_from(self.left).unwrap_or(usize::MAX)
    }

    fn fill(&mut self, buf: &mut [u8]) -> Result<(), DecodeError> {
        if buf.len() as u64 > self.left {
            return Err(corrupt("truncated"));
        }
        self.inner.read_exact(buf).map_err(DecodeError::Io)?;
        self.hasher.update(&*buf);
        self.left -= buf.len() as u64;
        Ok(())
    }

    /// `n` bytes; `n` is checked against the file's length before anything is allocated.
    fn take(&mut self, n: usize) -> Result<Vec<u8>, DecodeError> {
        if n as u64 > self.left {
            return Err(corrupt("truncated"));
        }
        let mut out = vec![0u8; n];
        self.fill(&mut out)?;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        self.fill(&mut out)?;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Compares the digest that ends the file with what was read.
    fn check_digest(self) -> Result<(), DecodeError> {
        let mut stored = [0u8; DIGEST_BYTES];
        let mut inner = self.inner;
        inner.read_exact(&mut stored).map_err(DecodeError::Io)?;
        if self.hasher.finalize()[..] != stored {
            return Err(corrupt("checksum mismatch"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
