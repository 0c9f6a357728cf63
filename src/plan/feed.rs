//! Orders the job announced itself (`--sampler feed`, through the Python hook): per epoch, the
//! files each local rank reads, in the order it reads them.
//!
//! The node's stream for an epoch is its ranks' announced streams in lock-step
//! (`r0[0], r1[0], r0[1], r1[1], ...`), one lane per rank that announced any kept epoch (a
//! shorter stream, or a rank missing from an epoch, leaves its lane's slots empty), so that
//! position `p` of an epoch is always rank `p % lanes`'s: the tracker follows each rank on
//! its own, as ranks may drift apart. An epoch may be announced again (a rank joins late, the job restarts): the newest
//! announcement of each rank counts, and [`Feed::version`] tells plans built before it to go.
//!
//! A DistributedSampler's epoch is known whole on every rank (a permutation, rank `r` of `W`
//! reading every `W`-th sample from `r`): the hook announces it too ([`World`]), and peers place
//! the job's files on its nodes from it (who read a file, who will fetch it).
//!
//! A job iterates several loaders: training, and validation between epochs (Lightning even
//! runs a validation "sanity check" before the first training epoch). Each announces as a
//! stream of its own ([`StreamKey`]), with its own epoch count. One stream is followed and
//! planned: the training loader's, told apart as the one that shuffles, and among several the
//! longest. The others' announcements are not kept: their opens are of files the followed
//! stream's epochs do not hold, so they are never judged against its prediction.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::catalog::{FileId, MaybeFile};

/// Announced epochs kept on either side of the one just announced: the reader's, the ones
/// before (ranks finishing them) and the next. Counted from the latest announcement, not the
/// largest epoch, so a restarted job announcing epoch 0 again is not discarded as old.
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

/// Which of the job's loaders an announcement comes from.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct StreamKey {
    /// What the hook calls it: the dataset's root under the mount (`train`, `val`).
    pub name: String,
    /// Whether its sampler shuffles (a training loader; validation reads in order).
    pub shuffled: bool,
}

impl StreamKey {
    /// Whether a stream announcing `len` files per rank is the training stream rather than
    /// this one, which announced `followed_len`: a shuffling loader over one in order, then
    /// the longer.
    fn outranked_by(&self, other: &StreamKey, len: usize, followed_len: usize) -> bool {
        (other.shuffled, len) > (self.shuffled, followed_len)
    }
}

/// What became of an announcement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Taken {
    /// An epoch of the followed stream; `len` is the node stream's new length for it, and
    /// `switched` says the followed stream changed to this one (what was announced before
    /// belongs to another loader: plans made from it are void).
    Followed { len: u64, switched: bool },
    /// Another stream's: not planned.
    Other,
}

#[derive(Default)]
pub struct Feed {
    state: Mutex<FeedState>,
    /// Counts announcements: each one's number is its epoch's version.
    version: AtomicU64,
}

#[derive(Default)]
struct FeedState {
    /// The stream planned, and the most files a rank announced for one of its epochs.
    followed: Option<(StreamKey, usize)>,
    epochs: BTreeMap<u64, Announced>,
}

/// What the ranks announced for one epoch.
#[derive(Default)]
struct Announced {
    /// The number of the latest announcement (see [`Feed::version_of`]).
    version: u64,
    /// rank → files in order.
    ranks: BTreeMap<u32, Arc<[FileId]>>,
    /// The whole epoch, every rank's share, if announced.
    world: Option<Arc<World>>,
}

impl Announced {
    /// Files held for it, the whole epoch's included.
    fn held(&self) -> usize {
        let world = self.world.as_ref().map_or(0, |w| w.files.len());
        self.ranks.values().map(|f| f.len()).sum::<usize>() + world
    }
}

/// An epoch of the whole job: rank `r` of `size` reads `files[r], files[r + size], ...` (a
/// DistributedSampler's split of its padded permutation), so position `p` is rank `p % size`'s.
/// A sample no file of the catalog answers is none.
pub struct World {
    pub size: u32,
    pub files: Arc<[MaybeFile]>,
    /// The announcement's number: a newer one for the same epoch replaces it.
    pub version: u64,
}

impl Feed {
    /// Files `rank` reads in `epoch` of `stream`, replacing what it announced for that epoch
    /// before. Epochs far from it go.
    pub fn announce(
        &self,
        stream: &StreamKey,
        epoch: u64,
        rank: u32,
        files: Arc<[FileId]>,
    ) -> Result<Taken, FeedError> {
        let mut st = self.state.lock();
        let switched = match &st.followed {
            None => true,
            Some((key, _)) if key == stream => false,
            Some((key, len)) if key.outranked_by(stream, files.len(), *len) => true,
            Some(_) => return Ok(Taken::Other),
        };
        if switched {
            st.followed = None;
            st.epochs.clear();
        }
        st.epochs.retain(|&e, _| e.abs_diff(epoch) < KEPT_EPOCHS);
        let replaced = (st.epochs.get(&epoch))
            .and_then(|a| a.ranks.get(&rank))
            .map_or(0, |f| f.len());
        if st.held() - replaced + files.len() > MAX_HELD {
            return Err(FeedError::TooLarge);
        }
        let announced = st.epochs.entry(epoch).or_default();
        if !announced.ranks.contains_key(&rank) && announced.ranks.len() >= MAX_RANKS {
            return Err(FeedError::TooManyRanks { epoch });
        }
        // Another share than before: the epoch as announced whole is another one's.
        if announced
            .ranks
            .get(&rank)
            .is_some_and(|before| *before != files)
        {
            announced.world = None;
        }
        announced.ranks.insert(rank, files.clone());
        announced.version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        let longest = announced.ranks.values().map(|f| f.len()).max().unwrap_or(0);
        let len = (longest * st.lanes().len()) as u64;
        let most = st.followed.as_ref().map_or(0, |(_, n)| *n).max(files.len());
        st.followed = Some((stream.clone(), most));
        Ok(Taken::Followed { len, switched })
    }

    /// The whole of `epoch` of `stream` (see [`World`]), replacing what was announced of it
    /// before. `false` (not kept) unless `stream` is the one followed, some rank of this node
    /// announced `epoch` (a whole epoch comes after a rank's share of it: one for an epoch
    /// far from the job's would only take memory), and every such rank's files are its share
    /// of `files` (rank `r` of `size` at `r`, `r + size`, ...; files the rank could not have
    /// announced, missing).
    pub fn announce_world(
        &self,
        stream: &StreamKey,
        epoch: u64,
        size: u32,
        files: Arc<[MaybeFile]>,
    ) -> Result<bool, FeedError> {
        let mut st = self.state.lock();
        if !st.followed.as_ref().is_some_and(|(key, _)| key == stream) {
            return Ok(false);
        }
        let Some(announced) = st.epochs.get(&epoch) else {
            return Ok(false);
        };
        let shares =
            (announced.ranks.iter()).all(|(&rank, own)| is_share_of(own, &files, rank, size));
        if !shares {
            return Ok(false);
        }
        let replaced = announced.world.as_ref().map_or(0, |w| w.files.len());
        if st.held() - replaced + files.len() > MAX_HELD {
            return Err(FeedError::TooLarge);
        }
        let version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        let world = Arc::new(World {
            size,
            files,
            version,
        });
        st.epochs.entry(epoch).or_default().world = Some(world);
        Ok(true)
    }

    /// The whole of `epoch`, if announced.
    pub fn world(&self, epoch: u64) -> Option<Arc<World>> {
        self.state.lock().epochs.get(&epoch)?.world.clone()
    }

    /// The followed stream, once one announced.
    pub fn followed(&self) -> Option<StreamKey> {
        self.state
            .lock()
            .followed
            .as_ref()
            .map(|(key, _)| key.clone())
    }

    /// Changes whenever `epoch` is announced: a plan built from an older version is stale.
    pub fn version_of(&self, epoch: u64) -> u64 {
        self.state
            .lock()
            .epochs
            .get(&epoch)
            .map_or(0, |a| a.version)
    }

    /// Ranks that announced `epoch`.
    pub fn ranks(&self, epoch: u64) -> Vec<u32> {
        self.state
            .lock()
            .epochs
            .get(&epoch)
            .map(|a| a.ranks.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Lanes of the node stream: the ranks that announced any kept epoch.
    pub fn lanes(&self) -> usize {
        self.state.lock().lanes().len().max(1)
    }

    /// Files announced for `epoch`, all ranks together.
    pub fn announced_len(&self, epoch: u64) -> u64 {
        self.state
            .lock()
            .epochs
            .get(&epoch)
            .map_or(0, |a| a.ranks.values().map(|f| f.len() as u64).sum())
    }

    /// The node's stream of `epoch`: its ranks' streams in lock-step, a lane each (empty if
    /// unannounced).
    pub fn node_stream(&self, epoch: u64) -> Vec<MaybeFile> {
        let streams: Vec<Option<Arc<[FileId]>>> = {
            let st = self.state.lock();
            let Some(announced) = st.epochs.get(&epoch) else {
                return Vec::new();
            };
            let lanes = st.lanes();
            lanes
                .iter()
                .map(|r| announced.ranks.get(r).cloned())
                .collect()
        };
        let longest = streams.iter().flatten().map(|s| s.len()).max().unwrap_or(0);
        let mut out = Vec::with_capacity(longest * streams.len());
        for i in 0..longest {
            out.extend(
                streams
                    .iter()
                    .map(|s| MaybeFile::new(s.as_ref().and_then(|s| s.get(i).copied()))),
            );
        }
        out
    }
}

/// Whether `own` (what `rank` announced) is, in order, among its share of `whole` (rank
/// `rank` of `size` reads positions `rank`, `rank + size`, ...): all of it, or all but the
/// files the rank dropped (ones it may not read, or no file of the catalog).
fn is_share_of(own: &[FileId], whole: &[MaybeFile], rank: u32, size: u32) -> bool {
    if rank >= size {
        return false;
    }
    let mut share =
        (whole.iter().skip(rank as usize).step_by(size as usize)).filter_map(|f| f.get());
    own.iter().all(|f| share.any(|g| g == *f))
}

impl FeedState {
    /// Files held for all kept epochs.
    fn held(&self) -> usize {
        self.epochs.values().map(Announced::held).sum()
    }

    /// The ranks that announced any kept epoch, in rank order: one lane each.
    fn lanes(&self) -> Vec<u32> {
        let mut ranks: Vec<u32> = self
            .epochs
            .values()
            .flat_map(|a| a.ranks.keys().copied())
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn train() -> StreamKey {
        StreamKey {
            name: "train".into(),
            shuffled: true,
        }
    }

    /// The node stream of `epoch`, empty lane slots as `None`.
    fn stream(feed: &Feed, epoch: u64) -> Vec<Option<FileId>> {
        feed.node_stream(epoch).iter().map(|f| f.get()).collect()
    }

    fn len(taken: Result<Taken, FeedError>) -> u64 {
        match taken.unwrap() {
            Taken::Followed { len, .. } => len,
            Taken::Other => panic!("not followed"),
        }
    }

    /// Lightning's order of loaders: a validation sanity check, then training, then
    /// validation again. Training is followed from its first announcement on; validation's
    /// files are its own stream's.
    #[test]
    fn the_shuffling_loader_is_followed_and_validation_is_another_stream() {
        let feed = Feed::default();
        let val = StreamKey {
            name: "val".into(),
            shuffled: false,
        };
        assert_eq!(
            feed.announce(&val, 0, 0, vec![100, 101].into()),
            Ok(Taken::Followed {
                len: 2,
                switched: true
            })
        );
        assert_eq!(
            feed.announce(&train(), 0, 0, vec![5, 1, 3].into()),
            Ok(Taken::Followed {
                len: 3,
                switched: true
            })
        );
        assert_eq!(
            feed.announce(&val, 1, 0, vec![100, 101].into()),
            Ok(Taken::Other)
        );
        assert_eq!(feed.followed(), Some(train()));
        assert_eq!(stream(&feed, 0), [Some(5), Some(1), Some(3)]);
        // A longer shuffling loader is the training one; a shorter one is not.
        let small = StreamKey {
            name: "subset".into(),
            shuffled: true,
        };
        assert_eq!(
            feed.announce(&small, 0, 0, vec![9].into()),
            Ok(Taken::Other)
        );
        assert_eq!(feed.followed(), Some(train()));
    }

    #[test]
    fn ranks_per_epoch_are_bounded_and_a_refusal_changes_nothing() {
        let feed = Feed::default();
        for rank in 0..MAX_RANKS as u32 {
            feed.announce(&train(), 0, rank, vec![rank].into()).unwrap();
        }
        let v = feed.version_of(0);
        assert_eq!(
            feed.announce(&train(), 0, 9999, vec![1].into()),
            Err(FeedError::TooManyRanks { epoch: 0 })
        );
        assert_eq!(feed.version_of(0), v);
        // A rank already there may announce again.
        assert_eq!(
            feed.announce(&train(), 0, 3, vec![7, 7].into()),
            Ok(Taken::Followed {
                len: 2 * MAX_RANKS as u64,
                switched: false
            })
        );
    }

    #[test]
    fn ranks_merge_in_lock_step_and_the_newest_announcement_counts() {
        let feed = Feed::default();
        assert!(feed.node_stream(0).is_empty());
        assert_eq!(feed.version_of(0), 0);
        assert_eq!(
            len(feed.announce(&train(), 0, 1, vec![10, 11, 12].into())),
            3
        );
        let v = feed.version_of(0);
        // Two lanes of three: rank 0's shorter stream leaves its last slot empty.
        assert_eq!(len(feed.announce(&train(), 0, 0, vec![1, 2].into())), 6);
        assert!(feed.version_of(0) > v);
        assert_eq!(feed.version_of(1), 0);
        let (r0, r1) = (Some, Some);
        assert_eq!(
            stream(&feed, 0),
            [r0(1), r1(10), r0(2), r1(11), None, r1(12)]
        );
        assert_eq!(len(feed.announce(&train(), 0, 0, vec![3].into())), 6);
        assert_eq!(
            stream(&feed, 0),
            [r0(3), r1(10), None, r1(11), None, r1(12)]
        );
        assert_eq!(feed.ranks(0), [0, 1]);
        assert_eq!(feed.lanes(), 2);
        // A rank that announced only epoch 0 keeps its lane, empty, in epoch 1.
        feed.announce(&train(), 1, 1, vec![7].into()).unwrap();
        assert_eq!(stream(&feed, 1), [None, Some(7)]);
    }

    #[test]
    fn old_epochs_are_forgotten() {
        let feed = Feed::default();
        for epoch in 0..10 {
            feed.announce(&train(), epoch, 0, vec![epoch as FileId].into())
                .unwrap();
        }
        assert!(feed.node_stream(5).is_empty());
        assert_eq!(stream(&feed, 6), [Some(6)]);
        assert_eq!(stream(&feed, 9), [Some(9)]);
        // A restarted job starts at 0 again: that is kept, the old run's epochs go.
        feed.announce(&train(), 0, 0, vec![0].into()).unwrap();
        assert_eq!(stream(&feed, 0), [Some(0)]);
        assert!(feed.node_stream(9).is_empty());
    }

    fn whole(files: &[FileId]) -> Arc<[MaybeFile]> {
        files.iter().map(|&f| MaybeFile::from(f)).collect()
    }

    /// An epoch announced whole is kept for the followed stream only, after a rank's share of
    /// it and only if it holds that share; it counts against what the feed holds, a newer one
    /// replaces it, and it goes with its epoch, a changed share or a switch.
    #[test]
    fn whole_epochs_are_kept_for_the_followed_stream_within_bounds() {
        let feed = Feed::default();
        let val = StreamKey {
            name: "val".into(),
            shuffled: false,
        };
        assert_eq!(
            feed.announce_world(&train(), 0, 2, whole(&[1, 2])),
            Ok(false)
        );
        feed.announce(&train(), 0, 0, vec![1, 3].into()).unwrap();
        assert_eq!(
            feed.announce_world(&val, 0, 2, whole(&[1, 2, 3, 4])),
            Ok(false)
        );
        // Not before a share of it, nor without the share (another size, other files).
        assert_eq!(
            feed.announce_world(&train(), 1, 2, whole(&[1, 2])),
            Ok(false)
        );
        for (size, files) in [(2, [1, 2, 4, 3]), (3, [1, 2, 3, 4]), (2, [3, 2, 1, 4])] {
            assert_eq!(
                feed.announce_world(&train(), 0, size, whole(&files)),
                Ok(false)
            );
        }
        assert!(feed.world(0).is_none());
        assert_eq!(
            feed.announce_world(&train(), 0, 2, whole(&[1, 2, 3, 4])),
            Ok(true)
        );
        let first = feed.world(0).unwrap();
        assert_eq!((first.size, first.files.len()), (2, 4));
        // A share with files the rank dropped (unreadable) is still its share.
        assert_eq!(
            feed.announce_world(&train(), 0, 2, whole(&[1, 9, 8, 7, 3, 6])),
            Ok(true)
        );
        // Plans stay: a whole epoch changes no rank's stream.
        let version = feed.version_of(0);
        feed.announce_world(&train(), 0, 2, whole(&[1, 2, 3, 4]))
            .unwrap();
        let second = feed.world(0).unwrap();
        assert!(second.version > first.version);
        assert_eq!(feed.version_of(0), version);
        // What it holds counts: one more file than the bound is refused, and changes nothing.
        let mut too_many = vec![MaybeFile::new(None); MAX_HELD - 1];
        too_many[0] = MaybeFile::from(1);
        too_many[2] = MaybeFile::from(3);
        assert_eq!(
            feed.announce_world(&train(), 0, 2, too_many.into()),
            Err(FeedError::TooLarge)
        );
        assert_eq!(feed.world(0).unwrap().version, second.version);
        // The same share again keeps it; another share drops it.
        feed.announce(&train(), 0, 0, vec![1, 3].into()).unwrap();
        assert!(feed.world(0).is_some());
        feed.announce(&train(), 0, 0, vec![3, 1].into()).unwrap();
        assert!(feed.world(0).is_none());
        // Gone with its epoch, and with the stream when another one is followed.
        feed.announce_world(&train(), 0, 2, whole(&[3, 2, 1, 4]))
            .unwrap();
        feed.announce(&train(), KEPT_EPOCHS, 0, vec![1].into())
            .unwrap();
        assert!(feed.world(0).is_none());
        assert!(
            feed.announce_world(&train(), KEPT_EPOCHS, 2, whole(&[1, 2]))
                .unwrap()
        );
        let bigger = StreamKey {
            name: "big".into(),
            shuffled: true,
        };
        feed.announce(&bigger, 0, 0, vec![1, 2, 3, 4, 5].into())
            .unwrap();
        assert!(feed.world(KEPT_EPOCHS).is_none());
    }
}
