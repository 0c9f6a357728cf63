//! What a copy's outcome does: to the file's state, the cache's room, staging ahead, and the
//! readers waiting for it. Source read errors (after the shell's retries) are answered with EIO
//! to that file's readers only while the frontier pauses; a changed file is refused at once
//! (ENOENT / ESTALE) and never staged again; a full cache file system lowers the capacity and
//! the readers are served from SOURCE.

use std::time::Instant;

use super::{Answer, Core, Effects, FileState, Job};

/// Where a copy's bytes came from: SOURCE (counted as read from it), or another node of the
/// job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Source,
    Peer,
}
use crate::cache::CopyError;
use crate::plan::TrackerMode;
use crate::stager::OpenError;
use crate::stats::Counters;

impl<R> Core<R> {
    /// Books the outcome of `job` and says how its waiting readers are answered. The worker
    /// that made it then asks for the next job itself: no wake-up here.
    #[cfg(test)]
    pub fn copied(&mut self, job: Job, result: Result<u64, CopyError>, now: Instant) -> Effects<R> {
        self.copied_from(job, Origin::Source, result, now)
    }

    /// [`copied`](Self::copied), from `origin`.
    pub fn copied_from(
        &mut self,
        job: Job,
        origin: Origin,
        result: Result<u64, CopyError>,
        now: Instant,
    ) -> Effects<R> {
        let file = job.file;
        self.release(file);
        let waiters = self.waiters.take(file);
        let mut effects = Effects::default();
        let answer = match result {
            Ok(bytes) => {
                if origin == Origin::Source {
                    let epoch = self.tracker.epoch_position().0;
                    self.counters.add_source_bytes(epoch, bytes);
                }
                self.cached(job, bytes, !waiters.is_empty());
                Answer::FromCache(file)
            }
            Err(e) => {
                self.files.set(file, FileState::Remote);
                self.failed(job, e, now, &mut effects)
            }
        };
        for w in waiters {
            self.stalled(w.since, now);
            effects.replies.push((w.reply, answer));
        }
        effects
    }

    /// A complete copy of `job`'s file (`bytes`): cached, keyed by its next use.
    fn cached(&mut self, job: Job, bytes: u64, had_waiters: bool) {
        let file = job.file;
        self.backoff.succeeded();
        self.files.set(file, FileState::Cached);
        self.space.used += bytes;
        Counters::add(&self.counters.staged_files, 1);
        Counters::add(&self.counters.staged_bytes, bytes);
        match self.tracker.mode() {
            TrackerMode::Predicting => {
                let next = self.next_need(file);
                self.space.evict.needed_at(file, next);
            }
            // Staged ahead for a prediction dropped meanwhile: first to go, as the other
            // copies staged for it (see `drop_next_uses`).
            _ if job.position.is_some() && !had_waiters => self.space.evict.stale(file),
            _ => {
                self.access_seq += 1;
                let seq = self.access_seq;
                self.space.evict.read(file, seq);
            }
        }
        if !had_waiters && job.position.is_some() {
            self.unread.insert(file);
        }
    }

    /// A failed copy of `job`'s file: what its readers get.
    fn failed(&mut self, job: Job, e: CopyError, now: Instant, effects: &mut Effects<R>) -> Answer {
        let file = job.file;
        match e {
            CopyError::NoSpace => {
                // The file system holds less than we were told: what we have is the limit.
                let was = self.space.capacity;
                if self.space.full() {
                    log::warn!(
                        "cache file system is full at {} bytes used (capacity was {was}); lowering the capacity and evicting",
                        self.space.used,
                    );
                }
                Counters::add(&self.counters.cache_full_events, 1);
                // Free a little so the next copy has a chance, then serve readers from SOURCE.
                if let Some(victim) = self.space.evict.victim(0) {
                    let size = self.held_bytes(victim);
                    self.evict(victim, effects);
                    self.space.capacity = self.space.capacity.saturating_sub(size);
                }
                Answer::FromSource(file)
            }
            // Unmounting: nobody waits for it any more, and the file is as if never staged.
            CopyError::Stopped => Answer::FromSource(file),
            CopyError::Deferred => self.put_off(job, now),
            // Its size, learnt by the copy, does not fit: what a known size that does not fit
            // gets (readers served from SOURCE, the frontier waiting at it for room).
            CopyError::NoRoom => {
                if let Some(pos) = job.position {
                    self.rewind_frontier(pos);
                }
                Answer::FromSource(file)
            }
            CopyError::Cache(e) => {
                log::warn!(
                    "cannot write {} to the cache: {e}; serving it from the source",
                    self.catalog.relative_path(file).display()
                );
                Counters::add(&self.counters.errors, 1);
                Answer::FromSource(file)
            }
            e @ (CopyError::SourceGone(_) | CopyError::SourceChanged(_)) => {
                // Not a fault of the file system: no pause, staging goes on with the others.
                self.changed.insert(file);
                let (error, errno) = match e {
                    CopyError::SourceGone(_) => (OpenError::Gone, "ENOENT"),
                    _ => (OpenError::Changed, "ESTALE"),
                };
                log::warn!("{e}; its readers get {errno} (remount to see the new version)");
                Counters::add(&self.counters.errors, 1);
                Answer::Failed(error)
            }
            CopyError::Source { path, source } => {
                Counters::add(&self.counters.errors, 1);
                let pause = self.backoff.failed(now);
                log::error!(
                    "reading {} failed after {} retries: {source}; readers of it get EIO, staging ahead pauses {:.1?}",
                    path.display(),
                    self.settings.retries,
                    pause
                );
                if let Some(pos) = job.position {
                    self.rewind_frontier(pos);
                }
                Answer::Failed(OpenError::Io)
            }
        }
    }
}
