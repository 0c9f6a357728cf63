//! Sample index → file, the way the job's dataset class numbers its samples.
//!
//! A sampler yields indices; what the job opens is `dataset.samples[i]`. This module rebuilds
//! that list from the catalog exactly as the dataset class builds it from the file system
//! (torchvision ImageFolder's sorted class folders and `os.walk(followlinks=True)`, a sorted
//! tree, or a user-supplied list), so that index i names the same file the framework opens.
//!
//! A sample whose path is a symlink maps to the file the link resolves to (that is what the
//! kernel opens); one that cannot be resolved inside SOURCE maps to no file and is simply not
//! staged.
//!
//! A dataset need not be all of SOURCE: any directory under it can be a dataset's root (a
//! dataset directory holds `train/` and `val/`, and the job reads `ImageFolder(root/train)`).
//! A layout is built for one root; [`Datasets`] builds them as they are asked for and keeps the
//! last few, since the catalog is shared and only the numbering differs.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::{Catalog, FileId, FileSet, Kind, MaybeFile, ROOT};

/// torchvision's `IMG_EXTENSIONS`, matched case-insensitively against the end of the path.
pub const DEFAULT_EXTENSIONS: &[&str] = &[
    ".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    ImageFolder,
    Tree,
    List,
}

impl LayoutKind {
    pub const ALL: [LayoutKind; 3] = [Self::ImageFolder, Self::Tree, Self::List];

    /// The name on the command line (`--layout`).
    pub fn name(self) -> &'static str {
        match self {
            Self::ImageFolder => "imagefolder",
            Self::Tree => "tree",
            Self::List => "list",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("cannot read --list-file {path}: {source}")]
    ListUnreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--list-file {path} line {line}: {reason}")]
    ListLine {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("--layout list needs --list-file FILE (one relative path per line)")]
    ListFileMissing,
    #[error("--list-file {0} names no file: give one relative path per line")]
    ListEmpty(PathBuf),
    #[error("layout {kind} found no samples {}; check --layout / --extensions / --dataset", in_dataset(.root))]
    Empty { kind: &'static str, root: String },
    #[error("--dataset {0}: no such directory in the source")]
    NoDirectory(PathBuf),
}

/// Where a dataset is, in a message: SOURCE itself, or a directory of it.
fn in_dataset(root: &str) -> String {
    match root {
        "." => "under the source".into(),
        dir => format!("in the source's {dir}"),
    }
}

/// How the job's dataset class numbers its files: the layout kind and its settings, the same
/// for every dataset root of a mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutSpec {
    pub kind: LayoutKind,
    /// ImageFolder: file name endings that count as samples, with their dot, matched
    /// case-insensitively.
    pub extensions: Vec<String>,
    /// List layout: one path per line, relative to the dataset's root; line i = sample i.
    pub list_file: Option<PathBuf>,
}

impl Default for LayoutSpec {
    fn default() -> Self {
        LayoutSpec {
            kind: LayoutKind::ImageFolder,
            extensions: DEFAULT_EXTENSIONS.iter().map(|e| e.to_string()).collect(),
            list_file: None,
        }
    }
}

/// One dataset's samples in index order, as catalog file ids.
pub struct Layout {
    /// The dataset's root directory, and its name ([`dataset_name`]).
    root: FileId,
    name: String,
    files: Vec<MaybeFile>,
    /// The files some sample reads.
    members: FileSet,
    classes: Vec<String>,
}

impl Layout {
    /// The samples of the dataset rooted at directory `root` (links followed), numbered as
    /// `spec` says.
    pub fn build(
        catalog: &Catalog,
        root: FileId,
        spec: &LayoutSpec,
    ) -> Result<Layout, LayoutError> {
        let root = catalog
            .resolve(root)
            .filter(|&r| catalog.entry(r).is_some_and(|e| e.kind == Kind::Directory))
            .ok_or_else(|| LayoutError::NoDirectory(catalog.relative_path(root)))?;
        let (files, classes) = match spec.kind {
            LayoutKind::ImageFolder => image_folder(catalog, root, &spec.extensions),
            LayoutKind::Tree => (sorted_tree(catalog, root), Vec::new()),
            LayoutKind::List => {
                let path = spec
                    .list_file
                    .as_deref()
                    .ok_or(LayoutError::ListFileMissing)?;
                let text = read_list(path)?;
                let files = parse_list(catalog, root, &text).map_err(list_line_error(path))?;
                if files.is_empty() {
                    return Err(LayoutError::ListEmpty(path.to_path_buf()));
                }
                (files.into_iter().map(MaybeFile::from).collect(), Vec::new())
            }
        };
        if files.is_empty() {
            return Err(LayoutError::Empty {
                kind: spec.kind.name(),
                root: dataset_name(catalog, root),
            });
        }
        let mut members = FileSet::with_id_space(catalog.len());
        members.extend(files.iter().filter_map(|f| f.get()));
        let mut files = files;
        files.shrink_to_fit();
        Ok(Layout {
            root,
            name: dataset_name(catalog, root),
            files,
            members,
            classes,
        })
    }

    /// The dataset's root directory.
    pub fn root(&self) -> FileId {
        self.root
    }

    /// The dataset's directory under SOURCE, `.` for SOURCE itself.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether some sample of the dataset reads `file`.
    pub fn contains(&self, file: FileId) -> bool {
        self.members.contains(file)
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The file sample `index` reads; `None` past the end or for a sample stagefs cannot serve.
    pub fn file_of(&self, index: u32) -> Option<FileId> {
        self.files.get(index as usize).and_then(|f| f.get())
    }

    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Heap memory of the sample → file table and the member set, in bytes.
    pub fn heap_bytes(&self) -> usize {
        4 * self.files.capacity() + self.members.heap_bytes()
    }

    /// Sample i is file i: for engine tests that do not need a real tree.
    #[cfg(test)]
    pub fn identity(n: u32) -> Layout {
        Layout::of_files((0..n).collect())
    }

    /// Sample i is `files[i]`: for engine tests and the cluster simulation, which need no real
    /// tree.
    pub fn of_files(files: Vec<FileId>) -> Layout {
        let mut members = FileSet::default();
        members.extend(files.iter().copied());
        Layout {
            root: ROOT,
            name: ".".into(),
            files: files.into_iter().map(MaybeFile::from).collect(),
            members,
            classes: Vec::new(),
        }
    }
}

/// How a dataset root is named to the user: its path relative to SOURCE, `.` for SOURCE.
pub fn dataset_name(catalog: &Catalog, root: FileId) -> String {
    match catalog.relative_path(root) {
        p if p.as_os_str().is_empty() => ".".into(),
        p => p.display().to_string(),
    }
}

/// Layouts kept built: the datasets a mount follows or looks at (the training set, the
/// validation set, a candidate while the order is searched for).
const KEPT_LAYOUTS: usize = 8;

/// The layouts of a mount's datasets, built on first use with the mount's [`LayoutSpec`].
pub struct Datasets {
    catalog: std::sync::Arc<Catalog>,
    spec: LayoutSpec,
    /// The dataset the user named (`--dataset`), if any: then it is the only one.
    named: Option<FileId>,
    /// Most recently used last.
    built: Mutex<Vec<std::sync::Arc<Layout>>>,
}

impl Datasets {
    pub fn new(catalog: std::sync::Arc<Catalog>, spec: LayoutSpec) -> Datasets {
        Datasets {
            catalog,
            spec,
            named: None,
            built: Mutex::new(Vec::new()),
        }
    }

    /// The job's dataset is the one at `relative`, as the user said: nothing else is looked
    /// for.
    pub fn named(mut self, relative: &Path) -> Result<Datasets, LayoutError> {
        let root = self.at(relative)?.root();
        self.named = Some(root);
        Ok(self)
    }

    /// The root of the dataset the user named, if they did.
    pub fn named_root(&self) -> Option<FileId> {
        self.named
    }

    pub fn catalog(&self) -> &std::sync::Arc<Catalog> {
        &self.catalog
    }

    pub fn spec(&self) -> &LayoutSpec {
        &self.spec
    }

    /// The layout of the dataset rooted at directory `root`. Built without the lock held:
    /// a million-file ImageFolder takes a second to sort.
    pub fn get(&self, root: FileId) -> Result<std::sync::Arc<Layout>, LayoutError> {
        let resolved = self.catalog.resolve(root).unwrap_or(root);
        if let Some(layout) = self.touch(resolved) {
            return Ok(layout);
        }
        let layout = std::sync::Arc::new(Layout::build(&self.catalog, root, &self.spec)?);
        let mut built = self.built.lock();
        if built.len() >= KEPT_LAYOUTS {
            built.remove(0);
        }
        built.push(layout.clone());
        Ok(layout)
    }

    /// The layout of the dataset at `relative` (a path under SOURCE, `.` or empty for SOURCE).
    pub fn at(&self, relative: &Path) -> Result<std::sync::Arc<Layout>, LayoutError> {
        let root = if relative.as_os_str().is_empty() || relative == Path::new(".") {
            Some(ROOT)
        } else {
            self.catalog.lookup_path(relative)
        };
        self.get(root.ok_or_else(|| LayoutError::NoDirectory(relative.to_path_buf()))?)
    }

    fn touch(&self, root: FileId) -> Option<std::sync::Arc<Layout>> {
        let mut built = self.built.lock();
        let i = built.iter().position(|l| l.root == root)?;
        let layout = built.remove(i);
        built.push(layout.clone());
        Some(layout)
    }
}

/// Python compares `str` by code point; for valid UTF-8 that is byte order. Names that are
/// not UTF-8 become surrogate escapes (U+DC80..U+DCFF) in Python, which we reproduce so a
/// stray Latin-1 file name sorts where torchvision puts it.
fn python_order(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    match (std::str::from_utf8(a), std::str::from_utf8(b)) {
        (Ok(_), Ok(_)) => a.cmp(b),
        _ => code_points(a).cmp(code_points(b)),
    }
}

fn code_points(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes.utf8_chunks().flat_map(|chunk| {
        chunk
            .valid()
            .chars()
            .map(|c| c as u32)
            .chain(chunk.invalid().iter().map(|&b| 0xDC00 + b as u32))
    })
}

fn has_extension(path: &[u8], extensions: &[String]) -> bool {
    let lower = String::from_utf8_lossy(path).to_lowercase();
    extensions.iter().any(|ext| lower.ends_with(ext.as_str()))
}

/// torchvision `make_dataset`: class folders are the root's entries that are directories
/// (following links), sorted; each class is walked with `os.walk(followlinks=True)`, the walk's
/// directories sorted by their full path string and the files of each sorted by name.
fn image_folder(
    catalog: &Catalog,
    root: FileId,
    extensions: &[String],
) -> (Vec<MaybeFile>, Vec<String>) {
    let extensions: Vec<String> = extensions.iter().map(|e| e.to_lowercase()).collect();
    let mut classes: Vec<(&[u8], FileId)> = catalog
        .children(root)
        .filter_map(|id| {
            let target = catalog.resolve(id)?;
            (catalog.entry(target)?.kind == Kind::Directory)
                .then_some((catalog.name(id).as_bytes(), target))
        })
        .collect();
    classes.sort_by(|a, b| python_order(a.0, b.0));

    let mut files = Vec::new();
    for (class_name, class_dir) in &classes {
        // Every directory the walk visits, as (path string, directory id).
        let mut dirs: Vec<(Vec<u8>, FileId)> = Vec::new();
        let mut stack: Vec<(Vec<u8>, FileId, Vec<FileId>)> =
            vec![(class_name.to_vec(), *class_dir, vec![*class_dir])];
        while let Some((path, dir, ancestors)) = stack.pop() {
            for child in catalog.children(dir) {
                let Some(target) = catalog.resolve(child) else {
                    continue;
                };
                if catalog.entry(target).map(|e| e.kind) != Some(Kind::Directory) {
                    continue;
                }
                if ancestors.contains(&target) {
                    log::warn!(
                        "symlink loop at {}; not followed",
                        catalog.relative_path(child).display()
                    );
                    continue;
                }
                let mut child_path = path.clone();
                child_path.push(b'/');
                child_path.extend_from_slice(catalog.name(child).as_bytes());
                let mut chain = ancestors.clone();
                chain.push(target);
                stack.push((child_path, target, chain));
            }
            dirs.push((path, dir));
        }
        dirs.sort_by(|a, b| python_order(&a.0, &b.0));
        for (path, dir) in dirs {
            // Children are already sorted by name bytes; non-UTF-8 names need Python's order.
            let mut names: Vec<FileId> = catalog.children(dir).collect();
            names.sort_by(|&a, &b| {
                python_order(catalog.name(a).as_bytes(), catalog.name(b).as_bytes())
            });
            for child in names {
                let resolved = catalog.resolve(child);
                if resolved.and_then(|t| catalog.entry(t)).map(|e| e.kind) == Some(Kind::Directory)
                {
                    continue;
                }
                let mut full = path.clone();
                full.push(b'/');
                full.extend_from_slice(catalog.name(child).as_bytes());
                if has_extension(&full, &extensions) {
                    files.push(MaybeFile::new(
                        resolved.filter(|&t| catalog.entry(t).map(|e| e.kind) == Some(Kind::File)),
                    ));
                }
            }
        }
    }
    let classes = classes
        .iter()
        .map(|(n, _)| String::from_utf8_lossy(n).into_owned())
        .collect();
    (files, classes)
}

/// Every regular file under `root` (symlinks not followed), sorted by path bytes.
fn sorted_tree(catalog: &Catalog, root: FileId) -> Vec<MaybeFile> {
    // Depth-first in name order with '/' as separator is not byte order ("a/x/b" vs "a/x-y"),
    // so collect paths and sort them.
    let mut with_paths: Vec<(Vec<u8>, FileId)> = Vec::new();
    let mut dirs = vec![(Vec::new(), root)];
    while let Some((path, dir)) = dirs.pop() {
        for child in catalog.children(dir) {
            let mut child_path = path.clone();
            if !child_path.is_empty() {
                child_path.push(b'/');
            }
            child_path.extend_from_slice(catalog.name(child).as_bytes());
            match catalog.entry(child).map(|e| e.kind) {
                Some(Kind::File) => with_paths.push((child_path, child)),
                Some(Kind::Directory) => dirs.push((child_path, child)),
                _ => {}
            }
        }
    }
    with_paths.sort_unstable();
    with_paths
        .into_iter()
        .map(|(_, id)| MaybeFile::from(id))
        .collect()
}

/// Reads a `--list-file` and checks the shape of its lines ([`list_paths`]), so a bad list is
/// reported before the scan; whether the paths exist is known only after it.
pub fn check_list_file(path: &Path) -> Result<(), LayoutError> {
    let text = read_list(path)?;
    let paths = list_paths(&text).map_err(list_line_error(path))?;
    if paths.is_empty() {
        return Err(LayoutError::ListEmpty(path.to_path_buf()));
    }
    Ok(())
}

fn read_list(path: &Path) -> Result<Vec<u8>, LayoutError> {
    crate::input::read(path).map_err(|source| LayoutError::ListUnreadable {
        path: path.to_path_buf(),
        source,
    })
}

fn list_line_error(path: &Path) -> impl FnOnce((usize, String)) -> LayoutError + '_ {
    move |(line, reason)| LayoutError::ListLine {
        path: path.to_path_buf(),
        line,
        reason,
    }
}

/// The lines of a `--list-file` as paths, checked for shape before any lookup: one relative
/// path per line (line i is sample i), no empty line, nothing absolute, no `..`. A trailing
/// newline and `\r\n` line ends are accepted. Errors carry the 1-based line number.
pub fn list_paths(text: &[u8]) -> Result<Vec<&Path>, (usize, String)> {
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    if body.is_empty() {
        return Ok(Vec::new());
    }
    body.split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, line)| {
            let line_no = i + 1;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                return Err((line_no, "empty line (every line must name a file)".into()));
            }
            let path = Path::new(OsStr::from_bytes(line));
            if path.is_absolute() {
                return Err((
                    line_no,
                    format!(
                        "'{}' is absolute; paths must be relative to the source",
                        path.display()
                    ),
                ));
            }
            if path
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return Err((
                    line_no,
                    format!(
                        "'{}' contains '..'; paths must stay inside the source",
                        path.display()
                    ),
                ));
            }
            Ok(path)
        })
        .collect()
}

/// [`list_paths`], then each path looked up in the catalog from `root`: it must name a regular
/// file (or a link resolving to one inside SOURCE).
fn parse_list(
    catalog: &Catalog,
    root: FileId,
    text: &[u8],
) -> Result<Vec<FileId>, (usize, String)> {
    list_paths(text)?
        .into_iter()
        .enumerate()
        .map(|(i, path)| {
            let line_no = i + 1;
            let id = catalog.lookup_path_from(root, path).ok_or_else(|| {
                (
                    line_no,
                    format!("'{}' does not exist in the source", path.display()),
                )
            })?;
            catalog
                .resolve(id)
                .filter(|&t| catalog.entry(t).map(|e| e.kind) == Some(Kind::File))
                .ok_or_else(|| {
                    (
                        line_no,
                        format!(
                            "'{}' is not a regular file (or a link to one) inside the source",
                            path.display()
                        ),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests;
