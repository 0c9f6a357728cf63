//! The next copy: urgent files first (a reader waits), then the staging frontier (see
//! [`frontier`](super::frontier)); and the room itself: a copy is made only if it fits or the
//! eviction policy gives up a copy for it.

use std::time::Instant;

use super::{Answer, Core, Effects, FileState, Job, Wake};
use crate::catalog::FileId;
use crate::stager::eviction::OTHER_STREAM;
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
            // A reader waits for it now: anything else may go (for another stream's file,
            // anything not staged for the predicted one).
            if let Some(size) = size
                && !self.room_for(size, self.urgent_needed_at(file), effects)
            {
                // No room: serve the waiting readers from SOURCE instead.
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

    /// What an urgent copy of `file` is needed at, for eviction: now (0), unless it belongs to
    /// another stream than the one predicted ([`OTHER_STREAM`]).
    fn urgent_needed_at(&self, file: FileId) -> u64 {
        if self.tracker.generation().predicts() && !self.in_predicted_stream(file) {
            OTHER_STREAM
        } else {
            0
        }
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
        let needed_at = match job.position {
            Some(pos) => self.ahead_needed_at(pos),
            None => self.urgent_needed_at(job.file),
        };
        // The room taken for a typical copy, if any, is made again for this one's size.
        self.release(job.file);
        let (bytes, copies) = self.learnt_sizes;
        self.learnt_sizes = (bytes + size, copies + 1);
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
        // Room is made in the frontier's order, when a copy is taken: a file of unknown size
        // gets a typical copy's (its own is made at `admit`). Made only at admission, copies
        // taken together were admitted in the order their workers opened the files, and one
        // admitted after its successor evicted that successor's fresh copy for it, which the
        // frontier then staged again (two workers, a full cache: 1% of the staging wasted).
        let room = self.room_to_take(file);
        if !self.make_room(room, self.ahead_needed_at(pos), effects) {
            return None;
        }
        self.reserve(file, room);
        // Unless making room put it back (to a copy given up), the lane's frontier moves on;
        // if it did, it walks over this position again and counts it then.
        self.step_frontier_from(pos, size.unwrap_or(0));
        self.files.set(file, FileState::Staging);
        Some(Job {
            file,
            position: Some(pos),
            has_room: size.is_some(),
        })
    }

    /// The room a copy of `file` takes when the frontier takes it: its size, or if that is
    /// not known yet, the mean of the sizes learnt at `admit` (0 before the first).
    fn room_to_take(&self, file: FileId) -> u64 {
        let (bytes, copies) = self.learnt_sizes;
        (self.size_of(file)).unwrap_or_else(|| bytes.checked_div(copies).unwrap_or(0))
    }

    /// Whether the frontier has a copy to make now: a file to stage that fits, or that the
    /// eviction policy makes room for.
    pub(super) fn copy_due(&mut self, now: Instant) -> bool {
        self.frontier_to_copy(now).is_some_and(|(pos, file)| {
            self.space.fits(self.room_to_take(file))
                || (self.space.evict)
                    .victim(self.ahead_needed_at(pos))
                    .is_some()
        })
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
        // Needed before the frontier: lanes' clocks differ from the order the frontier walks
        // (a rank ahead reads its positions sooner), so the frontier does not come back to it
        // by itself, and its reader would miss.
        if let Some(pos) = self.tracker.next_position(file) {
            self.rewind_frontier(pos);
        }
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
