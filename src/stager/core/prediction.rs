//! The prediction as the core follows it: a new generation (an order found or switched to,
//! the job's announcements, an epoch that grew), the reader repositioned (`stagefs epoch`, its
//! place found again), epoch plans handed over as the shell computes them, and eviction keys
//! kept in step with where the reader is.

use std::sync::Arc;

use super::{Core, Effects, Wake};
use crate::catalog::FileId;
use crate::order::SamplerKind;
use crate::plan::{EpochPlan, Generation, NEVER, Position, Prediction, TrackerMode};

impl<R> Core<R> {
    /// The generation the core follows and the epochs it wants planned, if any.
    pub fn wanted_epochs(&self) -> Option<(Arc<Generation>, Vec<u64>)> {
        let wanted = self.tracker.wanted();
        (!wanted.is_empty()).then(|| (self.tracker.generation().clone(), wanted))
    }

    /// An epoch plan the shell computed. Taken if the tracker still wants it (its generation,
    /// the reader's epoch or the next; a fed epoch's newer plan replaces the older): staging
    /// ahead may go on into it, and copies not needed within the old horizon are rekeyed by
    /// the shell ([`unplanned`](Self::unplanned), [`rekey`](Self::rekey)).
    pub fn planned(&mut self, plan: Arc<EpochPlan>) -> Effects<R> {
        let mut effects = Effects::default();
        if !self.tracker.wants_plan(&plan) {
            return effects;
        }
        // A newer plan of an epoch the frontier may have walked already, as its older plan
        // had it (a fed epoch announced ahead, or by one more rank, after the frontier passed
        // it empty or partial): the frontier comes back to stage what is new.
        if self.tracker.planned(plan.epoch).is_some() {
            let start = self.tracker.generation().join(plan.epoch, 0);
            self.rewind_frontiers(start);
        }
        let before = self.tracker.cursor();
        self.tracker.planned_epoch(plan);
        let after = self.tracker.cursor();
        if after > before {
            self.cursor_passed(before, after);
            // The reader crossed into an epoch whose successor is still to be planned.
            effects.plan = self.wanted_epochs().is_some();
        }
        effects.wake(Wake::All);
        effects
    }

    /// Cached files whose next use is not known: a new plan may know it.
    pub fn unplanned(&self) -> Vec<FileId> {
        self.space.evict.unplanned()
    }

    /// Tells the eviction policy the next use of `files`. False once not predicting (nothing
    /// to tell).
    pub fn rekey(&mut self, files: &[FileId]) -> bool {
        if self.tracker.mode() != TrackerMode::Predicting {
            return false;
        }
        for &file in files {
            if self.space.evict.contains(file) {
                let next = self.next_need(file);
                if next != NEVER {
                    self.space.evict.needed_at(file, next);
                }
            }
        }
        true
    }

    /// Follows `generation` from now on, the reader at its position `pos`, with the plans
    /// computed for it so far. An older generation than the one followed is ignored (two
    /// announcements racing to the lock).
    pub fn follow(
        &mut self,
        generation: Arc<Generation>,
        pos: Position,
        plans: Vec<Arc<EpochPlan>>,
    ) -> Effects<R> {
        let mut effects = Effects::default();
        if generation.id < self.tracker.generation().id {
            return effects;
        }
        self.tracker.follow(generation, pos);
        for plan in plans {
            self.tracker.planned_epoch(plan);
        }
        self.tracker.reposition(pos);
        self.place_frontiers(self.tracker.cursor());
        self.ahead_bytes = 0;
        if self.tracker.mode() == TrackerMode::Predicting {
            self.rekey_all();
        } else {
            self.drop_next_uses();
        }
        self.hint = None;
        self.follow_stream();
        effects.plan = self.wanted_epochs().is_some();
        effects.wake(Wake::All);
        effects
    }

    /// Follows an order found from the reader's opens, the reader at `pos` (where the first
    /// of its recent opens is in that order): those opens are taken as read where the order
    /// has them from there on, and staging goes on from the furthest.
    pub fn adopt_found(
        &mut self,
        generation: Arc<Generation>,
        pos: Position,
        plan: Arc<EpochPlan>,
    ) -> Effects<R> {
        let recent = self.tracker.recent_files();
        let effects = self.follow(generation, pos, vec![plan]);
        self.tracker.replay(&recent);
        self.catch_up_frontiers();
        effects
    }

    /// Moves the reader (and with it the frontier) to `pos`: `stagefs epoch`, or its place
    /// found again.
    pub fn reposition(&mut self, pos: Position) -> Effects<R> {
        self.tracker.reposition(pos);
        self.place_frontiers(self.tracker.cursor());
        self.ahead_bytes = 0;
        self.rekey_all();
        Effects {
            plan: self.wanted_epochs().is_some(),
            wake: Wake::All,
            ..Effects::default()
        }
    }

    /// The search the core asked for ([`Effects::resync`]) is over: it found the reader at
    /// `found`, or nowhere.
    pub fn resync_done(&mut self, found: Option<Position>) -> Effects<R> {
        self.resync_running = false;
        match found {
            Some(pos) if self.tracker.mode() == TrackerMode::Lost => {
                let effects = self.reposition(pos);
                let (e, o) = self.tracker.generation().split(pos);
                log::warn!(
                    "found the job's place again: epoch {e}, position {o}; staging ahead resumes"
                );
                self.hint = None;
                effects
            }
            _ => Effects::default(),
        }
    }

    /// The cursor moved over [from, to): those files' next uses are now later, and the
    /// lookahead window slid.
    pub(super) fn cursor_passed(&mut self, from: Position, to: Position) {
        let generation = self.tracker.generation().clone();
        let mut pos = from;
        while pos < to {
            let (epoch, offset) = generation.split(pos);
            // The tracker moves only over planned epochs.
            let Some(plan) = self.tracker.planned(epoch).cloned() else {
                break;
            };
            if offset >= plan.len() {
                // Past a fed epoch's end: nothing is read until the next epoch.
                pos = generation.join(epoch + 1, 0).min(to);
                continue;
            }
            let end = (to - pos).min(plan.len() - offset);
            for off in offset..offset + end {
                let Some(file) = plan.file_at(off) else {
                    continue;
                };
                if self.behind_frontier(pos + (off - offset)) {
                    let size = self.size_of(file).unwrap_or(0);
                    self.ahead_bytes = self.ahead_bytes.saturating_sub(size);
                }
                if self.space.evict.contains(file) {
                    let next = self.next_need(file);
                    self.space.evict.needed_at(file, next);
                }
            }
            pos += end;
        }
        self.catch_up_frontiers();
    }

    /// Every cached file keyed by its next use from where the reader is.
    fn rekey_all(&mut self) {
        for file in self.space.evict.files() {
            let next = self.next_need(file);
            self.space.evict.needed_at(file, next);
        }
    }

    /// The tracker is lost (or nothing is predicted): next uses mean nothing any more. Every
    /// cached file becomes less recently used than whatever the reader opens from now on, so
    /// copies staged for the abandoned prediction go first (counted as wasted if nobody read
    /// them) instead of holding the cache under position keys, which rank below every LRU
    /// stamp and no open moves.
    pub(super) fn drop_next_uses(&mut self) {
        for file in self.space.evict.files() {
            self.space.evict.stale(file);
        }
    }

    /// Counts opens under the stream the prediction follows now (after it changed).
    pub(super) fn follow_stream(&mut self) {
        let generation = self.tracker.generation();
        let name = generation.predicts().then(|| match &generation.prediction {
            Prediction::Announced(Some(stream)) => stream.name.clone(),
            _ => generation.layout.name().to_owned(),
        });
        self.streams.follow(name);
    }

    /// What the log and the statistics say when the opens stop following the prediction: the
    /// likely causes for this sampler, in the flags that fix them.
    pub(super) fn lost_message(&self) -> String {
        let generation = self.tracker.generation();
        let epoch = self.tracker.epoch_position().0;
        let Some(order) = generation.order() else {
            return format!(
                "opens stopped following the job's announcements around epoch {epoch}: another \
                 loader reads the same files in another order, or the job changed its order \
                 after announcing it. Until the opens match again, files are cached as they are read"
            );
        };
        let causes = match order.sampler.kind {
            SamplerKind::TorchDistributed => {
                "a wrong --seed, --world-size or --ranks; a job that never calls \
                 sampler.set_epoch(epoch) (--no-set-epoch); a job resumed at another epoch \
                 (`stagefs epoch MOUNT E`)"
            }
            SamplerKind::TorchRandom => {
                "a wrong --seed; the wrong --generator (loader: DataLoader(generator=g); sampler: \
                 RandomSampler(generator=g); global: torch.manual_seed only, and nothing else may \
                 draw from it); --persistent-workers if the DataLoader keeps its workers"
            }
            SamplerKind::NumpyLegacy => {
                "a wrong --seed; np.random.shuffle(idx) each epoch (--sampler numpy-inplace)"
            }
            _ => "a wrong --sampler or --seed",
        };
        format!(
            "opens stopped following {} around epoch {epoch}; likely causes: {causes}. \
             Mount without prediction flags to let stagefs find the order (--sampler auto), or let \
             the job announce it (`stagefs feed-env`). Until the opens match again, files are cached as they are read",
            order.flags(epoch)
        )
    }

    /// Says `hint` in the log (once) and the statistics: a search found the job's opens
    /// follow other flags than the configured ones.
    pub fn set_hint(&mut self, hint: String) {
        if self.hint.as_ref() != Some(&hint) {
            log::warn!("{hint}");
            self.hint = Some(hint);
        }
    }
}
