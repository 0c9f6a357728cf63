//! The part of SOURCE a benchmark reads: chosen reproducibly, so two runs (or two machines)
//! with the same flags read the same files.
//!
//! An ImageFolder-shaped SOURCE is cut along its class folders: whole classes, taken in a
//! seeded shuffle of the class list until the subset holds `--files N` files or `--fraction F`
//! of them, because a job trained on part of a dataset drops classes, not random images (and
//! a class's files sit together on the file system). A flat dataset is cut file by file the
//! same way. Without a size, the subset is all of it. The chosen files keep the dataset's own
//! order (ImageFolder's over the chosen classes), and that list is what every method reads:
//! sample i is the same file for all of them.

use std::path::PathBuf;

use crate::catalog::{Catalog, FileId, Layout, LayoutError, LayoutKind, LayoutSpec, ROOT};
use crate::order::{OrderError, SamplerConfig, SamplerKind};
use crate::stager::{Source, SourceError, attributes};

/// How much of SOURCE to read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SubsetSize {
    /// Everything.
    All,
    /// Whole classes (or files) until at least this many files.
    Files(u64),
    /// Whole classes (or files) until at least this share of the files, in (0, 1].
    Fraction(f64),
}

/// The files a benchmark reads, in sample order.
#[derive(Clone, Debug)]
pub struct Subset {
    /// Paths relative to SOURCE; line i of the mount's list file, sample i of every reader.
    pub paths: Vec<PathBuf>,
    /// Their catalog entries: what each must still be when it is read.
    pub files: Vec<FileId>,
    /// Their total size.
    pub bytes: u64,
    /// The class folders chosen, in the dataset's order; empty for a flat dataset.
    pub classes: Vec<String>,
    /// How many class folders SOURCE has (0 for a flat dataset).
    pub classes_in_source: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum SubsetError {
    #[error("--fraction {0} is outside (0, 1]: give the share of SOURCE to read, e.g. 0.1")]
    Fraction(f64),
    #[error("SOURCE holds no files to read")]
    Empty,
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Order(#[from] OrderError),
    #[error(transparent)]
    Source(#[from] SourceError),
}

/// Chooses the subset of `catalog` (a scan of SOURCE, read through `source`) that `size` asks
/// for; `seed` shuffles the classes (as `torch.randperm(classes,
/// generator=torch.Generator().manual_seed(seed))`). `extensions` are the sample file endings
/// an ImageFolder counts. The chosen files are `lstat`ed for their size.
pub fn choose(
    catalog: &Catalog,
    source: &dyn Source,
    extensions: &[String],
    size: SubsetSize,
    seed: i128,
) -> Result<Subset, SubsetError> {
    if let SubsetSize::Fraction(f) = size {
        check_fraction(f)?;
    }
    let (units, class_names) = units(catalog, extensions)?;
    let total: u64 = units.iter().map(|u| u.len() as u64).sum();
    if total == 0 {
        return Err(SubsetError::Empty);
    }
    let wanted = match size {
        SubsetSize::All => total,
        SubsetSize::Files(n) => n.min(total),
        SubsetSize::Fraction(f) => ((f * total as f64).ceil() as u64).clamp(1, total),
    };
    let mut chosen = vec![false; units.len()];
    let mut count = 0;
    if wanted == total {
        chosen.fill(true);
    } else {
        let mut shuffle = SamplerConfig::new(SamplerKind::TorchDistributed);
        shuffle.seed = seed;
        for unit in shuffle.epoch_order(units.len() as u64, 0, 0)? {
            if count >= wanted {
                break;
            }
            chosen[unit as usize] = true;
            count += units[unit as usize].len() as u64;
        }
    }
    let picked: Vec<&Vec<u32>> = (units.iter().zip(&chosen))
        .filter_map(|(u, &c)| c.then_some(u))
        .collect();
    let classes = (class_names.iter().zip(&chosen))
        .filter(|(_, c)| **c)
        .map(|(name, _)| name.clone())
        .collect();
    let files: Vec<u32> = picked.iter().flat_map(|u| u.iter().copied()).collect();
    let mut bytes = 0;
    for &f in &files {
        bytes += attributes(source, catalog, f)?.size;
    }
    Ok(Subset {
        paths: files.iter().map(|&f| catalog.relative_path(f)).collect(),
        bytes,
        files,
        classes,
        classes_in_source: class_names.len(),
    })
}

/// `f` if it is a share of SOURCE, in (0, 1].
pub fn check_fraction(f: f64) -> Result<f64, SubsetError> {
    if f > 0.0 && f <= 1.0 {
        Ok(f)
    } else {
        Err(SubsetError::Fraction(f))
    }
}

/// What the subset is cut into, in the dataset's order: an ImageFolder's classes (its files
/// grouped by class folder) with the classes' names, else every file on its own and no names.
fn units(
    catalog: &Catalog,
    extensions: &[String],
) -> Result<(Vec<Vec<u32>>, Vec<String>), SubsetError> {
    let spec = |kind| LayoutSpec {
        kind,
        extensions: extensions.to_vec(),
        list_file: None,
    };
    match Layout::build(catalog, ROOT, &spec(LayoutKind::ImageFolder)) {
        Ok(layout) => {
            let mut classes: Vec<Vec<u32>> = Vec::new();
            let mut names: Vec<String> = Vec::new();
            for file in (0..layout.len() as u32).filter_map(|i| layout.file_of(i)) {
                // A class's samples are consecutive in the layout; the top folder names it.
                let path = catalog.relative_path(file);
                let class = path
                    .components()
                    .next()
                    .map(|c| c.as_os_str().to_string_lossy());
                let class = class.unwrap_or_default().into_owned();
                if names.last() != Some(&class) {
                    names.push(class);
                    classes.push(Vec::new());
                }
                classes.last_mut().expect("pushed above").push(file);
            }
            Ok((classes, names))
        }
        Err(LayoutError::Empty { .. }) => {
            let layout = Layout::build(catalog, ROOT, &spec(LayoutKind::Tree))?;
            let files = (0..layout.len() as u32).filter_map(|i| layout.file_of(i));
            Ok((files.map(|f| vec![f]).collect(), Vec::new()))
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::{Path, PathBuf};

    use super::{Subset, SubsetError, SubsetSize, choose};
    use crate::catalog::{Catalog, DEFAULT_EXTENSIONS, Walking};
    use crate::stager::{LocalSource, SourceRoot};

    fn extensions() -> Vec<String> {
        DEFAULT_EXTENSIONS.iter().map(|e| e.to_string()).collect()
    }

    /// `classes` folders of `per_class` 10-byte images each (none if `classes` is 0: then
    /// `per_class` flat files).
    fn dataset(classes: u32, per_class: u32) -> (tempfile::TempDir, Catalog) {
        let dir = tempfile::tempdir().unwrap();
        for c in 0..classes.max(1) {
            for i in 0..per_class {
                let rel = match classes {
                    0 => format!("f{i:03}.bin"),
                    _ => format!("c{c:02}/img{i:03}.jpg"),
                };
                let path = dir.path().join(rel);
                fs::create_dir_all(path.parent().unwrap()).unwrap();
                fs::write(path, [0u8; 10]).unwrap();
            }
        }
        let catalog = Catalog::scan(dir.path(), Walking::threads(2)).unwrap();
        (dir, catalog)
    }

    fn source(catalog: &Catalog) -> LocalSource {
        LocalSource::new(std::sync::Arc::new(
            SourceRoot::open(catalog.root_path()).unwrap(),
        ))
    }

    fn pick(catalog: &Catalog, size: SubsetSize, seed: i128) -> Subset {
        choose(catalog, &source(catalog), &extensions(), size, seed).unwrap()
    }

    fn class_of(p: &Path) -> String {
        p.components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .into()
    }

    #[test]
    fn files_picks_whole_classes_reproducibly() {
        let (_dir, catalog) = dataset(10, 20);
        let a = pick(&catalog, SubsetSize::Files(50), 0);
        // 50 files need three classes of 20: whole ones, never part of one.
        assert_eq!(a.paths.len(), 60);
        assert_eq!(a.bytes, 600);
        assert_eq!((a.classes.len(), a.classes_in_source), (3, 10));
        let mut classes: Vec<String> = a.paths.iter().map(|p| class_of(p)).collect();
        classes.dedup();
        assert_eq!(classes, a.classes, "whole classes, each once");
        let mut sorted = classes.clone();
        sorted.sort();
        assert_eq!(classes, sorted, "the dataset's own order");
        assert_eq!(a.paths, pick(&catalog, SubsetSize::Files(50), 0).paths);
        // Another seed draws other classes: the shuffle is what chooses, not the names.
        let seeds: Vec<Vec<PathBuf>> = (0..4)
            .map(|s| pick(&catalog, SubsetSize::Files(50), s).paths)
            .collect();
        assert!(seeds.iter().any(|p| *p != seeds[0]));
    }

    #[test]
    fn fraction_rounds_up_to_whole_classes() {
        let (_dir, catalog) = dataset(10, 20);
        assert_eq!(
            pick(&catalog, SubsetSize::Fraction(0.25), 7).paths.len(),
            60
        );
        assert_eq!(pick(&catalog, SubsetSize::Fraction(0.2), 7).paths.len(), 40);
        assert_eq!(
            pick(&catalog, SubsetSize::Fraction(1.0), 7).paths.len(),
            200
        );
        for bad in [0.0, -0.5, 1.01, f64::NAN] {
            let err = choose(
                &catalog,
                &source(&catalog),
                &extensions(),
                SubsetSize::Fraction(bad),
                0,
            );
            assert!(matches!(err, Err(SubsetError::Fraction(_))), "{bad}");
        }
    }

    #[test]
    fn without_a_size_or_beyond_it_everything_in_dataset_order() {
        let (_dir, catalog) = dataset(4, 3);
        let all = pick(&catalog, SubsetSize::All, 0);
        let expected: Vec<PathBuf> = (0..12)
            .map(|i| PathBuf::from(format!("c{:02}/img{:03}.jpg", i / 3, i % 3)))
            .collect();
        assert_eq!(all.paths, expected);
        assert_eq!(pick(&catalog, SubsetSize::Files(1000), 3).paths, expected);
    }

    #[test]
    fn a_flat_dataset_is_cut_file_by_file() {
        let (_dir, catalog) = dataset(0, 30);
        let some = pick(&catalog, SubsetSize::Files(7), 1);
        assert_eq!(some.paths.len(), 7);
        assert_eq!((some.classes.len(), some.classes_in_source), (0, 0));
        let mut sorted = some.paths.clone();
        sorted.sort();
        assert_eq!(some.paths, sorted);
        assert_eq!(pick(&catalog, SubsetSize::All, 1).paths.len(), 30);
    }

    #[test]
    fn an_empty_source_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Catalog::scan(dir.path(), Walking::threads(1)).unwrap();
        let err = choose(
            &catalog,
            &source(&catalog),
            &extensions(),
            SubsetSize::All,
            0,
        );
        assert!(
            matches!(err, Err(SubsetError::Layout(_) | SubsetError::Empty)),
            "{err:?}"
        );
    }
}
