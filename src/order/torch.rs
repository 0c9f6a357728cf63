//! torch's CPU `randperm` and the two samplers built on it: `DistributedSampler` and
//! `RandomSampler` (what `DataLoader(shuffle=True)` uses).

use super::mt19937::Mt19937;
use super::{GeneratorSource, TorchVersion};

/// From torch 2.6 on, `randperm` switches to 64-bit draws for `n >= u32::MAX / 20`.
const INSIDE_OUT_MIN_N: u64 = u32::MAX as u64 / 20;
const INSIDE_OUT_SINCE: TorchVersion = TorchVersion { major: 2, minor: 6 };

/// `torch.Generator().manual_seed(seed)`: the seed is taken mod 2^64 like a Python int, and
/// torch's MT19937 keeps only its low 32 bits.
pub fn generator(seed: u64) -> Mt19937 {
    Mt19937::new(seed as u32)
}

fn inside_out(n: u64, version: TorchVersion) -> bool {
    n >= INSIDE_OUT_MIN_N && version >= INSIDE_OUT_SINCE
}

/// How many 32-bit outputs one `randperm(n)` consumes.
pub(super) fn randperm_draws(n: u64, version: TorchVersion) -> u64 {
    if inside_out(n, version) {
        2 * n
    } else {
        n.saturating_sub(1)
    }
}

/// `torch.randperm(n, generator=g)` on CPU, as `version` computes it. `n <= 2^32`.
pub fn randperm(n: u64, g: &mut Mt19937, version: TorchVersion) -> Vec<u32> {
    if inside_out(n, version) {
        randperm_inside_out(n, g)
    } else {
        randperm_classic(n, g)
    }
}

/// Forward Fisher-Yates with plain modulo of 32-bit draws: for i in 0..n-1,
/// swap(a[i], a[i + random() % (n - i)]).
fn randperm_classic(n: u64, g: &mut Mt19937) -> Vec<u32> {
    let mut a: Vec<u32> = (0..n).map(|i| i as u32).collect();
    let steps = a.len().saturating_sub(1);
    let mut i = 0;
    while i < steps {
        for &r in g.take(steps - i) {
            let z = (u64::from(r) % (n - i as u64)) as usize;
            a.swap(i, i + z);
            i += 1;
        }
    }
    a
}

/// torch >= 2.6 for large n: inside-out Fisher-Yates with 64-bit draws:
/// for i in 0..n, z = random64() % (i + 1); a[i] = a[z]; a[z] = i.
fn randperm_inside_out(n: u64, g: &mut Mt19937) -> Vec<u32> {
    let mut a: Vec<u32> = Vec::with_capacity(n as usize);
    for i in 0..n {
        let z = (g.next_u64() % (i + 1)) as usize;
        a.push(i as u32);
        a[i as usize] = a[z];
        a[z] = i as u32;
    }
    a
}

/// `DistributedSampler` on a dataset of `n` samples with `world` replicas.
pub struct Distributed {
    pub n: u64,
    pub world: u32,
    pub drop_last: bool,
    pub version: TorchVersion,
}

impl Distributed {
    /// `num_samples`: ceil(n / world), or floor(n / world) with drop_last (torch writes it as
    /// ceil((n - world) / world) when n % world != 0, which is the same).
    pub fn num_samples(&self) -> u64 {
        let w = u64::from(self.world);
        if self.drop_last {
            self.n / w
        } else {
            self.n.div_ceil(w)
        }
    }

    /// The orders of `ranks` merged in lock-step. `seed` is `seed + epoch` mod 2^64, or `None`
    /// for shuffle=False. The padded index list is `idx[k % n]` for k < total (padding repeats
    /// from the start, as often as needed); with drop_last, total <= n so nothing wraps.
    pub fn node_order(&self, seed: Option<u64>, ranks: &[u32]) -> Vec<u32> {
        let idx: Vec<u32> = match seed {
            Some(s) => randperm(self.n, &mut generator(s), self.version),
            None => (0..self.n).map(|i| i as u32).collect(),
        };
        if self.world == 1 {
            // One replica reads the list as is: total == n, nothing to pad or drop.
            return idx;
        }
        let num = self.num_samples();
        let w = u64::from(self.world);
        let mut out = Vec::with_capacity((num as usize) * ranks.len());
        for j in 0..num {
            out.extend(
                ranks
                    .iter()
                    .map(|&r| idx[((j * w + u64::from(r)) % self.n) as usize]),
            );
        }
        out
    }
}

/// `RandomSampler` (what `DataLoader(shuffle=True)` uses) on `n` samples, and where it draws from.
pub struct Random {
    pub n: u64,
    pub seed: u64,
    /// The generator seeded with `seed`: the loader's, the sampler's own, or the global RNG
    /// after `torch.manual_seed(seed)`.
    pub generator: GeneratorSource,
    pub persistent_workers: bool,
    pub version: TorchVersion,
}

impl Random {
    /// The order of epoch `epoch`, assuming nothing else draws from the generator; None once
    /// `wanted` says no (asked every few million words skipped).
    pub fn epoch_order(&self, epoch: u64, wanted: &dyn Fn() -> bool) -> Option<Vec<u32>> {
        let e = u128::from(epoch);
        // Outputs the loader's base seed (one random64 per iterator) has taken from the
        // generator up to and including this epoch: persistent workers keep the first iterator
        // alive. A sampler's own generator gives the loader nothing: its base seed comes from
        // the global RNG.
        let base_seed_draws = match (self.generator, self.persistent_workers) {
            (GeneratorSource::Sampler, _) => 0,
            (_, true) => 2,
            (_, false) => 2 * (e + 1),
        };
        let mut g = generator(self.seed);
        if self.generator == GeneratorSource::Global {
            // Each epoch the sampler draws a random64 seed for a private generator, which
            // keeps only its low 32 bits: the second output of the pair.
            discard_while(&mut g, base_seed_draws + 2 * e + 1, wanted)?;
            Some(randperm(
                self.n,
                &mut Mt19937::new(g.next_u32()),
                self.version,
            ))
        } else {
            // Each epoch: randperm for the order, then one more whose result is discarded
            // when the sampler is exhausted.
            let per_epoch = 2 * u128::from(randperm_draws(self.n, self.version));
            discard_while(&mut g, base_seed_draws + e * per_epoch, wanted)?;
            Some(randperm(self.n, &mut g, self.version))
        }
    }
}

/// Words skipped between two questions whether the order is still wanted (a few ms).
const WORDS_BETWEEN_ASKS: u128 = 1 << 24;

/// Skips `k` outputs of `g`, unless `wanted` says no on the way.
fn discard_while(g: &mut Mt19937, mut k: u128, wanted: &dyn Fn() -> bool) -> Option<()> {
    while k > WORDS_BETWEEN_ASKS {
        if !wanted() {
            return None;
        }
        g.discard(WORDS_BETWEEN_ASKS);
        k -= WORDS_BETWEEN_ASKS;
    }
    g.discard(k);
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLASSIC: TorchVersion = TorchVersion {
        major: 1,
        minor: 13,
    };

    #[test]
    fn randperm_check_values() {
        // From access-order.md.
        let newest = TorchVersion::NEWEST;
        assert_eq!(
            randperm(10, &mut generator(0), newest),
            [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]
        );
        assert_eq!(
            randperm(10, &mut generator(42), newest),
            [2, 6, 1, 8, 4, 5, 0, 9, 3, 7]
        );
    }

    #[test]
    fn randperm_tiny_lengths_draw_nothing() {
        for n in [0, 1] {
            let mut g = generator(0);
            assert_eq!(
                randperm(n, &mut g, CLASSIC),
                (0..n as u32).collect::<Vec<_>>()
            );
            assert_eq!(g.next_u32(), generator(0).next_u32());
        }
    }

    #[test]
    fn inside_out_hand_example() {
        // Seed 0, n = 6. random64() draws and z = draw % (i + 1):
        //   i=0: 10123822223749065263 -> 0   a = [0]
        //   i=1: 13192915183495924928 -> 0   a = [1, 0]
        //   i=2: 11119021634053362427 -> 1   a = [1, 2, 0]
        //   i=3: 10051320526890433895 -> 3   a = [1, 2, 0, 3]
        //   i=4:  7815051614634499795 -> 0   a = [4, 2, 0, 3, 1]
        //   i=5: 11914643441472427762 -> 4   a = [4, 2, 0, 3, 5, 1]
        let mut g = generator(0);
        assert_eq!(g.next_u64(), 10123822223749065263);
        assert_eq!(
            randperm_inside_out(6, &mut generator(0)),
            [4, 2, 0, 3, 5, 1]
        );
        // Same with seed 42, computed the same way.
        assert_eq!(
            randperm_inside_out(6, &mut generator(42)),
            [3, 0, 5, 4, 1, 2]
        );
    }

    #[test]
    fn inside_out_is_a_permutation_and_draws_2n() {
        for n in [1u64, 2, 3, 1000, 4097] {
            let mut g = generator(n);
            let mut a = randperm_inside_out(n, &mut g);
            let mut h = generator(n);
            h.discard(u128::from(2 * n));
            assert_eq!(g.next_u32(), h.next_u32(), "n={n}");
            a.sort_unstable();
            assert!(a.iter().copied().eq(0..n as u32), "n={n}");
        }
    }

    #[test]
    fn version_and_length_pick_the_algorithm() {
        let v26 = TorchVersion { major: 2, minor: 6 };
        let v25 = TorchVersion { major: 2, minor: 5 };
        assert!(!inside_out(INSIDE_OUT_MIN_N - 1, v26));
        assert!(inside_out(INSIDE_OUT_MIN_N, v26));
        assert!(!inside_out(INSIDE_OUT_MIN_N, v25));
        assert_eq!(INSIDE_OUT_MIN_N, 214_748_364);
        assert_eq!(randperm_draws(INSIDE_OUT_MIN_N, v26), 2 * INSIDE_OUT_MIN_N);
        assert_eq!(randperm_draws(INSIDE_OUT_MIN_N, v25), INSIDE_OUT_MIN_N - 1);
    }
}
