//! torch's classic `randperm(n)` computed only as far as a search needs it: the first
//! positions of a candidate order cost about as many generator draws, not a whole
//! permutation, which is what lets the search try tens of thousands of seeds in well under a
//! second.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A multiplicative hash for the sparse permutation's integer keys (SipHash would dominate
/// the search's cost).
#[derive(Default)]
struct IndexHasher(u64);

impl Hasher for IndexHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, k: u64) {
        self.0 = k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The first positions of torch's classic `randperm(n)` from its first draws, for the quick
/// rejection of a search: the few displaced entries kept in a list, which for a handful of
/// steps is much cheaper than [`SparsePermutation`]'s hash map.
pub(super) struct FirstPositions {
    displaced: Vec<(u64, u32)>,
}

impl FirstPositions {
    /// After one Fisher-Yates step per draw (`draws.len() < n`).
    pub(super) fn new(n: u64, draws: &[u32]) -> FirstPositions {
        let mut first = FirstPositions {
            displaced: Vec::with_capacity(2 * draws.len()),
        };
        for (i, &d) in draws.iter().enumerate() {
            let i = i as u64;
            let z = i + u64::from(d) % (n - i);
            let (vi, vz) = (first.at(i), first.at(z));
            first.set(z, vi);
            first.set(i, vz);
        }
        first
    }

    pub(super) fn at(&self, i: u64) -> u32 {
        self.displaced
            .iter()
            .find(|&&(k, _)| k == i)
            .map_or(i as u32, |&(_, v)| v)
    }

    fn set(&mut self, i: u64, v: u32) {
        match self.displaced.iter_mut().find(|(k, _)| *k == i) {
            Some(slot) => slot.1 = v,
            None => self.displaced.push((i, v)),
        }
    }
}

/// torch's classic `randperm(n)` (forward Fisher-Yates, `swap(a[i], a[i + draw % (n - i)])`)
/// computed only as far as asked: position `i` is final after step `i`, and only the
/// displaced entries are stored. `draw` gives the generator's 32-bit outputs.
pub(super) struct SparsePermutation<D> {
    n: u64,
    steps_done: u64,
    draw: D,
    displaced: HashMap<u64, u32, BuildHasherDefault<IndexHasher>>,
}

impl<D: FnMut() -> u32> SparsePermutation<D> {
    pub(super) fn new(n: u64, draw: D) -> SparsePermutation<D> {
        SparsePermutation {
            n,
            steps_done: 0,
            draw,
            displaced: HashMap::default(),
        }
    }

    fn value(&self, i: u64) -> u32 {
        self.displaced.get(&i).copied().unwrap_or(i as u32)
    }

    /// The permutation's value at `position`; `None` past its end.
    pub(super) fn at(&mut self, position: u64) -> Option<u32> {
        if position >= self.n {
            return None;
        }
        // The last position takes no draw: it holds what is left.
        while self.steps_done <= position && self.steps_done + 1 < self.n {
            let i = self.steps_done;
            let z = i + u64::from((self.draw)()) % (self.n - i);
            let (vi, vz) = (self.value(i), self.value(z));
            self.displaced.insert(z, vi);
            self.displaced.insert(i, vz);
            self.steps_done += 1;
        }
        Some(self.value(position))
    }
}
