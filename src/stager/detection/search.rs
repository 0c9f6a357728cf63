//! The searches themselves, off the open path: each candidate dataset's opens judged
//! ([`crate::order::detect`]), the first shuffled order found switched to (one read in order
//! only in the last round), and a verdict that says why when nothing is found.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::super::Inner;
use super::{Detector, JobRank, Search};
use crate::catalog::{FileId, Layout};
use crate::order::SamplerKind;
use crate::order::detect::{self, Detection, RankOpens};
use crate::plan::{Order, TrackerMode};

/// The opens that are samples of `layout`, as its sample indices, per rank.
fn opens_in(layout: &Layout, opens: &[(u32, Vec<FileId>)]) -> Vec<RankOpens> {
    let wanted: HashSet<FileId> = opens.iter().flat_map(|(_, f)| f.iter().copied()).collect();
    let mut index_of = HashMap::with_capacity(wanted.len());
    for index in 0..layout.len() as u32 {
        if let Some(file) = layout.file_of(index)
            && wanted.contains(&file)
        {
            // The first sample of a file that several samples name.
            index_of.entry(file).or_insert(index);
        }
    }
    opens
        .iter()
        .map(|(rank, files)| RankOpens {
            rank: *rank,
            indices: files
                .iter()
                .filter_map(|f| index_of.get(f).copied())
                .collect(),
        })
        .filter(|r| !r.indices.is_empty())
        .collect()
}

/// What one dataset's search came to, for the verdict.
enum Outcome {
    Found(Detection, Arc<Layout>),
    /// Too few samples per rank to tell an order from chance.
    TooSmall {
        samples: u64,
    },
    Unexplained,
}

impl Inner {
    /// Feeds one open of `file` by thread `opener` of `rank` to the detection; starts a
    /// search when one is due.
    pub(in crate::stager) fn observe_open(
        self: &Arc<Self>,
        file: FileId,
        rank: JobRank,
        opener: u32,
    ) {
        let Some(detector) = &self.detector else {
            return;
        };
        let Some(search) = detector.observe(file, rank, opener) else {
            return;
        };
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name("stage-detect".into())
            .spawn(move || inner.search(search));
        if let Err(e) = spawned {
            detector.cannot_search(format!("cannot start the order search: {e}"));
        }
    }

    /// Searches the opens in each candidate dataset; the first shuffled order found is
    /// switched to, one read in order only in the last round.
    fn search(self: Arc<Self>, search: Search) {
        let Some(detector) = &self.detector else {
            return;
        };
        let started = std::time::Instant::now();
        let roots = detector.search_roots();
        let mut in_order = None;
        let mut verdicts = Vec::new();
        for &root in &roots {
            match self.search_dataset(detector, &search, root) {
                Outcome::Found(d, layout) if d.in_order() => {
                    in_order = in_order.or(Some((d, layout)));
                }
                Outcome::Found(d, layout) => {
                    self.log_search(&search, started);
                    return self.adopt(detector, &search, d, layout);
                }
                outcome => verdicts.push((root, outcome)),
            }
        }
        self.log_search(&search, started);
        if search.last
            && let Some((d, layout)) = in_order
        {
            return self.adopt(detector, &search, d, layout);
        }
        if detector.give_up.load(Ordering::Relaxed)
            && let Some(again) = detector.resume()
        {
            log::info!(
                "--sampler auto: a new reader opened files during the search; searching again"
            );
            return self.clone().search(again);
        }
        let why = self.why_not_found(&search, &verdicts, in_order.is_some());
        self.not_found(detector, why);
    }

    /// Ends a search without a result: the next round runs now if it fell due meanwhile.
    fn not_found(self: &Arc<Self>, detector: &Detector, why: String) {
        if let Some(next) = detector.not_found(why) {
            self.clone().search(next);
        }
    }

    fn log_search(&self, search: &Search, started: std::time::Instant) {
        log::info!(
            "--sampler auto: searched {} opens of {} rank(s) in {:.2?}",
            search.opens.iter().map(|(_, f)| f.len()).sum::<usize>(),
            search.opens.len(),
            started.elapsed()
        );
    }

    /// Searches the opens that are samples of the dataset at `root`, from the first, and
    /// after a first round also from where that one's ended (`previous`): a job whose first
    /// opens were another loader's (a peek at a batch) starts its epoch there.
    fn search_dataset(&self, detector: &Detector, search: &Search, root: FileId) -> Outcome {
        let Ok(layout) = detector.datasets.get(root) else {
            return Outcome::Unexplained;
        };
        let len = layout.len() as u64;
        let mut opens = opens_in(&layout, &search.opens);
        // The mount's own flags are hints: its seed is tried first, and without a launcher's
        // environment its world size and (single) rank say whose opens these are.
        let hint = self.plan.configured();
        let mut launch = search.launch;
        if launch.world_size == 1
            && hint.world_size > 1
            && let [rank] = self.plan.configured_ranks()[..]
            && let [only] = &mut opens[..]
        {
            only.rank = rank;
            launch = JobRank {
                rank,
                world_size: hint.world_size,
                local: Some((0, 1)),
            };
        }
        if !detect::judgeable(len, launch.world_size) {
            return Outcome::TooSmall {
                samples: len.div_ceil(u64::from(launch.world_size.max(1))),
            };
        }
        let hinted_seed = u64::try_from(hint.seed).ok();
        let give_up = &detector.give_up;
        let from = |skip: usize| -> Vec<RankOpens> {
            let skipped = opens.iter().map(|r| RankOpens {
                rank: r.rank,
                indices: r.indices.get(skip..).unwrap_or_default().to_vec(),
            });
            skipped.collect()
        };
        let found = detect::detect(len, launch.world_size, hinted_seed, &opens, give_up)
            .or_else(|| {
                (search.previous > 0)
                    .then(|| {
                        let later = from(search.previous);
                        detect::detect(len, launch.world_size, hinted_seed, &later, give_up)
                    })
                    .flatten()
            })
            .or_else(|| detect::detect_in_order(len, launch.world_size, &opens));
        match found {
            Some(detection) => Outcome::Found(detection, layout),
            None => Outcome::Unexplained,
        }
    }

    /// Switches to what a search found, unless something else took over meanwhile.
    fn adopt(
        self: &Arc<Self>,
        detector: &Detector,
        search: &Search,
        found: Detection,
        layout: Arc<Layout>,
    ) {
        if !detector.is_active() {
            // The job started announcing meanwhile.
            return;
        }
        let Detection { sampler, epoch } = found;
        let ranks = match sampler.kind {
            SamplerKind::TorchDistributed => search.launch.node_ranks().unwrap_or_else(|| {
                let mut seen: Vec<u32> = search.opens.iter().map(|(r, _)| *r).collect();
                seen.retain(|&r| r < sampler.world_size);
                seen
            }),
            // Every rank reads the same order: the node's stream is that order once.
            _ => vec![search.opens.first().map_or(0, |(r, _)| *r)],
        };
        let order = Order {
            sampler,
            ranks,
            layout,
        };
        let flags = order.flags(epoch);
        match self.switch_to(order, epoch) {
            Ok(true) => {
                log::warn!("--sampler auto detected: {flags}; staging ahead from now on");
                detector.found(flags, epoch);
            }
            // The job announces its order (which ended the detection): that takes precedence.
            Ok(false) if !detector.is_active() => {}
            // The prediction moved meanwhile (`stagefs epoch`): the next search judges again.
            Ok(false) => self.not_found(
                detector,
                format!("found {flags}, but the prediction changed meanwhile"),
            ),
            Err(e) => self.not_found(detector, format!("found {flags} but cannot follow it: {e}")),
        }
    }

    /// Why nothing was found, and what to do, in one line: for the dataset most opens came
    /// from, whatever can be told from its opens.
    fn why_not_found(
        &self,
        search: &Search,
        verdicts: &[(FileId, Outcome)],
        in_order: bool,
    ) -> String {
        let catalog = &self.catalog;
        let opens = search.opens.iter().map(|(_, f)| f.len()).max().unwrap_or(0);
        let announce =
            "let the job announce its order (`eval \"$(stagefs feed-env)\"` before it starts)";
        let Some((root, outcome)) = verdicts.first() else {
            return if in_order {
                format!(
                    "the first {opens} opens read their dataset in order, as a validation loader does, and nothing else was found yet"
                )
            } else {
                format!(
                    "the first {opens} opens come from no dataset directory with enough of them; {announce}"
                )
            };
        };
        let dataset = crate::catalog::dataset_name(catalog, *root);
        match outcome {
            Outcome::TooSmall { samples } => format!(
                "{dataset} has {samples} samples per rank, too few for its first opens to tell an order from chance; {announce}, or name it with --sampler/--seed"
            ),
            _ if search.launch.world_size > 1 => format!(
                "no DistributedSampler or other sampler stagefs knows orders the first {opens} opens of {dataset} on {} ranks (a wrapped sampler such as Lightning's DistributedSamplerWrapper, or a custom one); {announce}",
                search.launch.world_size
            ),
            _ => format!(
                "no sampler and seed stagefs can find orders the first {opens} opens of {dataset}: a DataLoader that shuffles with torch's global generator after other draws from it (model initialisation) cannot be found from its opens, nor can a custom or weighted sampler; {announce}, or give the loader its own seeded generator (DataLoader(generator=torch.Generator().manual_seed(S)))"
            ),
        }
    }

    /// Switches the prediction to `order` (detected) with the reader in `epoch`, placed where
    /// its recent opens are in that order. False if something else moved the prediction
    /// meanwhile (the job started announcing, `stagefs epoch`): that stands.
    pub(in crate::stager) fn switch_to(
        self: &Arc<Self>,
        order: Order,
        epoch: u64,
    ) -> Result<bool, crate::order::OrderError> {
        // Computed before the lock is taken: opens meanwhile go on, on demand.
        let prepared = self.plan.prepare(order, epoch)?;
        let predicting =
            |core: &super::super::core::Core<_>| core.tracker().mode() == TrackerMode::Predicting;
        let recent = {
            let core = self.core.lock();
            if predicting(&core) {
                return Ok(false);
            }
            core.tracker().recent_files()
        };
        let span = crate::plan::reach(prepared.stream().len() as u64, self.settings.tracker.window);
        // From the first of the recent opens on: what they skipped is still to come.
        let first =
            crate::plan::densest_run(prepared.stream(), &recent, span).map_or(0, |r| r.first);
        let mut core = self.core.lock();
        if predicting(&core) {
            return Ok(false);
        }
        let Some((generation, plan)) = self.plan.adopt(prepared, true) else {
            return Ok(false);
        };
        // The recent opens again under the lock: the opens since are the reader's too.
        let effects = core.adopt_found(generation.clone(), generation.join(epoch, first), plan);
        self.apply(core, effects);
        Ok(true)
    }
}
