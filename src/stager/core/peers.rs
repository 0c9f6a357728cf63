//! The job's other nodes, as the core sees them: the copies they will fetch from this node
//! (kept by eviction like the node's own next uses, see [`Core::next_need`]), and copies put off
//! because the node holding them has not read them yet (the frontier comes back to them
//! shortly, see [`Core::may_wait_for_peer`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{Answer, Core, Effects, FileState, Job, Wake};
use crate::catalog::FileId;
use crate::plan::{NEVER, Position, TrackerMode};
use crate::stats::Counters;

/// How long the frontier waits after a copy was put off before it asks again.
const PUT_OFF_FOR: Duration = Duration::from_millis(100);
/// Nearest to the reader a copy may be put off: a reader must never wait for a peer's reader.
const MIN_WAIT_DISTANCE: Position = 64;

/// What the other nodes need of this one.
#[derive(Default)]
pub(super) struct PeerNeeds {
    /// The generation the positions are in.
    generation: u64,
    /// File → where, in this node's stream coordinates, another node reads it.
    by_file: HashMap<FileId, Position>,
    /// The frontier waits until then after a copy was put off.
    wait_until: Option<Instant>,
}

impl<R> Core<R> {
    /// Other nodes read `needs` (file, position in this generation's coordinates) next epoch,
    /// from this node: cached ones are kept by eviction until about then.
    pub fn peers_need(&mut self, generation: u64, needs: Vec<(FileId, Position)>) {
        if generation != self.tracker.generation().id {
            return;
        }
        if self.peer_needs.generation != generation {
            self.peer_needs.by_file.clear();
            self.peer_needs.generation = generation;
        }
        for (file, pos) in needs {
            let need = self.peer_needs.by_file.entry(file).or_insert(pos);
            *need = (*need).min(pos);
            self.rekey_cached(file);
        }
    }

    /// A peer fetched `file` (its copy is open for the transfer): its need is met, and the copy
    /// is ranked by this node's own next use from now on, so one not needed here again is the
    /// first to go instead of crowding out the copies this node will read.
    pub fn peer_fetched(&mut self, file: FileId) {
        if self.peer_needs.by_file.remove(&file).is_some() {
            self.rekey_cached(file);
        }
    }

    /// Tells eviction when `file`'s copy is next needed, if it is cached and predicted.
    fn rekey_cached(&mut self, file: FileId) {
        if self.files.get(file) == FileState::Cached
            && self.tracker.mode() == TrackerMode::Predicting
        {
            let next = self.next_need(file);
            self.space.evict.needed_at(file, next);
        }
    }

    /// When `file` is next needed, by this node's reader or a peer's: what eviction ranks it
    /// by. A peer fetches ahead of its reader by about as much as this node stages ahead, so
    /// its need is ranked that much earlier.
    pub(super) fn next_need(&self, file: FileId) -> Position {
        let own = self.tracker.next_use(file);
        let peer = match self.peer_needs.by_file.get(&file) {
            Some(&pos) if self.peer_needs.generation == self.tracker.generation().id => {
                let lead = self.frontier().saturating_sub(self.tracker.cursor());
                pos.saturating_sub(lead).max(self.tracker.cursor())
            }
            _ => NEVER,
        };
        own.min(peer)
    }

    /// Forgets what peers needed well before the reader's position: they have fetched it or
    /// read it from SOURCE by now. Its copy is rekeyed by this node's own next use.
    pub(super) fn expire_peer_needs(&mut self) {
        let cursor = self.tracker.cursor();
        let slack = (self.tracker.generation().epoch_len / 8).max(MIN_WAIT_DISTANCE);
        let expired: Vec<FileId> = (self.peer_needs.by_file.iter())
            .filter(|&(_, &pos)| pos.saturating_add(slack) < cursor)
            .map(|(&f, _)| f)
            .collect();
        for file in expired {
            self.peer_needs.by_file.remove(&file);
            self.rekey_cached(file);
        }
    }

    /// Whether `job` may be put off for its holder to read the file first: staged ahead, no
    /// reader waits for it, and far enough from the reader (an eighth of an epoch, at least
    /// [`MIN_WAIT_DISTANCE`] positions) that it will be back in time.
    pub fn may_wait_for_peer(&self, job: Job) -> bool {
        let Some(pos) = job.position else {
            return false;
        };
        let distance = (self.tracker.generation().epoch_len / 8).max(MIN_WAIT_DISTANCE);
        !self.waiters.has(job.file)
            && self.tracker.on_slowest_clock(pos) >= self.tracker.cursor().saturating_add(distance)
    }

    /// `job` was put off (its holder has not read it yet): the frontier goes back to it and
    /// waits a moment before asking again.
    pub(super) fn put_off(&mut self, job: Job, now: Instant) -> Answer {
        Counters::add(&self.counters.peer_deferrals, 1);
        if let Some(pos) = job.position {
            self.rewind_frontier(pos);
        }
        self.peer_needs.wait_until = Some(now + PUT_OFF_FOR);
        Answer::FromSource(job.file)
    }

    /// Whether the frontier waits for a copy put off.
    pub(super) fn waiting_for_peer(&self, now: Instant) -> bool {
        self.peer_needs.wait_until.is_some_and(|until| now < until)
    }

    /// Ends a wait for a copy put off, once it is over: the workers look again.
    pub(super) fn end_peer_wait(&mut self, now: Instant, effects: &mut Effects<R>) {
        if self.peer_needs.wait_until.is_some_and(|until| now >= until) {
            self.peer_needs.wait_until = None;
            effects.wake(Wake::All);
        }
    }
}
