//! [`KeyedHeap`]: cached files by a key, the largest first, each movable and removable in
//! O(log n). What the key means is the policy's (see the parent module).

use crate::catalog::FileId;

/// Marks a file that is not in the heap.
const ABSENT: u32 = u32::MAX;

/// A max-heap of `(key, file)` with each file's slot recorded, so a key can be moved or
/// removed in O(log n). 16 bytes per cached file plus 4 per catalog id: a B-tree and a hash
/// map of keys took about 60 bytes per cached file, which at millions of cached files was most
/// of the daemon's memory.
#[derive(Default)]
pub struct KeyedHeap {
    heap: Vec<(u64, FileId)>,
    /// Heap slot of each file id, [`ABSENT`] if not cached; grown on demand.
    slot: Vec<u32>,
}

impl KeyedHeap {
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

    /// Sets (or moves) `file`'s key.
    pub fn set(&mut self, file: FileId, key: u64) {
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

    /// The file with the largest key, and the key.
    pub fn top(&self) -> Option<(u64, FileId)> {
        self.heap.first().copied()
    }

    pub fn files(&self) -> Vec<FileId> {
        self.heap.iter().map(|&(_, f)| f).collect()
    }

    /// `file`'s current key, if it is in the heap.
    #[cfg(test)]
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
    fn the_largest_key_is_on_top() {
        let mut ix = KeyedHeap::default();
        ix.set(1, 10);
        ix.set(2, 500);
        ix.set(3, 50);
        assert_eq!(ix.top(), Some((500, 2)));
        ix.set(3, NEVER);
        assert_eq!(ix.top(), Some((NEVER, 3)));
        ix.remove(3);
        ix.set(2, 5);
        assert_eq!(ix.top(), Some((10, 1)));
        assert_eq!(ix.len(), 2);
    }

    #[test]
    fn files_keyed_finds_exactly_that_key() {
        let mut ix = KeyedHeap::default();
        ix.set(1, NEVER);
        ix.set(2, 7);
        ix.set(3, NEVER);
        ix.set(4, NEVER - 1);
        assert_eq!(ix.files_keyed(NEVER), vec![1, 3]);
        assert_eq!(ix.key(2), Some(7));
        ix.set(3, 9);
        assert_eq!(ix.files_keyed(NEVER), vec![1]);
        assert_eq!(ix.key(5), None);
    }

    proptest::proptest! {
        /// Against a plain model: after any sequence of sets and removes, the furthest entry
        /// and every key are the model's.
        #[test]
        fn behaves_like_a_sorted_set(ops in proptest::collection::vec((0u32..40, 0u64..30, proptest::bool::ANY), 0..300)) {
            let mut ix = KeyedHeap::default();
            let mut model = std::collections::BTreeMap::new();
            for (file, key, remove) in ops {
                if remove {
                    ix.remove(file);
                    model.remove(&file);
                } else {
                    ix.set(file, key);
                    model.insert(file, key);
                }
                let want = model.iter().map(|(&f, &k)| (k, f)).max();
                proptest::prop_assert_eq!(ix.top(), want);
                proptest::prop_assert_eq!(ix.len(), model.len());
            }
            for f in 0..40 {
                proptest::prop_assert_eq!(ix.key(f), model.get(&f).copied());
            }
        }
    }
}
