//! Answering an open: a hit from the cache (a previous mount's copy checked first), otherwise
//! the file queued as urgent and the reader left waiting for its copy or read through from
//! SOURCE; and feeding each open to the tracker, which moves the cursor, the eviction keys
//! and the frontier. Kept apart from the copy workers, which answer the waiting readers.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::MutexGuard;

use super::streams::{self, StreamSlot};
use super::{Answer, Deferred, FileState, Inner, OpenCallback, OpenResult, Opened, State, source};
use crate::cache::OpenCopy;
use crate::catalog::FileId;
use crate::plan::TrackerMode;
use crate::stats::Counters;

/// Opens between two resynchronisation attempts while lost.
const RESYNC_EVERY: u64 = 4096;

impl Inner {
    /// Sends the replies decided while the state lock was held; call it without the lock.
    pub(super) fn finish(&self, deferred: Deferred) {
        for (reply, answer) in deferred {
            reply(match answer {
                Answer::Done(result) => result,
                Answer::FromCache(file) => self
                    .open_cached(file)
                    .map(Opened::Cache)
                    .or_else(|_| self.open_source(file)),
                Answer::FromSource(file) => self.open_source(file),
            });
        }
    }

    /// Answers an open with its cache file.
    fn reply_hit(&self, reply: OpenCallback, copy: Arc<OpenCopy>) {
        Counters::add(&self.counters.hits, 1);
        reply(Ok(Opened::Cache(copy)));
    }

    fn open_cached(&self, file: FileId) -> std::io::Result<Arc<OpenCopy>> {
        self.cache.open_cached(&self.catalog, file)
    }

    /// Opens `file` on SOURCE for a reader (read-through, or no room to stage it).
    fn open_source(&self, file: FileId) -> OpenResult {
        match source::open_verified(&*self.source, &self.catalog, file) {
            Ok(f) => Ok(Opened::Source(f)),
            Err(e) => {
                log::warn!("{e}");
                Err(e.open_error())
            }
        }
    }

    pub(super) fn open(self: &Arc<Self>, file: FileId, reply: OpenCallback) {
        let started = Instant::now();
        // A hit's cache file is opened before the lock is taken (no I/O under it) and before
        // the tracker moves this file to the back of the eviction order: opened after, it was
        // often evicted in between, by the next copy making room (a 30% cache lost a quarter
        // of its hits that way). Copies are immutable and named by their source version, so
        // whatever this opens is the file's bytes if the state then says cached.
        let mut pre_opened = self.open_cached(file).ok();
        let mut st = self.state.lock();
        let stream = self.track_open(&mut st, file);
        if st.unverified.contains(file) {
            // A previous mount's copy: its bytes are checked before any is served, reading
            // the file without the lock held.
            drop(st);
            let verified = self.cache.open_verified(&self.catalog, file);
            st = self.state.lock();
            match verified {
                Ok(f) => {
                    st.unverified.remove(file);
                    drop(st);
                    return self.reply_hit(reply, f);
                }
                // Still that copy (not evicted meanwhile): drop it and stage it again below.
                Err(e) if st.unverified.contains(file) => {
                    log::warn!(
                        "{e}; staging {} again",
                        self.catalog.relative_path(file).display()
                    );
                    self.cache.remove(&self.catalog, file);
                    self.forget_cached(&mut st, file);
                }
                Err(_) => {}
            }
        }
        // A hit. Cached with nothing opened: staged just after the open was tried, or removed
        // behind our back; one more try tells, without the lock.
        for attempt in 0..2 {
            if st.files.get(file) != FileState::Cached {
                break;
            }
            if let Some(f) = pre_opened.take() {
                drop(st);
                return self.reply_hit(reply, f);
            }
            if attempt == 1 {
                log::warn!(
                    "cached copy of {} vanished; staging it again",
                    self.catalog.relative_path(file).display()
                );
                self.forget_cached(&mut st, file);
                break;
            }
            drop(st);
            pre_opened = self.open_cached(file).ok();
            st = self.state.lock();
        }
        let state = st.files.get(file);
        Counters::add(&self.counters.misses, 1);
        st.streams.miss(stream);
        let size = self.size_of(file);
        let read_through = size >= self.settings.read_through_above;
        if state == FileState::Remote || state == FileState::Cached {
            st.files.set(file, FileState::Queued);
            st.urgent.push_back(file);
            self.work.notify_one();
        }
        if read_through {
            drop(st);
            let result = self.open_source(file);
            Counters::add(
                &self.counters.stall_nanos,
                started.elapsed().as_nanos() as u64,
            );
            reply(result);
        } else {
            st.waiters.add(file, reply, started);
        }
    }

    /// Counts an open under its stream, and feeds one of the predicted stream to the tracker.
    fn track_open(self: &Arc<Self>, st: &mut MutexGuard<'_, State>, file: FileId) -> StreamSlot {
        st.unread.remove(&file);
        st.access_seq += 1;
        if self.plan.in_predicted_stream(file) {
            self.track_predicted(st, file);
            return st.streams.predicted_open();
        }
        // Another stream's (validation, label files): cached as read, judged against nothing.
        let seq = st.access_seq;
        if st.space.evict.contains(file) {
            st.space.evict.set_recently_used(file, seq);
        }
        let name = self.plan.other_stream_of(file).unwrap_or_else(|| {
            crate::catalog::dataset_name(&self.catalog, streams::dataset_of(&self.catalog, file))
        });
        st.streams.other_open(name)
    }

    /// Feeds an open to the tracker and keeps eviction keys and the frontier consistent with
    /// where the cursor went.
    fn track_predicted(self: &Arc<Self>, st: &mut MutexGuard<'_, State>, file: FileId) {
        let epoch_before = st.tracker.epoch_position().0;
        let m = st.tracker.on_open(file);
        match st.tracker.mode() {
            TrackerMode::Predicting => {
                if let Some((from, to)) = m.passed {
                    self.cursor_passed(st, from, to);
                }
                if st.tracker.epoch_position().0 != epoch_before {
                    // A new epoch enters the horizon: plan it and rekey, off this lock.
                    self.plan_ahead(st);
                } else if st.space.evict.contains(file) {
                    let next = st.tracker.next_use(file);
                    st.space.evict.set_next_use(file, next);
                }
                // The lookahead window slid: if a copy is due, one idle worker takes it and
                // wakes the next if there is more. Waking workers for nothing (everything
                // ahead cached) would cost every open two context switches.
                if m.passed.is_some() && self.copy_due(st) {
                    self.work.notify_one();
                }
            }
            TrackerMode::Lost | TrackerMode::OnDemand => {
                if m.became_lost {
                    self.drop_next_uses(st);
                }
                let seq = st.access_seq;
                if st.space.evict.contains(file) {
                    st.space.evict.set_recently_used(file, seq);
                }
            }
        }
        if m.became_lost && st.hint.is_none() {
            let hint = self.lost_message(st);
            log::warn!("{hint}");
            st.hint = Some(hint);
        }
        if st.tracker.mode() == TrackerMode::Lost {
            st.opens_since_resync += 1;
            if !st.resync_running && (m.became_lost || st.opens_since_resync >= RESYNC_EVERY) {
                st.resync_running = true;
                st.opens_since_resync = 0;
                let (recent, epoch) = (
                    st.tracker.recent_unpredicted(),
                    st.tracker.epoch_position().0,
                );
                if !self.spawn_resync(recent, epoch) {
                    st.resync_running = false;
                }
            }
        }
    }
}
