//! The shell's side of peers (see [`crate::peers`]): serving what this node holds, staging a
//! file from the node that read it the epoch before, and telling the core which copies the
//! other nodes will fetch from this one so eviction keeps them.
//!
//! Who read what ([`Readers`]) is computed per epoch off the core's lock from the job's whole
//! order: the prediction's sampler with every rank ([`Placement`]), or the epoch as the job's
//! hook announced it whole ([`crate::plan::World`]); the last few epochs are kept. An order
//! peers cannot place (not a DistributedSampler, ranks not in per-node blocks, a fed epoch
//! announced only rank by rank) is said once in the log, and the node stages its files from
//! SOURCE, as without `--peers`.

use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use super::Inner;
use super::core::{FileState, Job};
use super::source::{self, SourceError};
use crate::cache::CopyError;
use crate::catalog::Attributes;
use crate::peers::{
    Expected, Fallback, FetchError, Held, Holder, Peers, Placement, Readers, Split,
};
use crate::plan::{EpochPlan, Generation, NEVER, Plan, Prediction, TrackerMode, World};

/// Epochs whose readers are kept: the one before the reader's (who holds its files), its own
/// and the next (what the peers will fetch).
const READERS_KEPT: usize = 3;

/// Peers as the stager uses them.
pub(super) struct Peering {
    pub peers: Arc<Peers>,
    placed: Mutex<Placed>,
}

/// What is known of the current generation's placement.
#[derive(Default)]
struct Placed {
    /// The generation (none before the first).
    generation: Option<u64>,
    /// A computed order's placement (none for an announced one, or one peers cannot place).
    placement: Option<Arc<Placement>>,
    /// Why this generation's order cannot be placed was said in the log.
    said: bool,
    /// Readers of recent epochs.
    readers: Vec<Arc<Readers>>,
    /// The epochs whose needs the core was told, with the version of the epoch's readers:
    /// once, so a need met (the peer fetched the file) is not pinned again when the epoch is
    /// planned again; again if the job announced the epoch whole anew.
    told: Vec<(u64, u64)>,
}

/// Where an epoch's readers come from: the prediction's order with every rank, or the epoch
/// as the job announced it whole.
enum Whole {
    Computed(Arc<Placement>),
    Announced(Arc<World>, Split),
}

/// A copy from a peer that did not come, as the cache sees it.
enum PeerCopyError {
    Fetch(FetchError),
    Cache(CopyError),
}

impl From<CopyError> for PeerCopyError {
    fn from(e: CopyError) -> Self {
        PeerCopyError::Cache(e)
    }
}

impl Peering {
    pub fn new(peers: Arc<Peers>) -> Peering {
        Peering {
            peers,
            placed: Mutex::new(Placed::default()),
        }
    }

    /// `placed` made `generation`'s if it is newer: its placement computed (if an order's)
    /// and what was known of the one before dropped. `false` for an older generation (a
    /// caller still holding it): nothing of it is computed or kept.
    fn renew(&self, placed: &mut Placed, generation: &Generation) -> bool {
        match placed.generation {
            Some(id) if id == generation.id => return true,
            Some(id) if id > generation.id => return false,
            _ => {}
        }
        *placed = Placed {
            generation: Some(generation.id),
            ..Placed::default()
        };
        if let Some(order) = generation.order() {
            let settings = self.peers.settings();
            match Placement::new(order, settings.addrs.len(), settings.node) {
                Ok(placement) => placed.placement = Some(Arc::new(placement)),
                Err(e) => self.say_once(placed, &e),
            }
        }
        true
    }

    fn say_once(&self, placed: &mut Placed, why: &dyn std::fmt::Display) {
        if !std::mem::replace(&mut placed.said, true) {
            log::warn!("peers: {why}; this node stages from the source only");
        }
    }

    /// Whether the needs of `next`'s epoch under `generation` are to be told now: the first
    /// time for its version only.
    fn first_told(&self, generation: &Generation, next: &Readers) -> bool {
        let mut placed = self.placed.lock();
        let key = (next.epoch, next.version);
        if !self.renew(&mut placed, generation) || placed.told.contains(&key) {
            return false;
        }
        placed.told.retain(|&(epoch, _)| epoch != next.epoch);
        if placed.told.len() >= READERS_KEPT {
            placed.told.remove(0);
        }
        placed.told.push(key);
        true
    }

    /// Who reads what in `epoch` under `generation`, computed on first use; none if its
    /// whole order is not known.
    fn readers(
        &self,
        plan: &Plan,
        generation: &Generation,
        epoch: u64,
        id_space: usize,
    ) -> Option<Arc<Readers>> {
        let whole = {
            let mut placed = self.placed.lock();
            if !self.renew(&mut placed, generation) {
                return None;
            }
            match &generation.prediction {
                Prediction::Configured(_) | Prediction::Detected(_) => {
                    Whole::Computed(placed.placement.clone()?)
                }
                Prediction::Announced(Some(_)) => {
                    let (world, split) = self.announced(&mut placed, plan, epoch)?;
                    Whole::Announced(world, split)
                }
                _ => return None,
            }
        };
        let version = match &whole {
            Whole::Computed(_) => 0,
            Whole::Announced(world, _) => world.version,
        };
        let cached = |placed: &Placed| {
            (placed.readers.iter())
                .find(|r| (r.epoch, r.version) == (epoch, version))
                .cloned()
        };
        if let Some(r) = cached(&self.placed.lock()) {
            return Some(r);
        }
        // Computed off the lock: an epoch of a large dataset takes a moment.
        let readers = Arc::new(match &whole {
            Whole::Computed(placement) => placement.readers(epoch, id_space),
            Whole::Announced(world, split) => {
                split.readers((epoch, version), &world.files, id_space)
            }
        });
        let mut placed = self.placed.lock();
        if placed.generation != Some(generation.id) {
            return Some(readers);
        }
        if let Some(r) = cached(&placed) {
            return Some(r);
        }
        placed.readers.retain(|r| r.epoch != epoch);
        if placed.readers.len() >= READERS_KEPT {
            let oldest = (placed.readers.iter().enumerate())
                .min_by_key(|(_, r)| r.epoch)
                .map(|(i, _)| i)
                .unwrap_or(0);
            placed.readers.remove(oldest);
        }
        placed.readers.push(readers.clone());
        Some(readers)
    }

    /// The whole of announced `epoch` and its split over the nodes, if the job announced it
    /// and it can be placed (said once if not).
    fn announced(
        &self,
        placed: &mut Placed,
        plan: &Plan,
        epoch: u64,
    ) -> Option<(Arc<World>, Split)> {
        let world = plan.world(epoch)?;
        let settings = self.peers.settings();
        let ranks = plan.fed_ranks(epoch);
        let split = Split::new(world.size, &ranks, settings.addrs.len(), settings.node);
        match split {
            Ok(split) => Some((world, split)),
            Err(e) => {
                self.say_once(placed, &e);
                None
            }
        }
    }
}

impl Inner {
    /// After `epochs` of `generation` were planned (or announced whole): tells the core what
    /// the other nodes will fetch from this one in each of them.
    pub(super) fn plan_peers(self: &Arc<Self>, generation: &Generation, epochs: &[u64]) {
        let Some(peering) = &self.peering else {
            return;
        };
        let id_space = self.catalog.len();
        for &epoch in epochs.iter().filter(|&&e| e > 0) {
            let (Some(held), Some(next)) = (
                peering.readers(&self.plan, generation, epoch - 1, id_space),
                peering.readers(&self.plan, generation, epoch, id_space),
            ) else {
                continue;
            };
            if !peering.first_told(generation, &next) {
                continue;
            }
            let needs = (held.needs(&next).into_iter())
                .map(|(file, offset)| (file, generation.join(epoch, offset)))
                .collect();
            self.core.lock().peers_need(generation.id, needs);
        }
    }

    /// The node that read `job`'s file the epoch before the one it is staged for, if another
    /// node than this one, and that epoch.
    fn holder_of(&self, peering: &Peering, job: Job) -> Option<(usize, u64)> {
        let (generation, epoch) = {
            let core = self.core.lock();
            let generation = core.generation().clone();
            let epoch = match job.position {
                Some(pos) => generation.split(pos).0,
                None => core.tracker().epoch_position().0,
            };
            (generation, epoch)
        };
        let previous = epoch.checked_sub(1)?;
        let held = peering.readers(&self.plan, &generation, previous, self.catalog.len())?;
        Some((held.holder(job.file)?, previous))
    }

    /// Stages `job`'s file from the peer that holds it, if one does: `None` to read it from
    /// SOURCE (no holder, or the peer could not give it: counted by cause), else the outcome
    /// (a copy, a cache error, or put off until the holder has it).
    pub(super) fn copy_from_peer(
        self: &Arc<Self>,
        job: Job,
        has_room: &mut bool,
    ) -> Option<Result<u64, CopyError>> {
        let peering = self.peering.as_ref()?;
        let (node, epoch) = self.holder_of(peering, job)?;
        let relative = self.catalog.relative_path(job.file);
        if !peering.peers.is_up(node) {
            return self.not_now(peering, job, node, &relative, Fallback::Unreachable);
        }
        // What the copy must be: the catalog's version of the file (one lstat if the mount
        // has not seen it yet, still no read of SOURCE).
        let attributes = match source::attributes(&*self.source, &self.catalog, job.file) {
            Ok(a) => a,
            Err(SourceError::Io { .. }) => return None,
            Err(SourceError::Changed { path, error, .. }) => {
                return Some(Err(match error {
                    super::OpenError::Gone => CopyError::SourceGone(path),
                    _ => CopyError::SourceChanged(path),
                }));
            }
        };
        if !*has_room && !self.admit(job, attributes.size) {
            return Some(Err(CopyError::NoRoom));
        }
        *has_room = true;
        let asked = (node, relative.as_path(), epoch);
        match self.fetch_into_cache(peering, asked, job, &attributes) {
            Ok(bytes) => Some(Ok(bytes)),
            Err(PeerCopyError::Cache(e)) => Some(Err(e)),
            Err(PeerCopyError::Fetch(FetchError::Sink(e))) => Some(Err(CopyError::Cache(e))),
            Err(PeerCopyError::Fetch(FetchError::Later)) => {
                self.not_now(peering, job, node, &relative, Fallback::Later)
            }
            Err(PeerCopyError::Fetch(FetchError::Failed(
                why @ (Fallback::Timeout | Fallback::Unreachable),
            ))) => self.not_now(peering, job, node, &relative, why),
            Err(PeerCopyError::Fetch(FetchError::Failed(why))) => {
                peering.peers.fell_back(why, node, &relative);
                None
            }
        }
    }

    /// The holder cannot give `job`'s file now (`why`: it has not read it yet, or does not
    /// answer: not started yet, stopped, gone): put off if the reader is far enough from it
    /// that the frontier will be back in time, else read from SOURCE.
    fn not_now(
        &self,
        peering: &Peering,
        job: Job,
        node: usize,
        relative: &Path,
        why: Fallback,
    ) -> Option<Result<u64, CopyError>> {
        if self.core.lock().may_wait_for_peer(job) {
            return Some(Err(CopyError::Deferred));
        }
        peering.peers.fell_back(why, node, relative);
        None
    }

    /// Stages `job`'s file from `node`, which reads it (at `relative`) in `epoch`.
    fn fetch_into_cache(
        &self,
        peering: &Peering,
        (node, relative, epoch): (usize, &Path, u64),
        job: Job,
        attributes: &Attributes,
    ) -> Result<u64, PeerCopyError> {
        let expected = Expected {
            size: attributes.size,
            identity: attributes.identity,
        };
        self.cache
            .stage_with(&self.catalog, job.file, attributes, |out| {
                (peering.peers.fetch(node, (relative, epoch), &expected, out))
                    .map_err(PeerCopyError::Fetch)
            })
    }
}

impl Holder for Inner {
    fn held(&self, relative: &Path, epoch: u64) -> Held {
        let Some(file) = self.catalog.lookup_path(relative) else {
            return Held::Unknown;
        };
        if !self
            .catalog
            .entry(file)
            .is_some_and(|e| e.kind == crate::catalog::Kind::File)
        {
            return Held::Unknown;
        }
        let (state, unplanned) = {
            let core = self.core.lock();
            let tracker = core.tracker();
            let state = core.file_state(file);
            // Where the reader is matters only for a file it does not hold nor plan to.
            let unplanned =
                (state == FileState::Remote && tracker.next_use(file) == NEVER).then(|| Reader {
                    generation: tracker.generation().clone(),
                    epoch: tracker.epoch_position().0,
                    mode: tracker.mode(),
                    plan: tracker.planned(epoch).cloned(),
                });
            (state, unplanned)
        };
        match state {
            FileState::Cached => match self.cache.open_for_peer(&self.catalog, file) {
                Ok((copy, size, sum, identity)) => {
                    self.core.lock().peer_fetched(file);
                    Held::Copy {
                        file: copy,
                        size,
                        sum,
                        identity,
                    }
                }
                Err(_) => Held::Gone,
            },
            FileState::Staging | FileState::Queued => Held::Later,
            FileState::Remote => match unplanned {
                Some(reader) if self.knows_whole_share(&reader, relative, epoch) => Held::Gone,
                _ => Held::Later,
            },
        }
    }
}

/// Where this node's reader is, as a peer asking for a file needs it.
struct Reader {
    generation: Arc<Generation>,
    epoch: u64,
    mode: TrackerMode,
    /// The plan of the epoch asked about the tracker follows, if it has one.
    plan: Option<Arc<EpochPlan>>,
}

impl Inner {
    /// Whether this node knows all it will read of `epoch` of the stream the file at
    /// `relative` belongs to, so that a file it neither holds nor will read soon is one it
    /// will not have: it follows that stream (for an announced order, the file is under the
    /// followed loader's dataset root), and its reader has left the epoch or follows a
    /// current plan of it made from an order known whole (every local rank announced it).
    /// A node whose job has not started (no announcement yet), still reads another loader
    /// (Lightning's validation sanity check), or has not announced or planned that epoch
    /// yet, does not know: the asking node waits for it rather than read SOURCE. One that
    /// follows no order (lost, or none to follow) knows all it ever will.
    fn knows_whole_share(&self, reader: &Reader, relative: &Path, epoch: u64) -> bool {
        // Epochs are counted per loader: another loader's say nothing of this one's.
        let follows_file = match &reader.generation.prediction {
            Prediction::Announced(None) => false,
            Prediction::Announced(Some(stream)) => {
                stream.name == "." || relative.starts_with(&stream.name)
            }
            _ => true,
        };
        if !follows_file {
            return false;
        }
        if reader.epoch > epoch {
            return true;
        }
        match reader.mode {
            TrackerMode::Lost | TrackerMode::OnDemand => true,
            TrackerMode::Predicting => {
                (reader.plan.as_ref()).is_some_and(|p| self.plan.is_current(&reader.generation, p))
                    && self.plan.all_ranks_announced(epoch)
            }
        }
    }
}
