//! The staging methods as events on a virtual clock: node 0's real [`Core`], its reader (its
//! ranks' stream, a file per compute step, waiting on misses), its copy workers (copies that
//! take the time the storage model gives them), and with peers, the requests the other nodes
//! make of it. See the module note of [`super`] for what is taken from symmetry.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{EpochRow, Job, Method, Setup, Storage};
use crate::cache::CopyError;
use crate::catalog::FileId;
use crate::peers::{Placement, Readers};
use crate::plan::{EpochPlan, Plan, Position, TrackerSettings};
use crate::stager::core::{Answer, Core, Effects, FileState, Job as Copy, Miss, Origin};
use crate::stager::{EvictionKind, StagerSettings};
use crate::stats::{Counters, PEER_FALLBACK_CAUSES};

const NANOS: f64 = 1e9;
/// How often time passes for the core (the shell's sweeper).
const TICK: u64 = 100_000_000;

enum Event {
    /// The reader is ready for its next file.
    Reader,
    CopyDone(Copy, Origin, Result<u64, CopyError>),
    Tick,
}

/// Node 0's reader: where it is in its stream.
struct Reader {
    epoch: u64,
    offset: u64,
    plan: Arc<EpochPlan>,
    done: bool,
}

/// What this node's peers ask of it, and how often it still had the file.
struct Peering {
    placement: Placement,
    readers: Vec<Arc<Readers>>,
    /// (position in the asking node's stream, file), by position: asked once staging there.
    requests: VecDeque<(Position, FileId)>,
    served: u64,
    not_held: u64,
}

/// Counts at an epoch's start, for its row.
#[derive(Clone, Copy, Default)]
struct Mark {
    at: u64,
    source_bytes: u64,
    peer_bytes: u64,
    hits: u64,
    misses: u64,
    stall_nanos: u64,
    opens: u64,
    read_through: u64,
}

struct Sim<'a> {
    setup: &'a Setup,
    job: &'a Job,
    storage: &'a Storage,
    method: Method,
    core: Core<()>,
    plan: Plan,
    counters: Arc<Counters>,
    base: Instant,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, Event>,
    idle: usize,
    active_source: usize,
    active_peer: usize,
    /// When the file system's metadata service has a slot for this node next.
    metadata_next: u64,
    /// When the node's processors are free next (all cores as one, fluid).
    cpu_free: u64,
    compute_per_file: u64,
    reader: Reader,
    peering: Option<Peering>,
    /// Opens on the file system, and bytes the reader read from it directly.
    opens: u64,
    read_through: u64,
    mark: Mark,
    rows: Vec<EpochRow>,
}

/// Runs stagefs (with peers or not) for `job`: one row per epoch.
pub fn run(setup: &Setup, job: &Job, storage: &Storage, peers: bool) -> Vec<EpochRow> {
    let mut sim = Sim::new(setup, job, storage, peers);
    sim.run();
    sim.rows
}

impl<'a> Sim<'a> {
    fn new(setup: &'a Setup, job: &'a Job, storage: &'a Storage, peers: bool) -> Sim<'a> {
        let plan = Plan::new(
            setup.sampler.clone(),
            setup.ranks.clone(),
            setup.layout.clone(),
            setup.catalog.len(),
        )
        .expect("a validated order");
        let settings = StagerSettings {
            threads: job.stage_threads,
            lookahead_files: u64::MAX,
            lookahead_bytes: u64::MAX,
            capacity: job.cache_bytes,
            read_through_above: u64::MAX,
            retries: 0,
            open_timeout: Duration::from_secs(3600),
            tracker: TrackerSettings::default(),
            eviction: EvictionKind::Belady,
        };
        let counters = Arc::new(Counters::default());
        let generation = plan.generation();
        let mut core = Core::new(
            setup.catalog.clone(),
            generation.clone(),
            settings,
            counters.clone(),
        );
        for epoch in [0, 1] {
            let _ = core.planned(plan.epoch(&generation, epoch));
        }
        let placement = (peers && job.nodes > 1)
            .then(|| Placement::new(&setup.order(), job.nodes as usize, 0).ok())
            .flatten();
        let per_batch_nanos = job.compute_per_batch * NANOS / f64::from(job.batch_size.max(1));
        let reader = Reader {
            epoch: 0,
            offset: 0,
            plan: plan.epoch(&generation, 0),
            done: false,
        };
        let mut sim = Sim {
            setup,
            job,
            storage,
            method: if peers {
                Method::StagefsPeers
            } else {
                Method::Stagefs
            },
            core,
            plan,
            counters,
            base: Instant::now(),
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: HashMap::new(),
            idle: job.stage_threads.max(1),
            active_source: 0,
            active_peer: 0,
            metadata_next: 0,
            cpu_free: 0,
            // The node's ranks compute in parallel, each on its own batches.
            compute_per_file: (per_batch_nanos / f64::from(job.ranks_per_node)) as u64,
            reader,
            peering: placement.map(|placement| Peering {
                placement,
                readers: Vec::new(),
                requests: VecDeque::new(),
                served: 0,
                not_held: 0,
            }),
            opens: 0,
            read_through: 0,
            mark: Mark::default(),
            rows: Vec::new(),
        };
        sim.tell_needs(&[1]);
        sim
    }

    fn instant(&self) -> Instant {
        self.base + Duration::from_nanos(self.now)
    }

    fn at(&mut self, when: u64, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse((when, self.seq)));
        self.events.insert(self.seq, event);
    }

    fn run(&mut self) {
        self.at(0, Event::Reader);
        self.at(TICK, Event::Tick);
        while !self.reader.done {
            let Some(Reverse((when, seq))) = self.queue.pop() else {
                log::error!("simulation: the reader waits for a copy nobody makes");
                return;
            };
            self.now = when;
            match self
                .events
                .remove(&seq)
                .expect("every queued event is kept")
            {
                Event::Reader => self.read_next(),
                Event::CopyDone(copy, origin, result) => self.copy_done(copy, origin, result),
                Event::Tick => {
                    let effects = self.core.tick(self.instant(), None);
                    self.apply(effects);
                    self.at(self.now + TICK, Event::Tick);
                }
            }
            self.serve_peers();
            self.dispatch();
        }
    }

    /// The reader opens its next file: a hit goes on after the compute step, a miss waits.
    fn read_next(&mut self) {
        if self.reader.offset >= self.reader.plan.len() {
            self.end_epoch();
            if self.reader.done {
                return;
            }
        }
        let offset = self.reader.offset;
        self.reader.offset += 1;
        let Some(file) = self.reader.plan.file_at(offset) else {
            return self.at(self.now, Event::Reader);
        };
        let mut effects = Effects::default();
        let now = self.instant();
        let slot = self.core.opened(file, now, &mut effects);
        if self.core.file_state(file) == FileState::Cached {
            self.core.hit();
            let read = self.on_cpu(self.job.cpu.read);
            self.at(read.max(self.now + self.compute_per_file), Event::Reader);
        } else {
            match self.core.miss(file, slot, (), now, &mut effects) {
                // Answered when the copy is done (`apply`).
                Miss::Waiting => {}
                Miss::ReadThrough(()) => self.answered(Answer::FromSource(file)),
            }
        }
        self.apply(effects);
    }

    /// The reader's open was answered: it goes on, after reading SOURCE itself if told to.
    /// The core counted the wait for the copy; a read from SOURCE after it is waited for too.
    fn answered(&mut self, answer: Answer) {
        let mut ready = self.on_cpu(self.job.cpu.read);
        if let Answer::FromSource(file) = answer {
            let size = self.setup.size(file);
            self.read_through += size;
            ready += self.source_time(size, 1);
            Counters::add(&self.counters.stall_nanos, ready - self.now);
        }
        self.at(ready + self.compute_per_file, Event::Reader);
    }

    /// The reader finished its epoch: its row, and the next epoch's plan.
    fn end_epoch(&mut self) {
        let row = self.row();
        self.rows.push(row);
        self.mark = self.marked();
        let next = self.reader.epoch + 1;
        if next >= self.job.epochs {
            self.reader.done = true;
            return;
        }
        let generation = self.core.generation().clone();
        self.reader.plan = self.plan.epoch(&generation, next);
        self.reader.epoch = next;
        self.reader.offset = 0;
    }

    fn marked(&self) -> Mark {
        let c = &self.counters;
        Mark {
            at: self.now,
            source_bytes: Counters::get(&c.source_bytes),
            peer_bytes: Counters::get(&c.peer_bytes),
            hits: Counters::get(&c.hits),
            misses: Counters::get(&c.misses),
            stall_nanos: Counters::get(&c.stall_nanos),
            opens: self.opens,
            read_through: self.read_through,
        }
    }

    /// The epoch since the mark, for the whole job: every node as this one.
    fn row(&self) -> EpochRow {
        let (now, then) = (self.marked(), self.mark);
        let nodes = f64::from(self.job.nodes);
        let opens = (now.hits - then.hits) + (now.misses - then.misses);
        EpochRow {
            method: self.method,
            epoch: Some(self.reader.epoch),
            seconds: (now.at - then.at) as f64 / NANOS,
            pfs_bytes: nodes
                * ((now.source_bytes - then.source_bytes) + (now.read_through - then.read_through))
                    as f64,
            pfs_opens: nodes * (now.opens - then.opens) as f64,
            peer_bytes: nodes * (now.peer_bytes - then.peer_bytes) as f64,
            hit_ratio: (opens > 0).then(|| (now.hits - then.hits) as f64 / opens as f64),
            stall_seconds: (now.stall_nanos - then.stall_nanos) as f64 / NANOS,
        }
    }

    /// Carries out what the core asked: answers, epochs to plan (and the peers' needs).
    fn apply(&mut self, effects: Effects<()>) {
        for ((), answer) in effects.replies {
            self.answered(answer);
        }
        if effects.plan
            && let Some((generation, epochs)) = self.core.wanted_epochs()
        {
            for &epoch in &epochs {
                let planned = self.core.planned(self.plan.epoch(&generation, epoch));
                self.apply(planned);
            }
            let unplanned = self.core.unplanned();
            self.core.rekey(&unplanned);
            self.tell_needs(&epochs);
        }
    }

    /// Gives idle copy workers the core's next jobs.
    fn dispatch(&mut self) {
        while self.idle > 0 {
            let mut effects = Effects::default();
            let job = self.core.next_job(self.instant(), &mut effects);
            self.apply(effects);
            let Some(job) = job else {
                return;
            };
            self.idle -= 1;
            self.start_copy(job);
        }
    }

    /// A copy: from the peer that read the file the epoch before if it has it (put off if it
    /// has not staged it yet and the reader is far), else from the file system.
    fn start_copy(&mut self, job: Copy) {
        let size = self.setup.size(job.file);
        let mut extra = 0;
        if let Some((holder_has, held)) = self.holder_state(job) {
            if holder_has && held {
                let rate = self.storage.net_bandwidth / (self.active_peer + 1) as f64;
                let took = self.storage.net_latency * NANOS + size as f64 / rate * NANOS;
                // The node serving it spends as much: by symmetry, this node serves as many.
                let done = self.on_cpu(2.0 * self.job.cpu.copy);
                self.active_peer += 1;
                return self.at(
                    done.max(self.now + took as u64),
                    Event::CopyDone(job, Origin::Peer, Ok(size)),
                );
            }
            let latency = (self.storage.net_latency * NANOS) as u64;
            if !holder_has && self.core.may_wait_for_peer(job) {
                self.active_peer += 1;
                let deferred = Err(CopyError::Deferred);
                return self.at(
                    self.now + latency,
                    Event::CopyDone(job, Origin::Peer, deferred),
                );
            }
            let cause = if holder_has { "not_held" } else { "later" };
            let index = PEER_FALLBACK_CAUSES.iter().position(|&c| c == cause);
            Counters::add(&self.counters.peer_fallbacks[index.unwrap_or(0)], 1);
            extra = latency;
        }
        let took = extra + self.source_time(size, self.active_source + 1);
        let done = self.on_cpu(self.job.cpu.copy);
        self.active_source += 1;
        self.at(
            done.max(self.now + took),
            Event::CopyDone(job, Origin::Source, Ok(size)),
        );
    }

    /// With peers, for a copy whose file another node read the epoch before: whether that
    /// node has staged it by now (as far as this node has staged its own stream), and whether
    /// it still holds it (as often as this node still held what its peers asked for).
    fn holder_state(&mut self, job: Copy) -> Option<(bool, bool)> {
        let generation = self.core.generation().clone();
        let epoch = match job.position {
            Some(pos) => generation.split(pos).0,
            None => self.core.tracker().epoch_position().0,
        };
        let held_epoch = epoch.checked_sub(1)?;
        let frontier = self.core.frontier();
        let peering = self.peering.as_mut()?;
        let readers = readers(peering, held_epoch, self.setup.catalog.len());
        readers.holder(job.file)?;
        let offset = readers.offset_of(job.file)?;
        let has = frontier > generation.join(held_epoch, offset);
        let asked = peering.served + peering.not_held;
        let share_held = if asked == 0 {
            1.0
        } else {
            peering.served as f64 / asked as f64
        };
        Some((has, unit(job.file) < share_held))
    }

    /// Nanoseconds a read of `size` bytes from the file system takes with `streams` of this
    /// node's reading at once: a metadata slot (the service's rate shared by every node), its
    /// round trip, and the bytes at this node's share of the bandwidth.
    fn source_time(&mut self, size: u64, streams: usize) -> u64 {
        let nodes = f64::from(self.job.nodes);
        let slot = self.metadata_next.max(self.now);
        self.metadata_next = slot + (nodes / self.storage.pfs_metadata_rate * NANOS) as u64;
        self.opens += 1;
        let share = (self.storage.pfs_bandwidth / nodes).min(self.storage.net_bandwidth);
        let rate = share / streams.max(1) as f64;
        let transfer = self.storage.pfs_latency + size as f64 / rate;
        (slot - self.now) + (transfer * NANOS) as u64
    }

    /// When `seconds` of processor time asked for now are done: after what the node's cores
    /// were asked for before, at their pace.
    fn on_cpu(&mut self, seconds: f64) -> u64 {
        if seconds <= 0.0 {
            return self.now;
        }
        let start = self.cpu_free.max(self.now);
        self.cpu_free = start + (seconds / self.job.cpu.cores * NANOS) as u64;
        self.cpu_free
    }

    fn copy_done(&mut self, job: Copy, origin: Origin, result: Result<u64, CopyError>) {
        self.idle += 1;
        match origin {
            Origin::Peer => self.active_peer -= 1,
            Origin::Source => self.active_source -= 1,
        }
        if origin == Origin::Peer
            && let Ok(bytes) = result
        {
            Counters::add(&self.counters.peer_files, 1);
            Counters::add(&self.counters.peer_bytes, bytes);
        }
        let effects = self.core.copied_from(job, origin, result, self.instant());
        self.apply(effects);
    }

    /// Tells the core what the other nodes will fetch from this one in `epochs`, and queues
    /// their requests.
    fn tell_needs(&mut self, epochs: &[u64]) {
        let generation = self.core.generation().clone();
        let id_space = self.setup.catalog.len();
        let Some(peering) = self.peering.as_mut() else {
            return;
        };
        for &epoch in epochs.iter().filter(|&&e| e > 0) {
            let held = readers(peering, epoch - 1, id_space);
            let next = readers(peering, epoch, id_space);
            let needs: Vec<(FileId, Position)> = held
                .needs(&next)
                .into_iter()
                .map(|(file, offset)| (file, generation.join(epoch, offset)))
                .collect();
            let mut requests: Vec<(Position, FileId)> =
                needs.iter().map(|&(file, pos)| (pos, file)).collect();
            requests.sort_unstable();
            peering.requests.extend(requests);
            self.core.peers_need(generation.id, needs);
        }
    }

    /// The other nodes fetch what they need from this one as their staging reaches it (as
    /// far as this node's own has got): served if this node still holds it.
    fn serve_peers(&mut self) {
        let frontier = self.core.frontier();
        loop {
            let Some(peering) = self.peering.as_mut() else {
                return;
            };
            let Some(&(_, file)) = peering.requests.front().filter(|r| r.0 < frontier) else {
                return;
            };
            peering.requests.pop_front();
            if self.core.file_state(file) == FileState::Cached {
                peering.served += 1;
                Counters::add(&self.counters.served_files, 1);
                self.core.peer_fetched(file);
            } else {
                peering.not_held += 1;
            }
        }
    }
}

/// Who read what in `epoch`, computed on first use (the last three kept).
fn readers(peering: &mut Peering, epoch: u64, id_space: usize) -> Arc<Readers> {
    if let Some(r) = peering.readers.iter().find(|r| r.epoch == epoch) {
        return r.clone();
    }
    let readers = Arc::new(peering.placement.readers(epoch, id_space));
    if peering.readers.len() >= 3 {
        peering.readers.remove(0);
    }
    peering.readers.push(readers.clone());
    readers
}

/// A number in [0, 1) fixed for `file`: which files a holder no longer has, at the share the
/// simulation found.
fn unit(file: FileId) -> f64 {
    let x = u64::from(file)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(29)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x >> 11) as f64 / (1u64 << 53) as f64
}
