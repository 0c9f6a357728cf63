//! [`Lru`]: the least recently read copy goes, whatever the prediction says, for any file: a
//! plain cache, the baseline the prediction is measured against. Copies staged ahead and not
//! read yet are kept for their reader (a plain cache evicting them would evict what it just
//! fetched), except for a file a reader waits for now: then the latest staged goes.

use super::Eviction;
use super::heap::KeyedHeap;
use crate::catalog::FileId;
use crate::plan::Position;

#[derive(Default)]
pub struct Lru {
    /// Read copies keyed by `u64::MAX - last read`: the oldest read on top.
    read: KeyedHeap,
    /// Copies not read yet, keyed by when they were staged: the latest on top.
    staged: KeyedHeap,
    /// Counts reads and copies.
    clock: u64,
}

impl Lru {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }
}

impl Eviction for Lru {
    fn len(&self) -> usize {
        self.read.len() + self.staged.len()
    }

    fn contains(&self, file: FileId) -> bool {
        self.read.contains(file) || self.staged.contains(file)
    }

    fn needed_at(&mut self, file: FileId, _pos: Position) {
        // Only that a copy was made counts: whenever it is needed, it waits for its reader.
        if !self.contains(file) {
            let stamp = self.tick();
            self.staged.set(file, stamp);
        }
    }

    fn read(&mut self, file: FileId, _seq: u64) {
        self.staged.remove(file);
        let key = u64::MAX - self.tick();
        self.read.set(file, key);
    }

    fn stale(&mut self, file: FileId) {
        self.staged.remove(file);
        self.read.set(file, u64::MAX);
    }

    fn remove(&mut self, file: FileId) {
        self.read.remove(file);
        self.staged.remove(file);
    }

    fn victim(&self, needed_at: Position) -> Option<FileId> {
        let oldest_read = self.read.top().map(|(_, f)| f);
        oldest_read.or_else(|| {
            let waited_for = needed_at == 0;
            waited_for
                .then(|| self.staged.top().map(|(_, f)| f))
                .flatten()
        })
    }

    fn files(&self) -> Vec<FileId> {
        let mut files = self.read.files();
        files.extend(self.staged.files());
        files
    }

    fn unplanned(&self) -> Vec<FileId> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_read_goes_whatever_is_predicted() {
        let mut l = Lru::default();
        l.needed_at(1, 5);
        l.needed_at(2, 1_000);
        l.read(2, 10);
        l.read(1, 11);
        assert_eq!(l.victim(1), Some(2));
        assert_eq!(l.victim(u64::MAX), Some(2), "any file may take its room");
        l.read(2, 12);
        assert_eq!(l.victim(1), Some(1));
    }

    #[test]
    fn copies_not_read_yet_go_only_for_a_waiting_reader_latest_first() {
        let mut l = Lru::default();
        l.needed_at(1, 5);
        l.needed_at(2, 6);
        assert_eq!(l.victim(7), None);
        assert_eq!(l.victim(0), Some(2));
        assert_eq!(l.len(), 2);
        l.remove(2);
        assert_eq!(l.files(), [1]);
    }
}
