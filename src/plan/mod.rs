//! The node's predicted stream: which file is read at each position of each epoch.
//!
//! A sampler gives sample indices per rank; a node serves several local ranks whose streams
//! interleave, and the layout turns indices into files. This module composes the three into
//! one stream of file ids per epoch and indexes it backwards (file → its positions) so the
//! stager can ask "when is this file next needed?", the question Belady eviction runs on.
//!
//! Epochs are computed on demand and only a few are kept: the run is never materialised.
//! Computing one takes long at scale (up to seconds for 14 M samples), so the stager plans
//! the next epoch off its lock and asks [`Plan::planned`], which never computes.

mod feed;
mod tracker;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::catalog::{FileId, Layout, MaybeFile};
use crate::order::{OrderError, SamplerConfig, SamplerKind};

pub use feed::{Feed, FeedError, StreamKey};
pub use tracker::{Run, Tracker, TrackerMode, TrackerSettings, densest_run, find_position, reach};

/// A position in the run: `epoch * epoch_len + offset`. Global positions make "next use"
/// comparable across the epoch boundary.
pub type Position = u64;

/// "Not needed again within the horizon we know": evicted first.
pub const NEVER: Position = Position::MAX;

/// Longest fed epoch planned, in positions (all ranks of the node): 2^28, ten times the
/// largest public image dataset, and 3 GB of plans. An announcement beyond it is staged only
/// that far (the positions of an epoch plan are u32 offsets in any case).
const MAX_FED_EPOCH_LEN: u64 = 1 << 28;

/// Epoch plans kept in memory: the cursor's epoch and the next one, which is all the tracker
/// and the stager look at (12 bytes per sample each, so this bounds the plan's memory).
const CACHED_EPOCHS: usize = 2;

/// An order and its first epoch's plan, computed and ready for [`Plan::adopt`].
pub struct Prepared {
    order: Arc<Order>,
    plan: EpochPlan,
}

/// Epoch plans in memory, and the epochs some thread is computing right now.
#[derive(Default)]
struct Epochs {
    recent: VecDeque<Arc<EpochPlan>>,
    building: Vec<u64>,
}

impl Epochs {
    fn get(&self, epoch: u64) -> Option<Arc<EpochPlan>> {
        self.recent.iter().find(|p| p.epoch == epoch).cloned()
    }
}

/// One epoch of the node stream, with its inverse.
pub struct EpochPlan {
    pub epoch: u64,
    /// The [`Order`] it was computed for ([`Plan::adopt`] replaces it).
    generation: u64,
    /// The announcement it was built from ([`Feed::version_of`]; 0 for a computed order), and
    /// the epoch length then (a fed stream is cut to it).
    built_from: u64,
    built_len: u64,
    /// File read at each offset of the epoch.
    stream: Vec<MaybeFile>,
    /// `positions[starts[f]..starts[f + 1]]` are the offsets (ascending) where file f is read.
    starts: Vec<u32>,
    positions: Vec<u32>,
}

impl EpochPlan {
    fn build(
        epoch: u64,
        (built_from, built_len): (u64, u64),
        stream: Vec<MaybeFile>,
        file_count: usize,
    ) -> EpochPlan {
        // Counting sort: a CSR index in two passes, no per-file allocation.
        let mut starts = vec![0u32; file_count + 1];
        for f in stream.iter().filter_map(|f| f.get()) {
            starts[f as usize + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut fill = starts.clone();
        let mut positions = vec![0u32; starts[file_count] as usize];
        for (offset, f) in stream.iter().enumerate() {
            if let Some(f) = f.get() {
                positions[fill[f as usize] as usize] = offset as u32;
                fill[f as usize] += 1;
            }
        }
        EpochPlan {
            epoch,
            generation: 0,
            built_from,
            built_len,
            stream,
            starts,
            positions,
        }
    }

    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u64 {
        self.stream.len() as u64
    }

    /// The file read at `offset`; `None` past the end or for a sample stagefs cannot serve.
    pub fn file_at(&self, offset: u64) -> Option<FileId> {
        self.stream.get(offset as usize).and_then(|f| f.get())
    }

    /// Heap memory of this epoch's plan, in bytes.
    pub fn heap_bytes(&self) -> usize {
        4 * (self.stream.capacity() + self.starts.capacity() + self.positions.capacity())
    }

    /// Offsets at which `file` is read in this epoch, ascending.
    pub fn offsets_of(&self, file: FileId) -> &[u32] {
        match (
            self.starts.get(file as usize),
            self.starts.get(file as usize + 1),
        ) {
            (Some(&a), Some(&b)) => &self.positions[a as usize..b as usize],
            _ => &[],
        }
    }
}

/// What an announcement changed in a fed plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FedChange {
    /// Planned as it was (or the plan does not follow announcements).
    Nothing,
    /// The epoch length grew to fit it: every position moved.
    Grown,
    /// The job's training loader announced for the first time: the plan follows its stream
    /// from now on, and what another loader announced before is dropped.
    Switched,
    /// Another loader's (validation): not planned.
    Other,
}

/// How a prediction came about, for the statistics and the messages about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provenance {
    /// The mount's flags.
    Configured,
    /// `--sampler auto` found it from the job's first opens.
    Detected,
    /// The job announces its order (`--sampler feed`, or an auto mount the hook talks to).
    Announced,
}

/// What is predicted: the sampler, the node's ranks, and the dataset whose samples it orders.
#[derive(Clone)]
pub struct Order {
    pub sampler: SamplerConfig,
    pub ranks: Vec<u32>,
    pub provenance: Provenance,
    /// The dataset the sampler's indices number (a fed order's files come with it).
    pub layout: Arc<Layout>,
}

impl Order {
    /// The flags that name this prediction on a mount's command line.
    pub fn flags(&self, epoch: u64) -> String {
        let flags = self.sampler.flags(&self.ranks, epoch);
        match self.layout.name() {
            "." => flags,
            dataset => format!("{flags} --dataset {dataset}"),
        }
    }
}

/// The whole prediction: sampler settings, local ranks and layout, producing epoch plans.
pub struct Plan {
    /// Replaced as a whole when `--sampler auto` finds the job's order or the job starts
    /// announcing it; `generation` counts the replacements.
    order: RwLock<Arc<Order>>,
    generation: AtomicU64,
    /// Number of catalog entries (file ids are below this).
    id_space: usize,
    /// Positions per epoch. Fixed by the first epoch for computed orders; for a fed order,
    /// 0 until the first announcement, then grown (under the stager's lock, which moves the
    /// tracker to the new coordinates) when an announcement would not fit.
    epoch_len: AtomicU64,
    /// What the job announced (used while the sampler is `feed`), and its lanes when last
    /// announced.
    feed: Feed,
    fed_lanes: AtomicUsize,
    epochs: Mutex<Epochs>,
    /// Signalled when an epoch finishes building.
    built: Condvar,
}

impl Plan {
    pub fn new(
        sampler: SamplerConfig,
        ranks: Vec<u32>,
        layout: Arc<Layout>,
        id_space: usize,
    ) -> Result<Plan, OrderError> {
        sampler.validate(layout.len() as u64, &ranks)?;
        let fed = sampler.kind == SamplerKind::Feed;
        let plan = Plan {
            order: RwLock::new(Arc::new(Order {
                sampler,
                ranks,
                provenance: if fed {
                    Provenance::Announced
                } else {
                    Provenance::Configured
                },
                layout,
            })),
            generation: AtomicU64::new(0),
            id_space,
            epoch_len: AtomicU64::new(0),
            feed: Feed::default(),
            fed_lanes: AtomicUsize::new(1),
            epochs: Mutex::new(Epochs::default()),
            built: Condvar::new(),
        };
        // Samplers that give every rank the same order yield one stream per node, the
        // distributed one a merge of the local ranks: the first epoch says which.
        if plan.sampler().predicts() && !fed {
            let len = plan.epoch(0).len();
            plan.epoch_len.store(len, Ordering::SeqCst);
        }
        Ok(plan)
    }

    /// Computes, off any lock, what [`adopt`](Self::adopt) switches to: `order` and its plan
    /// of `epoch`.
    pub fn prepare(&self, order: Order, epoch: u64) -> Result<Prepared, OrderError> {
        let len = order.layout.len() as u64;
        order.sampler.validate(len, &order.ranks)?;
        order.sampler.check_epoch_reachable(len, epoch)?;
        let stream = self.stream_of(&order, epoch);
        if stream.is_empty() {
            return Err(OrderError::EmptyDataset);
        }
        let len = stream.len() as u64;
        let plan = EpochPlan::build(epoch, (0, len), stream, self.id_space);
        Ok(Prepared {
            order: Arc::new(order),
            plan,
        })
    }

    /// Switches to a prepared order, unless the job announces its order meanwhile (false).
    /// Positions then mean other places: the caller (holding the stager's lock) moves the
    /// tracker before anyone uses one.
    pub fn adopt(&self, prepared: Prepared) -> bool {
        let Prepared { order, mut plan } = prepared;
        let mut epochs = self.epochs.lock();
        // An order the job announces is not replaced by a computed one.
        if self.is_fed() && order.provenance != Provenance::Announced {
            return false;
        }
        // A fed order's length comes with its announcements.
        let len = if order.sampler.kind == SamplerKind::Feed {
            0
        } else {
            plan.len()
        };
        // The order before the generation: a plan computed meanwhile that reads the new
        // generation then reads the new order too.
        *self.order.write() = order;
        self.epoch_len.store(len, Ordering::SeqCst);
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        plan.generation = generation;
        epochs.recent.clear();
        epochs.recent.push_back(Arc::new(plan));
        drop(epochs);
        self.built.notify_all();
        true
    }

    /// Follows the job's announcements from now on (an `auto` mount the feed hook talks to).
    /// Nothing is predicted until the first one.
    pub fn follow_announcements(&self) {
        let mut epochs = self.epochs.lock();
        let layout = self.layout();
        *self.order.write() = Arc::new(Order {
            sampler: SamplerConfig::new(SamplerKind::Feed),
            ranks: vec![0],
            provenance: Provenance::Announced,
            layout,
        });
        self.epoch_len.store(0, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
        epochs.recent.clear();
    }

    /// How many times the order was replaced: a caller that let go of the stager's lock
    /// checks it did not change behind its back.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The prediction now in force.
    pub fn order(&self) -> Arc<Order> {
        self.order.read().clone()
    }

    pub fn predicts(&self) -> bool {
        self.sampler().predicts() && self.epoch_len() > 0
    }

    /// Lanes of the node stream: one per local rank whose stream it interleaves (position `p`
    /// of an epoch is lane `p % lanes`'s), so the tracker follows each rank on its own; one
    /// for an order the node reads once.
    pub fn lanes(&self) -> usize {
        let order = self.order.read();
        match order.sampler.kind {
            SamplerKind::Feed => self.fed_lanes.load(Ordering::SeqCst).max(1),
            SamplerKind::TorchDistributed if order.sampler.world_size > 1 => {
                order.ranks.len().max(1)
            }
            _ => 1,
        }
    }

    /// Positions per epoch on this node (all local ranks together).
    pub fn epoch_len(&self) -> u64 {
        self.epoch_len.load(Ordering::Relaxed)
    }

    /// Whether the order is the job's announcements (`--sampler feed`).
    pub fn is_fed(&self) -> bool {
        self.sampler().kind == SamplerKind::Feed
    }

    /// Ranks that announced `epoch` (none unless fed).
    pub fn fed_ranks(&self, epoch: u64) -> Vec<u32> {
        if self.is_fed() {
            self.feed.ranks(epoch)
        } else {
            Vec::new()
        }
    }

    /// Files the job announced for `epoch` of the followed stream (all ranks).
    pub fn announced_len(&self, epoch: u64) -> u64 {
        self.feed.announced_len(epoch)
    }

    /// The followed stream's name and whether it shuffles, once the job announced one.
    pub fn followed_stream(&self) -> Option<StreamKey> {
        self.feed.followed()
    }

    /// The other announced stream `file` belongs to, if any.
    pub fn other_stream_of(&self, file: FileId) -> Option<String> {
        self.feed.other_stream_of(file)
    }

    /// Takes what `rank` announced it reads in `epoch` of `stream`, and says what changed
    /// ([`FedChange`]): the caller, holding the stager's lock, moves the tracker when positions
    /// now mean other places.
    pub fn announce(
        &self,
        stream: &StreamKey,
        epoch: u64,
        rank: u32,
        files: Arc<[FileId]>,
    ) -> Result<FedChange, FeedError> {
        if !self.is_fed() {
            return Ok(FedChange::Nothing);
        }
        let (len, switched) = match self.feed.announce(stream, epoch, rank, files)? {
            feed::Taken::Other => return Ok(FedChange::Other),
            feed::Taken::Followed { len, switched } => (len, switched),
        };
        if switched {
            // Another loader's epochs were planned: they go, and the length starts over.
            let mut epochs = self.epochs.lock();
            self.generation.fetch_add(1, Ordering::SeqCst);
            epochs.recent.clear();
            self.epoch_len.store(0, Ordering::SeqCst);
        }
        // A rank's first announcement adds a lane: positions change rank, as when they grow.
        let lanes = self.feed.lanes();
        let lanes_changed = self.fed_lanes.swap(lanes, Ordering::SeqCst) != lanes;
        let grew = self.grow_epoch_len(epoch, len) || lanes_changed;
        Ok(match (switched, grew) {
            (true, _) => FedChange::Switched,
            (false, true) => FedChange::Grown,
            (false, false) => FedChange::Nothing,
        })
    }

    /// Makes a fed epoch of `len` positions fit; whether the epoch length grew.
    fn grow_epoch_len(&self, epoch: u64, len: u64) -> bool {
        if len <= self.epoch_len() {
            return false;
        }
        // Room for every file once or more, so a job's later, longer epochs (another loader,
        // more ranks announcing) rarely grow it again; a power of two keeps it stable.
        let grown = len
            .max(self.id_space as u64)
            .next_power_of_two()
            .min(MAX_FED_EPOCH_LEN);
        if len > grown {
            log::warn!(
                "epoch {epoch} as announced is {len} positions long; staging follows its first {grown}"
            );
        }
        if grown <= self.epoch_len() {
            return false;
        }
        self.epoch_len.store(grown, Ordering::SeqCst);
        true
    }

    /// The announcement version `plan` must have been built from to be current.
    fn is_current(&self, plan: &EpochPlan) -> bool {
        if plan.generation != self.generation.load(Ordering::SeqCst) {
            return false;
        }
        // The version is published before a grown length: a plan built in between is cut short.
        !self.is_fed()
            || (plan.built_from >= self.feed.version_of(plan.epoch)
                && plan.built_len == self.epoch_len())
    }

    pub fn sampler(&self) -> SamplerConfig {
        self.order.read().sampler.clone()
    }

    pub fn ranks(&self) -> Vec<u32> {
        self.order.read().ranks.clone()
    }

    /// How sample indices map to files: the dataset the order numbers.
    pub fn layout(&self) -> Arc<Layout> {
        self.order.read().layout.clone()
    }

    /// Whether an open of `file` belongs to the predicted stream: a sample of its dataset, or
    /// for a fed order, a file the followed stream announced. Other opens (a validation set,
    /// a label file), and every open while nothing is predicted, are another stream's, never
    /// judged against this one.
    pub fn in_predicted_stream(&self, file: FileId) -> bool {
        if !self.predicts() {
            return false;
        }
        let order = self.order.read();
        if order.sampler.kind == SamplerKind::Feed {
            self.feed.contains(file)
        } else {
            order.layout.contains(file)
        }
    }

    /// Refuses an epoch whose positions do not fit in 64 bits, and one that would take
    /// minutes of replaying to plan (see [`SamplerConfig::check_epoch_reachable`]).
    pub fn check_epoch_reachable(&self, epoch: u64) -> Result<(), OrderError> {
        // The stager plans `epoch` and the next one: positions up to the end of epoch + 1 must
        // not saturate in `join`, or `split` reads them back as another epoch and the tracker
        // walks ~2^64 positions to catch up.
        if epoch
            .checked_add(2)
            .and_then(|e| e.checked_mul(self.epoch_len()))
            .is_none()
        {
            return Err(OrderError::EpochTooLarge {
                epoch,
                epoch_len: self.epoch_len(),
            });
        }
        self.sampler()
            .check_epoch_reachable(self.layout().len() as u64, epoch)
    }

    /// The plan of `epoch`, computed on first use (or when a newer announcement made it
    /// stale) and kept among the last few. Single-flight: a caller asking for an epoch another
    /// thread is computing waits for that result.
    pub fn epoch(&self, epoch: u64) -> Arc<EpochPlan> {
        self.epoch_while(epoch, &|| true)
            .expect("a plan always wanted is always computed")
    }

    /// [`epoch`](Self::epoch), given up (`None`, nothing kept) as soon as `wanted` says it is
    /// no longer wanted: reaching a far epoch may replay minutes of random draws, which must
    /// stop when whoever asked for it goes away.
    pub fn epoch_while(&self, epoch: u64, wanted: &dyn Fn() -> bool) -> Option<Arc<EpochPlan>> {
        let mut epochs = self.epochs.lock();
        loop {
            if let Some(p) = epochs.get(epoch)
                && self.is_current(&p)
            {
                return Some(p);
            }
            if !epochs.building.contains(&epoch) {
                break;
            }
            self.built.wait(&mut epochs);
        }
        epochs.building.push(epoch);
        drop(epochs);
        let plan = self.compute(epoch, wanted).map(Arc::new);
        let mut epochs = self.epochs.lock();
        epochs.building.retain(|&e| e != epoch);
        match &plan {
            // A stale plan stays in use until this one replaces it: the tracker keeps matching.
            Some(p) if p.generation == self.generation.load(Ordering::SeqCst) => {
                epochs.recent.retain(|p| p.epoch != epoch);
                if epochs.recent.len() >= CACHED_EPOCHS {
                    epochs.recent.pop_front();
                }
                epochs.recent.push_back(p.clone());
            }
            // Given up, or the order was replaced while this was computed: the caller gets
            // what it asked for, the plans in memory stay the new order's (and a waiter for
            // the same epoch computes it itself).
            _ => {}
        }
        drop(epochs);
        self.built.notify_all();
        plan
    }

    /// The plan of `epoch` if it is in memory; never computes.
    pub fn planned(&self, epoch: u64) -> Option<Arc<EpochPlan>> {
        self.epochs.lock().get(epoch)
    }

    /// Drops the plans of epochs before `epoch` (the reader has left them), so that computing
    /// the next one does not hold three epochs in memory at once.
    pub fn forget_before(&self, epoch: u64) {
        self.epochs.lock().recent.retain(|p| p.epoch >= epoch);
    }

    /// Node stream of `epoch`, without the inverse index (for resynchronisation scans, which
    /// look at many epochs once).
    pub fn stream(&self, epoch: u64) -> Vec<MaybeFile> {
        self.stream_of(&self.order(), epoch)
    }

    /// Node stream of `epoch` under `order`, which need not be the one in force (to judge
    /// another order against the opens before switching to it).
    pub fn stream_of(&self, order: &Order, epoch: u64) -> Vec<MaybeFile> {
        self.stream_while(order, epoch, &|| true)
            .expect("a stream always wanted is always computed")
    }

    /// [`stream_of`](Self::stream_of), None once `wanted` says no.
    fn stream_while(
        &self,
        order: &Order,
        epoch: u64,
        wanted: &dyn Fn() -> bool,
    ) -> Option<Vec<MaybeFile>> {
        if order.sampler.kind == SamplerKind::Feed {
            let mut files = self.feed.node_stream(epoch);
            files.truncate(self.epoch_len() as usize);
            return Some(files);
        }
        // validate() ran in new(); what can still fail is per epoch (torch refuses a seed +
        // epoch above 2^64): that epoch is then not predicted, and the log says why.
        let indices = order
            .sampler
            .node_order_while(order.layout.len() as u64, epoch, &order.ranks, wanted)
            .unwrap_or_else(|e| {
                log::error!(
                    "cannot predict epoch {epoch}: {e}; its files are cached as they are read"
                );
                Some(Vec::new())
            })?;
        Some(
            indices
                .into_iter()
                .map(|i| MaybeFile::new(order.layout.file_of(i)))
                .collect(),
        )
    }

    /// The files `epoch` reads, in order, leaving out samples that cannot be served.
    pub fn files(&self, epoch: u64) -> Vec<FileId> {
        self.stream(epoch).iter().filter_map(|f| f.get()).collect()
    }

    fn compute(&self, epoch: u64, wanted: &dyn Fn() -> bool) -> Option<EpochPlan> {
        let started = std::time::Instant::now();
        // Read before the stream: an announcement or a new order racing with this makes the
        // plan stale.
        let generation = self.generation.load(Ordering::SeqCst);
        let version = self.feed.version_of(epoch);
        let len = self.epoch_len();
        let Some(stream) = self.stream_while(&self.order(), epoch, wanted) else {
            log::info!("gave up planning epoch {epoch}: it is no longer wanted");
            return None;
        };
        let mut plan = EpochPlan::build(epoch, (version, len), stream, self.id_space);
        plan.generation = generation;
        log::debug!(
            "planned epoch {epoch}: {} positions in {:.1?}",
            plan.len(),
            started.elapsed()
        );
        Some(plan)
    }

    /// Converts a global position to (epoch, offset).
    pub fn split(&self, pos: Position) -> (u64, u64) {
        let len = self.epoch_len().max(1);
        (pos / len, pos % len)
    }

    pub fn join(&self, epoch: u64, offset: u64) -> Position {
        epoch
            .saturating_mul(self.epoch_len())
            .saturating_add(offset)
    }

    /// File at a global position if its epoch is planned already: `None` if it is not,
    /// `Some(None)` if the sample there cannot be served.
    pub fn planned_file_at(&self, pos: Position) -> Option<Option<FileId>> {
        let (e, o) = self.split(pos);
        self.planned(e).map(|plan| plan.file_at(o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::order::SamplerKind;

    /// A torch-random plan over `n` files whose ids equal their sample indices.
    fn plan(n: u32) -> Plan {
        let layout = Arc::new(Layout::identity(n));
        Plan::new(
            SamplerConfig::new(SamplerKind::TorchRandom),
            vec![0],
            layout,
            n as usize,
        )
        .unwrap()
    }

    /// Positions of the epoch and the next must fit in 64 bits (the spin of `--epoch
    /// 18446744073709551614` came from positions that saturated).
    #[test]
    fn epochs_whose_positions_overflow_are_refused() {
        let p = plan(10);
        assert!(p.check_epoch_reachable(37).is_ok());
        for epoch in [u64::MAX / 10 - 1, u64::MAX - 1, u64::MAX] {
            assert!(
                matches!(
                    p.check_epoch_reachable(epoch),
                    Err(OrderError::EpochTooLarge { .. })
                ),
                "{epoch}"
            );
        }
    }

    #[test]
    fn forget_before_keeps_the_current_epoch_and_later() {
        let p = plan(50);
        p.epoch(1);
        p.forget_before(1);
        assert!(p.planned(0).is_none());
        assert!(p.planned(1).is_some());
        // A forgotten epoch is recomputed on demand, identically.
        assert_eq!(p.epoch(0).stream, p.stream(0));
    }

    #[test]
    fn a_plan_no_longer_wanted_is_given_up_and_nothing_is_kept() {
        let layout = Arc::new(Layout::identity(1000));
        let numpy = SamplerConfig::new(SamplerKind::NumpyLegacy);
        let p = Plan::new(numpy, vec![0], layout, 1000).unwrap();
        assert!(p.epoch_while(100_000, &|| false).is_none());
        assert!(p.planned(100_000).is_none());
        assert_eq!(p.epoch(3).stream, p.stream(3));
    }

    #[test]
    fn concurrent_requests_for_an_epoch_share_one_computation() {
        // Large enough that both threads ask while the first is still computing.
        let p = plan(2_000_000);
        let barrier = std::sync::Barrier::new(2);
        let (a, b) = std::thread::scope(|s| {
            let ask = || {
                barrier.wait();
                p.epoch(5)
            };
            let a = s.spawn(ask);
            let b = s.spawn(ask);
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(Arc::ptr_eq(&a, &b), "epoch 5 was computed twice");
    }
}
