//! [`MaybeFile`]: the file a sample reads, or none, in the four bytes of a [`FileId`].
//!
//! The layout and every epoch plan hold one per sample, millions of them, where an
//! `Option<FileId>` would take eight bytes. The marker for "none" stays inside this type:
//! everything outside sees an `Option<FileId>`.

use super::FileId;

/// A [`FileId`], or none for a sample stagefs cannot serve (a dangling link, a link leaving
/// SOURCE). Stored as the id itself.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct MaybeFile(FileId);

impl MaybeFile {
    /// Never an id: a catalog has at most `u32::MAX` entries, so ids stop one below.
    const NONE: FileId = FileId::MAX;

    pub fn new(file: Option<FileId>) -> MaybeFile {
        MaybeFile(file.unwrap_or(Self::NONE))
    }

    pub fn get(self) -> Option<FileId> {
        (self.0 != Self::NONE).then_some(self.0)
    }
}

impl From<FileId> for MaybeFile {
    fn from(file: FileId) -> MaybeFile {
        MaybeFile(file)
    }
}

impl std::fmt::Debug for MaybeFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_bytes_and_every_id_round_trips() {
        assert_eq!(size_of::<MaybeFile>(), 4);
        for file in [None, Some(0), Some(7), Some(FileId::MAX - 1)] {
            assert_eq!(MaybeFile::new(file).get(), file);
        }
    }
}
