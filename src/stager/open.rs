//! Answering an open: the core decides (streams, the tracker, hit or miss); the shell opens the
//! cached copy before taking the lock (no I/O under it) and again, once, if the copy turned
//! up or went between the two, checks a previous mount's copy against its checksum off the
//! lock, and reads a large file through from SOURCE.

use std::sync::Arc;
use std::time::Instant;

use super::core::{Effects, FileState, Miss};
use super::source::{self, SourceError};
use super::{Inner, OpenCallback, Opened};
use crate::cache::{CacheError, OpenCopy};
use crate::catalog::FileId;
use crate::stats::Counters;

/// Why a previous mount's copy is not served.
#[derive(Debug, thiserror::Error)]
enum NotReused {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Cache(#[from] CacheError),
}

impl Inner {
    fn open_cached(&self, file: FileId) -> std::io::Result<Arc<OpenCopy>> {
        self.cache.open_cached(&self.catalog, file)
    }

    /// A previous mount's copy of `file`, opened if it is a copy of the source file as it is
    /// now (one `lstat` of it, unless the mount has seen it already) with its bytes intact.
    fn verify_reused(&self, file: FileId) -> Result<Arc<OpenCopy>, NotReused> {
        let now = source::attributes(&*self.source, &self.catalog, file)?;
        Ok(self.cache.open_verified(&self.catalog, file, &now)?)
    }

    pub(super) fn open(self: &Arc<Self>, file: FileId, reply: OpenCallback) {
        let started = Instant::now();
        // A hit's cache file is opened before the lock is taken and before the tracker moves
        // this file to the back of the eviction order: opened after, it was often evicted in
        // between, by the next copy making room (a 30% cache lost a quarter of its hits that
        // way). Copies are immutable and named by their source version, so whatever this
        // opens is the file's bytes if the core then says cached.
        let mut pre_opened = self.open_cached(file).ok();
        let mut effects = Effects::default();
        let mut core = self.core.lock();
        let slot = core.opened(file, started, &mut effects);
        if core.is_unverified(file) {
            // A previous mount's copy: it must be of the source file's version now, and its
            // bytes are checked before any is served, without the lock held.
            drop(core);
            let verified = self.verify_reused(file);
            core = self.core.lock();
            if let Err(e) = &verified
                && core.is_unverified(file)
            {
                log::warn!(
                    "{e}; staging {} again",
                    self.catalog.relative_path(file).display()
                );
            }
            core.verified(file, verified.is_ok(), &mut effects);
            if let Ok(copy) = verified {
                core.hit();
                self.apply(core, effects);
                return reply(Ok(Opened::Cache(copy)));
            }
        }
        // A hit. Cached with nothing opened: staged just after the open was tried, or removed
        // behind our back; one more try tells, without the lock.
        for attempt in 0..2 {
            if core.file_state(file) != FileState::Cached {
                break;
            }
            if let Some(copy) = pre_opened.take() {
                core.hit();
                self.apply(core, effects);
                return reply(Ok(Opened::Cache(copy)));
            }
            if attempt == 1 {
                core.vanished(file);
                break;
            }
            drop(core);
            pre_opened = self.open_cached(file).ok();
            core = self.core.lock();
        }
        let miss = core.miss(file, slot, reply, started, &mut effects);
        self.apply(core, effects);
        if let Miss::ReadThrough(reply) = miss {
            let result = self.open_source(file);
            Counters::add(
                &self.counters.stall_nanos,
                started.elapsed().as_nanos() as u64,
            );
            reply(result);
        }
    }
}
