//! numpy's `permutation(n)` (= `shuffle(arange(n))`), shared by the legacy `RandomState`
//! (MT19937; also Chainer's default order sampler) and the new `Generator` (PCG64), and the
//! legacy `shuffle(idx)` of one array in place every epoch.
//!
//! All shuffle with the same masked-rejection `interval()`, so it is written once over a
//! small bit-source trait. The number of draws depends on the values drawn, so reaching
//! epoch `e` means running the draws of epochs `0..e` (without building their arrays, except
//! the in-place array, which each epoch moves on). The stream's state after the last epoch
//! asked for is kept, so asking for epochs in order (the planner, one epoch after the other;
//! a resynchronisation scanning epochs) costs one epoch's draws each instead of a replay from
//! the start. A replay asks its caller every few million draws whether the order is still
//! wanted (a far `stagefs epoch` whose client left stops there).

use std::sync::{Mutex, PoisonError};

use super::mt19937::Mt19937;
use super::pcg64::Pcg64;

/// Where `interval()` takes its 32-bit words from.
trait BitSource {
    fn next_u32(&mut self) -> u32;
}

impl BitSource for Mt19937 {
    #[inline]
    fn next_u32(&mut self) -> u32 {
        Mt19937::next_u32(self)
    }
}

impl BitSource for Pcg64 {
    #[inline]
    fn next_u32(&mut self) -> u32 {
        Pcg64::next_u32(self)
    }
}

/// numpy's `random_interval(max)` for `1 <= max <= u32::MAX`: draw 32-bit words masked to
/// the smallest all-ones value >= max until one is <= max. (numpy switches to 64-bit words
/// only for max > u32::MAX, which orders of u32 indices never reach; shuffles never ask for
/// max 0.)
#[inline]
fn interval<B: BitSource>(bits: &mut B, max: u32) -> u32 {
    let mask = u32::MAX >> max.leading_zeros();
    loop {
        let v = bits.next_u32() & mask;
        if v <= max {
            return v;
        }
    }
}

/// numpy's Fisher-Yates: for i = n-1 down to 1, j = interval(i), swap(i, j). `swap` sees each
/// pair; skipping an epoch passes a no-op.
fn shuffle_draws<B: BitSource>(bits: &mut B, n: u64, mut swap: impl FnMut(usize, usize)) {
    for i in (1..n).rev() {
        let j = interval(bits, i as u32);
        swap(i as usize, j as usize);
    }
}

/// What successive epochs shuffle.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shuffled {
    /// A fresh `arange(n)` each epoch: successive `permutation(n)`.
    Fresh,
    /// One array, shuffled again each epoch: `shuffle(idx)` in place. The draws are those of
    /// `Fresh` (`interval(i)` depends only on i); only the array they move differs.
    InPlace,
}

/// A stream seeded with `seed` after `done` epochs of shuffling `n` indices.
struct Checkpoint<B> {
    seed: u64,
    n: u64,
    shuffled: Shuffled,
    done: u64,
    bits: B,
    /// `InPlace`: the array after those epochs (`Fresh` keeps none: each epoch starts anew).
    array: Vec<u32>,
}

/// Draws replayed between two questions whether the order is still wanted (a few ms).
const DRAWS_BETWEEN_ASKS: u64 = 1 << 22;

/// Streams kept: enough for the planner, a resynchronisation and a user's `stagefs order`
/// at once (an MT19937 state is 5 KB; an in-place stream also keeps its array, 4 bytes a
/// sample).
const CHECKPOINTS: usize = 4;

/// Where recent streams stood, per generator kind.
struct Checkpoints<B>(Mutex<Vec<Checkpoint<B>>>);

impl<B: BitSource + Clone> Checkpoints<B> {
    const fn new() -> Self {
        Checkpoints(Mutex::new(Vec::new()))
    }

    /// The order of epoch `epoch` (0 is the first) of the stream `fresh` starts, shuffling
    /// `n` indices as `shuffled` says, resumed from the latest checkpoint at or before it.
    /// None once `wanted` says no.
    fn nth_order(
        &self,
        (seed, n, shuffled): (u64, u64, Shuffled),
        epoch: u64,
        fresh: impl FnOnce() -> B,
        wanted: &dyn Fn() -> bool,
    ) -> Option<Vec<u32>> {
        let resume = self
            .lock()
            .iter()
            .filter(|c| c.seed == seed && c.n == n && c.shuffled == shuffled && c.done <= epoch)
            .max_by_key(|c| c.done)
            .map(|c| (c.done, c.bits.clone(), c.array.clone()));
        let arange = || (0..n).map(|i| i as u32).collect::<Vec<u32>>();
        let (mut done, mut bits, mut array) = resume.unwrap_or_else(|| match shuffled {
            Shuffled::Fresh => (0, fresh(), Vec::new()),
            Shuffled::InPlace => (0, fresh(), arange()),
        });
        let mut since_asked = 0;
        while done < epoch {
            since_asked += n;
            if since_asked >= DRAWS_BETWEEN_ASKS {
                since_asked = 0;
                if !wanted() {
                    return None;
                }
            }
            match shuffled {
                Shuffled::Fresh => shuffle_draws(&mut bits, n, |_, _| {}),
                Shuffled::InPlace => shuffle_draws(&mut bits, n, |i, j| array.swap(i, j)),
            }
            done += 1;
        }
        let mut order = match shuffled {
            Shuffled::Fresh => arange(),
            Shuffled::InPlace => array,
        };
        shuffle_draws(&mut bits, n, |i, j| order.swap(i, j));
        self.remember(Checkpoint {
            seed,
            n,
            shuffled,
            done: epoch + 1,
            bits,
            array: match shuffled {
                Shuffled::Fresh => Vec::new(),
                Shuffled::InPlace => order.clone(),
            },
        });
        Some(order)
    }

    /// Keeps `new`, replacing an older point of the same stream, else the least advanced.
    fn remember(&self, new: Checkpoint<B>) {
        let mut kept = self.lock();
        let same = (kept.iter())
            .position(|c| c.seed == new.seed && c.n == new.n && c.shuffled == new.shuffled);
        match same {
            Some(i) if kept[i].done < new.done => kept[i] = new,
            Some(_) => {}
            None if kept.len() < CHECKPOINTS => kept.push(new),
            None => {
                let least = (0..kept.len()).min_by_key(|&i| kept[i].done).unwrap_or(0);
                kept[least] = new;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Checkpoint<B>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

static LEGACY: Checkpoints<Mt19937> = Checkpoints::new();
static GENERATOR: Checkpoints<Pcg64> = Checkpoints::new();

/// The two numpy streams, for the search of `--sampler auto`, which tries many seeds once each
/// (the checkpoints would only churn).
#[derive(Clone, Copy)]
pub enum Stream {
    Legacy,
    Generator,
}

impl Stream {
    /// The first `permutation(n)` of a stream seeded with `seed`, into `out` (reused).
    pub fn first_permutation(self, seed: u64, n: u64, out: &mut Vec<u32>) {
        out.clear();
        out.extend(0..n as u32);
        let swap = |i: usize, j: usize| out.swap(i, j);
        match self {
            Stream::Legacy => shuffle_draws(&mut Mt19937::new(seed as u32), n, swap),
            Stream::Generator => shuffle_draws(&mut Pcg64::from_seed(seed), n, swap),
        }
    }
}

/// `np.random.seed(seed)`, then the `epoch`-th `np.random.permutation(n)`; None once
/// `wanted` says no.
pub fn legacy_order(seed: u32, n: u64, epoch: u64, wanted: &dyn Fn() -> bool) -> Option<Vec<u32>> {
    let stream = (u64::from(seed), n, Shuffled::Fresh);
    LEGACY.nth_order(stream, epoch, || Mt19937::new(seed), wanted)
}

/// `np.random.seed(seed); idx = np.arange(n)`, then `np.random.shuffle(idx)` once per epoch
/// up to and including `epoch`: `idx` as that epoch reads it. None once `wanted` says no.
pub fn inplace_order(seed: u32, n: u64, epoch: u64, wanted: &dyn Fn() -> bool) -> Option<Vec<u32>> {
    let stream = (u64::from(seed), n, Shuffled::InPlace);
    LEGACY.nth_order(stream, epoch, || Mt19937::new(seed), wanted)
}

/// `rng = np.random.default_rng(seed)`, then the `epoch`-th `rng.permutation(n)`; None once
/// `wanted` says no.
pub fn generator_order(
    seed: u64,
    n: u64,
    epoch: u64,
    wanted: &dyn Fn() -> bool,
) -> Option<Vec<u32>> {
    let stream = (seed, n, Shuffled::Fresh);
    GENERATOR.nth_order(stream, epoch, || Pcg64::from_seed(seed), wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(seed: u32, n: u64, epoch: u64) -> Vec<u32> {
        legacy_order(seed, n, epoch, &|| true).unwrap()
    }

    fn inplace(seed: u32, n: u64, epoch: u64) -> Vec<u32> {
        inplace_order(seed, n, epoch, &|| true).unwrap()
    }

    fn generator(seed: u64, n: u64, epoch: u64) -> Vec<u32> {
        generator_order(seed, n, epoch, &|| true).unwrap()
    }

    #[test]
    fn check_values() {
        // From access-order.md.
        assert_eq!(legacy(0, 10, 0), [2, 8, 4, 9, 1, 6, 7, 3, 0, 5]);
        assert_eq!(generator(0, 10, 0), [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]);
    }

    #[test]
    fn seeds_beyond_one_word() {
        // The golden vectors only use seeds below 2^32; these come from numpy 2.4.6
        // (default_rng(s).permutation(10) twice, np.random.seed(2**32-1); permutation(12)).
        let cases: [(u64, [u32; 10], [u32; 10]); 3] = [
            (
                1 << 32 | 5,
                [6, 7, 4, 2, 5, 0, 9, 8, 3, 1],
                [9, 4, 6, 3, 5, 2, 1, 0, 8, 7],
            ),
            (
                u64::MAX,
                [8, 7, 3, 0, 4, 6, 1, 2, 5, 9],
                [2, 7, 5, 1, 8, 4, 0, 6, 9, 3],
            ),
            (
                12345678901234,
                [9, 1, 5, 0, 8, 3, 2, 7, 6, 4],
                [4, 1, 5, 6, 2, 7, 9, 3, 8, 0],
            ),
        ];
        for (seed, first, second) in cases {
            assert_eq!(generator(seed, 10, 0), first, "seed {seed}");
            assert_eq!(generator(seed, 10, 1), second, "seed {seed}");
        }
        assert_eq!(
            legacy(u32::MAX, 12, 0),
            [11, 8, 5, 9, 1, 10, 6, 0, 4, 7, 2, 3]
        );
    }

    /// The `epoch`-th legacy permutation replayed from a fresh stream, no checkpoint involved.
    fn replayed(seed: u32, n: u64, epoch: u64) -> Vec<u32> {
        let mut bits = Mt19937::new(seed);
        for _ in 0..epoch {
            shuffle_draws(&mut bits, n, |_, _| {});
        }
        let mut a: Vec<u32> = (0..n as u32).collect();
        shuffle_draws(&mut bits, n, |i, j| a.swap(i, j));
        a
    }

    #[test]
    fn epochs_in_any_order_match_a_replay_from_the_start() {
        // Forward (resumes), backward (falls back to the start), repeated, and a gap.
        for epoch in [0, 1, 2, 5, 3, 3, 0, 9, 4] {
            assert_eq!(
                legacy(77, 300, epoch),
                replayed(77, 300, epoch),
                "epoch {epoch}"
            );
        }
        // Another length of the same seed is another stream.
        assert_eq!(legacy(77, 10, 1), replayed(77, 10, 1));
    }

    #[test]
    fn a_replay_no_longer_wanted_stops() {
        let asked = std::cell::Cell::new(0);
        let n = 1000;
        let far = 10 * DRAWS_BETWEEN_ASKS / n;
        let until_third = || {
            asked.set(asked.get() + 1);
            asked.get() < 3
        };
        assert_eq!(legacy_order(79, n, far, &until_third), None);
        assert_eq!(asked.get(), 3);
        // What was given up leaves the stream as it was.
        assert_eq!(legacy(79, n, 2), replayed(79, n, 2));
    }

    #[test]
    fn inplace_epochs_reshuffle_the_previous_epoch() {
        // Shuffling an array moves its entries as the same draws move arange(n): epoch e's
        // array is epoch e-1's indexed by the e-th permutation. Asked for in any order, with
        // the permutations' stream of the same seed in use alongside.
        let (seed, n) = (78, 300);
        let mut previous: Vec<u32> = (0..n as u32).collect();
        let mut expected = Vec::new();
        for epoch in 0..8 {
            let current: Vec<u32> = (legacy(seed, n, epoch).iter())
                .map(|&p| previous[p as usize])
                .collect();
            expected.push(current.clone());
            previous = current;
        }
        assert_eq!(inplace(seed, n, 0), legacy(seed, n, 0));
        for epoch in [1, 2, 5, 3, 3, 0, 7, 4] {
            assert_eq!(
                inplace(seed, n, epoch),
                expected[epoch as usize],
                "epoch {epoch}"
            );
        }
    }

    #[test]
    fn interval_masks_and_rejects() {
        // A source that yields a fixed sequence shows the mask and the rejection loop.
        struct Fixed(std::vec::IntoIter<u32>);
        impl BitSource for Fixed {
            fn next_u32(&mut self) -> u32 {
                self.0.next().expect("drew more words than expected")
            }
        }
        // max 5 -> mask 7: 0xff & 7 = 7 > 5 rejected, 6 rejected, 0x12 & 7 = 2 accepted.
        let mut src = Fixed(vec![0xff, 6, 0x12].into_iter());
        assert_eq!(interval(&mut src, 5), 2);
        assert_eq!(src.0.len(), 0);
        // max u32::MAX: everything is accepted as is.
        let mut src = Fixed(vec![0xdead_beef].into_iter());
        assert_eq!(interval(&mut src, u32::MAX), 0xdead_beef);
    }
}
