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
/// Ranks one epoch may be announced by: a node's processes, with room to spare (a node has
/// 8 or 16 GPUs), and a bound on what an announcing client can make the daemon hold.
pub const MAX_RANKS: usize = 256;
/// Files held for all announced epochs together (4 bytes each: 1 GiB): two epochs of every
/// rank of a node over the largest public datasets, and a bound a client cannot push past.
pub const MAX_HELD: usize = 1 << 28;

/// Why an announcement was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FeedError {
    #[error("epoch {epoch} is already announced by {MAX_RANKS} ranks: one mount serves one node")]
    TooManyRanks { epoch: u64 },
    #[error("the announced orders would hold more than {MAX_HELD} files")]
    TooLarge,
}

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
    pub fn announce(&self, epoch: u64, rank: u32, files: Arc<[FileId]>) -> Result<u64, FeedError> {
        let mut epochs = self.epochs.lock();
        epochs.retain(|&e, _| e.abs_diff(epoch) < KEPT_EPOCHS);
        let held: usize = epochs
            .iter()
            .flat_map(|(&e, a)| {
                a.ranks
                    .iter()
                    .filter(move |&(&r, _)| (e, r) != (epoch, rank))
            })
            .map(|(_, f)| f.len())
            .sum();
        if held + files.len() > MAX_HELD {
            return Err(FeedError::TooLarge);
        }
        let announced = epochs.entry(epoch).or_default();
        if !announced.ranks.contains_key(&rank) && announced.ranks.len() >= MAX_RANKS {
            return Err(FeedError::TooManyRanks { epoch });
        }
        announced.ranks.insert(rank, files);
        announced.version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(announced.ranks.values().map(|f| f.len() as u64).sum())
    }

    /// Changes whenever `epoch` is announced: a plan built from an older version is stale.
    pub fn version_of(&self, epoch: u64) -> u64 {
        self.epochs.lock().get(&epoch).map_or(0, |a| a.version)
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
    fn ranks_per_epoch_are_bounded_and_a_refusal_changes_nothing() {
        let feed = Feed::default();
        for rank in 0..MAX_RANKS as u32 {
            feed.announce(0, rank, vec![rank].into()).unwrap();
        }
        let v = feed.version_of(0);
        assert_eq!(
            feed.announce(0, 9999, vec![1].into()),
            Err(FeedError::TooManyRanks { epoch: 0 })
        );
        assert_eq!(feed.version_of(0), v);
        // A rank already there may announce again.
        assert_eq!(
            feed.announce(0, 3, vec![7, 7].into()),
            Ok(MAX_RANKS as u64 + 1)
        );
    }

    #[test]
    fn ranks_merge_in_lock_step_and_the_newest_announcement_counts() {
        let feed = Feed::default();
        assert!(feed.node_stream(0).is_empty());
        assert_eq!(feed.version_of(0), 0);
        assert_eq!(feed.announce(0, 1, vec![10, 11, 12].into()).unwrap(), 3);
        let v = feed.version_of(0);
        assert_eq!(feed.announce(0, 0, vec![1, 2].into()).unwrap(), 5);
        assert!(feed.version_of(0) > v);
        assert_eq!(feed.version_of(1), 0);
        assert_eq!(feed.node_stream(0), [1, 10, 2, 11, 12]);
        assert_eq!(feed.announce(0, 0, vec![3].into()).unwrap(), 4);
        assert_eq!(feed.node_stream(0), [3, 10, 11, 12]);
        assert_eq!(feed.ranks(0), [0, 1]);
        assert!(feed.node_stream(1).is_empty());
    }

    #[test]
    fn old_epochs_are_forgotten() {
        let feed = Feed::default();
        for epoch in 0..10 {
            feed.announce(epoch, 0, vec![epoch as FileId].into())
                .unwrap();
        }
        assert!(feed.node_stream(5).is_empty());
        assert_eq!(feed.node_stream(6), [6]);
        assert_eq!(feed.node_stream(9), [9]);
        // A restarted job starts at 0 again: that is kept, the old run's epochs go.
        feed.announce(0, 0, vec![0].into()).unwrap();
        assert_eq!(feed.node_stream(0), [0]);
        assert!(feed.node_stream(9).is_empty());
    }
}
