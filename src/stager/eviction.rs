//! Which cached file to drop: the one whose next use is furthest away (Belady's rule).
//!
//! Because stagefs knows the future, the optimal offline policy is available online. Each
//! cached file is keyed by its next planned position; files not needed again within the plan's
//! horizon carry [`NEVER`](crate::plan::NEVER) and go first. When no prediction is available
//! the key is an LRU stamp instead, so the same index serves both modes.

use crate::catalog::FileId;
use crate::plan::Position;

/// Keys of LRU-stamped files count down from here, so a more recent use is a smaller key
/// (kept longer) and all of them rank after predicted keys of real positions.
const LRU_TOP: u64 = u64::MAX - 1;

/// Marks a file that is not in the heap.
const ABSENT: u32 = u32::MAX;

/// A max-heap of `(key, file)` with each file's slot recorded, so a key can be moved or
/// removed in O(log n). 16 bytes per cached file plus 4 per catalog id: a B-tree and a hash
/// map of keys took about 60 bytes per cached file, which at millions of cached files was most
/// of the daemon's memory.
#[derive(Default)]
pub struct EvictionIndex {
    heap: Vec<(u64, FileId)>,
    /// Heap slot of each file id, [`ABSENT`] if not cached; grown on demand.
    slot: Vec<u32>,
}

impl EvictionIndex {
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    fn slot_of(&self, file: FileId) -> Option<usize> {
        match self.slot.get(file as usize) {
            Some(&s) if s != ABSENT => Some(s as usize),
            _ => None,
        }
    }

    pub fn contains(&self, file: FileId) -> bool {
        self.slot_of(file).is_some()
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
        match self.slot_of(file) {
            Some(i) => {
                self.heap[i].0 = key;
                self.sift_up(i);
                self.sift_down(i);
            }
            None => {
                if self.slot.len() <= file as usize {
                    self.slot.resize(file as usize + 1, ABSENT);
                }
                self.heap.push((key, file));
                let last = self.heap.len() - 1;
                self.slot[file as usize] = last as u32;
                self.sift_up(last);
            }
        }
    }

    pub fn remove(&mut self, file: FileId) {
        let Some(i) = self.slot_of(file) else {
            return;
        };
        let last = self.heap.len() - 1;
        self.swap(i, last);
        self.heap.pop();
        self.slot[file as usize] = ABSENT;
        if i < self.heap.len() {
            self.sift_up(i);
            self.sift_down(i);
        }
    }

    /// The file needed furthest in the future and its key.
    pub fn furthest(&self) -> Option<(u64, FileId)> {
        self.heap.first().copied()
    }

    pub fn files(&self) -> Vec<FileId> {
        self.heap.iter().map(|&(_, f)| f).collect()
    }

    /// `file`'s current key, if it is cached.
    pub fn key(&self, file: FileId) -> Option<u64> {
        self.slot_of(file).map(|i| self.heap[i].0)
    }

    /// Files whose key is exactly `key`, in id order.
    pub fn files_keyed(&self, key: u64) -> Vec<FileId> {
        let mut files: Vec<FileId> = self
            .heap
            .iter()
            .filter(|&&(k, _)| k == key)
            .map(|&(_, f)| f)
            .collect();
        files.sort_unstable();
        files
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.slot[self.heap[a].1 as usize] = a as u32;
        self.slot[self.heap[b].1 as usize] = b as u32;
    }

    fn sift_up(&mut self, mut i: usize) {
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.heap[i] <= self.heap[parent] {
                break;
            }
            self.swap(i, parent);
            i = parent;
        }
    }

    fn sift_down(&mut self, mut i: usize) {
        loop {
            let (left, right) = (2 * i + 1, 2 * i + 2);
            let mut largest = i;
            if left < self.heap.len() && self.heap[left] > self.heap[largest] {
                largest = left;
            }
            if right < self.heap.len() && self.heap[right] > self.heap[largest] {
                largest = right;
            }
            if largest == i {
                return;
            }
            self.swap(i, largest);
            i = largest;
        }
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

    proptest::proptest! {
        /// Against a plain model: after any sequence of sets and removes, the furthest entry
        /// and every key are the model's.
        #[test]
        fn behaves_like_a_sorted_set(ops in proptest::collection::vec((0u32..40, 0u64..30, proptest::bool::ANY), 0..300)) {
            let mut ix = EvictionIndex::default();
            let mut model = std::collections::BTreeMap::new();
            for (file, key, remove) in ops {
                if remove {
                    ix.remove(file);
                    model.remove(&file);
                } else {
                    ix.set_next_use(file, key);
                    model.insert(file, key);
                }
                let want = model.iter().map(|(&f, &k)| (k, f)).max();
                proptest::prop_assert_eq!(ix.furthest(), want);
                proptest::prop_assert_eq!(ix.len(), model.len());
            }
            for f in 0..40 {
                proptest::prop_assert_eq!(ix.key(f), model.get(&f).copied());
            }
        }
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
