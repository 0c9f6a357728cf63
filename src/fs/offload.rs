//! SOURCE calls made for FUSE requests, off the FUSE threads and bounded in time.
//!
//! A request that needs SOURCE (another user's permission check, an attribute or ACL of
//! SOURCE's, a statfs refresh) must not hold a FUSE thread: SOURCE hangs for minutes when a
//! parallel file system's server does, and a mount with every FUSE thread waiting on it
//! answers nobody, not even cache hits. So such a call runs on one of a few threads of its
//! own, and its request is answered when it returns, or with its fallback (what is known
//! without SOURCE) once [`BOUND`] has passed, whichever comes first. The threads are bounded:
//! a hung SOURCE ties up at most [`THREADS`] of them, and once all of them have been stuck
//! past the bound, requests get their fallback at once instead of queueing behind them.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How long a request waits for SOURCE before its fallback answers it. Longer than a loaded
/// parallel file system's slowest metadata call, short enough for `ls` and a loader to
/// carry on.
pub const BOUND: Duration = Duration::from_secs(2);
/// Threads making SOURCE calls for requests: enough for a few users' concurrent checks.
const THREADS: usize = 4;
/// Calls waiting for a thread, at most; past it the oldest is dropped (its request gets its
/// fallback): a long hang must not grow the queue with every request.
const MAX_QUEUED: usize = 1024;

type Task = Box<dyn FnOnce() + Send>;

struct Queue {
    /// Calls not started yet, with when they were asked for.
    calls: VecDeque<(Instant, Task)>,
    /// Fallbacks by deadline (every call has the same bound, so arrival order is theirs).
    deadlines: VecDeque<(Instant, Task)>,
    /// When each thread's current call was asked for, if it is in one.
    busy_since: Vec<Option<Instant>>,
    /// A request got its fallback since SOURCE last answered in time (logged once per stall).
    stalled: bool,
    shutdown: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    work: Condvar,
    timer: Condvar,
}

/// The threads; dropping it lets them end (a thread stuck in SOURCE ends when SOURCE answers).
pub struct Offload {
    shared: Arc<Shared>,
}

impl Offload {
    pub fn start() -> std::io::Result<Offload> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                calls: VecDeque::new(),
                deadlines: VecDeque::new(),
                busy_since: vec![None; THREADS],
                stalled: false,
                shutdown: false,
            }),
            work: Condvar::new(),
            timer: Condvar::new(),
        });
        for slot in 0..THREADS {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("stagefs-source".into())
                .spawn(move || call_loop(&s, slot))?;
        }
        let s = shared.clone();
        std::thread::Builder::new()
            .name("stagefs-bound".into())
            .spawn(move || fallback_loop(&s))?;
        Ok(Offload { shared })
    }

    /// Runs `call` on a SOURCE thread and gives its result to `answer`; if it has not
    /// returned within [`BOUND`] (or every thread is stuck in SOURCE), `answer` gets
    /// `fallback()` instead. `answer` runs once, on whichever thread decides it: keep it short
    /// and free of SOURCE I/O. A call whose request was answered before it started is skipped.
    pub fn run<T: 'static>(
        &self,
        call: impl FnOnce() -> T + Send + 'static,
        answer: impl FnOnce(T) + Send + 'static,
        fallback: impl FnOnce() -> T + Send + 'static,
    ) {
        let answer = Arc::new(Mutex::new(Some(answer)));
        let answered = Arc::new(AtomicBool::new(false));
        let (shared, returned) = (self.shared.clone(), self.shared.clone());
        let late = {
            let (answer, answered) = (answer.clone(), answered.clone());
            move || {
                if let Some(a) = answer.lock().take() {
                    shared.note_stall();
                    answered.store(true, Ordering::SeqCst);
                    a(fallback());
                }
            }
        };
        let on_time = move || {
            if answered.load(Ordering::SeqCst) {
                return;
            }
            let result = call();
            returned.note_answer();
            if let Some(a) = answer.lock().take() {
                a(result);
            }
        };
        let mut q = self.shared.queue.lock();
        let now = Instant::now();
        let stuck = q
            .busy_since
            .iter()
            .all(|b| b.is_some_and(|since| now.saturating_duration_since(since) >= BOUND));
        if stuck || q.shutdown {
            drop(q);
            return late();
        }
        if q.calls.len() >= MAX_QUEUED {
            q.calls.pop_front();
        }
        q.calls.push_back((now, Box::new(on_time)));
        q.deadlines.push_back((now + BOUND, Box::new(late)));
        drop(q);
        self.shared.work.notify_one();
        self.shared.timer.notify_one();
    }
}

impl Shared {
    fn note_stall(&self) {
        if !std::mem::replace(&mut self.queue.lock().stalled, true) {
            log::warn!(
                "SOURCE has not answered within {BOUND:?}: requests that need it are answered from what is known without it until it does"
            );
        }
    }

    fn note_answer(&self) {
        if std::mem::take(&mut self.queue.lock().stalled) {
            log::info!("SOURCE answers again");
        }
    }
}

impl Drop for Offload {
    fn drop(&mut self) {
        self.shared.queue.lock().shutdown = true;
        self.shared.work.notify_all();
        self.shared.timer.notify_all();
    }
}

/// A SOURCE thread: takes the next call, makes it with the lock released.
fn call_loop(shared: &Shared, slot: usize) {
    let mut q = shared.queue.lock();
    loop {
        if q.shutdown {
            return;
        }
        let Some((asked, call)) = q.calls.pop_front() else {
            shared.work.wait(&mut q);
            continue;
        };
        q.busy_since[slot] = Some(asked);
        drop(q);
        call();
        q = shared.queue.lock();
        q.busy_since[slot] = None;
    }
}

/// The bound: answers each request still unanswered at its deadline with its fallback.
fn fallback_loop(shared: &Shared) {
    let mut q = shared.queue.lock();
    loop {
        let now = Instant::now();
        match q.deadlines.front() {
            Some(&(due, _)) if due <= now || q.shutdown => {
                let (_, late) = q.deadlines.pop_front().expect("a front entry");
                drop(q);
                late();
                q = shared.queue.lock();
            }
            Some(&(due, _)) => {
                shared.timer.wait_for(&mut q, due - now);
            }
            None if q.shutdown => return,
            None => shared.timer.wait(&mut q),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_call_that_returns_in_time_answers() {
        let offload = Offload::start().unwrap();
        let (tx, rx) = mpsc::channel();
        offload.run(|| 1, move |v| tx.send(v).unwrap(), || 2);
        assert_eq!(rx.recv().unwrap(), 1);
    }

    /// Calls that never return answer with their fallback after the bound; once every thread
    /// is stuck, later requests get it at once and no call is made for them.
    #[test]
    fn a_hung_call_is_answered_by_its_fallback_and_threads_stay_bounded() {
        let offload = Offload::start().unwrap();
        let (release, hung) = mpsc::channel::<()>();
        let hung = Arc::new(Mutex::new(hung));
        let (tx, rx) = mpsc::channel();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ask = |n: usize| {
            let (hung, tx, calls) = (hung.clone(), tx.clone(), calls.clone());
            offload.run(
                move || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let _ = hung.lock().recv();
                    n
                },
                move |v| tx.send(v).unwrap(),
                move || n + 100,
            );
        };
        for n in 0..THREADS {
            ask(n);
        }
        let mut late: Vec<usize> = (0..THREADS).map(|_| rx.recv().unwrap()).collect();
        late.sort();
        assert_eq!(late, (100..100 + THREADS).collect::<Vec<_>>());
        // Every thread is stuck past the bound now: answered at once, nothing queued.
        ask(7);
        assert_eq!(rx.try_recv(), Ok(107));
        assert!(offload.shared.queue.lock().calls.is_empty());
        drop(release);
        assert!(calls.load(Ordering::SeqCst) <= THREADS);
    }
}
