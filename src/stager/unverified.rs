//! Which cached files a previous mount left whose bytes are still to be checked against their
//! checksum (on their first open). One bit per catalog id: a remount can reuse millions of
//! files, and the rest of the per-file state is one byte each.

use crate::catalog::FileId;

#[derive(Default)]
pub(super) struct Unverified(Vec<u64>);

impl Unverified {
    fn slot(file: FileId) -> (usize, u64) {
        (file as usize / 64, 1 << (file % 64))
    }

    pub(super) fn insert(&mut self, file: FileId) {
        let (word, bit) = Self::slot(file);
        if self.0.len() <= word {
            self.0.resize(word + 1, 0);
        }
        self.0[word] |= bit;
    }

    pub(super) fn remove(&mut self, file: FileId) {
        let (word, bit) = Self::slot(file);
        if let Some(w) = self.0.get_mut(word) {
            *w &= !bit;
        }
    }

    pub(super) fn contains(&self, file: FileId) -> bool {
        let (word, bit) = Self::slot(file);
        self.0.get(word).is_some_and(|w| w & bit != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_independent() {
        let mut u = Unverified::default();
        for f in [0, 63, 64, 1_000_003] {
            assert!(!u.contains(f));
            u.insert(f);
        }
        u.remove(64);
        assert!(u.contains(0) && u.contains(63) && u.contains(1_000_003));
        assert!(!u.contains(64) && !u.contains(65) && !u.contains(u32::MAX));
    }
}
