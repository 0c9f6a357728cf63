//! Finding the job's place again when its opens stop following the prediction (a wrong flag,
//! a resumed job, a variant of a detected order): a search of the epochs off the open path,
//! asked for by the core ([`Effects::resync`](super::core::Effects)) and answered to it.

use std::sync::Arc;

use super::Inner;
use super::detection::Detector;
use crate::catalog::FileId;
use crate::order::detect;
use crate::plan::{Generation, Order, Position};

/// Positions a resynchronisation may scan in total (epochs × epoch length), to bound its CPU.
const RESYNC_BUDGET: u64 = 200_000_000;

impl Inner {
    /// Looks for the epoch and position the recent opens follow, off the open path; for a
    /// detected order, also for a variant of it the first epoch could not tell apart.
    /// False if the thread could not be started.
    pub(super) fn spawn_resync(self: &Arc<Self>, recent: Vec<FileId>, around_epoch: u64) -> bool {
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name("stage-resync".into())
            .spawn(move || inner.resync(&recent, around_epoch));
        if let Err(e) = &spawned {
            log::warn!("cannot start a resynchronisation thread: {e}");
        }
        spawned.is_ok()
    }

    fn resync(self: &Arc<Self>, recent: &[FileId], around_epoch: u64) {
        let generation = self.core.lock().generation().clone();
        // The reader's epoch and the next first: a job that skipped ahead, or a loader that
        // raced past a gap. Found in an earlier epoch, or explaining fewer of the opens than
        // another configuration does (a detected order is switched to it), the search
        // widens to every epoch a restarted or resumed job may be in.
        let near = generation.order().and_then(|order| {
            let placed = self.placed(order, recent, around_epoch);
            placed.filter(|&(_, epoch, _)| epoch >= around_epoch)
        });
        let variant = generation
            .order()
            .and_then(|order| self.best_variant(order, recent, around_epoch))
            .filter(|(count, ..)| near.is_none_or(|(n, ..)| *count > n));
        if let Some((_, variant, epoch)) = variant
            && self.follow_variant(&generation, variant, epoch)
        {
            self.run(|core| ((), core.resync_done(None)));
            return;
        }
        let mut found = near.map(|(_, epoch, offset)| generation.join(epoch, offset));
        // From epoch 0 (a job restarted from scratch) to well past the current epoch (a resumed
        // job), within a CPU budget.
        let span = (RESYNC_BUDGET / generation.epoch_len.max(1)).clamp(2, 1000);
        let epochs = 0..around_epoch.saturating_add(span / 2).max(span);
        if found.is_none() {
            let window = self.settings.tracker.window;
            let stream = |epoch| self.plan.stream(&generation, epoch);
            found = crate::plan::find_position(&generation, stream, recent, epochs.clone(), window)
                .map(|(_, pos)| pos);
        }
        let plan = found.map(|pos| {
            // Planned before taking the lock: opens meanwhile go on.
            self.plan.epoch(&generation, generation.split(pos).0)
        });
        if found.is_none() {
            log::info!(
                "recent opens match no position in epochs {}..{}; still caching on demand",
                epochs.start,
                epochs.end
            );
        }
        self.run(|core| {
            // The reader moved first: a plan of an epoch the tracker did not want yet is
            // refused, and the opens until the planner made it again were mispredictions.
            let mut effects = core.resync_done(found);
            if let Some(p) = plan {
                effects.merge(core.planned(p));
            }
            ((), effects)
        });
    }

    /// Switches a detected order to `variant`, which explains the recent opens better with
    /// the reader in `epoch` (true); for one the user configured, the hint says which flags
    /// would predict it.
    fn follow_variant(
        self: &Arc<Self>,
        generation: &Generation,
        variant: Order,
        epoch: u64,
    ) -> bool {
        // Named as the job would be from its start: the epoch it was first found in.
        let start = self.detector.as_ref().map_or(epoch, Detector::found_at);
        let flags = variant.flags(start.min(epoch));
        if !generation.is_detected() {
            let hint = format!(
                "the job's opens follow {flags}: remount with those flags (or with none: --sampler auto)"
            );
            self.core.lock().set_hint(hint);
            return false;
        }
        match self.switch_to(variant, epoch) {
            Ok(false) => false,
            Ok(true) => {
                log::warn!("--sampler auto: the job's later opens follow {flags}; predicting that");
                if let Some(d) = &self.detector {
                    d.refined(flags);
                }
                true
            }
            Err(e) => {
                log::warn!("cannot follow {flags}: {e}");
                false
            }
        }
    }

    /// Where `order` places the most of `recent` in the epochs around `around_epoch`: how
    /// many, in which epoch, and the offset just after the last of them.
    fn placed(
        &self,
        order: &Order,
        recent: &[FileId],
        around_epoch: u64,
    ) -> Option<(usize, u64, Position)> {
        let window = self.settings.tracker.window;
        (around_epoch.saturating_sub(1)..=around_epoch + 1)
            .filter_map(|epoch| {
                let stream = order.stream(epoch);
                let span = crate::plan::reach(stream.len() as u64, window);
                let run = crate::plan::densest_run(&stream, recent, span)?;
                Some((run.count, epoch, run.after))
            })
            .max_by_key(|&(count, ..)| count)
    }

    /// The variant of `order` that best explains `recent` in the epochs around `around_epoch`:
    /// how many of them it places, the variant, and the epoch they are in.
    fn best_variant(
        &self,
        order: &Order,
        recent: &[FileId],
        around_epoch: u64,
    ) -> Option<(usize, Order, u64)> {
        detect::variants(&order.sampler, around_epoch)
            .into_iter()
            .filter_map(|sampler| {
                // One replica's order is the node's whole stream, whichever rank opened first.
                let ranks = if sampler.world_size == 1 {
                    vec![0]
                } else {
                    order.ranks.clone()
                };
                let variant = Order {
                    sampler,
                    ranks,
                    layout: order.layout.clone(),
                };
                let (count, epoch, _) = self.placed(&variant, recent, around_epoch)?;
                Some((count, variant, epoch))
            })
            .max_by_key(|(count, ..)| *count)
    }
}
