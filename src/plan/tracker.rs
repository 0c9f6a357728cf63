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

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use super::{NEVER, Plan, Position};
use crate::catalog::{FileId, MaybeFile};
use crate::stats::EpochQuality;

/// Smallest reach, in positions: the reordering of a small job (two workers, prefetch_factor
/// 2, batches of 64). On epochs shorter than four times this, a quarter of the epoch would not
/// cover it, and a wrong order can pass for a right one (such a dataset is mostly cached whole
/// anyway).
const MIN_REACH: u64 = 256;

/// The share of an epoch the reach may cover: a random open is predicted by chance with
/// probability at most 1 / CHANCE_DIVISOR.
const CHANCE_DIVISOR: u64 = 4;

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

impl Default for TrackerSettings {
    fn default() -> Self {
        TrackerSettings {
            window: 65_536,
            recent: 64,
        }
    }
}

/// How far ahead of the cursor an open may land and count as predicted:
/// min(window, max(256, epoch_len / 4)). A quarter of an epoch bounds what chance achieves
/// (see [`TrackerSettings::recent`]); the floor covers a small job's reordering; the window is
/// the user's bound. The cursor skips positions half a reach behind the furthest predicted
/// open, so a loader may keep up to half a reach in flight: 32,768 samples with the defaults
/// on an epoch of 262,144 or more, e.g. 8 workers × prefetch 2 × batches of 256 × 8 ranks.
pub fn reach(epoch_len: u64, window: u64) -> u64 {
    (epoch_len / CHANCE_DIVISOR)
        .max(MIN_REACH)
        .min(window)
        .max(1)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackerMode {
    /// Opens follow the plan.
    Predicting,
    /// Too few recent opens were predicted; waiting for a resynchronisation.
    Lost,
    /// No prediction at all (`--sampler none`).
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
    plan: Arc<Plan>,
    settings: TrackerSettings,
    mode: TrackerMode,
    /// The slowest lane's epoch: `consumed` covers it and the next.
    base_epoch: u64,
    /// Read positions of `base_epoch` and the next epoch, one bitmap each.
    consumed: [Vec<u64>; 2],
    /// One per lane of the node stream (see [`Plan::lanes`]): each local rank is followed on
    /// its own, so ranks that drift apart (no gradient sync, a slow node) keep their place.
    lanes: Vec<Lane>,
    /// Recent opens and whether each was predicted.
    recent: VecDeque<(FileId, bool)>,
    recent_misses: usize,
    mispredictions: u64,
    /// Opens and predicted opens of the last few epochs, oldest first.
    quality: VecDeque<EpochQuality>,
}

/// Where one lane's reader is: its positions are `lane, lane + lanes, ...` of every epoch.
#[derive(Clone, Debug)]
struct Lane {
    /// The lane's first unread position (see [`Tracker::advance`]).
    cursor: Position,
    /// The lane's furthest predicted open (where matching reaches to).
    high_water: Position,
    /// The lane's last [`FRONT_SAMPLE`] predicted positions, whose median drags its cursor.
    front: VecDeque<Position>,
}

impl Lane {
    fn at(cursor: Position) -> Lane {
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
    fn front(&self) -> Option<Position> {
        let mut recent: Vec<Position> = self.front.iter().copied().collect();
        let middle = recent.len() / 2;
        (!recent.is_empty()).then(|| *recent.select_nth_unstable(middle).1)
    }
}

impl Tracker {
    pub fn new(plan: Arc<Plan>, settings: TrackerSettings) -> Tracker {
        let mode = if plan.predicts() {
            TrackerMode::Predicting
        } else {
            TrackerMode::OnDemand
        };
        let words = plan.epoch_len().div_ceil(64) as usize;
        let mut tracker = Tracker {
            plan,
            settings,
            mode,
            base_epoch: 0,
            consumed: [vec![0; words], vec![0; words]],
            lanes: Vec::new(),
            recent: VecDeque::with_capacity(settings.recent),
            recent_misses: 0,
            mispredictions: 0,
            quality: VecDeque::with_capacity(QUALITY_EPOCHS),
        };
        tracker.place_lanes(0);
        tracker
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
        reach(self.plan.epoch_len(), self.settings.window)
    }

    /// (epoch, offset in epoch) of the cursor.
    pub fn epoch_position(&self) -> (u64, u64) {
        self.plan.split(self.cursor())
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
        self.quality.back().is_some_and(|q| {
            q.epoch > 0 && q.opens <= EARLY_OPENS && q.opens - q.predicted >= EARLY_MISSES
        }) && self.plan.order().provenance == super::Provenance::Detected
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
    }

    /// Moves the tracker to `pos` (a resynchronisation result or `stagefs epoch`), every lane
    /// to its first position from there, and resumes predicting.
    pub fn reposition(&mut self, pos: Position) {
        if !self.plan.predicts() {
            return;
        }
        let (epoch, _) = self.plan.split(pos);
        self.base_epoch = epoch;
        // A fed plan's epochs get longer when an announcement needs it.
        let words = self.plan.epoch_len().div_ceil(64) as usize;
        for c in &mut self.consumed {
            c.clear();
            c.resize(words, 0);
        }
        self.place_lanes(pos);
        self.recent.clear();
        self.recent_misses = 0;
        self.mode = TrackerMode::Predicting;
        // Everything before `pos` in its epoch counts as read.
        let start = self.plan.join(epoch, 0);
        for p in start..pos {
            self.mark(p);
        }
        self.advance();
    }

    /// A lane per lane of the plan, each at its first position from `pos`.
    fn place_lanes(&mut self, pos: Position) {
        self.lanes = vec![Lane::at(pos); self.plan.lanes()];
        for lane in 0..self.lanes.len() {
            self.lanes[lane] = Lane::at(self.align(pos, lane));
        }
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

    /// Stops predicting until the next [`reposition`](Self::reposition): the plan's order was
    /// replaced by one that predicts nothing yet.
    pub fn stop_predicting(&mut self) {
        self.mode = TrackerMode::OnDemand;
        self.recent.clear();
        self.recent_misses = 0;
    }

    /// Whether position `pos` was read (by any lane).
    pub fn is_read(&self, pos: Position) -> bool {
        self.is_marked(pos)
    }

    /// When `file` is next needed, as a position on the slowest lane's clock: its next unread
    /// position in the planned epochs (the cursor's and the next) from its lane's cursor on,
    /// less how far that lane runs ahead of the slowest. [`NEVER`] if it is not within them.
    /// What the cache's eviction ranks files by.
    pub fn next_use(&self, file: FileId) -> Position {
        if !self.plan.predicts() {
            return NEVER;
        }
        for epoch in [self.base_epoch, self.base_epoch + 1] {
            // Only epochs planned already: an open never waits for (or pays for) a plan.
            let Some(plan) = self.plan.planned(epoch) else {
                break;
            };
            for &off in plan.offsets_of(file) {
                let pos = self.plan.join(epoch, off as u64);
                if pos >= self.lane_at(pos).cursor && !self.is_marked(pos) {
                    return self.on_slowest_clock(pos);
                }
            }
        }
        NEVER
    }

    /// `pos` on the slowest lane's clock: a lane ahead of the others reads its positions that
    /// much sooner.
    pub fn on_slowest_clock(&self, pos: Position) -> Position {
        let lane = self.lane_of(pos);
        let in_step = self.align(self.cursor(), lane);
        let lead = self.lanes[lane].cursor.saturating_sub(in_step);
        pos.saturating_sub(lead).max(self.cursor())
    }

    /// Which lane `pos` belongs to.
    fn lane_of(&self, pos: Position) -> usize {
        let (_, offset) = self.plan.split(pos);
        (offset % self.lanes.len().max(1) as u64) as usize
    }

    fn lane_at(&self, pos: Position) -> &Lane {
        &self.lanes[self.lane_of(pos)]
    }

    /// Lane `lane`'s first position at or after `pos`.
    fn align(&self, pos: Position, lane: usize) -> Position {
        let lanes = self.lanes.len().max(1) as u64;
        let (epoch, offset) = self.plan.split(pos);
        let aligned = offset + (lane as u64 + lanes - offset % lanes) % lanes;
        if aligned >= self.plan.epoch_len() {
            return self.plan.join(epoch + 1, lane as u64);
        }
        self.plan.join(epoch, aligned)
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
            .max(self.plan.join(self.base_epoch, 0));
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
            let Some(plan) = self.plan.planned(epoch) else {
                break;
            };
            for &off in plan.offsets_of(file) {
                let pos = self.plan.join(epoch, off as u64);
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
        let rel = pos.checked_sub(self.plan.join(self.base_epoch, 0))?;
        let len = self.plan.epoch_len();
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

    /// Every lane's cursor = its first unread position, but never more than half a reach
    /// behind its reader's front ([`Lane::front`]): what a loader left that far behind it is
    /// not coming (e.g. a dropped last batch), and the opens after it must stay within reach.
    /// Positions never read are passed over at once: a sample that cannot be served, a slot
    /// a shorter rank leaves empty, and the rest of a fed epoch shorter than the epoch length
    /// once the next one has been announced. The bitmaps slide on as the slowest lane leaves
    /// an epoch; a lane cannot run more than an epoch ahead of the slowest.
    fn advance(&mut self) {
        let half_reach = self.reach() / 2;
        loop {
            for lane in 0..self.lanes.len() {
                if let Some(front) = self.lanes[lane].front() {
                    let dragged = self.align(front.saturating_sub(half_reach), lane);
                    self.lanes[lane].cursor = self.lanes[lane].cursor.max(dragged);
                }
                let cursor = self.passed_over(self.lanes[lane].cursor, lane);
                self.lanes[lane].cursor = cursor;
            }
            if self.cursor() < self.plan.join(self.base_epoch + 1, 0) {
                break;
            }
            // Slide the two epoch bitmaps forward by one epoch.
            self.consumed.swap(0, 1);
            self.consumed[1].fill(0);
            self.base_epoch += 1;
        }
    }

    /// Lane `lane`'s first position from `cursor` on that is still to be read.
    fn passed_over(&self, mut cursor: Position, lane: usize) -> Position {
        let lanes = self.lanes.len() as u64;
        loop {
            let (epoch, offset) = self.plan.split(cursor);
            let Some(plan) = self.plan.planned(epoch) else {
                return cursor;
            };
            let past_end = offset >= plan.len();
            if past_end {
                // On to the next epoch once it is planned and has positions at all.
                if self
                    .plan
                    .planned(epoch + 1)
                    .is_some_and(|next| next.len() > 0)
                {
                    cursor = self.plan.join(epoch + 1, lane as u64);
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
            } else if plan.len() < self.plan.epoch_len() {
                // Past the end of a (fed) epoch shorter than the epoch length: wait there for
                // the next one to be announced.
                self.plan.join(epoch, plan.len())
            } else {
                self.plan.join(epoch + 1, lane as u64)
            };
        }
    }
}

/// Searches epochs `epochs` for the place the recent opens follow: the epoch and offset where
/// most of them fall within one [`reach`] (of `window`), a span chance does not fill. Returns
/// the position just after the latest matched open, or `None` if no epoch explains at least
/// three quarters of them.
pub fn find_position(
    plan: &Plan,
    recent: &[FileId],
    epochs: std::ops::Range<u64>,
    window: u64,
) -> Option<Position> {
    if recent.is_empty() || !plan.predicts() {
        return None;
    }
    let span = reach(plan.epoch_len(), window);
    let mut best: Option<(usize, Position)> = None;
    for epoch in epochs {
        if let Some(Run { count, after, .. }) = densest_run(&plan.stream(epoch), recent, span)
            && best.is_none_or(|(c, _)| count > c)
        {
            best = Some((count, plan.join(epoch, after)));
        }
    }
    best.map(|(_, pos)| pos)
}

/// Where a run of opens lies in one epoch's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// How many of the opens it places.
    pub count: usize,
    /// Offset of the first of them.
    pub first: u64,
    /// Offset just after the last of them.
    pub after: u64,
}

/// Where in `stream` (one epoch) the most of the files of `recent` fall within one window, if
/// at least three quarters of them do.
pub fn densest_run(stream: &[MaybeFile], recent: &[FileId], window: u64) -> Option<Run> {
    let wanted: HashSet<FileId> = recent.iter().copied().collect();
    let needed = (wanted.len() * 3).div_ceil(4).max(1);
    let hits: Vec<u64> = stream
        .iter()
        .enumerate()
        .filter(|(_, f)| f.get().is_some_and(|f| wanted.contains(&f)))
        .map(|(o, _)| o as u64)
        .collect();
    // Densest run of hits spanning at most one window (two-pointer sweep).
    let mut best: Option<Run> = None;
    let mut lo = 0;
    for hi in 0..hits.len() {
        while hits[hi] - hits[lo] > window {
            lo += 1;
        }
        let count = hi - lo + 1;
        if count >= needed && best.is_none_or(|b| count > b.count) {
            best = Some(Run {
                count,
                first: hits[lo],
                after: hits[hi] + 1,
            });
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Layout;
    use crate::order::{SamplerConfig, SamplerKind};

    /// Feeds an open, with the tracker's epoch and the next planned first, as the stager's
    /// planner thread has them planned (the tracker itself never computes a plan).
    fn planned_open(t: &mut Tracker, file: FileId) -> OpenMatch {
        let epoch = t.epoch_position().0;
        t.plan.epoch(epoch);
        t.plan.epoch(epoch + 1);
        t.on_open(file)
    }

    #[test]
    fn an_open_in_an_unplanned_epoch_does_not_wait_for_its_plan() {
        let p = plan(100, SamplerKind::TorchRandom, 7);
        let mut t = Tracker::new(p.clone(), TrackerSettings::default());
        let next_epoch_first = p.files(1)[0];
        // Epoch 1 is not planned (stream() does not keep it): no match there, no plan made.
        let _ = t.on_open(next_epoch_first);
        assert!(p.planned(1).is_none());
    }

    /// A plan over `n` files whose ids equal their sample indices.
    fn plan(n: u32, kind: SamplerKind, seed: i128) -> Arc<Plan> {
        let mut cfg = SamplerConfig::new(kind);
        cfg.seed = seed;
        let layout = Arc::new(Layout::identity(n));
        Arc::new(Plan::new(cfg, vec![0], layout, n as usize).unwrap())
    }

    #[test]
    fn in_order_opens_move_the_cursor_and_cross_epochs() {
        let p = plan(100, SamplerKind::TorchRandom, 7);
        let mut t = Tracker::new(
            p.clone(),
            TrackerSettings {
                window: 8,
                ..Default::default()
            },
        );
        for epoch in 0..3 {
            for f in p.files(epoch) {
                assert!(planned_open(&mut t, f).position.is_some());
            }
            assert_eq!(t.epoch_position(), (epoch + 1, 0));
        }
        assert_eq!(t.mispredictions(), 0);
    }

    #[test]
    fn out_of_order_within_window_all_match() {
        let p = plan(1000, SamplerKind::TorchDistributed, 0);
        let mut t = Tracker::new(
            p.clone(),
            TrackerSettings {
                window: 64,
                ..Default::default()
            },
        );
        let stream = p.files(0);
        // Two workers alternating batches of 16, each worker's batch read backwards.
        for chunk in stream.chunks(32) {
            let (a, b) = chunk.split_at(chunk.len().min(16));
            for f in b.iter().chain(a.iter()).rev() {
                assert!(planned_open(&mut t, *f).position.is_some());
            }
        }
        assert_eq!(t.mispredictions(), 0);
        assert_eq!(t.epoch_position(), (1, 0));
    }

    #[test]
    fn skipped_tail_does_not_stall_the_cursor() {
        let p = plan(200, SamplerKind::Sequential, 0);
        let mut t = Tracker::new(
            p.clone(),
            TrackerSettings {
                window: 10,
                ..Default::default()
            },
        );
        // The loader drops the last 5 samples of each epoch (drop_last batches).
        for epoch in 0..2 {
            for f in &p.files(epoch)[..195] {
                planned_open(&mut t, *f);
            }
        }
        assert_eq!(t.mispredictions(), 0);
        assert!(t.cursor() >= 200 + 195 - 10, "cursor {}", t.cursor());
    }

    #[test]
    fn a_resumed_job_gets_lost_and_find_position_resyncs() {
        let p = plan(5000, SamplerKind::TorchRandom, 1);
        let mut t = Tracker::new(
            p.clone(),
            TrackerSettings {
                window: 128,
                ..Default::default()
            },
        );
        // The job resumed at epoch 5.
        let stream = p.files(5);
        let mut lost_at = None;
        for (i, f) in stream.iter().enumerate().take(100) {
            if planned_open(&mut t, *f).became_lost {
                lost_at = Some(i);
                break;
            }
        }
        assert!(lost_at.is_some());
        assert_eq!(t.mode(), TrackerMode::Lost);
        let pos = find_position(&p, &t.recent_files(), 0..10, 128).unwrap();
        let (epoch, offset) = p.split(pos);
        assert_eq!(epoch, 5);
        assert_eq!(offset, lost_at.unwrap() as u64 + 1);
        t.reposition(pos);
        for f in &stream[offset as usize..] {
            assert!(planned_open(&mut t, *f).position.is_some());
        }
    }

    #[test]
    fn padding_repeats_match_twice() {
        // 10 samples over 4 ranks pads to 12: rank 0..1 read one file twice per epoch overall.
        let mut cfg = SamplerConfig::new(SamplerKind::TorchDistributed);
        cfg.world_size = 4;
        let layout = Arc::new(Layout::identity(10));
        let p = Arc::new(Plan::new(cfg, vec![0, 1, 2, 3], layout, 10).unwrap());
        let mut t = Tracker::new(
            p.clone(),
            TrackerSettings {
                window: 4,
                ..Default::default()
            },
        );
        for f in p.files(0) {
            assert!(planned_open(&mut t, f).position.is_some());
        }
        assert_eq!(t.epoch_position(), (1, 0));
    }

    /// Whether `t` predicted every one of `opens` (fed in order) and how far it got.
    fn all_predicted(t: &mut Tracker, opens: &[FileId]) -> bool {
        let before = t.mispredictions();
        for &f in opens {
            planned_open(t, f);
        }
        t.mispredictions() == before
    }

    /// The order `workers` DataLoader workers open an epoch in: worker w takes batches w,
    /// w + workers, ... and reads each in order; the workers take turns open by open.
    fn worker_order(stream: &[FileId], batch: usize, workers: usize) -> Vec<FileId> {
        let batches: Vec<&[FileId]> = stream.chunks(batch).collect();
        let mut queues: Vec<Vec<FileId>> = (0..workers)
            .map(|w| {
                let mine = batches.iter().skip(w).step_by(workers);
                mine.flat_map(|b| b.iter().copied()).rev().collect()
            })
            .collect();
        let mut order = Vec::with_capacity(stream.len());
        while order.len() < stream.len() {
            for q in &mut queues {
                order.extend(q.pop());
            }
        }
        order
    }

    #[test]
    fn a_wrong_seed_on_a_dataset_shorter_than_the_window_gets_lost_and_keeps_counting() {
        // Every file has a position within the default window: matching alone accepts anything.
        let p = plan(2000, SamplerKind::TorchRandom, 1);
        let mut t = Tracker::new(p, TrackerSettings::default());
        let reader = plan(2000, SamplerKind::TorchRandom, 2).files(0);
        let mut lost_at = None;
        for (i, &f) in reader.iter().enumerate() {
            if planned_open(&mut t, f).became_lost {
                lost_at = Some(i);
            }
        }
        let lost_at = lost_at.expect("lost within the epoch");
        assert!(lost_at < 100, "lost only after {} opens", lost_at + 1);
        assert_eq!(t.mode(), TrackerMode::Lost);
        // Lost, every open is one stagefs did not predict: the count went on to the end.
        assert_eq!(t.mispredictions(), 2000 - t.quality_by_epoch()[0].predicted);
        let q = t.quality_by_epoch();
        assert_eq!((q.len(), q[0].epoch, q[0].opens), (1, 0, 2000));
        assert!(t.prediction_quality().unwrap() < 0.05, "{q:?}");
    }

    #[test]
    fn dataloader_workers_reordering_batches_stay_predicted_over_three_epochs() {
        for workers in [2, 4] {
            let p = plan(2000, SamplerKind::TorchRandom, 1);
            let mut t = Tracker::new(p.clone(), TrackerSettings::default());
            for epoch in 0..3 {
                let order = worker_order(&p.files(epoch), 32, workers);
                assert!(
                    all_predicted(&mut t, &order),
                    "{workers} workers, epoch {epoch}"
                );
                assert_eq!(t.epoch_position(), (epoch + 1, 0));
            }
            let per_epoch: Vec<(u64, u64, u64)> = t
                .quality_by_epoch()
                .iter()
                .map(|q| (q.epoch, q.opens, q.predicted))
                .collect();
            assert_eq!(
                per_epoch,
                [(0, 2000, 2000), (1, 2000, 2000), (2, 2000, 2000)]
            );
            assert_eq!(t.prediction_quality(), Some(1.0));
        }
    }

    #[test]
    fn two_local_ranks_drifting_apart_stay_predicted() {
        let mut cfg = SamplerConfig::new(SamplerKind::TorchDistributed);
        cfg.world_size = 2;
        let layout = Arc::new(Layout::identity(2000));
        let p = Arc::new(Plan::new(cfg, vec![0, 1], layout, 2000).unwrap());
        let mut t = Tracker::new(p.clone(), TrackerSettings::default());
        // A fixed pseudo-random schedule: either rank may run up to 24 samples ahead.
        let mut rng = 0x2545_f491_u64;
        for epoch in 0..3 {
            // Rank r's i-th sample is at position 2i + r of the merged node stream.
            let merged = p.files(epoch);
            let mut next = [0usize; 2];
            let mut order = Vec::new();
            while next[0] + next[1] < merged.len() {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let mut r = (rng >> 33) as usize % 2;
                if next[r] >= next[1 - r] + 24 || 2 * next[r] + r >= merged.len() {
                    r = 1 - r;
                }
                order.push(merged[2 * next[r] + r]);
                next[r] += 1;
            }
            assert!(all_predicted(&mut t, &order), "epoch {epoch}");
        }
        assert_eq!(t.mispredictions(), 0);
        assert_eq!(t.quality_by_epoch().len(), 3);
        assert_eq!(t.prediction_quality(), Some(1.0));
    }

    #[test]
    fn the_next_epoch_counts_only_once_it_is_planned() {
        let p = plan(50, SamplerKind::TorchRandom, 7);
        p.epoch(0);
        let mut t = Tracker::new(p.clone(), TrackerSettings::default());
        let stream = p.files(0);
        for &f in &stream {
            t.on_open(f);
        }
        // Read in epoch 0; epoch 1 is not planned, so no next use is known.
        assert_eq!(t.next_use(stream[0]), NEVER);
        assert_eq!(t.plan.planned_file_at(p.join(1, 0)), None);
        let next = p.epoch(1);
        let at = next.offsets_of(stream[0])[0] as u64;
        assert_eq!(t.next_use(stream[0]), p.join(1, at));
        assert_eq!(
            t.plan.planned_file_at(p.join(1, 0)),
            Some(Some(next.file_at(0).unwrap()))
        );
    }

    /// Two ranks of a node launched without gradient sync: one runs far ahead of the other,
    /// further than any reach. Each is followed on its own, every open predicted, and a file
    /// the fast rank reads soon ranks as soon as one the slow rank reads soon.
    #[test]
    fn ranks_far_apart_are_each_followed() {
        let mut cfg = SamplerConfig::new(SamplerKind::TorchDistributed);
        cfg.world_size = 2;
        let layout = Arc::new(Layout::identity(2000));
        let p = Arc::new(Plan::new(cfg, vec![0, 1], layout, 2000).unwrap());
        let mut t = Tracker::new(p.clone(), TrackerSettings::default());
        // Rank 1 reads 400 samples (800 positions, beyond the reach of 500) before rank 0
        // starts; then both go on at the same pace to the end of epoch 1.
        let lane = |epoch: u64, r: usize| -> Vec<FileId> {
            p.files(epoch).into_iter().skip(r).step_by(2).collect()
        };
        let (r0, r1): (Vec<FileId>, Vec<FileId>) = (
            [lane(0, 0), lane(1, 0)].concat(),
            [lane(0, 1), lane(1, 1)].concat(),
        );
        let mut order: Vec<FileId> = r1[..400].to_vec();
        for i in 0..1000 {
            order.extend([r0[i], r1[400 + i]]);
        }
        assert!(all_predicted(&mut t, &order));
        // Rank 0 starts epoch 1; rank 1 is 400 samples into it, 800 positions further on, and
        // its next file ranks as soon as rank 0's next one.
        assert_eq!(t.cursor(), p.join(1, 0));
        assert_eq!(t.next_use(r0[1000]), p.join(1, 0));
        assert_eq!(t.next_use(r1[1400]), p.join(1, 1));
    }

    #[test]
    fn an_open_matched_beyond_reach_is_a_misprediction_and_does_not_move_the_reader() {
        let p = plan(2000, SamplerKind::Sequential, 0);
        let mut t = Tracker::new(p.clone(), TrackerSettings::default());
        let stream = p.files(0);
        // Within the window, but 1500 positions ahead of a reader at 0 (the reach is 500).
        let m = planned_open(&mut t, stream[1500]);
        assert_eq!(m.position, Some(1500));
        assert_eq!(t.mispredictions(), 1);
        // The reader carries on from the start, predicted, and reads 1500 as the file it is.
        assert!(all_predicted(&mut t, &stream[..1500]));
        assert!(all_predicted(&mut t, &stream[1501..]));
        assert_eq!(t.epoch_position(), (1, 0));
        let q = t.quality_by_epoch();
        assert_eq!((q[0].opens, q[0].predicted), (2000, 1999));
    }

    #[test]
    fn on_demand_never_mispredicts() {
        let p = plan(10, SamplerKind::None, 0);
        let mut t = Tracker::new(p, TrackerSettings::default());
        assert_eq!(t.mode(), TrackerMode::OnDemand);
        for f in 0..10 {
            assert_eq!(t.on_open(f), OpenMatch::default());
        }
        assert_eq!(t.mispredictions(), 0);
        assert_eq!(t.prediction_quality(), None);
        assert!(t.quality_by_epoch().is_empty());
    }
}
