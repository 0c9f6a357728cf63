//! Where in an epoch the recent opens lie: the searches that place a reader again once its
//! opens stop following the cursor (a resumed job, a wrong seed found to be a variant), and
//! the reach within which an open counts as predicted.

use std::collections::HashSet;

use crate::catalog::{FileId, MaybeFile};
use crate::plan::{Generation, Position};

/// Smallest reach, in positions: the reordering of a small job (two workers, prefetch_factor
/// 2, batches of 64). On epochs shorter than four times this, a quarter of the epoch would not
/// cover it, and a wrong order can pass for a right one (such a dataset is mostly cached whole
/// anyway).
const MIN_REACH: u64 = 256;

/// The share of an epoch the reach may cover: a random open is predicted by chance with
/// probability at most 1 / CHANCE_DIVISOR.
const CHANCE_DIVISOR: u64 = 4;

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

/// Searches epochs `epochs` of `generation` (whose node streams `stream` gives) for the place
/// the recent opens follow: the epoch and offset where most of them fall within one [`reach`]
/// (of `window`), a span chance does not fill. Returns how many it places and the position
/// just after the latest of them, or `None` if no epoch explains at least three quarters.
pub fn find_position(
    generation: &Generation,
    stream: impl Fn(u64) -> Vec<MaybeFile>,
    recent: &[FileId],
    epochs: std::ops::Range<u64>,
    window: u64,
) -> Option<(usize, Position)> {
    if recent.is_empty() || !generation.predicts() {
        return None;
    }
    let span = reach(generation.epoch_len, window);
    let mut best: Option<(usize, Position)> = None;
    for epoch in epochs {
        if let Some(Run { count, after, .. }) = densest_run(&stream(epoch), recent, span)
            && best.is_none_or(|(c, _)| count > c)
        {
            best = Some((count, generation.join(epoch, after)));
        }
    }
    best
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
