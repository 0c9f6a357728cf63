//! The node's predicted stream: which file is read at each position of each epoch.
//!
//! A sampler gives sample indices per rank; a node serves several local ranks whose streams
//! interleave, and the layout turns indices into files. This module composes the three into
//! one stream of file ids per epoch ([`EpochPlan`]) and indexes it backwards (file → its
//! positions) so the engine can ask "when is this file next needed?", the question Belady
//! eviction runs on; and it follows where the reader is in it ([`Tracker`]).
//!
//! What is predicted is a [`Generation`], immutable and replaced whole (see its module). [`Plan`]
//! is the mount's side of it, shared by the threads that change or compute with the prediction:
//! the current generation, the job's announcements ([`Feed`]), and the epoch plans computed so
//! far. Epochs are computed on demand and only a few are kept: the run is never materialised.
//! Computing one takes long at scale (up to seconds for 14 M samples), so it is done off the
//! engine's lock, single-flight, and the engine core is handed the plans: it never calls into
//! this type, and no caller has to hold any lock of the engine's while using it.

mod epoch;
mod feed;
mod generation;
mod tracker;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::catalog::{FileId, Layout, MaybeFile};
use crate::order::{OrderError, SamplerConfig, SamplerKind};

pub use epoch::EpochPlan;
pub use feed::{Feed, FeedError, StreamKey, World};
pub use generation::{Generation, Order, Prediction};
pub use tracker::{
    DEFAULT_WINDOW, OpenMatch, Run, Tracker, TrackerMode, TrackerSettings, densest_run,
    find_position, reach,
};

/// A position in the run: `epoch * epoch_len + offset`. Global positions make "next use"
/// comparable across the epoch boundary.
pub type Position = u64;

/// "Not needed again within the horizon we know": evicted first.
pub const NEVER: Position = Position::MAX;

/// Longest fed epoch planned, in positions (all ranks of the node): 2^28, ten times the
/// largest public image dataset, and 3 GB of plans. An announcement beyond it is staged only
/// that far (the positions of an epoch plan are u32 offsets in any case).
const MAX_FED_EPOCH_LEN: u64 = 1 << 28;

/// Largest epoch a job may announce: positions up to the end of the epoch after it fit in 64
/// bits at the longest fed epoch (else the tracker would walk ~2^64 positions to reach it).
pub const MAX_FED_EPOCH: u64 = u64::MAX / MAX_FED_EPOCH_LEN - 2;

/// Epoch plans kept: the reader's epoch and the next one, which is all the engine looks at
/// (12 bytes per sample each, so this bounds the plans' memory).
const CACHED_EPOCHS: usize = 2;

/// An order and its first epoch's plan, computed off every lock and ready for
/// [`Plan::adopt`].
pub struct Prepared {
    order: Arc<Order>,
    stream: Vec<MaybeFile>,
    epoch: u64,
}

impl Prepared {
    /// The node stream of the prepared epoch.
    pub fn stream(&self) -> &[MaybeFile] {
        &self.stream
    }
}

/// What an announcement changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FedChange {
    /// Planned as it was (or the prediction does not follow announcements).
    Nothing,
    /// The epoch length or the lanes grew to fit it: a new generation, every position moved.
    Grown,
    /// The job's training loader announced for the first time: a new generation that
    /// follows its stream, and what another loader announced before is dropped.
    Switched,
    /// Another loader's (validation): not planned.
    Other,
}

/// Epoch plans in memory, and the epochs some thread is computing right now.
#[derive(Default)]
struct Epochs {
    recent: Vec<Arc<EpochPlan>>,
    building: Vec<(u64, u64)>,
}

/// The mount's prediction, shared (see the module's note).
pub struct Plan {
    /// What the mount was told (`--sampler`, auto, feed and none included), and its ranks.
    configured: SamplerConfig,
    configured_ranks: Vec<u32>,
    current: RwLock<Arc<Generation>>,
    last_id: AtomicU64,
    /// What the job announced (followed while the prediction is [`Prediction::Announced`]).
    feed: Feed,
    epochs: Mutex<Epochs>,
    /// Signalled when an epoch finishes building.
    built: Condvar,
    /// Number of catalog entries (file ids are below this).
    id_space: usize,
}

impl Plan {
    /// The mount's prediction: `sampler` for `ranks` over `layout` (nothing yet for auto,
    /// feed and none).
    pub fn new(
        sampler: SamplerConfig,
        ranks: Vec<u32>,
        layout: Arc<Layout>,
        id_space: usize,
    ) -> Result<Plan, OrderError> {
        sampler.validate(layout.len() as u64, &ranks)?;
        let prediction = match sampler.kind {
            SamplerKind::Auto | SamplerKind::None => Prediction::Unknown,
            SamplerKind::Feed => Prediction::Announced(None),
            _ => Prediction::Configured(Arc::new(Order {
                sampler: sampler.clone(),
                ranks: ranks.clone(),
                layout: layout.clone(),
            })),
        };
        let (epoch_len, lanes) = match &prediction {
            // Samplers that give every rank the same order yield one stream per node, the
            // distributed one a merge of the local ranks: the first epoch says how long.
            Prediction::Configured(order) => (order.stream(0).len() as u64, order.lanes()),
            _ => (0, 1),
        };
        Ok(Plan {
            configured: sampler,
            configured_ranks: ranks,
            current: RwLock::new(Arc::new(Generation {
                id: 0,
                prediction,
                layout,
                epoch_len,
                lanes,
            })),
            last_id: AtomicU64::new(0),
            feed: Feed::default(),
            epochs: Mutex::new(Epochs::default()),
            built: Condvar::new(),
            id_space,
        })
    }

    /// The prediction in force.
    pub fn generation(&self) -> Arc<Generation> {
        self.current.read().clone()
    }

    /// What the mount was told (`--sampler` and its settings).
    pub fn configured(&self) -> &SamplerConfig {
        &self.configured
    }

    /// The ranks the mount was told it serves (`--rank`/`--ranks`).
    pub fn configured_ranks(&self) -> &[u32] {
        &self.configured_ranks
    }

    /// Whether the prediction follows the job's announcements.
    pub fn is_fed(&self) -> bool {
        self.generation().is_announced()
    }

    /// Makes `prediction` (over `layout`, `epoch_len` positions in `lanes`) the one in force.
    fn replace(
        &self,
        prediction: Prediction,
        layout: Arc<Layout>,
        (epoch_len, lanes): (u64, usize),
    ) -> Arc<Generation> {
        let generation = Arc::new(Generation {
            id: self.last_id.fetch_add(1, Ordering::SeqCst) + 1,
            prediction,
            layout,
            epoch_len,
            lanes,
        });
        *self.current.write() = generation.clone();
        let mut epochs = self.epochs.lock();
        epochs.recent.clear();
        generation
    }

    /// Computes, off any lock, what [`adopt`](Self::adopt) switches to: `order` and its
    /// stream of `epoch`.
    pub fn prepare(&self, order: Order, epoch: u64) -> Result<Prepared, OrderError> {
        order.check(epoch)?;
        let stream = order.stream(epoch);
        if stream.is_empty() {
            return Err(OrderError::EmptyDataset);
        }
        Ok(Prepared {
            order: Arc::new(order),
            stream,
            epoch,
        })
    }

    /// Makes a prepared order the prediction (`detected`: found by `--sampler auto`, else a
    /// variant of the configured one), unless the job announces its order meanwhile, which
    /// takes precedence (`None`). Returns the new generation and its plan of the prepared
    /// epoch.
    pub fn adopt(
        &self,
        prepared: Prepared,
        detected: bool,
    ) -> Option<(Arc<Generation>, Arc<EpochPlan>)> {
        if self.is_fed() {
            return None;
        }
        let Prepared {
            order,
            stream,
            epoch,
        } = prepared;
        let coordinates = (stream.len() as u64, order.lanes());
        let layout = order.layout.clone();
        let prediction = if detected {
            Prediction::Detected(order)
        } else {
            Prediction::Configured(order)
        };
        let generation = self.replace(prediction, layout, coordinates);
        let plan = Arc::new(EpochPlan::build(
            (epoch, generation.id, 0),
            stream,
            self.id_space,
        ));
        self.epochs.lock().recent.push(plan.clone());
        Some((generation, plan))
    }

    /// Follows the job's announcements from now on (a mount the feed hook talks to): nothing
    /// is predicted until the first one.
    pub fn follow_announcements(&self) -> Arc<Generation> {
        let layout = self.generation().layout.clone();
        self.replace(Prediction::Announced(None), layout, (0, 1))
    }

    /// Takes what `rank` announced it reads in `epoch` of `stream`, and says what changed
    /// ([`FedChange`]) and the generation in force after it.
    pub fn announce(
        &self,
        stream: &StreamKey,
        epoch: u64,
        rank: u32,
        files: Arc<[FileId]>,
    ) -> Result<(FedChange, Arc<Generation>), FeedError> {
        let current = self.generation();
        if !current.is_announced() {
            return Ok((FedChange::Nothing, current));
        }
        let (len, switched) = match self.feed.announce(stream, epoch, rank, files)? {
            feed::Taken::Other => return Ok((FedChange::Other, current)),
            feed::Taken::Followed { len, switched } => (len, switched),
        };
        let lanes = self.feed.lanes();
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
        let epoch_len = match switched {
            true => grown,
            false => grown.max(current.epoch_len),
        };
        // A rank's first announcement adds a lane: positions change rank, as when they grow.
        if !switched && epoch_len == current.epoch_len && lanes == current.lanes {
            return Ok((FedChange::Nothing, current));
        }
        let prediction = Prediction::Announced(Some(stream.clone()));
        let generation = self.replace(prediction, current.layout.clone(), (epoch_len, lanes));
        let change = if switched {
            FedChange::Switched
        } else {
            FedChange::Grown
        };
        Ok((change, generation))
    }

    /// Takes the whole of `epoch` of `stream` as the job announced it (see [`World`]): `false`
    /// if not kept (the prediction does not follow announcements, or `stream` is not the one
    /// followed).
    pub fn announce_world(
        &self,
        stream: &StreamKey,
        epoch: u64,
        size: u32,
        files: Arc<[MaybeFile]>,
    ) -> Result<bool, FeedError> {
        if !self.is_fed() {
            return Ok(false);
        }
        self.feed.announce_world(stream, epoch, size, files)
    }

    /// The stream whose announcements are followed (none unless fed, or before the first).
    pub fn followed(&self) -> Option<StreamKey> {
        self.is_fed().then(|| self.feed.followed()).flatten()
    }

    /// The whole of `epoch` as the job announced it (none unless fed).
    pub fn world(&self, epoch: u64) -> Option<Arc<World>> {
        self.is_fed().then(|| self.feed.world(epoch)).flatten()
    }

    /// Ranks that announced `epoch` (none unless fed).
    pub fn fed_ranks(&self, epoch: u64) -> Vec<u32> {
        if self.is_fed() {
            self.feed.ranks(epoch)
        } else {
            Vec::new()
        }
    }

    /// Whether every rank of this node announced `epoch` (always, unless fed).
    pub fn all_ranks_announced(&self, epoch: u64) -> bool {
        !self.is_fed() || self.feed.ranks(epoch).len() >= self.feed.lanes()
    }

    /// Files the job announced for `epoch` of the followed stream (all ranks).
    pub fn announced_len(&self, epoch: u64) -> u64 {
        self.feed.announced_len(epoch)
    }

    /// Refuses an epoch whose positions do not fit in 64 bits, and one that would take
    /// minutes of replaying to plan.
    pub fn check_epoch_reachable(&self, epoch: u64) -> Result<(), OrderError> {
        let current = self.generation();
        // The engine plans `epoch` and the next one: positions up to the end of epoch + 1 must
        // not saturate in `join`, or `split` reads them back as another epoch and the tracker
        // walks ~2^64 positions to catch up.
        if epoch
            .checked_add(2)
            .and_then(|e| e.checked_mul(current.epoch_len))
            .is_none()
        {
            return Err(OrderError::EpochTooLarge {
                epoch,
                epoch_len: current.epoch_len,
            });
        }
        match current.order() {
            Some(order) => order.check(epoch),
            None => Ok(()),
        }
    }

    /// The plan of `epoch` under `generation`, computed on first use (or when a newer
    /// announcement made it stale) and kept among the last few. Single-flight: a caller asking
    /// for an epoch another thread is computing waits for that result.
    pub fn epoch(&self, generation: &Generation, epoch: u64) -> Arc<EpochPlan> {
        self.epoch_while(generation, epoch, &|| true)
            .expect("a plan always wanted is always computed")
    }

    /// [`epoch`](Self::epoch), given up (`None`, nothing kept) as soon as `wanted` says it is
    /// no longer wanted: reaching a far epoch may replay minutes of random draws, which must
    /// stop when whoever asked for it goes away.
    pub fn epoch_while(
        &self,
        generation: &Generation,
        epoch: u64,
        wanted: &dyn Fn() -> bool,
    ) -> Option<Arc<EpochPlan>> {
        let key = (generation.id, epoch);
        let mut epochs = self.epochs.lock();
        loop {
            if let Some(p) = self.cached(&epochs, generation, epoch) {
                return Some(p);
            }
            if !epochs.building.contains(&key) {
                break;
            }
            self.built.wait(&mut epochs);
        }
        epochs.building.push(key);
        drop(epochs);
        let plan = self.compute(generation, epoch, wanted).map(Arc::new);
        let mut epochs = self.epochs.lock();
        epochs.building.retain(|&k| k != key);
        // Given up, or the prediction was replaced while this was computed: the caller gets
        // what it asked for, the plans in memory stay the new prediction's.
        if let Some(p) = &plan
            && generation.id == self.generation().id
        {
            epochs.recent.retain(|q| (q.generation, q.epoch) != key);
            if epochs.recent.len() >= CACHED_EPOCHS {
                epochs.recent.remove(0);
            }
            epochs.recent.push(p.clone());
        }
        drop(epochs);
        self.built.notify_all();
        plan
    }

    /// The plan of `epoch` under `generation` if it is in memory and current; never
    /// computes.
    pub fn planned(&self, generation: &Generation, epoch: u64) -> Option<Arc<EpochPlan>> {
        self.cached(&self.epochs.lock(), generation, epoch)
    }

    fn cached(
        &self,
        epochs: &Epochs,
        generation: &Generation,
        epoch: u64,
    ) -> Option<Arc<EpochPlan>> {
        let plan = epochs
            .recent
            .iter()
            .find(|p| (p.generation, p.epoch) == (generation.id, epoch))?;
        self.is_current(generation, plan).then(|| plan.clone())
    }

    /// Whether `plan`, of `generation`, is as its epoch is known now: an announcement since
    /// makes a fed plan stale.
    pub fn is_current(&self, generation: &Generation, plan: &EpochPlan) -> bool {
        plan.generation == generation.id
            && (!generation.is_announced() || plan.built_from >= self.feed.version_of(plan.epoch))
    }

    /// Drops the plans of epochs before `epoch` (the reader has left them), so that computing
    /// the next one does not hold three epochs in memory at once.
    pub fn forget_before(&self, epoch: u64) {
        self.epochs.lock().recent.retain(|p| p.epoch >= epoch);
    }

    /// The node stream of `epoch` under `generation`, without the inverse index (for
    /// searches, which look at many epochs once).
    pub fn stream(&self, generation: &Generation, epoch: u64) -> Vec<MaybeFile> {
        self.stream_while(generation, epoch, &|| true)
            .expect("a stream always wanted is always computed")
    }

    fn stream_while(
        &self,
        generation: &Generation,
        epoch: u64,
        wanted: &dyn Fn() -> bool,
    ) -> Option<Vec<MaybeFile>> {
        match generation.order() {
            Some(order) => order.stream_while(epoch, wanted),
            None if generation.is_announced() => {
                let mut files = self.feed.node_stream(epoch);
                files.truncate(generation.epoch_len as usize);
                Some(files)
            }
            None => Some(Vec::new()),
        }
    }

    fn compute(
        &self,
        generation: &Generation,
        epoch: u64,
        wanted: &dyn Fn() -> bool,
    ) -> Option<EpochPlan> {
        let started = std::time::Instant::now();
        // Read before the stream: an announcement racing with this makes the plan stale.
        let version = self.feed.version_of(epoch);
        let Some(stream) = self.stream_while(generation, epoch, wanted) else {
            log::info!("gave up planning epoch {epoch}: it is no longer wanted");
            return None;
        };
        let plan = EpochPlan::build((epoch, generation.id, version), stream, self.id_space);
        log::debug!(
            "planned epoch {epoch}: {} positions in {:.1?}",
            plan.len(),
            started.elapsed()
        );
        Some(plan)
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
        let g = p.generation();
        p.epoch(&g, 0);
        p.epoch(&g, 1);
        p.forget_before(1);
        assert!(p.planned(&g, 0).is_none());
        assert!(p.planned(&g, 1).is_some());
        // A forgotten epoch is recomputed on demand, identically.
        assert_eq!(
            p.epoch(&g, 0).files(),
            g.order()
                .unwrap()
                .stream(0)
                .iter()
                .filter_map(|f| f.get())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_plan_no_longer_wanted_is_given_up_and_nothing_is_kept() {
        let layout = Arc::new(Layout::identity(1000));
        let numpy = SamplerConfig::new(SamplerKind::NumpyLegacy);
        let p = Plan::new(numpy, vec![0], layout, 1000).unwrap();
        let g = p.generation();
        assert!(p.epoch_while(&g, 100_000, &|| false).is_none());
        assert!(p.planned(&g, 100_000).is_none());
    }

    /// A new generation replaces the plans of the old: a plan asked for under the old one is
    /// computed for it, and not kept.
    #[test]
    fn plans_belong_to_their_generation() {
        let p = plan(100);
        let old = p.generation();
        p.epoch(&old, 0);
        let mut numpy = SamplerConfig::new(SamplerKind::NumpyLegacy);
        numpy.seed = 3;
        let order = Order {
            sampler: numpy,
            ranks: vec![0],
            layout: old.layout.clone(),
        };
        let (new, plan0) = p.adopt(p.prepare(order, 0).unwrap(), true).unwrap();
        assert!(new.id > old.id && new.is_detected());
        assert!(p.planned(&old, 0).is_none());
        assert!(Arc::ptr_eq(&p.planned(&new, 0).unwrap(), &plan0));
        let stale = p.epoch(&old, 1);
        assert_eq!(stale.generation(), old.id);
        assert!(p.planned(&old, 1).is_none());
    }

    #[test]
    fn concurrent_requests_for_an_epoch_share_one_computation() {
        // Large enough that both threads ask while the first is still computing.
        let p = plan(2_000_000);
        let g = p.generation();
        let barrier = std::sync::Barrier::new(2);
        let (a, b) = std::thread::scope(|s| {
            let ask = || {
                barrier.wait();
                p.epoch(&g, 5)
            };
            let a = s.spawn(ask);
            let b = s.spawn(ask);
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(Arc::ptr_eq(&a, &b), "epoch 5 was computed twice");
    }
}
