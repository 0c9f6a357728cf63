//! numpy's `default_rng(seed)` bit generator: `SeedSequence` seeding of a PCG64 (XSL-RR 128/64)
//! stream, with numpy's buffered 32-bit draws.
//!
//! Only integer seeds below 2^64 are accepted upstream (see `SamplerConfig::validate`), so the
//! entropy is at most two 32-bit words and always fits the 4-word pool: the extra-entropy
//! mixing pass of `SeedSequence` is never needed.

const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const PCG_MULT: u128 = (2_549_297_995_355_413_924 << 64) | 4_865_540_595_714_422_341;

/// `SeedSequence(seed).generate_state(4, uint64)`.
fn seed_sequence_state(seed: u64) -> [u64; 4] {
    let mut hash_const = INIT_A;
    let mut hashmix = |value: u32| {
        let mut v = value ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_A);
        v = v.wrapping_mul(hash_const);
        v ^ (v >> 16)
    };
    let mix = |x: u32, y: u32| {
        let r = MIX_MULT_L
            .wrapping_mul(x)
            .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
        r ^ (r >> 16)
    };
    // Entropy words are the seed's little-endian u32 words ([0] for 0); missing pool words
    // hash 0, so padding with zeros covers every seed length up to 4 words.
    let mut pool = [seed as u32, (seed >> 32) as u32, 0, 0].map(&mut hashmix);
    for src in 0..4 {
        for dst in 0..4 {
            if src != dst {
                let h = hashmix(pool[src]);
                pool[dst] = mix(pool[dst], h);
            }
        }
    }

    let mut hash_const = INIT_B;
    let mut words = [0u32; 8];
    for (i, w) in words.iter_mut().enumerate() {
        let mut d = pool[i % 4] ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_B);
        d = d.wrapping_mul(hash_const);
        *w = d ^ (d >> 16);
    }
    std::array::from_fn(|k| u64::from(words[2 * k]) | (u64::from(words[2 * k + 1]) << 32))
}

/// numpy's PCG64 bit generator.
#[derive(Clone)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
    /// High half of the last 64-bit draw, kept for the following 32-bit draw (numpy's
    /// `has_uint32`/`uinteger`). It survives across calls, so epochs must share one stream.
    spare: Option<u32>,
}

impl Pcg64 {
    /// The bit generator of `np.random.default_rng(seed)`.
    pub fn from_seed(seed: u64) -> Self {
        let s = seed_sequence_state(seed);
        let initstate = (u128::from(s[0]) << 64) | u128::from(s[1]);
        let initseq = (u128::from(s[2]) << 64) | u128::from(s[3]);
        let mut g = Self {
            state: 0,
            inc: (initseq << 1) | 1,
            spare: None,
        };
        g.step();
        g.state = g.state.wrapping_add(initstate);
        g.step();
        g
    }

    #[inline(always)]
    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let hi = (self.state >> 64) as u64;
        let lo = self.state as u64;
        (hi ^ lo).rotate_right((hi >> 58) as u32)
    }

    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if let Some(v) = self.spare.take() {
            return v;
        }
        let x = self.next_u64();
        self.spare = Some((x >> 32) as u32);
        x as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_rng_0_first_draw() {
        // Check value from access-order.md (numpy: default_rng(0).bit_generator.random_raw()).
        assert_eq!(Pcg64::from_seed(0).next_u64(), 11749869230777074271);
    }

    #[test]
    fn next_u32_splits_one_u64_low_half_first() {
        let x = Pcg64::from_seed(9).next_u64();
        let mut g = Pcg64::from_seed(9);
        assert_eq!(g.next_u32(), x as u32);
        assert_eq!(g.next_u32(), (x >> 32) as u32);
    }
}
