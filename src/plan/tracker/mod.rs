//! Where the reader is in the predicted stream, and how well the prediction holds.
//!
//! Real loaders do not open files in stream order: DataLoader workers each take whole batches
//! and run `prefetch_factor` batches ahead, local ranks interleave, padding repeats a file in
//! an epoch and every file recurs next epoch. The tracker matches each open to the earliest
//! unread planned position of that file within a tolerance window around the cursor, keeps
//! the cursor at the low-water mark of what was read (positions left far behind count as
//! skipped), and crosses epoch boundaries as reads move on.
//!
//! Matching alone proves little: on a dataset shorter than the window every file has a
//! position inside it, so any order matches. An open therefore counts as *predicted* only if
//! it lands within [`reach`] of the cursor, a span a uniformly random open (a wrong seed or
//! sampler) hits with probability at most ¼. Every other open is a misprediction. When fewer
//! than half of the recent opens were predicted the tracker declares itself lost; the stager
//! then searches for the epoch and position the recent opens do follow ([`find_position`]) and
//! either repositions the tracker or stays on demand.
//!
//! The tracker holds the [`Generation`] it follows and the epoch plans it was handed (the
//! reader's epoch and the next): it computes nothing and asks nobody, so it is plain data,
//! tested without threads. Whoever owns it plans the epochs it wants ([`Tracker::wanted`])
//! off any lock and hands them over ([`Tracker::planned_epoch`]).

mod lanes;
mod search;

use std::collections::VecDeque;
use std::sync::Arc;

use super::{EpochPlan, Generation, NEVER, Position};
use crate::catalog::FileId;
use crate::stats::EpochQuality;

use lanes::Lane;
pub use search::{Run, densest_run, find_position, reach};

/// A detected order's first opens of a later epoch judged on their own: a variant of the order
/// (see `order::detect::variants`) reads the first epoch alike and differs from the second on,
/// so when half of that epoch's first opens are unpredicted the tracker is lost at once rather
/// than after half of [`TrackerSettings::recent`] opens, and the variant is switched to within
/// the epoch's first batches.
const EARLY_OPENS: u64 = 32;
const EARLY_MISSES: u64 = EARLY_OPENS / 2;

/// Epochs whose prediction quality is kept (the reader's and the few before it).
const QUALITY_EPOCHS: usize = 8;
/// Predicted positions the reader's front is the median of: a few re-read files among them
/// cannot move it, and it still follows the loader within a batch or two.
const FRONT_SAMPLE: usize = 16;

#[derive(Clone, Copy, Debug)]
pub struct TrackerSettings {
    /// How far from the cursor, in positions, an open is still matched to a planned position
    /// (so the tracker keeps its place through unusual reordering); whether it counts as
    /// predicted is decided by the tighter [`reach`], of which this is the upper bound.
    pub window: u64,
    /// How many recent opens are judged: the tracker is lost when fewer than half of them were
    /// predicted. A random order is predicted with probability ≤ ¼; it reaches half of 64
    /// opens with probability 1.5·10⁻⁵, while a right order stays near all of them.
    pub recent: usize,
}

/// How far from the reader (in samples) an open is still matched to the prediction: roughly
/// workers × prefetch × batch × local ranks of a large job. A mount's default
/// (`daemon::defaults::WINDOW`) is this.
pub const DEFAULT_WINDOW: u64 = 65_536;

impl Default for TrackerSettings {
    fn default() -> Self {
        TrackerSettings {
            window: DEFAULT_WINDOW,
            recent: 64,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackerMode {
    /// Opens follow the plan.
    Predicting,
    /// Too few recent opens were predicted; waiting for a resynchronisation.
    Lost,
    /// Nothing is predicted (see [`Generation::predicts`]).
    OnDemand,
}

/// What one open did to the tracker.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct OpenMatch {
    /// The planned position the open was matched to (predicted or not: a read position).
    pub position: Option<Position>,
    /// The cursor moved over `[from, to)`: files there now have a later next use.
    pub passed: Option<(Position, Position)>,
    /// This open tipped the tracker into [`TrackerMode::Lost`].
    pub became_lost: bool,
}

pub struct Tracker {
    generation: Arc<Generation>,
    /// The plans of `base_epoch` and the next, as far as they were handed over.
    plans: Vec<Arc<EpochPlan>>,
    settings: TrackerSettings,
    mode: TrackerMode,
    /// The slowest lane's epoch: `consumed` covers it and the next.
    base_epoch: u64,
    /// Read positions of `base_epoch` and the next epoch, one bitmap each.
    consumed: [Vec<u64>; 2],
    /// One per lane of the node stream (see [`Generation::lanes`]): each local rank is followed on
    /// its own, so ranks that drift apart (no gradient sync, a slow node) keep their place.
    lanes: Vec<Lane>,
    /// Recent opens and whether each was predicted.
    recent: VecDeque<(FileId, bool)>,
    recent_misses: usize,
    mispredictions: u64,
    /// Opens and predicted opens of the last few epochs, oldest first.
    quality: VecDeque<EpochQuality>,
    /// Opens and predicted opens of the reader's epoch since this prediction was taken up
    /// there (what [`doubts_epoch_start`](Self::doubts_epoch_start) judges: the misses that
    /// led to a switch are not the new prediction's).
    since_followed: EpochQuality,
}

/// Where one lane's reader is: its positions are `lane, lane + lanes, ...` of every epoch.
impl Tracker {
    pub fn new(generation: Arc<Generation>, settings: TrackerSettings) -> Tracker {
        let mut tracker = Tracker {
            generation,
            plans: Vec::new(),
            settings,
            mode: TrackerMode::OnDemand,
            base_epoch: 0,
            consumed: [Vec::new(), Vec::new()],
            lanes: Vec::new(),
            recent: VecDeque::with_capacity(settings.recent),
            recent_misses: 0,
            mispredictions: 0,
            quality: VecDeque::with_capacity(QUALITY_EPOCHS),
            since_followed: EpochQuality::default(),
        };
        tracker.reset(0);
        tracker
    }

    /// Follows `generation` from now on, the reader at its `pos` (a new prediction, or
    /// positions that moved: the plans handed over so far are void). Counts and the recent
    /// opens stay: they are the reader's, whatever predicts it.
    pub fn follow(&mut self, generation: Arc<Generation>, pos: Position) {
        self.generation = generation;
        self.plans.clear();
        self.reset(pos);
    }

    /// Every lane at its first position from `pos`, nothing read after it, predicting if
    /// there is anything to predict.
    fn reset(&mut self, pos: Position) {
        let (epoch, _) = self.generation.split(pos);
        self.base_epoch = epoch;
        self.plans.retain(|p| p.epoch >= epoch);
        let words = self.generation.epoch_len.div_ceil(64) as usize;
        for c in &mut self.consumed {
            c.clear();
            c.resize(words, 0);
        }
        self.place_lanes(pos);
        self.since_followed = EpochQuality {
            epoch,
            ..EpochQuality::default()
        };
        self.mode = if self.generation.predicts() {
            TrackerMode::Predicting
        } else {
            TrackerMode::OnDemand
        };
    }

    /// The generation followed.
    pub fn generation(&self) -> &Arc<Generation> {
        &self.generation
    }

    /// The plan of `epoch`, if it was handed over.
    pub fn planned(&self, epoch: u64) -> Option<&Arc<EpochPlan>> {
        self.plans.iter().find(|p| p.epoch == epoch)
    }

    /// The epochs whose plans the tracker wants and lacks: the reader's and the next.
    pub fn wanted(&self) -> Vec<u64> {
        if !self.generation.predicts() {
            return Vec::new();
        }
        let e = self.base_epoch;
        [e, e + 1]
            .into_iter()
            .filter(|&epoch| self.planned(epoch).is_none())
            .collect()
    }

    /// Takes `plan` (of this generation, for the reader's epoch or the next; a fed epoch's
    /// newer plan replaces the older). False if it is not wanted (another generation's, an
    /// epoch the reader left). Positions of its epoch may now be passed over at once.
    pub fn planned_epoch(&mut self, plan: Arc<EpochPlan>) -> bool {
        if !self.wants_plan(&plan) {
            return false;
        }
        self.plans.retain(|p| p.epoch != plan.epoch);
        self.plans.push(plan);
        if self.mode == TrackerMode::Predicting {
            self.advance();
        }
        true
    }

    /// Whether [`planned_epoch`](Self::planned_epoch) takes `plan`.
    pub fn wants_plan(&self, plan: &EpochPlan) -> bool {
        plan.generation() == self.generation.id
            && (self.base_epoch..=self.base_epoch + 1).contains(&plan.epoch)
    }

    pub fn mode(&self) -> TrackerMode {
        self.mode
    }

    /// The slowest lane's first unread position: nothing before it is still to be read.
    pub fn cursor(&self) -> Position {
        self.lanes.iter().map(|l| l.cursor).min().unwrap_or(0)
    }

    /// Opens not predicted while there was a prediction: matched nowhere within reach while
    /// predicting, and every open while lost.
    pub fn mispredictions(&self) -> u64 {
        self.mispredictions
    }

    /// Share of opens predicted in the latest epoch that had opens; `None` before the first
    /// open and without a prediction.
    pub fn prediction_quality(&self) -> Option<f64> {
        self.quality
            .back()
            .map(|q| q.predicted as f64 / q.opens.max(1) as f64)
    }

    /// Opens and predicted opens per epoch, for the last few epochs, oldest first.
    pub fn quality_by_epoch(&self) -> Vec<EpochQuality> {
        self.quality.iter().copied().collect()
    }

    /// How far ahead of the cursor an open counts as predicted now (see [`reach`]).
    fn reach(&self) -> u64 {
        reach(self.generation.epoch_len, self.settings.window)
    }

    /// (epoch, offset in epoch) of the cursor.
    pub fn epoch_position(&self) -> (u64, u64) {
        self.generation.split(self.cursor())
    }

    /// Files of the most recent opens, oldest first (input to [`find_position`]).
    pub fn recent_files(&self) -> Vec<FileId> {
        self.recent.iter().map(|(f, _)| *f).collect()
    }

    /// Files of the most recent opens that were not predicted, oldest first: where the reader
    /// went when it left the prediction (the input to [`find_position`] once lost; the
    /// predicted opens before them lie elsewhere, and mixed in they can make the new place
    /// unrecognisable, e.g. the end and the start of an epoch).
    pub fn recent_unpredicted(&self) -> Vec<FileId> {
        self.recent
            .iter()
            .filter(|(_, predicted)| !predicted)
            .map(|(f, _)| *f)
            .collect()
    }

    pub fn on_open(&mut self, file: FileId) -> OpenMatch {
        let mut result = OpenMatch::default();
        let epoch = self.base_epoch;
        let before = self.cursor();
        let position = match self.mode {
            TrackerMode::Predicting => {
                // A fed epoch announced since the last open may let the cursor on: judged
                // from where the reader can be now.
                self.advance();
                self.match_open(file)
            }
            TrackerMode::Lost | TrackerMode::OnDemand => None,
        };
        let predicted = position.is_some_and(|p| self.is_predicted(p));
        if self.mode != TrackerMode::OnDemand {
            if !predicted {
                self.mispredictions += 1;
            }
            self.count_quality(epoch, predicted);
        }
        self.remember(file, predicted || self.mode == TrackerMode::OnDemand);
        if let Some(pos) = position {
            // A late read behind its lane's cursor was read there; a match beyond reach is
            // chance (or a file read again early), and marking it would make the real read of
            // that position a misprediction in turn, epoch after epoch. Only predicted opens
            // move the lane's furthest read, which drags its cursor along.
            if predicted || pos < self.lane_at(pos).cursor {
                self.mark(pos);
            }
            if predicted {
                self.predicted_at(pos);
            }
            self.advance();
        }
        let after = self.cursor();
        if after > before {
            result.passed = Some((before, after));
        }
        if self.mode == TrackerMode::Predicting
            && (2 * self.recent_misses > self.settings.recent || self.doubts_epoch_start())
        {
            self.mode = TrackerMode::Lost;
            result.became_lost = true;
        }
        result.position = position;
        result
    }

    /// Whether the first opens of a later epoch of a detected order were mostly unpredicted
    /// (see [`EARLY_OPENS`]).
    fn doubts_epoch_start(&self) -> bool {
        let q = &self.since_followed;
        self.generation.is_detected()
            && q.epoch > 0
            && q.opens <= EARLY_OPENS
            && q.opens - q.predicted >= EARLY_MISSES
    }

    /// Whether an open at `pos` is what the prediction expected: within reach ahead of its
    /// lane's cursor. Behind it is not predicted either: in a wrong order skipped positions
    /// pile up there, and a legitimate late read is rare (the cursor waits half a reach).
    fn is_predicted(&self, pos: Position) -> bool {
        let cursor = self.lane_at(pos).cursor;
        pos >= cursor && pos - cursor < self.reach()
    }

    fn count_quality(&mut self, epoch: u64, predicted: bool) {
        if self.quality.back().is_none_or(|q| q.epoch != epoch) {
            if self.quality.len() == QUALITY_EPOCHS {
                self.quality.pop_front();
            }
            self.quality.push_back(EpochQuality {
                epoch,
                opens: 0,
                predicted: 0,
            });
        }
        let q = self.quality.back_mut().expect("pushed above");
        q.opens += 1;
        q.predicted += u64::from(predicted);
        if self.since_followed.epoch != epoch {
            self.since_followed = EpochQuality {
                epoch,
                ..EpochQuality::default()
            };
        }
        self.since_followed.opens += 1;
        self.since_followed.predicted += u64::from(predicted);
    }

    /// Moves the tracker to `pos` (a resynchronisation result or `stagefs epoch`), every lane
    /// to its first position from there, and resumes predicting.
    pub fn reposition(&mut self, pos: Position) {
        if !self.generation.predicts() {
            return;
        }
        self.reset(pos);
        self.recent.clear();
        self.recent_misses = 0;
        // Everything before `pos` in its epoch counts as read.
        let start = self.generation.join(self.base_epoch, 0);
        for p in start..pos {
            self.mark(p);
        }
        self.advance();
    }

    /// Takes `files` as read where they are predicted from the cursor on (the opens that led to
    /// a [`reposition`](Self::reposition) at the first of them), leaving what they skipped
    /// unread: files still in flight then match when they come.
    pub fn replay(&mut self, files: &[FileId]) {
        for &file in files {
            if let Some(pos) = self.match_open(file)
                && self.is_predicted(pos)
            {
                self.mark(pos);
                self.predicted_at(pos);
            }
        }
        self.advance();
    }

    /// Whether position `pos` was read (by any lane).
    pub fn is_read(&self, pos: Position) -> bool {
        self.is_marked(pos)
    }

    /// When `file` is next needed, as a position on the slowest lane's clock: its
    /// [`next_position`](Self::next_position) less how far that lane runs ahead of the
    /// slowest. [`NEVER`] if there is none. What the cache's eviction ranks files by.
    pub fn next_use(&self, file: FileId) -> Position {
        self.next_position(file)
            .map_or(NEVER, |pos| self.on_slowest_clock(pos))
    }

    /// `file`'s next unread position in the planned epochs (the cursor's and the next) from
    /// its lane's cursor on, while predicting.
    pub fn next_position(&self, file: FileId) -> Option<Position> {
        if self.mode != TrackerMode::Predicting {
            return None;
        }
        for epoch in [self.base_epoch, self.base_epoch + 1] {
            // Only epochs planned already: an open never waits for (or pays for) a plan.
            let plan = self.planned(epoch)?;
            for &off in plan.offsets_of(file) {
                let pos = self.generation.join(epoch, off as u64);
                if pos >= self.lane_at(pos).cursor && !self.is_marked(pos) {
                    return Some(pos);
                }
            }
        }
        None
    }

    fn remember(&mut self, file: FileId, matched: bool) {
        if self.recent.len() == self.settings.recent
            && let Some((_, was_matched)) = self.recent.pop_front()
            && !was_matched
        {
            self.recent_misses -= 1;
        }
        self.recent.push_back((file, matched));
        if !matched {
            self.recent_misses += 1;
        }
    }

    /// The position an open of `file` was read at: its first unread planned position from
    /// one window behind the slowest cursor to one window past the furthest lane's reach, in
    /// each lane; of several lanes', the one its lane predicts nearest that lane's reader (a
    /// file is in every epoch, and with lanes in different epochs two may expect it: the one
    /// reading near it now is the likely reader), else the first.
    fn match_open(&self, file: FileId) -> Option<Position> {
        let lo = self
            .cursor()
            .saturating_sub(self.settings.window)
            .max(self.generation.join(self.base_epoch, 0));
        // Ahead, the window extends from the furthest open, not the cursor: a cursor held back
        // by positions the loader skipped must not stop matching the opens that follow.
        let furthest = (self.lanes.iter())
            .map(|l| l.cursor.max(l.high_water))
            .max()
            .unwrap_or(0);
        let hi = furthest.saturating_add(self.settings.window);
        // The first unread position in each lane, in position order.
        let mut firsts: Vec<Position> = Vec::new();
        'epochs: for epoch in [self.base_epoch, self.base_epoch + 1] {
            // Only epochs planned already: an open must never wait for (or pay for) a plan;
            // the stager's planner computes the next epoch as soon as the cursor enters one.
            let Some(plan) = self.planned(epoch) else {
                break;
            };
            for &off in plan.offsets_of(file) {
                let pos = self.generation.join(epoch, off as u64);
                if pos >= hi {
                    break 'epochs;
                }
                let lane = self.lane_of(pos);
                if pos >= lo
                    && !self.is_marked(pos)
                    && !firsts.iter().any(|&p| self.lane_of(p) == lane)
                {
                    firsts.push(pos);
                }
            }
        }
        let nearest = (firsts.iter().copied())
            .filter(|&pos| self.is_predicted(pos))
            .min_by_key(|&pos| {
                let lane = self.lane_at(pos);
                pos.abs_diff(lane.front().unwrap_or(lane.cursor))
            });
        nearest.or(firsts.first().copied())
    }

    /// (which epoch bitmap, bit index) of a position, if it lies in the two tracked epochs.
    fn bit(&self, pos: Position) -> Option<(usize, usize)> {
        let rel = pos.checked_sub(self.generation.join(self.base_epoch, 0))?;
        let len = self.generation.epoch_len;
        (rel < 2 * len).then(|| ((rel / len) as usize, (rel % len) as usize))
    }

    fn is_marked(&self, pos: Position) -> bool {
        self.bit(pos)
            .and_then(|(e, b)| self.consumed[e].get(b / 64).map(|w| w & (1 << (b % 64))))
            .is_some_and(|w| w != 0)
    }

    fn mark(&mut self, pos: Position) {
        if let Some((e, b)) = self.bit(pos)
            && let Some(word) = self.consumed[e].get_mut(b / 64)
        {
            *word |= 1 << (b % 64);
        }
    }

    fn predicted_at(&mut self, pos: Position) {
        // The median lags the newest by half the sample: a quarter of a (tiny) reach at most.
        let sample = (self.reach() / 4).clamp(1, FRONT_SAMPLE as u64) as usize;
        let lane = self.lane_of(pos);
        let lane = &mut self.lanes[lane];
        lane.high_water = lane.high_water.max(pos);
        while lane.front.len() >= sample {
            lane.front.pop_front();
        }
        lane.front.push_back(pos);
    }
}

#[cfg(test)]
mod tests;
