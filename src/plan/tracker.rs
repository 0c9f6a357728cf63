//! Where the reader is in the predicted stream.
//!
//! Real loaders do not open files in stream order: DataLoader workers each take whole batches
//! and run `prefetch_factor` batches ahead, local ranks interleave, padding repeats a file in
//! an epoch and every file recurs next epoch. The tracker matches each open to the earliest
//! unread planned position of that file within a tolerance window around the cursor, keeps
//! the cursor at the low-water mark of what was read (positions left behind by more than the
//! window count as skipped), and crosses epoch boundaries as reads move on.
//!
//! Opens that match nothing are mispredictions. When most recent opens miss, the tracker
//! declares itself lost; the stager then searches for the epoch and position the recent opens
//! do follow ([`find_position`]) and either repositions the tracker or stays on demand.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use super::{Plan, Position};
use crate::catalog::{FileId, MaybeFile};

#[derive(Clone, Copy, Debug)]
pub struct TrackerSettings {
    /// Tolerance around the cursor, in positions: how far out of order opens may come. A
    /// DataLoader with 8 workers, prefetch_factor 2, batches of 256 and 8 local ranks keeps
    /// about 8 × 2 × 256 × 8 = 32,768 samples in flight.
    pub window: u64,
    /// How many recent opens are judged for sustained misprediction.
    pub recent: usize,
    /// How many of those must miss before the tracker gives up on its position.
    pub lost_after: usize,
}

impl Default for TrackerSettings {
    fn default() -> Self {
        TrackerSettings {
            window: 65_536,
            recent: 64,
            lost_after: 48,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackerMode {
    /// Opens follow the plan.
    Predicting,
    /// Too many recent opens matched nothing; waiting for a resynchronisation.
    Lost,
    /// No prediction at all (`--sampler none`).
    OnDemand,
}

/// What one open did to the tracker.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct OpenMatch {
    /// The planned position the open was matched to.
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
    /// The cursor's epoch: `consumed` covers it and the next.
    base_epoch: u64,
    /// Read positions of `base_epoch` and the next epoch, one bitmap each.
    consumed: [Vec<u64>; 2],
    cursor: Position,
    high_water: Position,
    recent: VecDeque<(FileId, bool)>,
    recent_misses: usize,
    mispredictions: u64,
}

impl Tracker {
    pub fn new(plan: Arc<Plan>, settings: TrackerSettings) -> Tracker {
        let mode = if plan.predicts() {
            TrackerMode::Predicting
        } else {
            TrackerMode::OnDemand
        };
        let words = plan.epoch_len().div_ceil(64) as usize;
        Tracker {
            plan,
            settings,
            mode,
            base_epoch: 0,
            consumed: [vec![0; words], vec![0; words]],
            cursor: 0,
            high_water: 0,
            recent: VecDeque::with_capacity(settings.recent),
            recent_misses: 0,
            mispredictions: 0,
        }
    }

    pub fn mode(&self) -> TrackerMode {
        self.mode
    }

    pub fn cursor(&self) -> Position {
        self.cursor
    }

    pub fn mispredictions(&self) -> u64 {
        self.mispredictions
    }

    /// (epoch, offset in epoch) of the cursor.
    pub fn epoch_position(&self) -> (u64, u64) {
        self.plan.split(self.cursor)
    }

    /// Files of the most recent opens, oldest first (input to [`find_position`]).
    pub fn recent_files(&self) -> Vec<FileId> {
        self.recent.iter().map(|(f, _)| *f).collect()
    }

    pub fn on_open(&mut self, file: FileId) -> OpenMatch {
        let mut result = OpenMatch::default();
        let position = match self.mode {
            TrackerMode::Predicting => self.match_open(file),
            TrackerMode::Lost | TrackerMode::OnDemand => None,
        };
        if self.mode == TrackerMode::Predicting && position.is_none() {
            self.mispredictions += 1;
        }
        self.remember(
            file,
            position.is_some() || self.mode == TrackerMode::OnDemand,
        );
        if let Some(pos) = position {
            self.mark(pos);
            self.high_water = self.high_water.max(pos);
            let before = self.cursor;
            self.advance();
            if self.cursor > before {
                result.passed = Some((before, self.cursor));
            }
        } else if self.mode == TrackerMode::Predicting
            && self.recent_misses >= self.settings.lost_after
        {
            self.mode = TrackerMode::Lost;
            result.became_lost = true;
        }
        result.position = position;
        result
    }

    /// Moves the tracker to `pos` (a resynchronisation result or `stagefs epoch`)
    /// and resumes predicting.
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
        self.cursor = pos;
        self.high_water = pos;
        self.recent.clear();
        self.recent_misses = 0;
        self.mode = TrackerMode::Predicting;
        // Everything before `pos` in its epoch counts as read.
        let start = self.plan.join(epoch, 0);
        for p in start..pos {
            self.mark(p);
        }
    }

    /// Stops predicting until the next [`reposition`](Self::reposition): the plan's order was
    /// replaced by one that predicts nothing yet.
    pub fn stop_predicting(&mut self) {
        self.mode = TrackerMode::OnDemand;
        self.recent.clear();
        self.recent_misses = 0;
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

    /// Earliest unread planned position of `file` from one window behind the cursor to one
    /// window past the furthest open.
    fn match_open(&self, file: FileId) -> Option<Position> {
        let lo = self
            .cursor
            .saturating_sub(self.settings.window)
            .max(self.plan.join(self.base_epoch, 0));
        // Ahead, the window extends from the furthest open, not the cursor: a cursor held back
        // by positions the loader skipped must not stop matching the opens that follow.
        let hi = self
            .cursor
            .max(self.high_water)
            .saturating_add(self.settings.window);
        for epoch in [self.base_epoch, self.base_epoch + 1] {
            // Only epochs planned already: an open must never wait for (or pay for) a plan;
            // the stager's planner computes the next epoch as soon as the cursor enters one.
            let Some(plan) = self.plan.planned(epoch) else {
                break;
            };
            for &off in plan.offsets_of(file) {
                let pos = self.plan.join(epoch, off as u64);
                if pos >= hi {
                    return None;
                }
                if pos >= lo && !self.is_marked(pos) {
                    return Some(pos);
                }
            }
        }
        None
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

    /// Cursor = first unread position, but never further behind the furthest read than the
    /// window: what a loader left that far behind it is not coming (e.g. a dropped last batch).
    fn advance(&mut self) {
        self.cursor = self
            .cursor
            .max(self.high_water.saturating_sub(self.settings.window));
        while self.is_marked(self.cursor) {
            self.cursor += 1;
        }
        while self.cursor >= self.plan.join(self.base_epoch + 1, 0) {
            // Slide the two epoch bitmaps forward by one epoch.
            self.consumed.swap(0, 1);
            self.consumed[1].fill(0);
            self.base_epoch += 1;
        }
    }
}

/// Searches epochs `epochs` for the place the recent opens follow: the epoch and offset where
/// most of them fall within one window. Returns the position just after the latest matched
/// open, or `None` if no epoch explains at least three quarters of them.
pub fn find_position(
    plan: &Plan,
    recent: &[FileId],
    epochs: std::ops::Range<u64>,
    window: u64,
) -> Option<Position> {
    if recent.is_empty() || !plan.predicts() {
        return None;
    }
    let mut best: Option<(usize, Position)> = None;
    for epoch in epochs {
        if let Some((count, offset)) = densest_run(&plan.stream(epoch), recent, window)
            && best.is_none_or(|(c, _)| count > c)
        {
            best = Some((count, plan.join(epoch, offset)));
        }
    }
    best.map(|(_, pos)| pos)
}

/// Where in `stream` (one epoch) the most of the files of `recent` fall within one window, if
/// at least three quarters of them do: (how many, offset just after the last of them).
pub fn densest_run(stream: &[MaybeFile], recent: &[FileId], window: u64) -> Option<(usize, u64)> {
    let wanted: HashSet<FileId> = recent.iter().copied().collect();
    let needed = (wanted.len() * 3).div_ceil(4).max(1);
    let hits: Vec<u64> = stream
        .iter()
        .enumerate()
        .filter(|(_, f)| f.get().is_some_and(|f| wanted.contains(&f)))
        .map(|(o, _)| o as u64)
        .collect();
    // Densest run of hits spanning at most one window (two-pointer sweep).
    let mut best: Option<(usize, u64)> = None;
    let mut lo = 0;
    for hi in 0..hits.len() {
        while hits[hi] - hits[lo] > window {
            lo += 1;
        }
        let count = hi - lo + 1;
        if count >= needed && best.is_none_or(|(c, _)| count > c) {
            best = Some((count, hits[hi] + 1));
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

    #[test]
    fn on_demand_never_mispredicts() {
        let p = plan(10, SamplerKind::None, 0);
        let mut t = Tracker::new(p, TrackerSettings::default());
        assert_eq!(t.mode(), TrackerMode::OnDemand);
        for f in 0..10 {
            assert_eq!(t.on_open(f), OpenMatch::default());
        }
        assert_eq!(t.mispredictions(), 0);
    }
}
