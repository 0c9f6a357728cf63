//! Finding the job's place again when its opens stop following the prediction (a wrong flag,
//! a resumed job): the message that says so once, and a search of the epochs off the open path.

use std::sync::Arc;

use super::detection::Detector;
use super::{Inner, State};
use crate::catalog::FileId;
use crate::order::{SamplerKind, detect};
use crate::plan::{Order, Provenance, TrackerMode};

/// Positions a resynchronisation may scan in total (epochs × epoch length), to bound its CPU.
const RESYNC_BUDGET: u64 = 200_000_000;

impl Inner {
    /// What the log and the statistics say when the opens stop following the prediction: the
    /// likely causes for this sampler, in the flags that fix them.
    pub(super) fn lost_message(&self, st: &State) -> String {
        let order = self.plan.order();
        let epoch = st.tracker.epoch_position().0;
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

    /// Looks for the epoch and position the recent opens follow, off the open path; for a
    /// detected order, also for a variant of it the first epoch could not tell apart.
    /// False if the thread could not be started (the caller, holding the state lock, clears
    /// `resync_running`).
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

    fn resync(&self, recent: &[FileId], around_epoch: u64) {
        let window = self.settings.tracker.window;
        let find = |epochs: std::ops::Range<u64>| {
            crate::plan::find_position(&self.plan, recent, epochs, window)
        };
        // The reader's epoch and the next first: a job that skipped ahead, or a loader that
        // raced past a gap. Found in an earlier epoch, or explaining fewer of the opens than
        // another configuration does (a detected order is switched to it), the search
        // widens to every epoch a restarted or resumed job may be in.
        let order = self.plan.order();
        let near = self
            .placed(&order, recent, around_epoch)
            .filter(|&(_, epoch, _)| epoch >= around_epoch);
        let variant = self
            .best_variant(&order, recent, around_epoch)
            .filter(|(count, ..)| near.is_none_or(|(n, ..)| *count > n));
        if let Some((_, variant, epoch)) = variant
            && self.follow_variant(&order, variant, epoch)
        {
            self.state.lock().resync_running = false;
            return;
        }
        let mut found = near.map(|(_, epoch, offset)| self.plan.join(epoch, offset));
        // From epoch 0 (a job restarted from scratch) to well past the current epoch (a resumed
        // job), within a CPU budget.
        let span = (RESYNC_BUDGET / self.plan.epoch_len().max(1)).clamp(2, 1000);
        let epochs = 0..around_epoch.saturating_add(span / 2).max(span);
        if found.is_none() {
            found = find(epochs.clone());
        }
        if let Some(pos) = found {
            // Planned before taking the lock: opens meanwhile go on.
            self.plan.epoch(self.plan.split(pos).0);
        }
        let mut st = self.state.lock();
        st.resync_running = false;
        match found {
            Some(pos) if st.tracker.mode() == TrackerMode::Lost => {
                self.reposition(&mut st, pos);
                let (e, o) = self.plan.split(pos);
                log::warn!(
                    "found the job's place again: epoch {e}, position {o}; staging ahead resumes"
                );
                st.hint = None;
            }
            Some(_) => {}
            None => log::info!(
                "recent opens match no position in epochs {}..{}; still caching on demand",
                epochs.start,
                epochs.end
            ),
        }
        drop(st);
        self.work.notify_all();
    }

    /// Switches a detected order to `variant`, which explains the recent opens better with
    /// the reader in `epoch` (true); for one the user configured, the log says which flags
    /// would predict it.
    fn follow_variant(&self, order: &Order, variant: Order, epoch: u64) -> bool {
        // Named as the job would be from its start: the epoch it was first found in.
        let start = self.detector.as_ref().map_or(epoch, Detector::found_at);
        let flags = variant.flags(start.min(epoch));
        if order.provenance != Provenance::Detected {
            let hint = format!(
                "the job's opens follow {flags}: remount with those flags (or with none: --sampler auto)"
            );
            let mut st = self.state.lock();
            // Said once, not at every resynchronisation while lost.
            if st.hint.as_ref() != Some(&hint) {
                log::warn!("{hint}");
                st.hint = Some(hint);
            }
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
    ) -> Option<(usize, u64, u64)> {
        let window = self.settings.tracker.window;
        (around_epoch.saturating_sub(1)..=around_epoch + 1)
            .filter_map(|epoch| {
                let stream = self.plan.stream_of(order, epoch);
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
                    provenance: order.provenance,
                    layout: order.layout.clone(),
                };
                let (count, epoch, _) = self.placed(&variant, recent, around_epoch)?;
                Some((count, variant, epoch))
            })
            .max_by_key(|(count, ..)| *count)
    }
}
