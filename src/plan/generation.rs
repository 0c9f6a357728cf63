//! What is predicted, as one immutable value. A [`Generation`] says how the order is known
//! ([`Prediction`]: configured, detected, announced, or not at all), which dataset its indices
//! number, and the coordinates positions are in (the epoch length and the lanes). Finding the
//! order, switching to a variant of it, following the job's announcements or an announcement
//! that needs a longer epoch each make a new generation, which replaces the old one whole:
//! whoever holds a generation keeps using it consistently until handed the next one, so no
//! caller ever has to hold a lock while positions change meaning under it.

use std::sync::Arc;

use super::Position;
use super::feed::StreamKey;
use crate::catalog::{Layout, MaybeFile};
use crate::order::{OrderError, SamplerConfig, SamplerKind};

/// An order computed from a sampler: the sampler, the node's ranks, and the dataset whose
/// samples it orders.
pub struct Order {
    pub sampler: SamplerConfig,
    pub ranks: Vec<u32>,
    pub layout: Arc<Layout>,
}

impl Order {
    /// The flags that name this order on a mount's command line, from `epoch` on.
    pub fn flags(&self, epoch: u64) -> String {
        let flags = self.sampler.flags(&self.ranks, epoch);
        match self.layout.name() {
            "." => flags,
            dataset => format!("{flags} --dataset {dataset}"),
        }
    }

    /// The node's stream of `epoch`: its ranks' orders merged in lock-step, as files. None as
    /// soon as `wanted` says it is no longer wanted (a far epoch replays minutes of draws).
    /// An epoch that cannot be computed (torch refuses a seed + epoch above 2^64) is empty,
    /// and the log says why: its files are cached as they are read.
    pub fn stream_while(&self, epoch: u64, wanted: &dyn Fn() -> bool) -> Option<Vec<MaybeFile>> {
        let len = self.layout.len() as u64;
        let indices = (self.sampler)
            .node_order_while(len, epoch, &self.ranks, wanted)
            .unwrap_or_else(|e| {
                log::error!(
                    "cannot predict epoch {epoch}: {e}; its files are cached as they are read"
                );
                Some(Vec::new())
            })?;
        let files = indices
            .into_iter()
            .map(|i| MaybeFile::new(self.layout.file_of(i)));
        Some(files.collect())
    }

    /// [`stream_while`](Self::stream_while), always wanted.
    pub fn stream(&self, epoch: u64) -> Vec<MaybeFile> {
        self.stream_while(epoch, &|| true)
            .expect("a stream always wanted is always computed")
    }

    /// Lanes of its node stream: one per local rank of a DistributedSampler (each reads its
    /// own share), one for an order every rank reads whole (the node reads it once).
    pub fn lanes(&self) -> usize {
        if self.sampler.world_size > 1 && self.sampler.kind == SamplerKind::TorchDistributed {
            self.ranks.len().max(1)
        } else {
            1
        }
    }

    /// Refuses settings that cannot predict this dataset, and an `epoch` that would take
    /// minutes of replaying to plan.
    pub fn check(&self, epoch: u64) -> Result<(), OrderError> {
        let len = self.layout.len() as u64;
        self.sampler.validate(len, &self.ranks)?;
        self.sampler.check_epoch_reachable(len, epoch)
    }
}

/// How the order is known, and which it is.
#[derive(Clone)]
pub enum Prediction {
    /// Nothing is predicted: `--sampler none`, or `--sampler auto` until it finds the order
    /// (and for good once it gave up). Files are cached as they are read.
    Unknown,
    /// The job announces its order (`--sampler feed`, or a mount the hook talked to): the
    /// loader stream followed, none before the first announcement.
    Announced(Option<StreamKey>),
    /// The mount's flags.
    Configured(Arc<Order>),
    /// `--sampler auto` found it from the job's opens.
    Detected(Arc<Order>),
}

/// One prediction and its coordinates, immutable.
pub struct Generation {
    /// Counts generations: a plan computed for another one does not fit this one.
    pub id: u64,
    pub prediction: Prediction,
    /// The dataset sample indices number: the order's, else the mount's (what an announcement
    /// of indices goes through).
    pub layout: Arc<Layout>,
    /// Positions per epoch on this node, all lanes together (0: nothing to position).
    pub epoch_len: u64,
    /// Lanes of the node stream: position `p` of an epoch is lane `p % lanes`'s.
    pub lanes: usize,
}

impl Generation {
    /// Whether anything is predicted: an order with positions to follow.
    pub fn predicts(&self) -> bool {
        self.epoch_len > 0
            && matches!(
                self.prediction,
                Prediction::Configured(_)
                    | Prediction::Detected(_)
                    | Prediction::Announced(Some(_))
            )
    }

    /// The computed order, if the prediction is one.
    pub fn order(&self) -> Option<&Arc<Order>> {
        match &self.prediction {
            Prediction::Configured(o) | Prediction::Detected(o) => Some(o),
            _ => None,
        }
    }

    pub fn is_announced(&self) -> bool {
        matches!(self.prediction, Prediction::Announced(_))
    }

    pub fn is_detected(&self) -> bool {
        matches!(self.prediction, Prediction::Detected(_))
    }

    /// A global position as (epoch, offset).
    pub fn split(&self, pos: Position) -> (u64, u64) {
        let len = self.epoch_len.max(1);
        (pos / len, pos % len)
    }

    /// The global position of `offset` in `epoch`.
    pub fn join(&self, epoch: u64, offset: u64) -> Position {
        epoch.saturating_mul(self.epoch_len).saturating_add(offset)
    }

    /// The flags that name the prediction, from `epoch` on (empty without an order).
    pub fn flags(&self, epoch: u64) -> String {
        self.order().map_or_else(String::new, |o| o.flags(epoch))
    }
}
