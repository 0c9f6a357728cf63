//! Which directories could be the job's dataset root: the ancestors of an opened file at the
//! layout's depth, counted per open, and the order they are tried in (see the parent
//! module's note).

use std::collections::HashMap;

use crate::catalog::{Catalog, FileId, Kind, ROOT};
use crate::order::detect;

use super::MAX_CANDIDATES;

/// `file`'s directories, from its parent up to SOURCE's root.
pub(super) fn ancestors(catalog: &Catalog, file: FileId) -> impl Iterator<Item = FileId> + '_ {
    let parent = move |id: FileId| (id != ROOT).then(|| catalog.entry(id).map(|e| e.parent))?;
    std::iter::successors(parent(file), move |&dir| parent(dir))
}

/// How deep a directory is below SOURCE's root.
fn depth(catalog: &Catalog, dir: FileId) -> usize {
    ancestors(catalog, dir).count()
}

/// Dataset roots to try for opens counted per root ([`Observed::by_root`]): first the deepest
/// holding three quarters of what the busiest holds, then the others by their opens, while
/// they hold a quarter of the busiest's and at least a search's worth.
pub(super) fn candidates(catalog: &Catalog, by_root: &HashMap<FileId, usize>) -> Vec<FileId> {
    let most = by_root.values().copied().max().unwrap_or(0);
    let mut roots: Vec<(FileId, usize)> = by_root
        .iter()
        .map(|(&r, &n)| (r, n))
        .filter(|&(_, n)| n >= detect::MIN_OPENS.max(most / 4))
        .collect();
    // Most opens first, the deeper of two alike first (ids are breadth-first: deeper is later).
    roots.sort_by_key(|&(r, n)| (std::cmp::Reverse(n), std::cmp::Reverse(r)));
    let likely = roots
        .iter()
        .filter(|&&(_, n)| 4 * n >= 3 * most)
        .max_by_key(|&&(r, _)| depth(catalog, r))
        .map(|&(r, _)| r);
    let mut out: Vec<FileId> = likely.into_iter().collect();
    out.extend(roots.iter().map(|&(r, _)| r).filter(|r| Some(*r) != likely));
    out.truncate(MAX_CANDIDATES);
    out
}

/// Files below every directory, all levels down. Ids are breadth-first, so a walk from the
/// last id back adds each directory's count to its parent's after its own is complete.
pub(super) fn files_below(catalog: &Catalog) -> HashMap<FileId, u32> {
    let mut below = HashMap::new();
    for id in (1..catalog.len() as FileId).rev() {
        let Some(e) = catalog.entry(id) else { continue };
        let own = match e.kind {
            Kind::File => 1,
            Kind::Directory => below.get(&id).copied().unwrap_or(0),
            _ => 0,
        };
        if own > 0 {
            *below.entry(e.parent).or_insert(0) += own;
        }
    }
    below
}
