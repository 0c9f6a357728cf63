//! When to try SOURCE again after it failed: the delays between one file's retries, and how
//! long staging ahead pauses while the file system keeps failing.
//!
//! Pure bookkeeping (no clock of its own: callers pass `now`), so it is tested without threads.

use std::time::{Duration, Instant};

/// Backoff before retrying a failed source read: 0.1 s, 0.4 s, 1.6 s … Long enough to ride out
/// a metadata server failover blip, short enough that a reader's EIO comes within seconds.
const RETRY_BASE: Duration = Duration::from_millis(100);
/// Longest wait between two retries of one file, however many `--retries` allow.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);
/// Longest pause of the frontier while the source keeps failing: also the longest it takes
/// staging to notice the source is back.
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// Delay before retry `attempt` (0 for the first) of one file's copy.
pub fn retry_delay(attempt: u32) -> Duration {
    RETRY_BASE
        .checked_mul(4u32.saturating_pow(attempt))
        .map_or(MAX_RETRY_DELAY, |d| d.min(MAX_RETRY_DELAY))
}

/// Whether staging ahead is paused because SOURCE keeps failing.
#[derive(Default)]
pub struct Backoff {
    paused_until: Option<Instant>,
    consecutive_failures: u32,
}

impl Backoff {
    /// A copy succeeded: SOURCE is back, staging goes on at once.
    pub fn succeeded(&mut self) {
        self.consecutive_failures = 0;
        self.paused_until = None;
    }

    /// A file failed after its retries: staging ahead pauses, longer with each failure in a
    /// row (0.2 s, 0.4 s … up to [`MAX_PAUSE`]). Returns the pause.
    pub fn failed(&mut self, now: Instant) -> Duration {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let pause = (RETRY_BASE * 2u32.pow(self.consecutive_failures.min(10))).min(MAX_PAUSE);
        self.paused_until = Some(now + pause);
        pause
    }

    pub fn paused(&self, now: Instant) -> bool {
        self.paused_until.is_some_and(|t| now < t)
    }

    /// Whether a pause ran out by `now` (it is then over): the workers are to be woken.
    pub fn pause_ended(&mut self, now: Instant) -> bool {
        let ended = self.paused_until.is_some_and(|t| now >= t);
        if ended {
            self.paused_until = None;
        }
        ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_wait_longer_each_time_up_to_a_bound() {
        let ms = |a| retry_delay(a).as_millis();
        assert_eq!([ms(0), ms(1), ms(2), ms(3)], [100, 400, 1600, 6400]);
        assert_eq!(retry_delay(5), MAX_RETRY_DELAY);
        // --retries is the user's: no overflow however many.
        assert_eq!(retry_delay(u32::MAX), MAX_RETRY_DELAY);
    }

    #[test]
    fn failures_in_a_row_pause_longer_and_a_success_resumes_at_once() {
        let now = Instant::now();
        let mut b = Backoff::default();
        assert!(!b.paused(now));
        let first = b.failed(now);
        assert!(b.paused(now));
        assert!(!b.paused(now + first));
        let second = b.failed(now);
        assert!(second > first);
        for _ in 0..20 {
            b.failed(now);
        }
        assert_eq!(b.failed(now), MAX_PAUSE);
        assert!(!b.pause_ended(now));
        assert!(b.pause_ended(now + MAX_PAUSE));
        assert!(!b.pause_ended(now + MAX_PAUSE), "reported once");
        b.failed(now);
        b.succeeded();
        assert!(!b.paused(now));
        assert_eq!(b.failed(now), first, "the count starts again");
    }
}
