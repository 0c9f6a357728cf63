//! The shell's side of peers (see [`crate::peers`]): serving what this node holds, staging a
//! file from the node that read it the epoch before, and telling the core which copies the
//! other nodes will fetch from this one so eviction keeps them.
//!
//! Who read what is the [`Placement`] of the prediction's order, computed per epoch off the
//! core's lock and kept for the last few epochs. An order peers cannot place (not a
//! DistributedSampler, ranks not in per-node blocks) is said once in the log, and the node
//! stages from SOURCE only, as without `--peers`.

use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use super::Inner;
use super::core::{FileState, Job};
use super::source::{self, SourceError};
use crate::cache::CopyError;
use crate::catalog::Attributes;
use crate::peers::{Expected, Fallback, FetchError, Held, Holder, Peers, Placement, Readers};
use crate::plan::{Generation, NEVER, Order};

/// Epochs whose readers are kept: the one before the reader's (who holds its files), its own
/// and the next (what the peers will fetch).
const READERS_KEPT: usize = 3;

/// Peers as the stager uses them.
pub(super) struct Peering {
    pub peers: Arc<Peers>,
    placed: Mutex<Placed>,
}

/// The placement of the order predicted now, and the readers of recent epochs under it.
#[derive(Default)]
struct Placed {
    order: Option<Arc<Order>>,
    placement: Option<Arc<Placement>>,
    readers: Vec<Arc<Readers>>,
    /// The (generation, epoch) whose needs the core was told: once, so a need met (the peer
    /// fetched the file) is not pinned again when the epoch is planned again.
    told: Vec<(u64, u64)>,
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

    /// The placement of `generation`'s order, made when the order changes; `None` (said once
    /// per order) if peers cannot place it.
    fn placement(&self, generation: &Generation) -> Option<Arc<Placement>> {
        let order = generation.order()?;
        let mut placed = self.placed.lock();
        if !placed.order.as_ref().is_some_and(|o| Arc::ptr_eq(o, order)) {
            let settings = self.peers.settings();
            let placement = Placement::new(order, settings.addrs.len(), settings.node);
            if let Err(e) = &placement {
                log::warn!("peers: {e}; this node stages from the source only");
            }
            *placed = Placed {
                order: Some(order.clone()),
                placement: placement.ok().map(Arc::new),
                readers: Vec::new(),
                told: Vec::new(),
            };
        }
        placed.placement.clone()
    }

    /// Whether the needs of (`generation`, `epoch`) are to be told now: the first time only.
    fn first_told(&self, generation: u64, epoch: u64) -> bool {
        let mut placed = self.placed.lock();
        if placed.told.contains(&(generation, epoch)) {
            return false;
        }
        if placed.told.len() >= READERS_KEPT {
            placed.told.remove(0);
        }
        placed.told.push((generation, epoch));
        true
    }

    /// Who reads what in `epoch` under `generation`'s order, computed on first use.
    fn readers(
        &self,
        generation: &Generation,
        epoch: u64,
        id_space: usize,
    ) -> Option<Arc<Readers>> {
        let placement = self.placement(generation)?;
        if let Some(r) = self.placed.lock().readers.iter().find(|r| r.epoch == epoch) {
            return Some(r.clone());
        }
        // Computed off the lock: an epoch of a large dataset takes a moment.
        let readers = Arc::new(placement.readers(epoch, id_space));
        let mut placed = self.placed.lock();
        if placed
            .placement
            .as_ref()
            .is_some_and(|p| Arc::ptr_eq(p, &placement))
        {
            placed.readers.retain(|r| r.epoch != epoch);
            if placed.readers.len() >= READERS_KEPT {
                let oldest = (placed.readers.iter().enumerate())
                    .min_by_key(|(_, r)| r.epoch)
                    .map(|(i, _)| i)
                    .unwrap_or(0);
                placed.readers.remove(oldest);
            }
            placed.readers.push(readers.clone());
        }
        Some(readers)
    }
}

impl Inner {
    /// After `epochs` of `generation` were planned: tells the core what the other nodes will
    /// fetch from this one in each of them.
    pub(super) fn plan_peers(self: &Arc<Self>, generation: &Generation, epochs: &[u64]) {
        let Some(peering) = &self.peering else {
            return;
        };
        let Some(placement) = peering.placement(generation) else {
            return;
        };
        let id_space = self.catalog.len();
        for &epoch in epochs.iter().filter(|&&e| e > 0) {
            if !peering.first_told(generation.id, epoch) {
                continue;
            }
            let (Some(held), Some(next)) = (
                peering.readers(generation, epoch - 1, id_space),
                peering.readers(generation, epoch, id_space),
            ) else {
                return;
            };
            let needs = (placement.needs(&held, &next).into_iter())
                .map(|(file, offset)| (file, generation.join(epoch, offset)))
                .collect();
            self.core.lock().peers_need(generation.id, needs);
        }
    }

    /// The node that read `job`'s file the epoch before the one it is staged for, if another
    /// node than this one.
    fn holder_of(&self, peering: &Peering, job: Job) -> Option<usize> {
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
        let held = peering.readers(&generation, previous, self.catalog.len())?;
        let placement = peering.placement(&generation)?;
        placement.holder(&held, job.file)
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
        let node = self.holder_of(peering, job)?;
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
        match self.fetch_into_cache(peering, node, job, &relative, &attributes) {
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

    fn fetch_into_cache(
        &self,
        peering: &Peering,
        node: usize,
        job: Job,
        relative: &Path,
        attributes: &Attributes,
    ) -> Result<u64, PeerCopyError> {
        let expected = Expected {
            size: attributes.size,
            identity: attributes.identity,
        };
        self.cache
            .stage_with(&self.catalog, job.file, attributes, |out| {
                (peering.peers.fetch(node, relative, &expected, out)).map_err(PeerCopyError::Fetch)
            })
    }
}

impl Holder for Inner {
    fn held(&self, relative: &Path) -> Held {
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
        let (state, next) = {
            let core = self.core.lock();
            (core.file_state(file), core.tracker().next_use(file))
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
            FileState::Remote if next != NEVER => Held::Later,
            FileState::Remote => Held::Gone,
        }
    }
}
