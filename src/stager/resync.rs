//! Finding the job's place again when its opens stop following the prediction (a wrong flag,
//! a resumed job): the message that says so once, and a search of the epochs off the open path.

use std::sync::Arc;

use super::{Inner, State};
use crate::catalog::FileId;
use crate::order::detect;
use crate::plan::{Order, Provenance, TrackerMode};

/// Positions a resynchronisation may scan in total (epochs × epoch length), to bound its CPU.
const RESYNC_BUDGET: u64 = 200_000_000;

impl Inner {
    pub(super) fn lost_message(&self, st: &State) -> String {
        let s = self.plan.sampler();
        let ranks: Vec<String> = self.plan.ranks().iter().map(|r| r.to_string()).collect();
        format!(
            "opens do not follow {} seed {} rank {} of {} (around epoch {}): check --sampler / --seed / --rank / --world-size, \
             or tell stagefs the epoch with `stagefs epoch MOUNT E` (or let the job announce its order: --sampler feed); until it finds its place again \
             stagefs caches files as they are read",
            s.kind,
            s.seed,
            ranks.join(","),
            s.world_size,
            st.tracker.epoch_position().0
        )
    }

    /// Looks for the epoch and position the recent opens follow, off the open path; for a
    /// detected order, also for a variant of it the first epoch could not tell apart.
    pub(super) fn spawn_resync(self: &Arc<Self>, recent: Vec<FileId>, around_epoch: u64) {
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name("stage-resync".into())
            .spawn(move || inner.resync(&recent, around_epoch));
        if let Err(e) = spawned {
            log::warn!("cannot start a resynchronisation thread: {e}");
            self.state.lock().resync_running = false;
        }
    }

    fn resync(&self, recent: &[FileId], around_epoch: u64) {
        // From epoch 0 (a job restarted from scratch) to well past the current epoch (a resumed
        // job), within a CPU budget.
        let span = (RESYNC_BUDGET / self.plan.epoch_len().max(1)).clamp(2, 1000);
        let epochs = 0..around_epoch.saturating_add(span / 2).max(span);
        let window = self.settings.tracker.window;
        let found = crate::plan::find_position(&self.plan, recent, epochs.clone(), window);
        let order = self.plan.order();
        // Found nowhere, or in an earlier epoch (the job repeats one): another configuration
        // may explain the opens better.
        let suspicious = found.is_none_or(|pos| self.plan.split(pos).0 < around_epoch);
        if suspicious
            && let Some((variant, epoch)) = self.better_variant(&order, recent, around_epoch)
        {
            let flags = variant.flags(epoch);
            if order.provenance == Provenance::Detected {
                match self.switch_to(variant, epoch) {
                    Ok(()) => {
                        log::warn!(
                            "--sampler auto: the job's later opens follow {flags}; predicting that"
                        );
                        if let Some(d) = &self.detector {
                            d.refined(flags);
                        }
                        self.state.lock().resync_running = false;
                        return;
                    }
                    Err(e) => log::warn!("cannot follow {flags}: {e}"),
                }
            } else {
                log::warn!(
                    "the job's opens follow {flags}: remount with those flags (or --sampler auto)"
                );
            }
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
                st.lost_reported = false;
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

    /// The variant of `order` (see [`detect::variants`]) that best explains `recent` in the
    /// epochs around `around_epoch`, if one does.
    fn better_variant(
        &self,
        order: &Order,
        recent: &[FileId],
        around_epoch: u64,
    ) -> Option<(Order, u64)> {
        let window = self.settings.tracker.window;
        let mut best: Option<(usize, Order, u64)> = None;
        for sampler in detect::variants(&order.sampler, around_epoch) {
            let variant = Order {
                sampler,
                ranks: order.ranks.clone(),
                provenance: order.provenance,
            };
            for epoch in around_epoch.saturating_sub(1)..=around_epoch + 1 {
                let stream = self.plan.stream_of(&variant, epoch);
                let span = crate::plan::reach(stream.len() as u64, window);
                if let Some(run) = crate::plan::densest_run(&stream, recent, span)
                    && best.as_ref().is_none_or(|(c, ..)| run.count > *c)
                {
                    best = Some((run.count, variant.clone(), epoch));
                }
            }
        }
        best.map(|(_, order, epoch)| (order, epoch))
    }
}
