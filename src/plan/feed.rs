//! Orders the job announced itself (`--sampler feed`, through the Python hook): per epoch, the
//! files each local rank reads, in the order it reads them.
//!
//! The node's stream for an epoch is its ranks' announced streams in lock-step, as local ranks
//! read at about the same pace (`r0[0], r1[0], r0[1], r1[1], ...`; a shorter stream simply
//! ends). An epoch may be announced again (a rank joins late, the job restarts): the newest
//! announcement of each rank counts, and [`Feed::version`] tells plans built before it to go.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::catalog::FileId;

/// Announced epochs kept on either side of the one just announced: the reader's, the ones
/// before (ranks finishing them) and the next, with room for a validation loader's epochs
/// interleaved with training ones. Counted from the latest announcement, not the largest
/// epoch, so a restarted job announcing epoch 0 again is not discarded as old.
const KEPT_EPOCHS: u64 = 4;

#[derive(Default)]
pub struct Feed {
    epochs: Mutex<BTreeMap<u64, Announced>>,
    /// Counts announcements: each one's number is its epoch's version.
    version: AtomicU64,
}

/// What the ranks announced for one epoch.
#[derive(Default)]
struct Announced {
    /// The number of the latest announcement (see [`Feed::version_of`]).
    version: u64,
    /// rank → files in order.
    ranks: BTreeMap<u32, Arc<[FileId]>>,
}

impl Feed {
    /// Files `rank` reads in `epoch`, replacing what it announced for that epoch before.
    /// Returns the node stream's new length for that epoch. Epochs far from it go.
    pub fn announce(&self, epoch: u64, rank: u32, files: Vec<FileId>) -> u64 {
        let mut epochs = self.epochs.lock();
        let announced = epochs.entry(epoch).or_default();
        announced.ranks.insert(rank, files.into());
        announced.version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        let len = announced.ranks.values().map(|f| f.len() as u64).sum();
        epochs.retain(|&e, _| e.abs_diff(epoch) < KEPT_EPOCHS);
        len
    }

    /// Changes whenever `epoch` is announced: a plan built from an older version is stale.
    pub fn version_of(&self, epoch: u64) -> u64 {
        self.epochs.lock().get(&epoch).map_or(0, |a| a.version)
    }

    /// Whether anything was announced yet.
    pub fn is_empty(&self) -> bool {
        self.epochs.lock().is_empty()
    }

    /// Ranks that announced `epoch`.
    pub fn ranks(&self, epoch: u64) -> Vec<u32> {
        self.epochs
            .lock()
            .get(&epoch)
            .map(|a| a.ranks.keys().copied().collect())
            .unwrap_or_default()
    }

    /// The node's stream of `epoch`: its ranks' streams in lock-step (empty if unannounced).
    pub fn node_stream(&self, epoch: u64) -> Vec<FileId> {
        let streams: Vec<Arc<[FileId]>> = match self.epochs.lock().get(&epoch) {
            Some(announced) => announced.ranks.values().cloned().collect(),
            None => return Vec::new(),
        };
        let longest = streams.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut out = Vec::with_capacity(streams.iter().map(|s| s.len()).sum());
        for i in 0..longest {
            out.extend(streams.iter().filter_map(|s| s.get(i)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_merge_in_lock_step_and_the_newest_announcement_counts() {
        let feed = Feed::default();
        assert!(feed.is_empty() && feed.node_stream(0).is_empty());
        assert_eq!(feed.version_of(0), 0);
        assert_eq!(feed.announce(0, 1, vec![10, 11, 12]), 3);
        let v = feed.version_of(0);
        assert_eq!(feed.announce(0, 0, vec![1, 2]), 5);
        assert!(feed.version_of(0) > v);
        assert_eq!(feed.version_of(1), 0);
        assert_eq!(feed.node_stream(0), [1, 10, 2, 11, 12]);
        assert_eq!(feed.announce(0, 0, vec![3]), 4);
        assert_eq!(feed.node_stream(0), [3, 10, 11, 12]);
        assert_eq!(feed.ranks(0), [0, 1]);
        assert!(feed.node_stream(1).is_empty());
    }

    #[test]
    fn old_epochs_are_forgotten() {
        let feed = Feed::default();
        for epoch in 0..10 {
            feed.announce(epoch, 0, vec![epoch as FileId]);
        }
        assert!(feed.node_stream(5).is_empty());
        assert_eq!(feed.node_stream(6), [6]);
        assert_eq!(feed.node_stream(9), [9]);
        // A restarted job starts at 0 again: that is kept, the old run's epochs go.
        feed.announce(0, 0, vec![0]);
        assert_eq!(feed.node_stream(0), [0]);
        assert!(feed.node_stream(9).is_empty());
    }
}
