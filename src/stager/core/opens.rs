//! An open, as the core sees it: counted under its stream, fed to the tracker if it is the
//! predicted stream's (which moves the cursor, the eviction keys and the frontier, and may
//! find the reader lost), then a hit or a miss. The shell opens the cached copy around these
//! calls (before the lock, and again if it raced a copy), so a hit never waits for I/O under
//! the lock.

use std::time::Instant;

use super::super::streams::{self, StreamSlot};
use super::{Core, Effects, FileState, Wake};
use crate::catalog::FileId;
use crate::plan::TrackerMode;
use crate::stats::Counters;

/// Opens between two searches for a lost reader's place.
const RESYNC_EVERY: u64 = 4096;

/// What a miss asks of the shell.
#[derive(Debug)]
pub enum Miss<R> {
    /// The file is large: read it through from SOURCE while its copy proceeds.
    ReadThrough(R),
    /// The reader waits for the copy (the core answers it when the copy is over).
    Waiting,
}

impl<R> Core<R> {
    /// Counts an open of `file` under its stream, and feeds one of the predicted stream to
    /// the tracker. Returns the stream it counted under (a miss counts there too).
    pub fn opened(&mut self, file: FileId, now: Instant, effects: &mut Effects<R>) -> StreamSlot {
        self.unread.remove(&file);
        self.access_seq += 1;
        let predicted = self.in_predicted_stream(file);
        if predicted {
            self.track_predicted(file, now, effects);
        } else if !self.tracker.generation().predicts() {
            // Remembered among the recent opens: an order found from them takes them as read.
            self.tracker.on_open(file);
        }
        if self.space.evict.contains(file) {
            self.space.evict.read(file, self.access_seq);
            if predicted && self.tracker.mode() == TrackerMode::Predicting {
                let next = self.next_need(file);
                self.space.evict.needed_at(file, next);
            }
        }
        if predicted {
            return self.streams.predicted_open();
        }
        // Another stream's (validation, label files): cached as read, judged against nothing.
        let dataset = streams::dataset_of(&self.catalog, file);
        let name = crate::catalog::dataset_name(&self.catalog, dataset);
        self.streams.other_open(name)
    }

    /// Whether `file` belongs to the predicted stream: a sample of its dataset, or for an
    /// announced order, a file of the epochs the job announced (the reader's and the next).
    pub(super) fn in_predicted_stream(&self, file: FileId) -> bool {
        let generation = self.tracker.generation();
        if !generation.predicts() {
            return false;
        }
        match generation.order() {
            Some(order) => order.layout.contains(file),
            None => {
                let epoch = self.tracker.epoch_position().0;
                (epoch..=epoch + 1).any(|e| {
                    (self.tracker.planned(e)).is_some_and(|p| !p.offsets_of(file).is_empty())
                })
            }
        }
    }

    /// Feeds an open to the tracker and keeps eviction keys and the frontier consistent with
    /// where the cursor went.
    fn track_predicted(&mut self, file: FileId, now: Instant, effects: &mut Effects<R>) {
        let epoch_before = self.tracker.epoch_position().0;
        let m = self.tracker.on_open(file);
        match self.tracker.mode() {
            TrackerMode::Predicting => {
                if let Some((from, to)) = m.passed {
                    self.cursor_passed(from, to);
                }
                if self.tracker.epoch_position().0 != epoch_before {
                    // A new epoch enters the horizon: the shell plans it and rekeys.
                    effects.plan = true;
                }
                // The lookahead window slid: if a copy is due, one idle worker takes it and
                // wakes the next if there is more. Waking workers for nothing (everything
                // ahead cached) would cost every open two context switches.
                if m.passed.is_some() && self.copy_due(now) {
                    effects.wake(Wake::One);
                }
            }
            TrackerMode::Lost | TrackerMode::OnDemand => {
                if m.became_lost {
                    self.drop_next_uses();
                }
            }
        }
        if m.became_lost && self.hint.is_none() {
            let hint = self.lost_message();
            log::warn!("{hint}");
            self.hint = Some(hint);
        }
        if self.tracker.mode() == TrackerMode::Lost {
            self.opens_since_resync += 1;
            if !self.resync_running && (m.became_lost || self.opens_since_resync >= RESYNC_EVERY) {
                self.resync_running = true;
                self.opens_since_resync = 0;
                let epoch = self.tracker.epoch_position().0;
                effects.resync = Some((self.tracker.recent_unpredicted(), epoch));
            }
        }
    }

    /// Whether `file`'s copy is a previous mount's, to be checked before it is served.
    pub fn is_unverified(&self, file: FileId) -> bool {
        self.unverified.contains_key(&file)
    }

    /// The shell checked a previous mount's copy of `file` against the source file and its
    /// checksum: if it is bad (and still that copy: not evicted meanwhile) it goes, to be
    /// staged again.
    pub fn verified(&mut self, file: FileId, good: bool, effects: &mut Effects<R>) {
        if good {
            self.unverified.remove(&file);
        } else if self.unverified.contains_key(&file) {
            effects.unlink.push(file);
            self.forget_cached(file);
        }
    }

    /// An open answered from the cache.
    pub fn hit(&mut self) {
        Counters::add(&self.counters.hits, 1);
    }

    /// `file` is cached, but its copy could not be opened twice: gone behind our back. It is
    /// staged again.
    pub fn vanished(&mut self, file: FileId) {
        log::warn!(
            "cached copy of {} vanished; staging it again",
            self.catalog.relative_path(file).display()
        );
        self.forget_cached(file);
    }

    /// An open of `file` that no copy answers: it is queued for staging as urgent (a reader
    /// waits), and the reader waits for the copy, or reads through from SOURCE if the file is
    /// large. `slot` is the stream the open counted under.
    pub fn miss(
        &mut self,
        file: FileId,
        slot: StreamSlot,
        reply: R,
        now: Instant,
        effects: &mut Effects<R>,
    ) -> Miss<R> {
        Counters::add(&self.counters.misses, 1);
        self.streams.miss(slot);
        let state = self.files.get(file);
        if state == FileState::Remote || state == FileState::Cached {
            self.files.set(file, FileState::Queued);
            self.urgent.push_back(file);
            effects.wake(Wake::One);
        }
        if self.size_of(file).unwrap_or(0) >= self.settings.read_through_above {
            Miss::ReadThrough(reply)
        } else {
            self.waiters.add(file, reply, now);
            Miss::Waiting
        }
    }
}
