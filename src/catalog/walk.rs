//! SOURCE's metadata calls at mount time (directory listings, the index's directories
//! re-checked) made on several threads at once, and never waited for forever.
//!
//! Each call to a parallel file system costs a network round trip, so several run at once; and
//! one that never returns (a hung server, a dead client) must not hang the mount without a
//! word: the walk gives up once no call has made progress (an entry read, a directory done)
//! for [`Walking::stall`], naming what it was waiting for. The threads are its own, not
//! scoped: one stuck in the kernel is left behind, and ends when its call does.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How long the walk waits for SOURCE without any progress before it gives up: far longer than
/// a loaded parallel file system takes to list a directory's next chunk.
pub const STALL: Duration = Duration::from_secs(60);
/// How often a walk reports progress: often enough to show it is alive on a slow file system,
/// rarely enough not to flood a log.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);
/// How often the waiting thread looks at the progress.
const CHECK_INTERVAL: Duration = Duration::from_millis(200);

/// How a walk runs: how many calls at once, and how long it waits for SOURCE at most.
#[derive(Clone, Copy, Debug)]
pub struct Walking {
    pub threads: usize,
    pub stall: Duration,
}

impl Walking {
    /// `threads` calls at once, giving up after [`STALL`] without progress.
    pub fn threads(threads: usize) -> Walking {
        Walking {
            threads,
            stall: STALL,
        }
    }
}

/// Progress of a walk, counted by whatever its calls read (entries, directories).
#[derive(Default)]
pub struct Progress(AtomicU64);

impl Progress {
    pub fn tick(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a walk does with each path: the paths to visit next, or why the walk cannot go on.
type Visit<E> = dyn Fn(&PathBuf, &Progress) -> Result<Vec<PathBuf>, E> + Send + Sync;

/// Why a walk ended early.
pub enum WalkError<E> {
    /// A visit said the walk cannot go on.
    Failed(E),
    /// Nothing progressed for the stall bound; these were being visited.
    Stalled(Vec<PathBuf>),
}

struct Queue {
    pending: VecDeque<PathBuf>,
    /// Queued or being visited; the walk is over when this reaches zero.
    outstanding: usize,
    /// What each thread is visiting.
    visiting: Vec<Option<PathBuf>>,
}

struct Shared<E> {
    queue: Mutex<Queue>,
    wake: Condvar,
    done: Condvar,
    progress: Progress,
    failed: Mutex<Option<E>>,
    /// Set when the walk ended early: threads still in a call drop its result and leave.
    abandoned: AtomicBool,
}

/// Visits every path of `start`, and every path a visit returns, with `walking.threads`
/// visits at once. `what` names the walk in progress reports.
pub fn walk<E: Send + 'static>(
    start: Vec<PathBuf>,
    walking: Walking,
    what: &str,
    visit: impl Fn(&PathBuf, &Progress) -> Result<Vec<PathBuf>, E> + Send + Sync + 'static,
) -> Result<(), WalkError<E>> {
    let threads = walking.threads.max(1);
    let shared = Arc::new(Shared {
        queue: Mutex::new(Queue {
            outstanding: start.len(),
            pending: start.into(),
            visiting: vec![None; threads],
        }),
        wake: Condvar::new(),
        done: Condvar::new(),
        progress: Progress::default(),
        failed: Mutex::new(None),
        abandoned: AtomicBool::new(false),
    });
    let visit = Arc::new(visit);
    let workers: Vec<_> = (0..threads)
        .map(|slot| {
            let (shared, visit) = (shared.clone(), visit.clone());
            std::thread::Builder::new()
                .name("stagefs-walk".into())
                .spawn(move || work(&shared, slot, &*visit))
                .expect("spawn a walk thread")
        })
        .collect();
    let outcome = wait(&shared, walking.stall, what);
    // Ended early, a thread may still be in a call that never returns: it is left behind.
    if outcome.is_ok() {
        for w in workers {
            let _ = w.join();
        }
    }
    outcome
}

/// One thread: visits what is pending until nothing is, or the walk is over.
fn work<E>(shared: &Shared<E>, slot: usize, visit: &Visit<E>) {
    loop {
        let path = {
            let mut q = shared.queue.lock();
            loop {
                if shared.abandoned.load(Ordering::SeqCst) || q.outstanding == 0 {
                    return;
                }
                if let Some(p) = q.pending.pop_front() {
                    q.visiting[slot] = Some(p.clone());
                    break p;
                }
                shared.wake.wait(&mut q);
            }
        };
        let result = visit(&path, &shared.progress);
        shared.progress.tick();
        let mut q = shared.queue.lock();
        q.visiting[slot] = None;
        match result {
            Ok(more) => {
                q.outstanding += more.len();
                q.pending.extend(more);
            }
            Err(e) => {
                shared.failed.lock().get_or_insert(e);
                shared.abandoned.store(true, Ordering::SeqCst);
            }
        }
        q.outstanding -= 1;
        drop(q);
        shared.wake.notify_all();
        shared.done.notify_all();
    }
}

/// Waits for the walk to end, reporting progress, and gives up once nothing progressed for
/// `stall`.
fn wait<E>(shared: &Shared<E>, stall: Duration, what: &str) -> Result<(), WalkError<E>> {
    let started = Instant::now();
    let (mut last_count, mut last_change, mut last_report) = (0, started, started);
    let mut q = shared.queue.lock();
    loop {
        if let Some(e) = shared.failed.lock().take() {
            return Err(WalkError::Failed(e));
        }
        if q.outstanding == 0 {
            return Ok(());
        }
        shared.done.wait_for(&mut q, CHECK_INTERVAL);
        let (count, now) = (shared.progress.count(), Instant::now());
        if count != last_count {
            (last_count, last_change) = (count, now);
        } else if now.duration_since(last_change) >= stall && q.outstanding > 0 {
            shared.abandoned.store(true, Ordering::SeqCst);
            shared.wake.notify_all();
            return Err(WalkError::Stalled(
                q.visiting.iter().flatten().cloned().collect(),
            ));
        }
        if now.duration_since(last_report) >= PROGRESS_INTERVAL {
            last_report = now;
            log::info!("{what}: {count} entries in {:.0?}", started.elapsed());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_is_visited_once_and_what_hangs_is_named() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let tree = walk::<()>(
            vec![PathBuf::new()],
            Walking::threads(3),
            "test",
            move |p, _| {
                record.lock().push(p.clone());
                Ok(match p.components().count() {
                    depth if depth < 3 => (0..3).map(|i| p.join(i.to_string())).collect(),
                    _ => Vec::new(),
                })
            },
        );
        assert!(tree.is_ok());
        assert_eq!(seen.lock().len(), 1 + 3 + 9 + 27);

        let (release, hang) = std::sync::mpsc::channel::<()>();
        let hang = Mutex::new(hang);
        let walking = Walking {
            threads: 2,
            stall: Duration::from_millis(300),
        };
        let stuck = walk::<()>(
            vec!["ok".into(), "hung".into()],
            walking,
            "test",
            move |p, _| {
                if p == &PathBuf::from("hung") {
                    let _ = hang.lock().recv();
                }
                Ok(Vec::new())
            },
        );
        match stuck {
            Err(WalkError::Stalled(waiting)) => assert_eq!(waiting, vec![PathBuf::from("hung")]),
            _ => panic!("a hung visit was waited for"),
        }
        drop(release);

        let failed = walk(vec!["a".into()], Walking::threads(2), "test", |_, _| Err(7));
        assert!(matches!(failed, Err(WalkError::Failed(7))));
    }
}
