//! Readers waiting for a file's copy: one list per file (single-flight: one copy answers them
//! all), and which waited too long by a given time. `R` is however a reader is answered.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::catalog::FileId;

/// A reader's open, answered when its file's copy is over.
pub struct Waiter<R> {
    pub reply: R,
    pub since: Instant,
}

pub struct Waiters<R>(HashMap<FileId, Vec<Waiter<R>>>);

impl<R> Default for Waiters<R> {
    fn default() -> Self {
        Waiters(HashMap::new())
    }
}

impl<R> Waiters<R> {
    pub fn add(&mut self, file: FileId, reply: R, since: Instant) {
        self.0
            .entry(file)
            .or_default()
            .push(Waiter { reply, since });
    }

    /// Whether a reader waits for `file`.
    pub fn has(&self, file: FileId) -> bool {
        self.0.contains_key(&file)
    }

    /// Everyone waiting for `file`, now to be answered.
    pub fn take(&mut self, file: FileId) -> Vec<Waiter<R>> {
        self.0.remove(&file).unwrap_or_default()
    }

    /// Removes and returns the waiters that have waited `timeout` or longer by `now`.
    pub fn expired(&mut self, now: Instant, timeout: Duration) -> Vec<(FileId, Waiter<R>)> {
        let mut out = Vec::new();
        self.0.retain(|&file, list| {
            let (expired, kept): (Vec<Waiter<R>>, Vec<Waiter<R>>) = std::mem::take(list)
                .into_iter()
                .partition(|w| now.saturating_duration_since(w.since) >= timeout);
            out.extend(expired.into_iter().map(|w| (file, w)));
            *list = kept;
            !list.is_empty()
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiters_are_taken_per_file_and_expire_by_age() {
        let t0 = Instant::now();
        let mut w = Waiters::default();
        w.add(1, "a", t0);
        w.add(1, "b", t0 + Duration::from_secs(5));
        w.add(2, "c", t0);
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
