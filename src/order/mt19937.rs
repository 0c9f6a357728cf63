//! The 32-bit Mersenne Twister (MT19937) with scalar `init_genrand` seeding.
//!
//! torch's CPU generator and numpy's legacy `RandomState` (and so Chainer) both produce this
//! exact stream, so one implementation serves both predictors. Outputs are made a block of
//! 624 at a time so that the hot shuffle loops read plain slices.

const N: usize = 624;
const M: usize = 397;

/// One MT19937 stream.
#[derive(Clone)]
pub struct Mt19937 {
    /// Raw state of the current block (what the next twist works on).
    state: [u32; N],
    /// Tempered outputs of the current block.
    out: [u32; N],
    /// Index of the next unread output; `N` when the block is used up.
    pos: usize,
}

impl Mt19937 {
    /// `init_genrand(seed)`: what both `torch.manual_seed` (low 32 bits) and
    /// `np.random.seed` do with a scalar seed.
    pub fn new(seed: u32) -> Self {
        // Both libraries twist before the first output.
        Self {
            state: seeded(seed, N),
            out: [0; N],
            pos: N,
        }
    }

    fn refill(&mut self) {
        twist(&mut self.state);
        for (o, &s) in self.out.iter_mut().zip(&self.state) {
            *o = temper(s);
        }
        self.pos = 0;
    }

    /// Next 32-bit output.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if self.pos == N {
            self.refill();
        }
        let v = self.out[self.pos];
        self.pos += 1;
        v
    }

    /// torch's `random64()` and numpy's `next_uint64`: first output in the high half.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let hi = u64::from(self.next_u32());
        (hi << 32) | u64::from(self.next_u32())
    }

    /// The next `1..=max` outputs (never more than what is left of the current block),
    /// marked as read. Lets hot loops iterate a slice instead of calling `next_u32`.
    /// `max` must be at least 1.
    #[inline]
    pub fn take(&mut self, max: usize) -> &[u32] {
        if self.pos == N {
            self.refill();
        }
        let start = self.pos;
        let end = start + max.min(N - start);
        self.pos = end;
        &self.out[start..end]
    }

    /// Skips `k` outputs. Whole blocks are only twisted, not tempered, which makes
    /// replaying earlier epochs of a fixed-draw-count shuffle cheap.
    pub fn discard(&mut self, mut k: u128) {
        let left = (N - self.pos) as u128;
        if k <= left {
            self.pos += k as usize;
            return;
        }
        k -= left;
        while k > N as u128 {
            twist(&mut self.state);
            k -= N as u128;
        }
        self.refill();
        self.pos = k as usize;
    }
}

/// Most outputs [`first_outputs`] can give: the twist's first `N - M` words read only words
/// of the seeded state.
pub const FIRST_OUTPUTS_MAX: usize = N - M;

/// The first `out.len()` outputs of `Mt19937::new(seed)` without seeding or twisting the whole
/// state: only the words they are made of. For a search over many seeds that needs a handful
/// of outputs from each, this is several times cheaper. At most [`FIRST_OUTPUTS_MAX`].
pub fn first_outputs(seed: u32, out: &mut [u32]) {
    assert!(
        out.len() <= FIRST_OUTPUTS_MAX,
        "at most {FIRST_OUTPUTS_MAX}"
    );
    let state = seeded(seed, M + out.len());
    for (i, o) in out.iter_mut().enumerate() {
        *o = temper(mix(state[i], state[i + 1], state[i + M]));
    }
}

/// `init_genrand(seed)`'s state, its first `words` words (the rest left 0).
fn seeded(seed: u32, words: usize) -> [u32; N] {
    let mut state = [0u32; N];
    state[0] = seed;
    for j in 1..words {
        let prev = state[j - 1];
        state[j] = 1_812_433_253u32
            .wrapping_mul(prev ^ (prev >> 30))
            .wrapping_add(j as u32);
    }
    state
}

#[inline(always)]
fn mix(cur: u32, next: u32, far: u32) -> u32 {
    let y = (cur & 0x8000_0000) | (next & 0x7fff_ffff);
    far ^ (y >> 1) ^ ((y & 1).wrapping_neg() & 0x9908_b0df)
}

/// The standard MT19937 state transition, in place, split into three loops so no index
/// needs a modulo.
fn twist(mt: &mut [u32; N]) {
    for i in 0..N - M {
        mt[i] = mix(mt[i], mt[i + 1], mt[i + M]);
    }
    for i in N - M..N - 1 {
        mt[i] = mix(mt[i], mt[i + 1], mt[i + M - N]);
    }
    mt[N - 1] = mix(mt[N - 1], mt[0], mt[M - 1]);
}

#[inline(always)]
fn temper(mut y: u32) -> u32 {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c_5680;
    y ^= (y << 15) & 0xefc6_0000;
    y ^ (y >> 18)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_outputs_for_default_seed() {
        let mut g = Mt19937::new(5489);
        let first: Vec<u32> = (0..5).map(|_| g.next_u32()).collect();
        assert_eq!(
            first,
            [3499211612, 581869302, 3890346734, 3586334585, 545404204]
        );
        // The C++ standard's check value: the 10000th output of the default-seeded engine.
        let mut g = Mt19937::new(5489);
        g.discard(9999);
        assert_eq!(g.next_u32(), 4123659995);
    }

    #[test]
    fn first_outputs_are_the_stream_s() {
        for seed in [0, 5, 5489, u32::MAX] {
            let mut out = [0u32; FIRST_OUTPUTS_MAX];
            first_outputs(seed, &mut out);
            let mut g = Mt19937::new(seed);
            assert!(out.iter().all(|&o| o == g.next_u32()), "seed {seed}");
        }
    }

    #[test]
    fn discard_and_take_match_single_steps() {
        for k in [0u128, 1, 5, 623, 624, 625, 1247, 1248, 1249, 5000] {
            let mut a = Mt19937::new(7);
            let mut b = a.clone();
            a.next_u32(); // start mid-block
            b.next_u32();
            a.discard(k);
            for _ in 0..k {
                b.next_u32();
            }
            assert_eq!(a.next_u64(), b.next_u64(), "discard({k})");
        }
        let mut a = Mt19937::new(11);
        let mut b = a.clone();
        let mut got = Vec::new();
        while got.len() < 2000 {
            got.extend_from_slice(a.take(2000 - got.len()));
        }
        let want: Vec<u32> = (0..2000).map(|_| b.next_u32()).collect();
        assert_eq!(got, want);
    }
}
