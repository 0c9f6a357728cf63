//! What `lstat` says of an entry ([`Attributes`]), and the table of what a mount has seen
//! ([`Seen`]): fetched on first need, never at mount time, and kept.
//!
//! A mount needs names and types, which directory listings give; sizes, times, owners and
//! identities are needed per file, when the file is looked up, opened or copied. On a parallel
//! file system the metadata server is the scarce resource, shared by every job of the cluster:
//! asking it about every file at mount time cost one request per file per node. So an entry's
//! attributes are read when first needed and kept from then on: what the mount has shown of a
//! file (its size to `stat`, its bytes to a reader) stays what it shows, and any later sight
//! that differs is a changed file.
//!
//! The table costs 4 bytes per entry and [`RECORD_BYTES`] per entry actually seen; an entry
//! nobody asked about costs nothing more. Readers never lock: a record is written once, then
//! published by its slot.

use std::fs::Metadata;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::{FileId, Kind};

/// An entry's attributes, as the mount shows them and checks them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attributes {
    pub kind: Kind,
    /// Permission bits (`st_mode & 0o7777`).
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    /// Regular files and links only: a directory's size is file-system specific, special files
    /// have no content to stage.
    pub size: u64,
    pub mtime_secs: i64,
    pub mtime_nanos: u32,
    /// [`identity`] of the node: which inode it is, and its ctime, which the kernel moves on
    /// every change of content, mode, owner, links or (for a directory) its entries, and which
    /// no user can set back.
    pub identity: u64,
}

impl Attributes {
    /// The attributes `lstat` (or `fstat`) reported in `st`.
    pub fn of_stat(st: &libc::stat) -> Attributes {
        let kind = Kind::of_mode(st.st_mode);
        Attributes {
            kind,
            perm: (st.st_mode & 0o7777) as u16,
            uid: st.st_uid,
            gid: st.st_gid,
            size: content_size(kind, st.st_size as u64),
            mtime_secs: st.st_mtime,
            mtime_nanos: st.st_mtime_nsec as u32,
            identity: identity_of(st.st_ino, st.st_ctime, st.st_ctime_nsec),
        }
    }

    /// The attributes `m` (`symlink_metadata`, or an open file's `metadata`) describes.
    pub fn of_metadata(m: &Metadata) -> Attributes {
        use std::os::unix::fs::MetadataExt;
        let kind = Kind::of(m.file_type());
        Attributes {
            kind,
            perm: (m.mode() & 0o7777) as u16,
            uid: m.uid(),
            gid: m.gid(),
            size: content_size(kind, m.size()),
            mtime_secs: m.mtime(),
            mtime_nanos: m.mtime_nsec() as u32,
            identity: identity(m),
        }
    }

    /// Whether `m` (a stat of a cached copy) carries this file's size and mtime, which a copy
    /// is given when it is published.
    pub fn matches(&self, m: &Metadata) -> bool {
        use std::os::unix::fs::MetadataExt;
        m.len() == self.size
            && m.mtime() == self.mtime_secs
            && m.mtime_nsec() as u32 == self.mtime_nanos
    }

    /// Whether `now` is still the node these attributes were taken from, unchanged: same
    /// kind, inode and ctime, and (but for a directory) size and mtime. Anything else
    /// (replaced, rewritten, chmod'ed, swapped for a link or a FIFO) is a changed file.
    pub fn is_unchanged(&self, now: &Attributes) -> bool {
        self.kind == now.kind
            && self.identity == now.identity
            && (self.kind == Kind::Directory
                || (self.size, self.mtime_secs, self.mtime_nanos)
                    == (now.size, now.mtime_secs, now.mtime_nanos))
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

    /// The record's words in the table.
    fn to_words(self) -> [u64; WORDS] {
        [
            self.size,
            self.mtime_secs as u64,
            self.identity,
            u64::from(self.mtime_nanos)
                | u64::from(self.perm) << 32
                | (kind_byte(self.kind) as u64) << 48,
            u64::from(self.uid) | u64::from(self.gid) << 32,
        ]
    }

    fn from_words(w: [u64; WORDS]) -> Attributes {
        Attributes {
            kind: Kind::ALL[(w[3] >> 48) as usize & 7],
            perm: (w[3] >> 32) as u16,
            uid: w[4] as u32,
            gid: (w[4] >> 32) as u32,
            size: w[0],
            mtime_secs: w[1] as i64,
            mtime_nanos: w[3] as u32,
            identity: w[2],
        }
    }
}

/// What the mount shows as a node's size: the bytes of a file or a link's target, nothing for
/// the rest.
fn content_size(kind: Kind, size: u64) -> u64 {
    if matches!(kind, Kind::File | Kind::Symlink) {
        size
    } else {
        0
    }
}

fn kind_byte(kind: Kind) -> u8 {
    Kind::ALL
        .iter()
        .position(|&k| k == kind)
        .expect("every kind is listed") as u8
}

/// A 64-bit fingerprint of a node's inode and ctime (the parts of `stat` that say *which* file
/// it is and *whether it changed*, and that its owner cannot forge: `touch -r` restores an
/// mtime, never a ctime). Stable across versions: cached copies record it. The device number is
/// left out on purpose: a network file system's client gets a new one each time it is
/// remounted, while its inode numbers and ctimes stay (they come from the server).
pub fn identity(m: &Metadata) -> u64 {
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

/// Why a sight of an entry is not the entry the mount knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Changed {
    /// Not of the kind the listing said (a file replaced by a link, a FIFO, a directory).
    Retyped,
    /// Another node, or the same one rewritten, since the mount first saw it.
    Rewritten,
}

/// 64-bit words per record.
const WORDS: usize = 5;
/// Bytes a seen entry costs in the table.
pub const RECORD_BYTES: usize = WORDS * 8;
/// Records per chunk: chunks are allocated as entries are seen and never move, so readers
/// need no lock.
const CHUNK: usize = 1024;
/// A slot no record was published in.
const UNSEEN: u32 = 0;

/// The attributes of the entries seen so far, by id.
pub struct Seen {
    /// Per entry: [`UNSEEN`], or its record's index plus one.
    slots: Vec<AtomicU32>,
    /// Records, [`CHUNK`] at a time, allocated on first use.
    chunks: Box<[OnceLock<Box<[AtomicU64]>>]>,
    /// Records handed out; taken by writers only, so an entry gets one record at most.
    used: Mutex<usize>,
}

impl Seen {
    /// A table for `len` entries, none seen.
    pub fn new(len: usize) -> Seen {
        Seen {
            slots: (0..len).map(|_| AtomicU32::new(UNSEEN)).collect(),
            chunks: (0..len.div_ceil(CHUNK)).map(|_| OnceLock::new()).collect(),
            used: Mutex::new(0),
        }
    }

    /// The attributes kept for `id`, if it was seen.
    pub fn get(&self, id: FileId) -> Option<Attributes> {
        let slot = self.slots.get(id as usize)?.load(Ordering::Acquire);
        (slot != UNSEEN).then(|| self.record(slot as usize - 1))
    }

    /// Keeps `seen` as `id`'s attributes unless some are kept already; returns the kept ones.
    pub fn keep(&self, id: FileId, seen: Attributes) -> Attributes {
        let Some(slot) = self.slots.get(id as usize) else {
            return seen;
        };
        let mut used = self.used.lock();
        if let Some(kept) = self.get(id) {
            return kept;
        }
        let index = *used;
        *used += 1;
        let chunk = self.chunks[index / CHUNK]
            .get_or_init(|| (0..CHUNK * WORDS).map(|_| AtomicU64::new(0)).collect());
        let at = index % CHUNK * WORDS;
        for (word, value) in chunk[at..at + WORDS].iter().zip(seen.to_words()) {
            word.store(value, Ordering::Relaxed);
        }
        // Published after its words: a reader that sees the slot sees them.
        slot.store(index as u32 + 1, Ordering::Release);
        seen
    }

    fn record(&self, index: usize) -> Attributes {
        let chunk = self.chunks[index / CHUNK]
            .get()
            .expect("a published record's chunk exists");
        let at = index % CHUNK * WORDS;
        let mut words = [0; WORDS];
        for (out, word) in words.iter_mut().zip(&chunk[at..at + WORDS]) {
            *out = word.load(Ordering::Relaxed);
        }
        Attributes::from_words(words)
    }

    /// Heap memory, in bytes.
    pub fn heap_bytes(&self) -> usize {
        let chunks = self.chunks.iter().filter(|c| c.get().is_some()).count();
        self.slots.capacity() * 4 + self.chunks.len() * 16 + chunks * CHUNK * RECORD_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(size: u64, kind: Kind) -> Attributes {
        Attributes {
            kind,
            perm: 0o4755,
            uid: u32::MAX,
            gid: 7,
            size,
            mtime_secs: -2,
            mtime_nanos: 999_999_999,
            identity: u64::MAX - 3,
        }
    }

    #[test]
    fn a_record_reads_back_as_written_and_the_first_is_kept() {
        let seen = Seen::new(3000);
        assert_eq!(seen.get(5), None);
        for (i, kind) in Kind::ALL.into_iter().enumerate() {
            let id = 1500 + i as FileId;
            let a = sample(u64::MAX - i as u64, kind);
            assert_eq!(seen.keep(id, a), a);
            assert_eq!(seen.get(id), Some(a));
        }
        let first = sample(1, Kind::File);
        seen.keep(0, first);
        assert_eq!(
            seen.keep(0, sample(2, Kind::File)),
            first,
            "the first sight stays"
        );
        assert_eq!(seen.get(0), Some(first));
        assert_eq!(seen.get(3000), None, "past the table");
        // Records are handed out in the order entries are seen, whatever their ids: one chunk
        // holds these eight, and unseen entries cost their slot only.
        assert_eq!(seen.heap_bytes(), 3000 * 4 + 3 * 16 + CHUNK * RECORD_BYTES);
    }
}
