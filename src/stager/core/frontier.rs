//! The staging frontier: where staging ahead has got to, one position per lane (a lane is a
//! local rank's share of the node stream, see the tracker's lanes). The next position to
//! stage is the lane's whose frontier is needed soonest on the slowest lane's clock, the
//! clock eviction ranks copies by: so the frontier stages in the order eviction keeps, and a
//! copy it made is never given up for one it makes later. (One frontier walking positions in
//! order staged a rank running ahead later than it needed, and evicted the slow rank's
//! copies for it that it had passed already and never came back to: two ranks a few samples
//! apart got 0.78 hits through a 30% cache.)
//!
//! Bounded by the horizon (the reader's epoch and the next), the lookahead and the cache's
//! room (in [`schedule`](super::schedule)).

use std::time::Instant;

use super::{Core, FileState};
use crate::catalog::FileId;
use crate::plan::{Position, TrackerMode};

/// How much sooner than a cached copy's next use the frontier's file must be needed for the
/// copy to go for it, with lanes: their clocks jitter by what each rank has in flight (a
/// batch or a few per worker), and without a margin the two copies at the cache's edge were
/// swapped back and forth as they did, each swap a copy staged for nothing (two ranks of a
/// DataLoader drifting apart: 38% of the dataset wasted).
const LANE_JITTER: Position = 256;

impl<R> Core<R> {
    /// When the frontier's file at `pos` counts as needed, for eviction: on the slowest lane's
    /// clock, plus [`LANE_JITTER`] with lanes.
    pub(super) fn ahead_needed_at(&self, pos: Position) -> Position {
        let margin = if self.tracker.lane_count() > 1 {
            LANE_JITTER
        } else {
            0
        };
        self.tracker.on_slowest_clock(pos) + margin
    }

    /// Every lane's frontier at the lane's first position from `pos` on.
    pub(super) fn place_frontiers(&mut self, pos: Position) {
        let tracker = &self.tracker;
        self.frontiers = (0..tracker.lane_count())
            .map(|lane| tracker.align(pos, lane))
            .collect();
    }

    /// Every lane's frontier at least at its lane's cursor (its reader passed it).
    pub(super) fn catch_up_frontiers(&mut self) {
        for (lane, frontier) in self.frontiers.iter_mut().enumerate() {
            *frontier = (*frontier).max(self.tracker.lane_cursor(lane));
        }
    }

    /// The lane whose frontier is needed soonest, and that frontier.
    fn soonest_frontier(&self) -> (usize, Position) {
        self.frontiers
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|&(_, pos)| (self.tracker.on_slowest_clock(pos), pos))
            .expect("a lane at least")
    }

    /// How far staging ahead has got, on the slowest lane's clock.
    pub fn frontier(&self) -> Position {
        self.tracker.on_slowest_clock(self.soonest_frontier().1)
    }

    /// Whether `pos`'s position in its lane's walk was staged ahead already.
    pub(super) fn behind_frontier(&self, pos: Position) -> bool {
        pos < self.frontiers[self.tracker.lane_of(pos)]
    }

    /// Moves the frontier over positions that need no copy (unservable, read already by a
    /// rank running ahead, cached or under way, changed on the source, larger than the cache)
    /// and returns the first that does, without taking it. Cheap when everything ahead is
    /// cached, so an open can ask whether a worker is needed at all.
    pub(super) fn frontier_to_copy(&mut self, now: Instant) -> Option<(Position, FileId)> {
        loop {
            let (lane, pos) = self.soonest_frontier();
            if !self.frontier_open(pos, now) {
                return None;
            }
            let (epoch, offset) = self.tracker.generation().split(pos);
            // An epoch not planned yet: the planner wakes the workers when it is.
            let plan = self.tracker.planned(epoch)?;
            let file = match plan.file_at(offset) {
                Some(file) if offset < plan.len() && !self.tracker.is_read(pos) => file,
                _ => {
                    self.frontiers[lane] = self.tracker.next_in_lane(pos);
                    continue;
                }
            };
            // A size not known yet is learnt when the copy opens the file (`admit`).
            let size = self.size_of(file).unwrap_or(0);
            if self.files.get(file) != FileState::Remote
                || self.changed.contains(&file)
                || size > self.space.capacity
            {
                self.frontiers[lane] = self.tracker.next_in_lane(pos);
                self.ahead_bytes += size;
                continue;
            }
            return Some((pos, file));
        }
    }

    /// Takes `pos` (`size` bytes, being copied): its lane's frontier moves on, unless making
    /// room for it put the frontier back to a copy given up, which then walks over `pos`
    /// again and counts it then.
    pub(super) fn step_frontier_from(&mut self, pos: Position, size: u64) {
        let lane = self.tracker.lane_of(pos);
        if self.frontiers[lane] == pos {
            self.frontiers[lane] = self.tracker.next_in_lane(pos);
            self.ahead_bytes += size;
        }
    }

    /// Whether the frontier may take `pos`: predicting, not paused, within the horizon (the
    /// cursor's epoch and the next) and the lookahead.
    fn frontier_open(&self, pos: Position, now: Instant) -> bool {
        if self.tracker.mode() != TrackerMode::Predicting
            || self.backoff.paused(now)
            || self.waiting_for_peer(now)
        {
            return false;
        }
        let cursor = self.tracker.cursor();
        let generation = self.tracker.generation();
        let (cursor_epoch, _) = generation.split(cursor);
        pos < generation.join(cursor_epoch + 2, 0)
            && self.tracker.on_slowest_clock(pos) - cursor < self.settings.lookahead_files
            && self.ahead_bytes < self.settings.lookahead_bytes
    }

    /// Every lane's frontier back to its first position from `pos` on (or its reader's, if
    /// that is further), if it passed it.
    pub(super) fn rewind_frontiers(&mut self, pos: Position) {
        for lane in 0..self.tracker.lane_count() {
            let at = (self.tracker.align(pos, lane)).max(self.tracker.lane_cursor(lane));
            self.rewind_frontier(at);
        }
    }

    /// Puts `pos`'s lane's frontier back to it so the file there is staged again: a failed
    /// prefetch once the source is back, or a copy evicted before the position it is next
    /// needed at was read.
    pub(super) fn rewind_frontier(&mut self, pos: Position) {
        let lane = self.tracker.lane_of(pos);
        if pos >= self.frontiers[lane] || pos < self.tracker.lane_cursor(lane) {
            return;
        }
        // The frontier counted the positions it passed (files not read yet) as ahead.
        let mut passed = 0;
        let mut p = pos;
        while p < self.frontiers[lane] {
            let (epoch, offset) = self.tracker.generation().split(p);
            if let Some(file) = self
                .tracker
                .planned(epoch)
                .and_then(|plan| plan.file_at(offset))
                && !self.tracker.is_read(p)
            {
                passed += self.size_of(file).unwrap_or(0);
            }
            p = self.tracker.next_in_lane(p);
        }
        self.ahead_bytes = self.ahead_bytes.saturating_sub(passed);
        self.frontiers[lane] = pos;
    }
}
