//! Answers delayed by a fixed latency without holding up the FUSE session: the session thread
//! hands each reply over as a closure with its deadline and goes on reading requests; one
//! thread answers them when their deadlines pass. Every delayed request of a mount gets the
//! same latency, so the order they arrive in is their deadline order and a FIFO queue is the
//! whole schedule.
//!
//! The remote can also be frozen, as a parallel file system whose server stopped answering:
//! then nothing is answered, delayed or not, until it is thawed.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How many requests were delayed, and how many at most were waiting at the same moment (a
/// server that answered one request at a time would never have more than one).
#[derive(Debug, Default)]
pub(super) struct DelayCounters {
    pub lookups: AtomicU64,
    pub opens: AtomicU64,
    in_flight: AtomicU64,
    pub max_in_flight: AtomicU64,
}

type Answer = Box<dyn FnOnce() + Send>;

struct Queue {
    pending: VecDeque<(Instant, Answer)>,
    /// Answers held while frozen, of requests that have no latency.
    held: Vec<Answer>,
    frozen: bool,
    /// Set when the mount ends: whatever waits is answered at once.
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    counters: Arc<DelayCounters>,
}

/// The answering thread; dropping it answers what is left and joins the thread.
pub(super) struct Delayer {
    latency: Duration,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Delayer {
    pub fn start(latency: Duration, counters: Arc<DelayCounters>) -> std::io::Result<Delayer> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                pending: VecDeque::new(),
                held: Vec::new(),
                frozen: false,
                closed: false,
            }),
            wake: Condvar::new(),
            counters,
        });
        let answering = shared.clone();
        let thread = std::thread::Builder::new()
            .name("slow-remote-delay".into())
            .spawn(move || answer_when_due(&answering))?;
        Ok(Delayer {
            latency,
            shared,
            thread: Some(thread),
        })
    }

    /// Runs `answer` once the latency has passed, counting it in flight until then.
    pub fn after_latency(&self, answer: impl FnOnce() + Send + 'static) {
        let counters = &self.shared.counters;
        let now_waiting = counters.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        counters
            .max_in_flight
            .fetch_max(now_waiting, Ordering::SeqCst);
        let due = Instant::now() + self.latency;
        self.shared
            .queue
            .lock()
            .pending
            .push_back((due, Box::new(answer)));
        self.shared.wake.notify_one();
    }
}

impl Delayer {
    /// Runs `answer` now, or when thawed if the remote is frozen.
    pub fn now_or_held(&self, answer: impl FnOnce() + Send + 'static) {
        let mut queue = self.shared.queue.lock();
        if queue.frozen && !queue.closed {
            queue.held.push(Box::new(answer));
        } else {
            drop(queue);
            answer();
        }
    }

    /// A handle that freezes and thaws the remote.
    pub fn freezer(&self) -> Freezer {
        Freezer(self.shared.clone())
    }
}

/// Freezes and thaws a remote: what a test uses to hang SOURCE.
#[derive(Clone)]
pub struct Freezer(Arc<Shared>);

impl Freezer {
    /// While `frozen`, no request is answered; thawing answers what was held.
    pub fn set(&self, frozen: bool) {
        let held = {
            let mut queue = self.0.queue.lock();
            queue.frozen = frozen;
            std::mem::take(&mut queue.held)
        };
        self.0.wake.notify_one();
        held.into_iter().for_each(|answer| answer());
    }
}

impl Drop for Delayer {
    fn drop(&mut self) {
        self.shared.queue.lock().closed = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The answering thread's loop: sleeps until the oldest deadline, answers, repeats.
fn answer_when_due(shared: &Shared) {
    let mut queue = shared.queue.lock();
    loop {
        let now = Instant::now();
        match queue.pending.front() {
            Some(&(due, _)) if (due <= now && !queue.frozen) || queue.closed => {
                let (_, answer) = queue.pending.pop_front().expect("a front entry");
                // Answered unlocked: the session thread keeps queueing meanwhile.
                drop(queue);
                shared.counters.in_flight.fetch_sub(1, Ordering::SeqCst);
                answer();
                queue = shared.queue.lock();
            }
            Some(_) if queue.frozen => shared.wake.wait(&mut queue),
            Some(&(due, _)) => {
                shared.wake.wait_for(&mut queue, due - now);
            }
            None if queue.closed => return,
            None => shared.wake.wait(&mut queue),
        }
    }
}
