//! [`FileSet`]: a set of catalog ids as one bit each, for "is this file one of that dataset's
//! samples?" on every open (a hash set would cost tens of bytes per file of a million-file
//! dataset; this costs an eighth of a byte per catalog entry).

use super::FileId;

#[derive(Clone, Default)]
pub struct FileSet {
    words: Vec<u64>,
    len: usize,
}

impl FileSet {
    /// An empty set with room for ids below `id_space` (larger ids grow it).
    pub fn with_id_space(id_space: usize) -> FileSet {
        FileSet {
            words: vec![0; id_space.div_ceil(64)],
            len: 0,
        }
    }

    pub fn contains(&self, file: FileId) -> bool {
        let (word, bit) = Self::slot(file);
        self.words.get(word).is_some_and(|w| w & bit != 0)
    }

    /// Adds `file`; whether it was new.
    pub fn insert(&mut self, file: FileId) -> bool {
        let (word, bit) = Self::slot(file);
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        let new = self.words[word] & bit == 0;
        self.words[word] |= bit;
        self.len += usize::from(new);
        new
    }

    /// Takes `file` out; whether it was in.
    pub fn remove(&mut self, file: FileId) -> bool {
        let (word, bit) = Self::slot(file);
        let Some(w) = self.words.get_mut(word) else {
            return false;
        };
        let was = *w & bit != 0;
        *w &= !bit;
        self.len -= usize::from(was);
        was
    }

    /// How many files are in it.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Heap memory, in bytes.
    pub fn heap_bytes(&self) -> usize {
        8 * self.words.capacity()
    }

    fn slot(file: FileId) -> (usize, u64) {
        (file as usize / 64, 1 << (file % 64))
    }
}

impl Extend<FileId> for FileSet {
    fn extend<I: IntoIterator<Item = FileId>>(&mut self, files: I) {
        for f in files {
            self.insert(f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_file_once_and_grows_past_its_id_space() {
        let mut set = FileSet::with_id_space(10);
        assert!(!set.contains(3));
        assert!(set.insert(3));
        assert!(!set.insert(3));
        assert!(set.insert(1000));
        assert!(set.contains(3) && set.contains(1000) && !set.contains(999));
        assert_eq!(set.len(), 2);
        assert!(set.remove(3) && !set.remove(3) && !set.remove(5000));
        assert!(!set.contains(3));
        assert_eq!(set.len(), 1);
    }
}
