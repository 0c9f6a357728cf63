//! Which cached copy to drop when a new one needs room: the [`Eviction`] policy, one file per
//! policy. The engine core tells the policy what it knows about each cached file (when it is
//! next needed, when it was last used, that it is gone) and asks it which copy may go for one
//! needed at a given position; it never looks at keys itself, so a new policy is one new file
//! and a line in [`EvictionKind`].
//!
//! - [`Belady`] (the default): stagefs knows the future, so the optimal offline policy is
//!   available online: the copy needed furthest ahead goes, and only for a file needed
//!   sooner than it.
//! - [`Lru`]: the least recently used copy goes, whatever the prediction says: the baseline a
//!   plain cache would be.

mod belady;
mod heap;
mod lru;

pub use belady::Belady;
pub use lru::Lru;

use crate::catalog::FileId;
use crate::plan::{NEVER, Position};

/// What the engine core asks of an eviction policy.
pub trait Eviction: Send {
    /// How many copies it holds.
    fn len(&self) -> usize;

    fn contains(&self, file: FileId) -> bool;

    /// A reader opened `file`'s copy (or one made for a reader waiting for it); `seq` grows
    /// with every open. While something is predicted, [`needed_at`](Self::needed_at) follows.
    fn read(&mut self, file: FileId, seq: u64);

    /// `file` (cached) is next needed at `pos` (on the slowest reader's clock;
    /// [`NEVER`](crate::plan::NEVER): not within the plans known).
    fn needed_at(&mut self, file: FileId, pos: Position);

    /// `file`'s next use is no longer known (the prediction it was staged for was dropped): it
    /// ranks before every copy read since.
    fn stale(&mut self, file: FileId);

    /// `file`'s copy is gone.
    fn remove(&mut self, file: FileId);

    /// The copy to evict so that a file needed at `needed_at` (0: one a reader waits for now)
    /// fits, if any may go for it.
    fn victim(&self, needed_at: Position) -> Option<FileId>;

    /// Every copy it holds.
    fn files(&self) -> Vec<FileId>;

    /// The copies whose next use is not known (to be told once the next epoch is planned).
    fn unplanned(&self) -> Vec<FileId>;
}

/// What a file of another stream than the predicted one (a validation set, label files) is
/// needed at when a reader waits for it: after every predicted position, before every copy
/// ranked by recency. It takes room only from copies not needed again or ranked by recency,
/// never from one staged for a predicted read: that copy would have to be staged again, while
/// reading the other stream's file from SOURCE costs what copying it would.
pub const OTHER_STREAM: Position = NEVER / 4;

/// The policies, as `--eviction` names them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum EvictionKind {
    /// The copy needed furthest ahead (Belady's rule, from the prediction)
    #[default]
    Belady,
    /// The least recently used copy (a plain cache; a baseline to compare against)
    Lru,
}

impl EvictionKind {
    /// A policy of this kind, holding nothing.
    pub fn policy(self) -> Box<dyn Eviction> {
        match self {
            EvictionKind::Belady => Box::<Belady>::default(),
            EvictionKind::Lru => Box::<Lru>::default(),
        }
    }
}
