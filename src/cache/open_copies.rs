//! Cached copies kept open from one open to the next, with what the FUSE layer registered
//! for each (its passthrough backing file).
//!
//! Opening a hit used to cost the daemon, besides the round trip itself, finding the copy's
//! name (a SHA-256), opening it, registering it with the kernel and, at release, the reverse:
//! 40% of its CPU time per hit (its `/proc` times over a loop of opens of cached files). A copy is
//! immutable for the life of the mount (its name says which source version it is), so one
//! open copy and one registration serve every later open of it.
//!
//! A kept copy holds its disk space, so it is let go the moment the copy is removed (eviction,
//! a copy found corrupt), never later: the cache's size bound stays a bound on the disk. The
//! table is bounded too, by file descriptors (see [`OpenCopies::new`]). When it is full, new
//! copies are simply not kept: a job reads its files in a cycle, and a table that replaced
//! old entries would lose each copy just before its next use.

use std::any::Any;
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dashmap::DashMap;
use parking_lot::Mutex;

use crate::catalog::FileId;

/// At most this many copies kept open (each is a descriptor in the daemon and a file the
/// kernel holds for passthrough, about 1 KB of kernel memory): enough for a node's share of an
/// epoch of most datasets, small next to the 1,048,576 descriptors Linux allows by default.
const MAX_KEPT: usize = 65_536;

/// An open cached copy, shared by every handle on it: readers use positioned reads only.
pub struct OpenCopy {
    file: File,
    /// What the FUSE layer registered for this copy, made by its first open and dropped with
    /// the copy (for passthrough: the kernel's backing file, closed when dropped).
    registration: Mutex<Option<Arc<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for OpenCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OpenCopy({:?})", self.file)
    }
}

impl OpenCopy {
    pub fn new(file: File) -> OpenCopy {
        OpenCopy {
            file,
            registration: Mutex::new(None),
        }
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// The registration `register` made for this copy at its first call, shared by every
    /// later one. A failed registration is not remembered: the next open tries again.
    pub fn registration<T: Any + Send + Sync>(
        &self,
        register: impl FnOnce(&File) -> io::Result<T>,
    ) -> io::Result<Arc<T>> {
        let mut slot = self.registration.lock();
        if let Some(made) = slot.clone().and_then(|r| r.downcast::<T>().ok()) {
            return Ok(made);
        }
        let made = Arc::new(register(&self.file)?);
        *slot = Some(made.clone());
        Ok(made)
    }
}

/// The copies kept open, by catalog file.
pub(super) struct OpenCopies {
    kept: DashMap<FileId, Arc<OpenCopy>>,
    count: AtomicUsize,
    capacity: usize,
}

impl OpenCopies {
    /// A table of at most `MAX_KEPT` copies, and at most half the descriptors the process may
    /// open (the other half is left to readers' handles, copies in flight and SOURCE).
    pub(super) fn new() -> OpenCopies {
        Self::with_capacity(MAX_KEPT.min(crate::sys::descriptor_limit() / 2))
    }

    pub(super) fn with_capacity(capacity: usize) -> OpenCopies {
        OpenCopies {
            kept: DashMap::new(),
            count: AtomicUsize::new(0),
            capacity,
        }
    }

    pub(super) fn get(&self, file: FileId) -> Option<Arc<OpenCopy>> {
        self.kept.get(&file).map(|c| c.clone())
    }

    /// Keeps `copy` of `file` open if there is room, and returns the one kept (an earlier one
    /// if another open got there first).
    pub(super) fn keep(&self, file: FileId, copy: OpenCopy) -> Arc<OpenCopy> {
        if self.count.load(Ordering::Relaxed) >= self.capacity {
            return Arc::new(copy);
        }
        let kept = self
            .kept
            .entry(file)
            .or_insert_with(|| {
                self.count.fetch_add(1, Ordering::Relaxed);
                Arc::new(copy)
            })
            .clone();
        // Opened just before a removal that has already forgotten the file: checked after the
        // insert, and the removal unlinks before it forgets, so one of the two lets it go.
        if kept.file.metadata().is_ok_and(|m| m.nlink() == 0) {
            self.kept
                .remove_if(&file, |_, c| Arc::ptr_eq(c, &kept))
                .inspect(|_| {
                    self.count.fetch_sub(1, Ordering::Relaxed);
                });
        }
        kept
    }

    /// Lets go of `file`'s copy, once its name is unlinked; handles still open on it keep it
    /// until they are released.
    pub(super) fn forget(&self, file: FileId) {
        if self.kept.remove(&file).is_some() {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }
}
