//! Which cached file to drop: the one whose next use is furthest away (Belady's rule).
//!
//! Because stagefs knows the future, the optimal offline policy is available online. Each
//! cached file is keyed by its next planned position; files not needed again within the plan's
//! horizon carry [`NEVER`](crate::plan::NEVER) and go first. When no prediction is available
//! the key is an LRU stamp instead, so the same index serves both modes.

use std::collections::{BTreeSet, HashMap};

use crate::catalog::FileId;
use crate::plan::Position;

/// Keys of LRU-stamped files count down from here, so a more recent use is a smaller key
/// (kept longer) and all of them rank after predicted keys of real positions.
const LRU_TOP: u64 = u64::MAX - 1;

#[derive(Default)]
pub struct EvictionIndex {
    by_key: BTreeSet<(u64, FileId)>,
    key_of: HashMap<FileId, u64>,
}

impl EvictionIndex {
    pub fn len(&self) -> usize {
        self.key_of.len()
    }

    pub fn contains(&self, file: FileId) -> bool {
        self.key_of.contains_key(&file)
    }

    /// Sets (or moves) `file`'s key to its next use.
    pub fn set_next_use(&mut self, file: FileId, next_use: Position) {
        self.set_key(file, next_use);
    }

    /// Sets `file`'s key to an LRU stamp (`seq` grows with every access).
    pub fn set_recently_used(&mut self, file: FileId, seq: u64) {
        self.set_key(file, LRU_TOP - seq.min(LRU_TOP / 2));
    }

    fn set_key(&mut self, file: FileId, key: u64) {
        if let Some(old) = self.key_of.insert(file, key) {
            self.by_key.remove(&(old, file));
        }
        self.by_key.insert((key, file));
    }

    pub fn remove(&mut self, file: FileId) {
        if let Some(old) = self.key_of.remove(&file) {
            self.by_key.remove(&(old, file));
        }
    }

    /// The file needed furthest in the future and its key.
    pub fn furthest(&self) -> Option<(u64, FileId)> {
        self.by_key.last().copied()
    }

    pub fn files(&self) -> Vec<FileId> {
        self.key_of.keys().copied().collect()
    }

    /// `file`'s current key, if it is cached.
    pub fn key(&self, file: FileId) -> Option<u64> {
        self.key_of.get(&file).copied()
    }

    /// Files whose key is exactly `key`.
    pub fn files_keyed(&self, key: u64) -> Vec<FileId> {
        self.by_key
            .range((key, FileId::MIN)..=(key, FileId::MAX))
            .map(|&(_, f)| f)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::NEVER;

    #[test]
    fn furthest_next_use_goes_first_and_never_before_all() {
        let mut ix = EvictionIndex::default();
        ix.set_next_use(1, 10);
        ix.set_next_use(2, 500);
        ix.set_next_use(3, 50);
        assert_eq!(ix.furthest(), Some((500, 2)));
        ix.set_next_use(3, NEVER);
        assert_eq!(ix.furthest(), Some((NEVER, 3)));
        ix.remove(3);
        ix.set_next_use(2, 5);
        assert_eq!(ix.furthest(), Some((10, 1)));
        assert_eq!(ix.len(), 2);
    }

    #[test]
    fn files_keyed_finds_exactly_that_key() {
        let mut ix = EvictionIndex::default();
        ix.set_next_use(1, NEVER);
        ix.set_next_use(2, 7);
        ix.set_next_use(3, NEVER);
        ix.set_next_use(4, NEVER - 1);
        assert_eq!(ix.files_keyed(NEVER), vec![1, 3]);
        assert_eq!(ix.key(2), Some(7));
        ix.set_next_use(3, 9);
        assert_eq!(ix.files_keyed(NEVER), vec![1]);
        assert_eq!(ix.key(5), None);
    }

    #[test]
    fn lru_stamps_evict_the_oldest_use() {
        let mut ix = EvictionIndex::default();
        ix.set_recently_used(7, 1);
        ix.set_recently_used(8, 2);
        ix.set_recently_used(9, 3);
        assert_eq!(ix.furthest().unwrap().1, 7);
        ix.set_recently_used(7, 4);
        assert_eq!(ix.furthest().unwrap().1, 8);
    }
}
