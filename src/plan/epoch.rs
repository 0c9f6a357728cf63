//! [`EpochPlan`]: one epoch of the node stream, with its inverse (file → the offsets it is
//! read at), immutable once built.

use crate::catalog::{FileId, MaybeFile};

/// One epoch of the node stream, with its inverse.
pub struct EpochPlan {
    pub epoch: u64,
    /// The [`Generation`](super::Generation) it was computed for.
    pub(super) generation: u64,
    /// The announcement it was built from ([`Feed::version_of`](super::Feed::version_of); 0
    /// for a computed order).
    pub(super) built_from: u64,
    /// File read at each offset of the epoch.
    stream: Vec<MaybeFile>,
    /// `positions[starts[f]..starts[f + 1]]` are the offsets (ascending) where file f is read.
    starts: Vec<u32>,
    positions: Vec<u32>,
}

impl EpochPlan {
    /// The plan of `stream`, epoch `epoch` of generation `generation` (announcement version
    /// `built_from`), over file ids below `file_count`.
    pub fn build(
        (epoch, generation, built_from): (u64, u64, u64),
        stream: Vec<MaybeFile>,
        file_count: usize,
    ) -> EpochPlan {
        // Counting sort: a CSR index in two passes, no per-file allocation.
        let mut starts = vec![0u32; file_count + 1];
        for f in stream.iter().filter_map(|f| f.get()) {
            starts[f as usize + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut fill = starts.clone();
        let mut positions = vec![0u32; starts[file_count] as usize];
        for (offset, f) in stream.iter().enumerate() {
            if let Some(f) = f.get() {
                positions[fill[f as usize] as usize] = offset as u32;
                fill[f as usize] += 1;
            }
        }
        EpochPlan {
            epoch,
            generation,
            built_from,
            stream,
            starts,
            positions,
        }
    }

    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u64 {
        self.stream.len() as u64
    }

    /// The generation it was computed for.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The file read at `offset`; `None` past the end or for a sample stagefs cannot serve.
    pub fn file_at(&self, offset: u64) -> Option<FileId> {
        self.stream.get(offset as usize).and_then(|f| f.get())
    }

    /// Every file of the epoch in order, samples that cannot be served left out.
    pub fn files(&self) -> Vec<FileId> {
        self.stream.iter().filter_map(|f| f.get()).collect()
    }

    /// Heap memory of this epoch's plan, in bytes.
    pub fn heap_bytes(&self) -> usize {
        4 * (self.stream.capacity() + self.starts.capacity() + self.positions.capacity())
    }

    /// Offsets at which `file` is read in this epoch, ascending.
    pub fn offsets_of(&self, file: FileId) -> &[u32] {
        match (
            self.starts.get(file as usize),
            self.starts.get(file as usize + 1),
        ) {
            (Some(&a), Some(&b)) => &self.positions[a as usize..b as usize],
            _ => &[],
        }
    }
}
