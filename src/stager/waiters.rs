//! Readers waiting for a file's copy: one list per file (single-flight: one copy answers them
//! all), and the sweeper that gives up on those that waited too long.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Answer, Deferred, Inner, OpenCallback, OpenError};
use crate::catalog::FileId;
use crate::stats::Counters;

/// How often the sweeper checks waiter deadlines, pause expiry and a lowered capacity.
const SWEEP_INTERVAL: Duration = Duration::from_millis(200);

/// A reader's open, answered when its file's copy is over.
pub struct Waiter {
    pub reply: OpenCallback,
    pub since: Instant,
}

#[derive(Default)]
pub struct Waiters(HashMap<FileId, Vec<Waiter>>);

impl Waiters {
    pub fn add(&mut self, file: FileId, reply: OpenCallback, since: Instant) {
        self.0
            .entry(file)
            .or_default()
            .push(Waiter { reply, since });
    }

    /// Everyone waiting for `file`, now to be answered.
    pub fn take(&mut self, file: FileId) -> Vec<Waiter> {
        self.0.remove(&file).unwrap_or_default()
    }

    /// Removes and returns the waiters that have waited `timeout` or longer by `now`.
    pub fn expired(&mut self, now: Instant, timeout: Duration) -> Vec<(FileId, Waiter)> {
        let mut out = Vec::new();
        self.0.retain(|&file, list| {
            let (expired, kept): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(list)
                .into_iter()
                .partition(|w| now.saturating_duration_since(w.since) >= timeout);
            out.extend(expired.into_iter().map(|w| (file, w)));
            *list = kept;
            !list.is_empty()
        });
        out
    }
}

impl Inner {
    /// Answers readers that waited too long, wakes the workers when a pause ends, and gives
    /// capacity back as the cache file system frees up after it was full.
    pub(super) fn sweeper(self: Arc<Self>) {
        while !self.shutdown.load(Ordering::SeqCst) {
            std::thread::sleep(SWEEP_INTERVAL);
            let mut deferred = Deferred::new();
            // statvfs is I/O on the cache file system: asked before taking the lock, and only
            // while the capacity is lowered.
            let lowered = self.state.lock().space.is_lowered();
            let free = lowered
                .then(|| self.cache.filesystem_space().ok())
                .flatten()
                .map(|(free, _)| free);
            {
                let mut st = self.state.lock();
                let timeout = self.settings.open_timeout;
                let now = Instant::now();
                for (file, w) in st.waiters.expired(now, timeout) {
                    log::error!(
                        "gave up waiting {:.0?} for {} to be staged; the reader gets EIO",
                        timeout,
                        self.catalog.relative_path(file).display()
                    );
                    Counters::add(&self.counters.errors, 1);
                    Counters::add(
                        &self.counters.stall_nanos,
                        now.saturating_duration_since(w.since).as_nanos() as u64,
                    );
                    deferred.push((w.reply, Answer::Done(Err(OpenError::Io))));
                }
                if let Some(free) = free
                    && st.space.regrow(free)
                {
                    log::debug!("cache capacity back to {} bytes", st.space.capacity);
                    self.work.notify_all();
                }
                if st.backoff.pause_ended(now) {
                    self.work.notify_all();
                }
            }
            self.finish(deferred);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiters_are_taken_per_file_and_expire_by_age() {
        let t0 = Instant::now();
        let mut w = Waiters::default();
        w.add(1, Box::new(|_| {}), t0);
        w.add(1, Box::new(|_| {}), t0 + Duration::from_secs(5));
        w.add(2, Box::new(|_| {}), t0);
        let expired = w.expired(t0 + Duration::from_secs(3), Duration::from_secs(3));
        let mut files: Vec<FileId> = expired.iter().map(|(f, _)| *f).collect();
        files.sort();
        assert_eq!(files, [1, 2]);
        assert_eq!(w.take(2).len(), 0, "file 2 had only the expired one");
        assert_eq!(w.take(1).len(), 1, "the younger one still waits");
        assert_eq!(w.take(1).len(), 0, "taken once");
        assert!(
            w.expired(t0 + Duration::from_secs(60), Duration::ZERO)
                .is_empty()
        );
    }
}
