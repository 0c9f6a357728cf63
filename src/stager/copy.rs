//! The copy threads and the fault policy: what a copy's outcome does to the file's state, to
//! the cache's room, to staging ahead, and to the readers waiting for it. Source read errors are
//! retried with backoff, then answered with EIO to that file's readers only while the frontier
//! pauses; a changed file is refused at once (ENOENT / ESTALE) and never retried; a full cache
//! file system lowers the capacity and the readers are served from SOURCE.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::source::{self, SourceError};
use super::{Answer, Deferred, FileState, Inner, Job, OpenError, State, backoff};
use crate::cache::CopyError;
use crate::catalog::FileId;
use crate::plan::TrackerMode;
use crate::stats::Counters;

/// How long an idle copy thread sleeps before it looks for work on its own (it is woken when
/// work comes; this only bounds a missed wake-up).
const IDLE_WAKE: Duration = Duration::from_millis(200);

impl Inner {
    /// A copy thread: takes the next job (urgent first, then the frontier), copies with the
    /// lock released, books the outcome, answers the waiters.
    pub(super) fn worker(self: Arc<Self>) {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        self.copy_threads.lock().push(tid);
        let mut st = self.state.lock();
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return;
            }
            let mut deferred = Deferred::new();
            match self.next_job(&mut st, &mut deferred) {
                Some(job) => {
                    if !st.urgent.is_empty() || self.copy_due(&mut st) {
                        self.work.notify_one();
                    }
                    drop(st);
                    self.finish(deferred);
                    let result = self.copy_with_retries(job.file);
                    st = self.state.lock();
                    let deferred = self.complete(&mut st, job, result);
                    if !deferred.is_empty() {
                        drop(st);
                        self.finish(deferred);
                        st = self.state.lock();
                    }
                }
                None if !deferred.is_empty() => {
                    drop(st);
                    self.finish(deferred);
                    st = self.state.lock();
                }
                None => {
                    self.work.wait_for(&mut st, IDLE_WAKE);
                }
            }
        }
    }

    /// Copies `file` into the cache, retrying what a failing file system may get right next
    /// time; a changed file or a full cache is not retried.
    pub(super) fn copy_with_retries(&self, file: FileId) -> Result<u64, CopyError> {
        let mut attempt = 0;
        loop {
            let staged = match source::open_verified(&*self.source, &self.catalog, file) {
                Ok(f) => self.cache.stage(f, &self.catalog, file, &self.shutdown),
                Err(SourceError::Changed {
                    path,
                    error: OpenError::Gone,
                    ..
                }) => Err(CopyError::SourceGone(path)),
                Err(SourceError::Changed { path, .. }) => Err(CopyError::SourceChanged(path)),
                Err(SourceError::Io { path, source }) => Err(CopyError::Source { path, source }),
            };
            match staged {
                Err(CopyError::Source { .. })
                    if attempt < self.settings.retries && !self.shutdown.load(Ordering::SeqCst) =>
                {
                    std::thread::sleep(backoff::retry_delay(attempt));
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Books the outcome of a copy and decides how its waiting readers are answered.
    pub(super) fn complete(
        &self,
        st: &mut State,
        job: Job,
        result: Result<u64, CopyError>,
    ) -> Deferred {
        let file = job.file;
        let size = self.size_of(file);
        st.space.reserved = st.space.reserved.saturating_sub(size);
        let waiters = st.waiters.take(file);
        let had_waiters = !waiters.is_empty();
        let mut deferred = Deferred::new();
        /// How the waiting readers are answered, once the lock is released.
        enum Then {
            Cache,
            Source,
            Fail(OpenError),
        }
        let then = match result {
            Ok(bytes) => {
                st.backoff.succeeded();
                st.files.set(file, FileState::Cached);
                st.space.used += size;
                Counters::add(&self.counters.staged_files, 1);
                Counters::add(&self.counters.staged_bytes, bytes);
                Counters::add(&self.counters.source_bytes, bytes);
                match st.tracker.mode() {
                    TrackerMode::Predicting => {
                        let next = st.tracker.next_use(file);
                        st.space.evict.set_next_use(file, next);
                    }
                    // Staged ahead for a prediction dropped meanwhile: first to go, as the
                    // other copies staged for it (see `drop_next_uses`).
                    _ if job.position.is_some() && !had_waiters => {
                        st.space.evict.set_recently_used(file, 0)
                    }
                    _ => {
                        st.access_seq += 1;
                        let seq = st.access_seq;
                        st.space.evict.set_recently_used(file, seq);
                    }
                }
                if !had_waiters && job.position.is_some() {
                    st.unread.insert(file);
                }
                Then::Cache
            }
            Err(CopyError::NoSpace) => {
                st.files.set(file, FileState::Remote);
                // The file system holds less than we were told: what we have is the limit.
                let was = st.space.capacity;
                if st.space.full() {
                    log::warn!(
                        "cache file system is full at {} bytes used (capacity was {was}); lowering the capacity and evicting",
                        st.space.used,
                    );
                }
                Counters::add(&self.counters.cache_full_events, 1);
                // Free a little so the next copy has a chance, then serve readers from SOURCE.
                if let Some((_, victim)) = st.space.evict.furthest() {
                    self.evict(st, victim);
                    st.space.capacity = st.space.capacity.saturating_sub(self.size_of(victim));
                }
                Then::Source
            }
            // Unmounting: nobody waits for it any more, and the file is as if never staged.
            Err(CopyError::Stopped) => {
                st.files.set(file, FileState::Remote);
                Then::Source
            }
            Err(CopyError::Cache(e)) => {
                st.files.set(file, FileState::Remote);
                log::warn!(
                    "cannot write {} to the cache: {e}; serving it from the source",
                    self.catalog.relative_path(file).display()
                );
                Counters::add(&self.counters.errors, 1);
                Then::Source
            }
            Err(e @ (CopyError::SourceGone(_) | CopyError::SourceChanged(_))) => {
                // Not a fault of the file system: no pause, staging goes on with the others.
                st.files.set(file, FileState::Remote);
                st.changed.insert(file);
                let error = match e {
                    CopyError::SourceGone(_) => OpenError::Gone,
                    _ => OpenError::Changed,
                };
                log::warn!(
                    "{e}; its readers get {} (remount to see the new version)",
                    match error {
                        OpenError::Gone => "ENOENT",
                        _ => "ESTALE",
                    }
                );
                Counters::add(&self.counters.errors, 1);
                Then::Fail(error)
            }
            Err(CopyError::Source { path, source }) => {
                st.files.set(file, FileState::Remote);
                Counters::add(&self.counters.errors, 1);
                let pause = st.backoff.failed(Instant::now());
                log::error!(
                    "reading {} failed after {} retries: {source}; readers of it get EIO, staging ahead pauses {:.1?}",
                    path.display(),
                    self.settings.retries,
                    pause
                );
                if let Some(pos) = job.position {
                    self.rewind_frontier(st, pos);
                }
                Then::Fail(OpenError::Io)
            }
        };
        for w in waiters {
            Counters::add(
                &self.counters.stall_nanos,
                w.since.elapsed().as_nanos() as u64,
            );
            let answer = match then {
                Then::Cache => Answer::FromCache(file),
                Then::Source => Answer::FromSource(file),
                Then::Fail(errno) => Answer::Done(Err(errno)),
            };
            deferred.push((w.reply, answer));
        }
        // No wake-up here: the worker that completed looks for the next job itself.
        deferred
    }
}
