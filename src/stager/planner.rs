//! Keeping eviction keys and the horizon in step with the reader: the planner thread that
//! computes the next epoch's plan off the state lock when the cursor enters an epoch, and the
//! rekeying of cached files when the cursor moves or jumps.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use parking_lot::MutexGuard;

use super::{Inner, State};
use crate::plan::{NEVER, Position, TrackerMode};

/// Files rekeyed per hold of the state lock after a new epoch is planned: about a millisecond
/// of work, so opens never wait long behind a rekey of millions of cached files.
const REKEY_CHUNK: usize = 2_048;
/// How often an idle planner checks for shutdown.
const IDLE_WAKE: Duration = Duration::from_millis(200);

impl Inner {
    /// Asks the planner for the epoch after the cursor's (see [`Inner::planner`]).
    pub(super) fn plan_ahead(&self, st: &mut State) {
        st.replan = true;
        self.plan_wanted.notify_one();
    }

    /// Whenever the cursor enters an epoch: computes the plan of the next one and gives the
    /// cached files that had no next use within the old horizon their use in it, all without
    /// holding the state lock for long. Done inline, a 14 M-sample plan and the rekey of
    /// millions of cached files would stall every open for seconds at each epoch boundary.
    /// Until it is done, those files rank as not needed and the frontier stops at the boundary.
    pub(super) fn planner(self: Arc<Self>) {
        let mut st = self.state.lock();
        loop {
            while !st.replan {
                if self.shutdown.load(Ordering::SeqCst) {
                    return;
                }
                self.plan_wanted.wait_for(&mut st, IDLE_WAKE);
            }
            st.replan = false;
            let epoch = st.tracker.epoch_position().0;
            drop(st);
            self.plan.forget_before(epoch);
            // The cursor's epoch too: a reader that crossed two short epochs before this
            // thread ran is in one nobody planned, and no open there could match.
            self.plan.epoch(epoch);
            self.plan.epoch(epoch + 1);
            let unkeyed = self.state.lock().space.evict.files_keyed(NEVER);
            for chunk in unkeyed.chunks(REKEY_CHUNK) {
                let mut st = self.state.lock();
                if st.tracker.mode() != TrackerMode::Predicting {
                    break;
                }
                for &file in chunk {
                    if st.space.evict.key(file) == Some(NEVER) {
                        let next = st.tracker.next_use(file);
                        st.space.evict.set_next_use(file, next);
                    }
                }
                // Waiting opens go before the next chunk.
                MutexGuard::unlock_fair(st);
            }
            self.work.notify_all();
            st = self.state.lock();
        }
    }

    /// The cursor moved over [from, to): those files' next uses are now later, and the
    /// lookahead window slid.
    pub(super) fn cursor_passed(&self, st: &mut State, from: Position, to: Position) {
        let mut pos = from;
        while pos < to {
            let (epoch, offset) = self.plan.split(pos);
            // The tracker matched opens only in planned epochs, so these are planned.
            let Some(plan) = self.plan.planned(epoch) else {
                break;
            };
            if offset >= plan.len() {
                // Past a fed epoch's end: nothing is read until the next epoch.
                pos = self.plan.join(epoch + 1, 0).min(to);
                continue;
            }
            let end = (to - pos).min(plan.len() - offset);
            for off in offset..offset + end {
                let Some(file) = plan.file_at(off) else {
                    continue;
                };
                if pos + (off - offset) < st.frontier {
                    st.ahead_bytes = st.ahead_bytes.saturating_sub(self.size_of(file));
                }
                if st.space.evict.contains(file) {
                    let next = st.tracker.next_use(file);
                    st.space.evict.set_next_use(file, next);
                }
            }
            pos += end;
        }
        if st.frontier < to {
            st.frontier = to;
            st.ahead_bytes = 0;
        }
    }

    pub(super) fn rekey_all(&self, st: &mut State) {
        for file in st.space.evict.files() {
            let next = st.tracker.next_use(file);
            st.space.evict.set_next_use(file, next);
        }
    }

    /// The tracker is lost: next uses mean nothing any more. Every cached file becomes less
    /// recently used than whatever the reader opens from now on, so copies staged for the
    /// abandoned prediction go first (counted as wasted if nobody read them) instead of holding
    /// the cache under position keys, which rank below every LRU stamp and no open moves.
    pub(super) fn drop_next_uses(&self, st: &mut State) {
        for file in st.space.evict.files() {
            st.space.evict.set_recently_used(file, 0);
        }
    }

    /// Moves the tracker (and with it the frontier) to `pos`.
    pub(super) fn reposition(&self, st: &mut State, pos: Position) {
        st.tracker.reposition(pos);
        st.frontier = st.tracker.cursor();
        st.ahead_bytes = 0;
        self.rekey_all(st);
        self.plan_ahead(st);
    }
}
