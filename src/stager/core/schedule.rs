//! The next copy: urgent files first (a reader waits), then the staging frontier, which walks
//! the predicted stream ahead of the slowest reader, bounded by the horizon (the reader's
//! epoch and the next), the lookahead and the cache's room; and the room itself: a copy is
//! made only if it fits or the eviction policy gives up a copy for it.

use std::time::Instant;

use super::{Answer, Core, Effects, FileState, Job, Wake};
use crate::catalog::FileId;
use crate::plan::{Position, TrackerMode};
use crate::stats::Counters;

impl<R> Core<R> {
    /// The next copy to make: urgent files first, then the frontier. Readers of an urgent file
    /// that cannot fit at all are served from SOURCE instead (in `effects`).
    pub fn next_job(&mut self, now: Instant, effects: &mut Effects<R>) -> Option<Job> {
        let job = self
            .next_urgent(now, effects)
            .or_else(|| self.next_ahead(now, effects));
        if job.is_some() && (!self.urgent.is_empty() || self.copy_due(now)) {
            // More to do: the next idle worker takes it.
            effects.wake(Wake::One);
        }
        job
    }

    fn next_urgent(&mut self, now: Instant, effects: &mut Effects<R>) -> Option<Job> {
        while let Some(file) = self.urgent.pop_front() {
            if self.files.get(file) != FileState::Queued {
                continue;
            }
            let size = self.size_of(file);
            // A reader waits for it now: anything else may go.
            if let Some(size) = size
                && !self.room_for(size, 0, effects)
            {
                // No room at all: serve the waiting readers from SOURCE instead.
                self.files.set(file, FileState::Remote);
                for w in self.waiters.take(file) {
                    self.stalled(w.since, now);
                    effects.replies.push((w.reply, Answer::FromSource(file)));
                }
                continue;
            }
            self.files.set(file, FileState::Staging);
            if let Some(size) = size {
                self.reserve(file, size);
            }
            return Some(Job {
                file,
                position: None,
                has_room: size.is_some(),
            });
        }
        None
    }

    /// Whether a copy of `bytes` fits the cache, making room for it (for a file needed at
    /// `needed_at`) if the eviction policy gives some.
    fn room_for(&mut self, bytes: u64, needed_at: u64, effects: &mut Effects<R>) -> bool {
        bytes <= self.space.capacity && self.make_room(bytes, needed_at, effects)
    }

    /// The copy of `job`, taken before its size was known, has opened the file and found it
    /// `size` bytes: room is made for it now, as it would have been had the size been known.
    /// False if there is none; the shell then gives the copy up ([`CopyError::NoRoom`]).
    ///
    /// [`CopyError::NoRoom`]: crate::cache::CopyError::NoRoom
    pub fn admit(&mut self, job: Job, size: u64, effects: &mut Effects<R>) -> bool {
        let needed_at = job
            .position
            .map_or(0, |pos| self.tracker.on_slowest_clock(pos));
        if !self.room_for(size, needed_at, effects) {
            return false;
        }
        self.reserve(job.file, size);
        if job.position.is_some() {
            self.ahead_bytes += size;
        }
        true
    }

    fn next_ahead(&mut self, now: Instant, effects: &mut Effects<R>) -> Option<Job> {
        let (pos, file) = self.frontier_to_copy(now)?;
        let size = self.size_of(file);
        if let Some(size) = size {
            if !self.make_room(size, self.tracker.on_slowest_clock(pos), effects) {
                return None;
            }
            self.ahead_bytes += size;
            self.reserve(file, size);
        }
        self.frontier += 1;
        self.files.set(file, FileState::Staging);
        Some(Job {
            file,
            position: Some(pos),
            has_room: size.is_some(),
        })
    }

    /// Whether the frontier has a copy to make now: a file to stage that fits, or that the
    /// eviction policy makes room for.
    pub(super) fn copy_due(&mut self, now: Instant) -> bool {
        self.frontier_to_copy(now).is_some_and(|(pos, file)| {
            self.space.fits(self.size_of(file).unwrap_or(0))
                || (self.space.evict)
                    .victim(self.tracker.on_slowest_clock(pos))
                    .is_some()
        })
    }

    /// Moves the frontier over positions that need no copy (unservable, read already by a
    /// rank running ahead, cached or under way, changed on the source, larger than the cache)
    /// and returns the first that does, without taking it. Cheap when everything ahead is
    /// cached, so an open can ask whether a worker is needed at all.
    fn frontier_to_copy(&mut self, now: Instant) -> Option<(Position, FileId)> {
        /// What is at the frontier.
        enum At {
            File(FileId),
            Nothing,
            EpochEnd(Position),
        }
        while self.frontier_open(now) {
            let pos = self.frontier;
            let at = {
                let generation = self.tracker.generation();
                let (epoch, offset) = generation.split(pos);
                // An epoch not planned yet: the planner wakes the workers when it is.
                let plan = self.tracker.planned(epoch)?;
                match plan.file_at(offset) {
                    // A fed epoch shorter than the epoch length: on to the next one at once.
                    _ if offset >= plan.len() => At::EpochEnd(generation.join(epoch + 1, 0)),
                    Some(file) if !self.tracker.is_read(pos) => At::File(file),
                    _ => At::Nothing,
                }
            };
            let file = match at {
                At::File(file) => file,
                At::Nothing => {
                    self.frontier += 1;
                    continue;
                }
                At::EpochEnd(next) => {
                    self.frontier = next;
                    continue;
                }
            };
            // A size not known yet is learnt when the copy opens the file (`admit`).
            let size = self.size_of(file).unwrap_or(0);
            let state = self.files.get(file);
            if state != FileState::Remote
                || self.changed.contains(&file)
                || size > self.space.capacity
            {
                self.frontier += 1;
                self.ahead_bytes += size;
                continue;
            }
            return Some((pos, file));
        }
        None
    }

    /// Whether the frontier may take another position: predicting, not paused, and within the
    /// horizon (the cursor's epoch and the next) and the lookahead.
    fn frontier_open(&self, now: Instant) -> bool {
        if self.tracker.mode() != TrackerMode::Predicting || self.backoff.paused(now) {
            return false;
        }
        let cursor = self.tracker.cursor();
        let generation = self.tracker.generation();
        let (cursor_epoch, _) = generation.split(cursor);
        self.frontier < generation.join(cursor_epoch + 2, 0)
            && self.frontier - cursor < self.settings.lookahead_files
            && self.ahead_bytes < self.settings.lookahead_bytes
    }

    /// Puts the frontier back to `pos` so a failed prefetch is retried once the source is back.
    pub(super) fn rewind_frontier(&mut self, pos: Position) {
        let cursor = self.tracker.cursor();
        if pos >= self.frontier || pos < cursor {
            return;
        }
        self.frontier = pos;
        // Positions behind the frontier are planned: it only moves over planned epochs.
        let generation = self.tracker.generation().clone();
        self.ahead_bytes = (cursor..pos)
            .filter_map(|p| {
                let (epoch, offset) = generation.split(p);
                self.tracker.planned(epoch)?.file_at(offset)
            })
            .filter_map(|f| self.size_of(f))
            .sum();
    }

    /// Evicts copies the policy gives up for a file needed at `needed_at` until `bytes` more
    /// fit. False if it gives up none in time (Belady: everything cached is needed sooner, so
    /// the new file is the one not to keep).
    pub(super) fn make_room(
        &mut self,
        bytes: u64,
        needed_at: u64,
        effects: &mut Effects<R>,
    ) -> bool {
        while !self.space.fits(bytes) {
            match self.space.evict.victim(needed_at) {
                Some(victim) => self.evict(victim, effects),
                None => return false,
            }
        }
        true
    }

    /// Drops `file` and its copy. The unlink (of a local file, tens of microseconds) is the
    /// one cache-directory call the shell makes under its lock: deferred until the lock was
    /// released, a new copy of the file had to be held back until it was done (or the late
    /// unlink would remove it), and readers of just-evicted files waited for that: a 30% cache
    /// through a mount fell from 1.0 to 0.90-0.97 hits with 3-5x the stall (engine_bench).
    pub(super) fn evict(&mut self, file: FileId, effects: &mut Effects<R>) {
        // Staged ahead and evicted before anyone read it: staging wasted.
        if self.unread.contains(&file) {
            Counters::add(&self.counters.wasted_bytes, self.held_bytes(file));
        }
        effects.unlink.push(file);
        self.forget_cached(file);
        Counters::add(&self.counters.evictions, 1);
    }

    /// Forgets `file`'s copy (evicted, or gone from the cache directory).
    pub(super) fn forget_cached(&mut self, file: FileId) {
        if self.space.evict.contains(file) {
            self.space.evict.remove(file);
            self.space.used = self.space.used.saturating_sub(self.held_bytes(file));
        }
        self.files.set(file, FileState::Remote);
        self.unread.remove(&file);
        self.unverified.remove(&file);
    }
}
