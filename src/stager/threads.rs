//! The shell's threads: copy workers (take a job from the core, copy with the lock released,
//! hand the outcome back), the planner (computes the epoch plans the core wants, off the
//! lock, and has the copies they make known rekeyed in small chunks), and the sweeper (time
//! passing: readers waiting too long, a pause ending, room coming back).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;

use super::backoff;
use super::core::{Effects, Job, Origin};
use super::source::{self, SourceError};
use super::{Inner, OpenError};
use crate::cache::CopyError;

/// How long an idle copy thread sleeps before it looks for work on its own (it is woken when
/// work comes; this only bounds a missed wake-up).
const IDLE_WAKE: Duration = Duration::from_millis(200);
/// How often the sweeper checks waiter deadlines, pause expiry and a lowered capacity.
const SWEEP_INTERVAL: Duration = Duration::from_millis(200);
/// Files rekeyed per hold of the lock after a new epoch is planned: about a millisecond of
/// work, so opens never wait long behind a rekey of millions of cached files.
const REKEY_CHUNK: usize = 2_048;

impl Inner {
    /// A copy thread: takes the next job (urgent first, then the frontier), copies with the
    /// lock released, books the outcome, answers the waiters.
    pub(super) fn worker(self: Arc<Self>) {
        self.copy_threads.lock().push(crate::sys::thread_id());
        let mut core = self.core.lock();
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return;
            }
            let mut effects = Effects::default();
            let job = core.next_job(Instant::now(), &mut effects);
            let idle = job.is_none() && effects.replies.is_empty() && effects.unlink.is_empty();
            if idle {
                self.work.wait_for(&mut core, IDLE_WAKE);
                continue;
            }
            self.apply(core, effects);
            if let Some(job) = job {
                let (origin, result) = self.copy(job);
                core = self.core.lock();
                let effects = core.copied_from(job, origin, result, Instant::now());
                self.apply(core, effects);
            }
            core = self.core.lock();
        }
    }

    /// Copies `job`'s file into the cache: from the peer holding it if one does and can give
    /// it, else from SOURCE.
    fn copy(self: &Arc<Self>, job: Job) -> (Origin, Result<u64, CopyError>) {
        let mut has_room = job.has_room;
        if let Some(result) = self.copy_from_peer(job, &mut has_room) {
            return (Origin::Peer, result);
        }
        (Origin::Source, self.copy_with_retries(job, has_room))
    }

    /// Whether the copy of `job`, taken before its size was known, has room now that it is
    /// known to be `size` bytes (see [`Core::admit`](super::core::Core::admit)).
    pub(super) fn admit(self: &Arc<Self>, job: Job, size: u64) -> bool {
        self.run(|core| {
            let mut effects = Effects::default();
            (core.admit(job, size, &mut effects), effects)
        })
    }

    /// Copies `job`'s file from SOURCE into the cache, retrying what a failing file system may
    /// get right next time; a changed file or a full cache is not retried.
    fn copy_with_retries(self: &Arc<Self>, job: Job, mut has_room: bool) -> Result<u64, CopyError> {
        let file = job.file;
        let mut attempt = 0;
        loop {
            let staged = match source::open_verified(&*self.source, &self.catalog, file) {
                Ok((f, attributes)) => {
                    if !has_room {
                        has_room = self.admit(job, attributes.size);
                        if !has_room {
                            return Err(CopyError::NoRoom);
                        }
                    }
                    self.cache
                        .stage(f, &attributes, &self.catalog, file, &self.shutdown)
                }
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

    /// Answers readers that waited too long, wakes the workers when a pause ends, and gives
    /// capacity back as the cache file system frees up after it was full.
    pub(super) fn sweeper(self: Arc<Self>) {
        while !self.shutdown.load(Ordering::SeqCst) {
            std::thread::sleep(SWEEP_INTERVAL);
            // statvfs is I/O on the cache file system: asked before taking the lock, and only
            // while the capacity is lowered.
            let lowered = self.core.lock().capacity_lowered();
            let free = lowered
                .then(|| self.cache.filesystem_space().ok())
                .flatten()
                .map(|(free, _)| free);
            self.run(|core| ((), core.tick(Instant::now(), free)));
        }
    }

    /// Whenever the core wants epochs planned (the reader entered an epoch, a new
    /// prediction): computes them off the lock, hands them over, then has the cached files
    /// that had no next use within the old horizon rekeyed, a chunk per hold of the lock.
    /// Done inline, a 14 M-sample plan and the rekey of millions of cached files would stall
    /// every open for seconds at each epoch boundary.
    pub(super) fn planner(self: Arc<Self>) {
        loop {
            let wanted = {
                let mut core = self.core.lock();
                loop {
                    if self.shutdown.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Some(wanted) = core.wanted_epochs() {
                        break wanted;
                    }
                    self.plan_wanted.wait_for(&mut core, IDLE_WAKE);
                }
            };
            let (generation, epochs) = wanted;
            if let Some(&first) = epochs.first() {
                self.plan.forget_before(first);
            }
            for &epoch in &epochs {
                let plan = self.plan.epoch(&generation, epoch);
                self.run(|core| ((), core.planned(plan)));
            }
            self.plan_peers(&generation, &epochs);
            self.rekey_unplanned();
        }
    }

    /// Rekeys the cached files whose next use was not known, in chunks.
    fn rekey_unplanned(self: &Arc<Self>) {
        let unplanned = self.core.lock().unplanned();
        for chunk in unplanned.chunks(REKEY_CHUNK) {
            let mut core = self.core.lock();
            if !core.rekey(chunk) {
                break;
            }
            // Waiting opens go before the next chunk.
            MutexGuard::unlock_fair(core);
        }
        self.work.notify_all();
    }
}
