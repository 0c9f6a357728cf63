//! Time passing: readers that waited too long for a copy get EIO, a pause of staging ahead
//! ends, and capacity comes back as the cache file system frees up after it was full.

use std::time::Instant;

use super::{Answer, Core, Effects, Wake};
use crate::stager::OpenError;
use crate::stats::Counters;

impl<R> Core<R> {
    /// Whether the capacity is below what was configured: the shell then asks the cache file
    /// system for its free space before the next [`tick`](Self::tick).
    pub fn capacity_lowered(&self) -> bool {
        self.space.is_lowered()
    }

    /// It is `now`; `free` is the cache file system's free space, if the shell asked.
    pub fn tick(&mut self, now: Instant, free: Option<u64>) -> Effects<R> {
        let mut effects = Effects::default();
        let timeout = self.settings.open_timeout;
        for (file, w) in self.waiters.expired(now, timeout) {
            log::error!(
                "gave up waiting {:.0?} for {} to be staged; the reader gets EIO",
                timeout,
                self.catalog.relative_path(file).display()
            );
            Counters::add(&self.counters.errors, 1);
            self.stalled(w.since, now);
            effects
                .replies
                .push((w.reply, Answer::Failed(OpenError::Io)));
        }
        if let Some(free) = free
            && self.space.regrow(free)
        {
            log::debug!("cache capacity back to {} bytes", self.space.capacity);
            effects.wake(Wake::All);
        }
        if self.backoff.pause_ended(now) {
            effects.wake(Wake::All);
        }
        self.end_peer_wait(now, &mut effects);
        self.expire_peer_needs();
        effects
    }
}
