//! [`Belady`]: the copy needed furthest ahead goes first, and only for a file needed sooner
//! than it; copies not needed again within the plans known ([`NEVER`]) go before all.
//!
//! When nothing is predicted (the reader is lost, or on demand) the only knowledge is
//! recency: a read copy is keyed by an LRU stamp instead, counted down from just below
//! [`NEVER`], so a more recent read is kept longer and every stamped copy ranks after the
//! predicted positions (which are far smaller numbers): one heap serves both. A read while
//! predicting is followed by its next use, which replaces the stamp.

use super::Eviction;
use super::heap::KeyedHeap;
use crate::catalog::FileId;
use crate::plan::{NEVER, Position};

/// Where LRU stamps count down from.
const LRU_TOP: u64 = NEVER - 1;

#[derive(Default)]
pub struct Belady(KeyedHeap);

impl Eviction for Belady {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn contains(&self, file: FileId) -> bool {
        self.0.contains(file)
    }

    fn needed_at(&mut self, file: FileId, pos: Position) {
        self.0.set(file, pos);
    }

    fn read(&mut self, file: FileId, seq: u64) {
        self.0.set(file, LRU_TOP - seq.min(LRU_TOP / 2));
    }

    fn stale(&mut self, file: FileId) {
        self.0.set(file, LRU_TOP);
    }

    fn remove(&mut self, file: FileId) {
        self.0.remove(file);
    }

    fn victim(&self, needed_at: Position) -> Option<FileId> {
        self.0
            .top()
            .filter(|&(key, _)| key > needed_at)
            .map(|(_, f)| f)
    }

    fn files(&self) -> Vec<FileId> {
        self.0.files()
    }

    fn unplanned(&self) -> Vec<FileId> {
        self.0.files_keyed(NEVER)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_needed_furthest_goes_and_only_for_one_needed_sooner() {
        let mut b = Belady::default();
        b.needed_at(1, 10);
        b.needed_at(2, 500);
        b.needed_at(3, 50);
        assert_eq!(b.victim(20), Some(2));
        assert_eq!(
            b.victim(500),
            None,
            "nothing is needed later than a file needed at 500"
        );
        b.needed_at(3, NEVER);
        assert_eq!(b.victim(NEVER - 1), Some(3));
        assert_eq!(b.unplanned(), [3]);
    }

    #[test]
    fn read_copies_rank_after_predicted_ones_oldest_first_and_stale_ones_first() {
        let mut b = Belady::default();
        b.needed_at(1, 1_000_000);
        b.read(7, 1);
        b.read(8, 2);
        assert_eq!(b.victim(0), Some(7));
        b.read(7, 3);
        assert_eq!(b.victim(0), Some(8));
        b.stale(7);
        assert_eq!(b.victim(0), Some(7));
        b.remove(8);
        b.remove(7);
        assert_eq!(b.victim(0), Some(1));
    }
}
