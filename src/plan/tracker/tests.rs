//! The tracker against orders computed here, the plans it wants handed to it before each open
//! as the engine's planner hands them over.

use super::*;
use crate::catalog::Layout;
use crate::order::{SamplerConfig, SamplerKind};
use crate::plan::{Order, Plan};

/// An order over files whose ids equal their sample indices, and the plans of it.
struct Fixture {
    plan: Plan,
    generation: Arc<Generation>,
}

impl Fixture {
    fn new(n: u32, cfg: SamplerConfig, ranks: Vec<u32>) -> Fixture {
        let layout = Arc::new(Layout::identity(n));
        let plan = Plan::new(cfg, ranks, layout, n as usize).unwrap();
        let generation = plan.generation();
        Fixture { plan, generation }
    }

    fn tracker(&self, settings: TrackerSettings) -> Tracker {
        Tracker::new(self.generation.clone(), settings)
    }

    fn files(&self, epoch: u64) -> Vec<FileId> {
        self.plan.epoch(&self.generation, epoch).files()
    }

    fn join(&self, epoch: u64, offset: u64) -> Position {
        self.generation.join(epoch, offset)
    }

    fn split(&self, pos: Position) -> (u64, u64) {
        self.generation.split(pos)
    }

    /// Hands `t` the plans it wants.
    fn hand_over(&self, t: &mut Tracker) {
        for epoch in t.wanted() {
            t.planned_epoch(self.plan.epoch(&self.generation, epoch));
        }
    }
}

/// Feeds an open, with the tracker's epoch and the next planned first, as the stager's
/// planner thread has them planned (the tracker itself never computes a plan).
fn planned_open(p: &Fixture, t: &mut Tracker, file: FileId) -> OpenMatch {
    p.hand_over(t);
    t.on_open(file)
}

/// A plan over `n` files whose ids equal their sample indices.
fn plan(n: u32, kind: SamplerKind, seed: i128) -> Fixture {
    let mut cfg = SamplerConfig::new(kind);
    cfg.seed = seed;
    Fixture::new(n, cfg, vec![0])
}

#[test]
fn an_open_in_an_unplanned_epoch_is_matched_nowhere() {
    let p = plan(100, SamplerKind::TorchRandom, 7);
    let mut t = p.tracker(TrackerSettings::default());
    let next_epoch_first = p.files(1)[0];
    // Nothing was handed over: no match, and the tracker wants epochs 0 and 1.
    assert_eq!(t.on_open(next_epoch_first).position, None);
    assert_eq!(t.wanted(), [0, 1]);
}

#[test]
fn in_order_opens_move_the_cursor_and_cross_epochs() {
    let p = plan(100, SamplerKind::TorchRandom, 7);
    let mut t = p.tracker(TrackerSettings {
        window: 8,
        ..Default::default()
    });
    for epoch in 0..3 {
        for f in p.files(epoch) {
            assert!(planned_open(&p, &mut t, f).position.is_some());
        }
        assert_eq!(t.epoch_position(), (epoch + 1, 0));
    }
    assert_eq!(t.mispredictions(), 0);
}

#[test]
fn out_of_order_within_window_all_match() {
    let p = plan(1000, SamplerKind::TorchDistributed, 0);
    let mut t = p.tracker(TrackerSettings {
        window: 64,
        ..Default::default()
    });
    let stream = p.files(0);
    // Two workers alternating batches of 16, each worker's batch read backwards.
    for chunk in stream.chunks(32) {
        let (a, b) = chunk.split_at(chunk.len().min(16));
        for f in b.iter().chain(a.iter()).rev() {
            assert!(planned_open(&p, &mut t, *f).position.is_some());
        }
    }
    assert_eq!(t.mispredictions(), 0);
    assert_eq!(t.epoch_position(), (1, 0));
}

#[test]
fn skipped_tail_does_not_stall_the_cursor() {
    let p = plan(200, SamplerKind::Sequential, 0);
    let mut t = p.tracker(TrackerSettings {
        window: 10,
        ..Default::default()
    });
    // The loader drops the last 5 samples of each epoch (drop_last batches).
    for epoch in 0..2 {
        for f in &p.files(epoch)[..195] {
            planned_open(&p, &mut t, *f);
        }
    }
    assert_eq!(t.mispredictions(), 0);
    assert!(t.cursor() >= 200 + 195 - 10, "cursor {}", t.cursor());
}

#[test]
fn a_resumed_job_gets_lost_and_find_position_resyncs() {
    let p = plan(5000, SamplerKind::TorchRandom, 1);
    let mut t = p.tracker(TrackerSettings {
        window: 128,
        ..Default::default()
    });
    // The job resumed at epoch 5.
    let stream = p.files(5);
    let mut lost_at = None;
    for (i, f) in stream.iter().enumerate().take(100) {
        if planned_open(&p, &mut t, *f).became_lost {
            lost_at = Some(i);
            break;
        }
    }
    assert!(lost_at.is_some());
    assert_eq!(t.mode(), TrackerMode::Lost);
    let stream_of = |epoch| p.plan.stream(&p.generation, epoch);
    let (_, pos) = find_position(&p.generation, stream_of, &t.recent_files(), 0..10, 128).unwrap();
    let (epoch, offset) = p.split(pos);
    assert_eq!(epoch, 5);
    assert_eq!(offset, lost_at.unwrap() as u64 + 1);
    t.reposition(pos);
    for f in &stream[offset as usize..] {
        assert!(planned_open(&p, &mut t, *f).position.is_some());
    }
}

#[test]
fn padding_repeats_match_twice() {
    // 10 samples over 4 ranks pads to 12: rank 0..1 read one file twice per epoch overall.
    let mut cfg = SamplerConfig::new(SamplerKind::TorchDistributed);
    cfg.world_size = 4;
    let p = Fixture::new(10, cfg, vec![0, 1, 2, 3]);
    let mut t = p.tracker(TrackerSettings {
        window: 4,
        ..Default::default()
    });
    for f in p.files(0) {
        assert!(planned_open(&p, &mut t, f).position.is_some());
    }
    assert_eq!(t.epoch_position(), (1, 0));
}

/// Whether `t` predicted every one of `opens` (fed in order) and how far it got.
fn all_predicted(p: &Fixture, t: &mut Tracker, opens: &[FileId]) -> bool {
    let before = t.mispredictions();
    for &f in opens {
        planned_open(p, t, f);
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
    let mut t = p.tracker(TrackerSettings::default());
    let reader = plan(2000, SamplerKind::TorchRandom, 2).files(0);
    let mut lost_at = None;
    for (i, &f) in reader.iter().enumerate() {
        if planned_open(&p, &mut t, f).became_lost {
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
        let mut t = p.tracker(TrackerSettings::default());
        for epoch in 0..3 {
            let order = worker_order(&p.files(epoch), 32, workers);
            assert!(
                all_predicted(&p, &mut t, &order),
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

/// With batch opens each batch's files come at once, as its worker starts it, and the
/// workers start together: the first batches of an epoch may come in any order. Here every
/// epoch is the workers' first round, last batch first (Lightning's ImageNet example over a
/// small dataset: 4 workers, 4 batches of 50 an epoch).
#[test]
fn the_first_batches_of_an_epoch_opened_whole_in_any_order_stay_predicted() {
    let p = plan(200, SamplerKind::TorchRandom, 1);
    let mut t = p.tracker(TrackerSettings::default());
    for epoch in 0..3 {
        let files = p.files(epoch);
        let order: Vec<FileId> = files.chunks(50).rev().flatten().copied().collect();
        assert!(all_predicted(&p, &mut t, &order), "epoch {epoch}");
        assert_eq!(t.epoch_position(), (epoch + 1, 0));
    }
    assert_eq!(t.prediction_quality(), Some(1.0));
}

#[test]
fn two_local_ranks_drifting_apart_stay_predicted() {
    let mut cfg = SamplerConfig::new(SamplerKind::TorchDistributed);
    cfg.world_size = 2;
    let p = Fixture::new(2000, cfg, vec![0, 1]);
    let mut t = p.tracker(TrackerSettings::default());
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
        assert!(all_predicted(&p, &mut t, &order), "epoch {epoch}");
    }
    assert_eq!(t.mispredictions(), 0);
    assert_eq!(t.quality_by_epoch().len(), 3);
    assert_eq!(t.prediction_quality(), Some(1.0));
}

#[test]
fn the_next_epoch_counts_only_once_it_is_planned() {
    let p = plan(50, SamplerKind::TorchRandom, 7);
    let mut t = p.tracker(TrackerSettings::default());
    t.planned_epoch(p.plan.epoch(&p.generation, 0));
    let stream = p.files(0);
    for &f in &stream {
        t.on_open(f);
    }
    // Read in epoch 0; epoch 1 is not planned, so no next use is known.
    assert_eq!(t.next_use(stream[0]), NEVER);
    assert!(t.planned(1).is_none());
    let next = p.plan.epoch(&p.generation, 1);
    assert!(t.planned_epoch(next.clone()));
    let at = next.offsets_of(stream[0])[0] as u64;
    assert_eq!(t.next_use(stream[0]), p.join(1, at));
    // The reader crossed into epoch 1 once it was planned.
    assert_eq!(t.epoch_position(), (1, 0));
}

/// A plan of another generation, or of an epoch the reader left, is not taken.
#[test]
fn plans_of_other_generations_and_left_epochs_are_refused() {
    let p = plan(50, SamplerKind::TorchRandom, 7);
    let mut t = p.tracker(TrackerSettings::default());
    let other = plan(50, SamplerKind::TorchRandom, 8);
    let mut cfg = SamplerConfig::new(SamplerKind::NumpyLegacy);
    cfg.seed = 1;
    let order = Order {
        sampler: cfg,
        ranks: vec![0],
        layout: p.generation.layout.clone(),
    };
    let (_, foreign) = other
        .plan
        .adopt(other.plan.prepare(order, 0).unwrap(), true)
        .unwrap();
    assert!(!t.planned_epoch(foreign));
    assert!(!t.planned_epoch(p.plan.epoch(&p.generation, 2)));
    assert!(t.planned_epoch(p.plan.epoch(&p.generation, 1)));
    assert_eq!(t.wanted(), [0]);
}

/// Two ranks of a node launched without gradient sync: one runs far ahead of the other,
/// further than any reach. Each is followed on its own, every open predicted, and a file
/// the fast rank reads soon ranks as soon as one the slow rank reads soon.
#[test]
fn ranks_far_apart_are_each_followed() {
    let mut cfg = SamplerConfig::new(SamplerKind::TorchDistributed);
    cfg.world_size = 2;
    let p = Fixture::new(2000, cfg, vec![0, 1]);
    let mut t = p.tracker(TrackerSettings::default());
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
    assert!(all_predicted(&p, &mut t, &order));
    // Rank 0 starts epoch 1; rank 1 is 400 samples into it, 800 positions further on, and
    // its next file ranks as soon as rank 0's next one.
    assert_eq!(t.cursor(), p.join(1, 0));
    assert_eq!(t.next_use(r0[1000]), p.join(1, 0));
    assert_eq!(t.next_use(r1[1400]), p.join(1, 1));
}

#[test]
fn an_open_matched_beyond_reach_is_a_misprediction_and_does_not_move_the_reader() {
    let p = plan(2000, SamplerKind::Sequential, 0);
    let mut t = p.tracker(TrackerSettings::default());
    let stream = p.files(0);
    // Within the window, but 1500 positions ahead of a reader at 0 (the reach is 500).
    let m = planned_open(&p, &mut t, stream[1500]);
    assert_eq!(m.position, Some(1500));
    assert_eq!(t.mispredictions(), 1);
    // The reader carries on from the start, predicted, and reads 1500 as the file it is.
    assert!(all_predicted(&p, &mut t, &stream[..1500]));
    assert!(all_predicted(&p, &mut t, &stream[1501..]));
    assert_eq!(t.epoch_position(), (1, 0));
    let q = t.quality_by_epoch();
    assert_eq!((q[0].opens, q[0].predicted), (2000, 1999));
}

#[test]
fn on_demand_never_mispredicts() {
    let p = plan(10, SamplerKind::None, 0);
    let mut t = p.tracker(TrackerSettings::default());
    assert_eq!(t.mode(), TrackerMode::OnDemand);
    for f in 0..10 {
        assert_eq!(t.on_open(f), OpenMatch::default());
    }
    assert_eq!(t.mispredictions(), 0);
    assert_eq!(t.prediction_quality(), None);
    assert!(t.quality_by_epoch().is_empty());
}
