//! Finding the job's place again when its opens stop following the prediction (a wrong flag,
//! a resumed job): the message that says so once, and a search of the epochs off the open path.

use std::sync::Arc;

use super::{Inner, State};
use crate::catalog::FileId;
use crate::plan::TrackerMode;

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

    /// Looks for the epoch and position the recent opens follow, off the open path.
    pub(super) fn spawn_resync(self: &Arc<Self>, recent: Vec<FileId>, around_epoch: u64) {
        // From epoch 0 (a job restarted from scratch) to well past the current epoch (a resumed
        // job), within a CPU budget.
        let span = (RESYNC_BUDGET / self.plan.epoch_len().max(1)).clamp(2, 1000);
        let epochs = 0..around_epoch.saturating_add(span / 2).max(span);
        let inner = self.clone();
        let spawned = std::thread::Builder::new().name("stage-resync".into()).spawn(move || {
            let found = crate::plan::find_position(
                &inner.plan,
                &recent,
                epochs.clone(),
                inner.settings.tracker.window,
            );
            if let Some(pos) = found {
                // Planned before taking the lock: opens meanwhile go on.
                inner.plan.epoch(inner.plan.split(pos).0);
            }
            let mut st = inner.state.lock();
            st.resync_running = false;
            match found {
                Some(pos) if st.tracker.mode() == TrackerMode::Lost => {
                    inner.reposition(&mut st, pos);
                    let (e, o) = inner.plan.split(pos);
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
            inner.work.notify_all();
        });
        if let Err(e) = spawned {
            log::warn!("cannot start a resynchronisation thread: {e}");
            self.state.lock().resync_running = false;
        }
    }
}
