//! The crate's modules form layers, and a module may only refer to the layers below its own:
//! the import graph runs one way, so each layer can be read, tested and changed knowing only
//! what is beneath it. The order, bottom to top, with why each sits where it does:
//!
//! - `sys`: the raw Linux calls (a folder, `src/sys/`, by concern), the bottom: it uses
//!   nothing of the crate, and every layer may use it.
//! - `files`, `input`, `slow_remote`: leaves (whole-file reads and atomic writes, user-named
//!   text files, the simulated shared file system SOURCE lives on); they use only `sys`.
//! - `stats`: counters and the metrics file; uses only `files`.
//! - `catalog`: SOURCE's files and the dataset's sample → file layout.
//! - `order`: the samplers (sample indices per epoch), independent of the files.
//! - `plan`: the node's stream of files, composing `order` with the `catalog` layout.
//! - `cache`: the local directory holding copies of `catalog` files.
//! - `peers`: serves this node's copies to the job's other nodes and fetches theirs (HTTP/2).
//! - `stager`: copies ahead along the `plan` into the `cache`, counting in `stats`.
//! - `fs`: the FUSE operations, serving opens through the `stager`.
//! - `control`: the running mount's control channel (the feed hook's announcements, `stagefs
//!   epoch`), checked against the `catalog` and handed to the `stager`.
//! - `daemon`: the mounted process around `fs` and `control`.
//! - `bench`: a benchmark that mounts through `daemon` and reads as a job would.
//! - `sim`: a simulation of a job of many nodes, on the `stager`'s core and the `peers`'
//!   placement.
//! - `cli`: the commands, wiring everything.
//!
//! The check reads the sources: every `crate::X` (in code or an intra-doc link) inside module M
//! must have X in a layer below M's, or be M itself.

use std::fs;
use std::path::{Path, PathBuf};

const LAYERS: &[&str] = &[
    "sys",
    "files",
    "input",
    "slow_remote",
    "stats",
    "catalog",
    "order",
    "plan",
    "cache",
    "peers",
    "stager",
    "fs",
    "control",
    "daemon",
    "bench",
    "sim",
    "cli",
];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file under src/ belongs to (`None` for lib.rs and main.rs).
fn module_of(relative: &Path) -> Option<String> {
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_string())
}

/// Each `crate::X` in `text` as (1-based line, X), with `crate::{X, Y::z}` giving X and Y.
fn references(text: &str) -> Vec<(usize, String)> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let line_at = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        // `stagefs_crate::x` or `my_crate::x` are other paths.
        if text[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            continue;
        }
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level items, up to its matching brace.
            let mut depth = 0;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if c.is_whitespace() => {}
                    _ if item_start => {
                        item_start = false;
                        let name = ident(&group[i..]);
                        if !name.is_empty() {
                            out.push((line_at(at + "crate::{".len() + i), name));
                        }
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                out.push((line_at(at), name));
            }
        }
    }
    out
}

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|&l| l == module)
}

#[test]
fn modules_refer_only_to_layers_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut wrong = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).unwrap();
        let Some(module) = module_of(relative) else {
            continue;
        };
        let Some(own) = layer(&module) else {
            wrong.push(format!(
                "src/{}: module `{module}` is in no layer; add it to LAYERS in tests/layering.rs",
                relative.display()
            ));
            continue;
        };
        let text = fs::read_to_string(file).unwrap();
        for (line, target) in references(&text) {
            if target == module {
                continue;
            }
            match layer(&target) {
                Some(l) if l < own => {}
                Some(_) => wrong.push(format!(
                    "src/{}:{line}: `{module}` refers to crate::{target}, which is not below it",
                    relative.display()
                )),
                None => wrong.push(format!(
                    "src/{}:{line}: crate::{target} is in no layer; add it to LAYERS in tests/layering.rs",
                    relative.display()
                )),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports must go down the layers {LAYERS:?}:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn references_are_found_in_paths_and_groups() {
    let text = "use crate::cache::CacheDir;\nuse crate::{\n    plan::{Plan, NEVER},\n    stats,\n};\n/// [`x`](crate::order::X) and my_crate::no\n";
    let want = [(1, "cache"), (3, "plan"), (4, "stats"), (6, "order")];
    let want: Vec<(usize, String)> = want.iter().map(|&(l, m)| (l, m.to_string())).collect();
    assert_eq!(references(text), want);
}

#[test]
fn a_module_folder_counts_as_its_module() {
    assert_eq!(
        module_of(Path::new("sys/beneath.rs")).as_deref(),
        Some("sys")
    );
    assert_eq!(module_of(Path::new("sys/mod.rs")).as_deref(), Some("sys"));
    assert_eq!(module_of(Path::new("sys.rs")).as_deref(), Some("sys"));
    assert_eq!(module_of(Path::new("lib.rs")), None);
}
