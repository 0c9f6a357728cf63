//! The staging frontier: the position in the predicted stream up to which copies have been
//! started, ahead of the tracker's cursor, bounded by the horizon (the cursor's epoch and the
//! next), the lookahead and the cache's room; and the choice of the next copy to make.

use std::time::Instant;

use super::{Answer, Deferred, FileState, Inner, Job, State};
use crate::catalog::FileId;
use crate::plan::{Position, TrackerMode};
use crate::stats::Counters;

impl Inner {
    /// The next copy to make: urgent files first, then the frontier.
    pub(super) fn next_job(&self, st: &mut State, deferred: &mut Deferred) -> Option<Job> {
        let mut urgent_job = None;
        while let Some(file) = st.urgent.pop_front() {
            if st.files.get(file) != FileState::Queued {
                continue;
            }
            let size = self.size_of(file);
            // A reader waits for it now: anything else may go.
            if size > st.space.capacity || !self.make_room(st, size, 0) {
                // No room at all: serve the waiting readers from SOURCE instead.
                st.files.set(file, FileState::Remote);
                for w in st.waiters.take(file) {
                    Counters::add(
                        &self.counters.stall_nanos,
                        w.since.elapsed().as_nanos() as u64,
                    );
                    deferred.push((w.reply, Answer::FromSource(file)));
                }
                continue;
            }
            st.files.set(file, FileState::Staging);
            st.space.reserved += size;
            urgent_job = Some(Job {
                file,
                position: None,
            });
            break;
        }
        if urgent_job.is_some() {
            return urgent_job;
        }
        let (pos, file) = self.frontier_to_copy(st)?;
        let size = self.size_of(file);
        if !self.make_room(st, size, st.tracker.on_slowest_clock(pos)) {
            return None;
        }
        st.frontier += 1;
        st.ahead_bytes += size;
        st.files.set(file, FileState::Staging);
        st.space.reserved += size;
        Some(Job {
            file,
            position: Some(pos),
        })
    }

    /// Whether the frontier has a copy to make now: a file to stage that fits, or that is
    /// needed sooner than the furthest cached one (which [`Inner::make_room`] would evict).
    pub(super) fn copy_due(&self, st: &mut State) -> bool {
        self.frontier_to_copy(st).is_some_and(|(pos, file)| {
            st.space.used + st.space.reserved + self.size_of(file) <= st.space.capacity
                || st
                    .space
                    .evict
                    .furthest()
                    .is_some_and(|(key, _)| key > st.tracker.on_slowest_clock(pos))
        })
    }

    /// Moves the frontier over positions that need no copy (unservable, already cached or
    /// under way, changed on the source, larger than the cache) and returns the first that
    /// does, without taking it. Cheap when everything ahead is cached, so an open can ask
    /// whether a worker is needed at all.
    pub(super) fn frontier_to_copy(&self, st: &mut State) -> Option<(Position, FileId)> {
        while self.frontier_open(st) {
            let pos = st.frontier;
            let (epoch, offset) = self.plan.split(pos);
            // An epoch still being planned: the planner wakes the workers when it is.
            let plan = self.plan.planned(epoch)?;
            if offset >= plan.len() {
                // A fed epoch shorter than the epoch length: on to the next one at once.
                st.frontier = self.plan.join(epoch + 1, 0);
                continue;
            }
            // Nothing to serve there, or read already by a rank running ahead.
            let Some(file) = plan.file_at(offset).filter(|_| !st.tracker.is_read(pos)) else {
                st.frontier += 1;
                continue;
            };
            let size = self.size_of(file);
            let state = st.files.get(file);
            if state != FileState::Remote || st.changed.contains(&file) || size > st.space.capacity
            {
                st.frontier += 1;
                st.ahead_bytes += size;
                continue;
            }
            return Some((pos, file));
        }
        None
    }

    /// Whether the frontier may take another position: predicting, not paused, and within the
    /// horizon (the cursor's epoch and the next) and the lookahead.
    pub(super) fn frontier_open(&self, st: &State) -> bool {
        if st.tracker.mode() != TrackerMode::Predicting || st.backoff.paused(Instant::now()) {
            return false;
        }
        let cursor = st.tracker.cursor();
        let (cursor_epoch, _) = self.plan.split(cursor);
        st.frontier < self.plan.join(cursor_epoch + 2, 0)
            && st.frontier - cursor < self.settings.lookahead_files
            && st.ahead_bytes < self.settings.lookahead_bytes
    }

    /// Puts the frontier back to `pos` so a failed prefetch is retried once the source is back.
    pub(super) fn rewind_frontier(&self, st: &mut State, pos: Position) {
        let cursor = st.tracker.cursor();
        if pos >= st.frontier || pos < cursor {
            return;
        }
        st.frontier = pos;
        // Positions behind the frontier are planned: it only moves over planned epochs.
        st.ahead_bytes = (cursor..pos)
            .filter_map(|p| self.plan.planned_file_at(p).flatten())
            .map(|f| self.size_of(f))
            .sum();
    }
}
