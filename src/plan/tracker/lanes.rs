//! The tracker's lanes: one per local rank of the node stream, each with its own cursor
//! (see [`Tracker`]). Position `p` of an epoch is lane `p % lanes`'s, so a lane's positions
//! are `lane, lane + lanes, ...`; its cursor steps over them alone, and a file a fast lane
//! reads soon is needed as soon as one the slowest reads soon ([`Tracker::on_slowest_clock`]).

use std::collections::VecDeque;

use super::{FRONT_SAMPLE, Tracker};
use crate::plan::Position;

#[derive(Clone, Debug)]
pub(super) struct Lane {
    /// The lane's first unread position (see [`Tracker::advance`]).
    pub(super) cursor: Position,
    /// The lane's furthest predicted open (where matching reaches to).
    pub(super) high_water: Position,
    /// The lane's last [`FRONT_SAMPLE`] predicted positions, whose median drags its cursor.
    pub(super) front: VecDeque<Position>,
}

impl Lane {
    pub(super) fn at(cursor: Position) -> Lane {
        Lane {
            cursor,
            high_water: cursor,
            front: VecDeque::with_capacity(FRONT_SAMPLE),
        }
    }

    /// Where the reader's front is: the median of the last predicted positions. Not the
    /// furthest: a file read again (accelerate's `even_batches` re-reads an epoch's first
    /// batch at its end; a retry; a peek) matches its next use, anywhere within reach, and
    /// dragging the cursor there would skip positions still to be read.
    pub(super) fn front(&self) -> Option<Position> {
        let mut recent: Vec<Position> = self.front.iter().copied().collect();
        let middle = recent.len() / 2;
        (!recent.is_empty()).then(|| *recent.select_nth_unstable(middle).1)
    }
}

impl Tracker {
    /// A lane per lane of the generation, each at its first position from `pos`.
    pub(super) fn place_lanes(&mut self, pos: Position) {
        self.lanes = vec![Lane::at(pos); self.generation.lanes.max(1)];
        for lane in 0..self.lanes.len() {
            self.lanes[lane] = Lane::at(self.align(pos, lane));
        }
    }

    /// `pos` on the slowest lane's clock: a lane ahead of the others reads its positions that
    /// much sooner.
    pub fn on_slowest_clock(&self, pos: Position) -> Position {
        let lane = self.lane_of(pos);
        let in_step = self.align(self.cursor(), lane);
        let lead = self.lanes[lane].cursor.saturating_sub(in_step);
        pos.saturating_sub(lead).max(self.cursor())
    }

    /// How many lanes there are (one at least).
    pub fn lane_count(&self) -> usize {
        self.lanes.len().max(1)
    }

    /// Lane `lane`'s first unread position.
    pub fn lane_cursor(&self, lane: usize) -> Position {
        self.lanes[lane].cursor
    }

    /// The position after `pos` in its lane: `lanes` on, or the lane's first of the next
    /// epoch past the end of `pos`'s epoch (its plan's end where it is planned shorter).
    pub fn next_in_lane(&self, pos: Position) -> Position {
        let lane = self.lane_of(pos);
        let (epoch, offset) = self.generation.split(pos);
        let len = self
            .planned(epoch)
            .map_or(self.generation.epoch_len, |plan| plan.len());
        let lanes = self.lane_count() as u64;
        if offset + lanes < len {
            pos + lanes
        } else {
            self.generation.join(epoch + 1, lane as u64)
        }
    }

    /// Which lane `pos` belongs to.
    pub fn lane_of(&self, pos: Position) -> usize {
        let (_, offset) = self.generation.split(pos);
        (offset % self.lane_count() as u64) as usize
    }

    pub(super) fn lane_at(&self, pos: Position) -> &Lane {
        &self.lanes[self.lane_of(pos)]
    }

    /// Lane `lane`'s first position at or after `pos`.
    pub fn align(&self, pos: Position, lane: usize) -> Position {
        let lanes = self.lane_count() as u64;
        let (epoch, offset) = self.generation.split(pos);
        let aligned = offset + (lane as u64 + lanes - offset % lanes) % lanes;
        if aligned >= self.generation.epoch_len {
            return self.generation.join(epoch + 1, lane as u64);
        }
        self.generation.join(epoch, aligned)
    }

    /// Every lane's cursor = its first unread position, but never more than three quarters
    /// of a reach behind its reader's front ([`Lane::front`]): what a loader left that far
    /// behind it is not coming (e.g. a dropped last batch), and the opens after it must stay
    /// within reach. Not less: a loader's workers start their batches together, and the first
    /// batch may come after the others (with batch opens, each batch's files at once): half
    /// a reach passed over the first batch of Lightning's ImageNet example (4 workers, 4
    /// batches an epoch), whose reads then counted as mispredicted.
    /// Positions never read are passed over at once: a sample that cannot be served, a slot
    /// a shorter rank leaves empty, and the rest of a fed epoch shorter than the epoch length
    /// once the next one has been announced. The bitmaps slide on as the slowest lane leaves
    /// an epoch; a lane cannot run more than an epoch ahead of the slowest.
    pub(super) fn advance(&mut self) {
        let behind = self.reach() / 4 * 3;
        loop {
            for lane in 0..self.lanes.len() {
                if let Some(front) = self.lanes[lane].front() {
                    let dragged = self.align(front.saturating_sub(behind), lane);
                    self.lanes[lane].cursor = self.lanes[lane].cursor.max(dragged);
                }
                let cursor = self.passed_over(self.lanes[lane].cursor, lane);
                self.lanes[lane].cursor = cursor;
            }
            if self.cursor() < self.generation.join(self.base_epoch + 1, 0) {
                break;
            }
            // Slide the two epoch bitmaps forward by one epoch; the left epoch's plan goes.
            self.consumed.swap(0, 1);
            self.consumed[1].fill(0);
            self.base_epoch += 1;
            let base = self.base_epoch;
            self.plans.retain(|p| p.epoch >= base);
        }
    }

    /// Lane `lane`'s first position from `cursor` on that is still to be read.
    fn passed_over(&self, mut cursor: Position, lane: usize) -> Position {
        let lanes = self.lanes.len() as u64;
        loop {
            let (epoch, offset) = self.generation.split(cursor);
            let Some(plan) = self.planned(epoch) else {
                return cursor;
            };
            let past_end = offset >= plan.len();
            if past_end {
                // On to the next epoch once it is planned and has positions at all.
                if self.planned(epoch + 1).is_some_and(|next| next.len() > 0) {
                    cursor = self.generation.join(epoch + 1, lane as u64);
                    continue;
                }
                return cursor;
            }
            let read = self.bit(cursor).is_some() && self.is_marked(cursor);
            if !read && plan.file_at(offset).is_some() {
                return cursor;
            }
            if self.bit(cursor).is_none() {
                // Beyond the two tracked epochs: the lane waits for the slowest.
                return cursor;
            }
            cursor = if offset + lanes < plan.len() {
                cursor + lanes
            } else if plan.len() < self.generation.epoch_len {
                // Past the end of a (fed) epoch shorter than the epoch length: wait there for
                // the next one to be announced.
                self.generation.join(epoch, plan.len())
            } else {
                self.generation.join(epoch + 1, lane as u64)
            };
        }
    }
}
