//! A benchmark's results: what each method measured per epoch, as a table for people, the
//! ratios that answer "how much faster", and JSON for scripts (`--json`).
//!
//! The table is a function of the [`Report`] alone, so anything that runs a benchmark (the
//! `bench` command, the demo) prints the same thing.

use std::fmt::Write;

use serde::Serialize;

use super::Method;

/// Everything one benchmark measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// What was read.
    pub subset: SubsetSummary,
    pub methods: Methods,
    /// Things the reader of the numbers should know (a skipped method, a page cache that
    /// was not dropped).
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SubsetSummary {
    pub files: u64,
    pub bytes: u64,
    /// The class folders read, when SOURCE is ImageFolder-shaped.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<String>,
    /// How many class folders SOURCE has (0: a flat dataset).
    pub classes_in_source: usize,
}

/// The methods that ran, by the names the JSON uses.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Methods {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub direct: Option<MethodRun>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stagefs: Option<MethodRun>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stagefs_fuse: Option<MethodRun>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy_first: Option<MethodRun>,
}

impl Methods {
    pub fn get(&self, method: Method) -> Option<&MethodRun> {
        match method {
            Method::Direct => self.direct.as_ref(),
            Method::Stagefs => self.stagefs.as_ref(),
            Method::StagefsFuse => self.stagefs_fuse.as_ref(),
            Method::CopyFirst => self.copy_first.as_ref(),
        }
    }

    pub fn slot(&mut self, method: Method) -> &mut Option<MethodRun> {
        match method {
            Method::Direct => &mut self.direct,
            Method::Stagefs => &mut self.stagefs,
            Method::StagefsFuse => &mut self.stagefs_fuse,
            Method::CopyFirst => &mut self.copy_first,
        }
    }

    /// The methods that ran, in [`Method::ALL`]'s order.
    pub fn iter(&self) -> impl Iterator<Item = (Method, &MethodRun)> {
        Method::ALL
            .into_iter()
            .filter_map(|m| self.get(m).map(|run| (m, run)))
    }
}

/// One method's run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MethodRun {
    /// copy-first: the copy of the subset to local storage, before the first epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy_seconds: Option<f64>,
    /// stagefs: mounting (checking the benchmark's scan of SOURCE against it), before the
    /// first epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mount_seconds: Option<f64>,
    /// Why the method did not run (then `epochs` is empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    pub epochs: Vec<Epoch>,
}

impl MethodRun {
    /// Time before the first epoch could start (copy or mount), plus every epoch.
    pub fn total_seconds(&self) -> f64 {
        self.setup_seconds() + self.epochs.iter().map(|e| e.seconds).sum::<f64>()
    }

    fn setup_seconds(&self) -> f64 {
        self.copy_seconds.or(self.mount_seconds).unwrap_or(0.0)
    }
}

/// One epoch of one method.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Epoch {
    pub seconds: f64,
    pub files: u64,
    pub bytes: u64,
    /// Time the training loop waited for data.
    pub stall_seconds: f64,
    /// Time a reader worker spent in reads (on average over the workers).
    pub read_seconds: f64,
    /// stagefs: opens served from the cache, and opens that waited for a copy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub misses: Option<u64>,
    /// stagefs: opens the kernel sent the daemon (a hooked job's batch opens are not).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fuse_opens: Option<u64>,
}

/// Bytes in a megabyte, as the table's MB/s counts them (decimal, as disks and networks do).
const MB: f64 = 1e6;

/// The per-epoch table, then the methods' setup times and the ratios to reading SOURCE
/// directly.
pub fn table(report: &Report) -> String {
    let mut out = String::new();
    let s = &report.subset;
    let classes = match s.classes_in_source {
        0 => String::new(),
        of => format!(" in {} of {of} classes", s.classes.len()),
    };
    let _ = writeln!(
        out,
        "subset: {} files{classes}, {:.1} MB",
        s.files,
        s.bytes as f64 / MB
    );
    let _ = writeln!(
        out,
        "{:>5}  {:<12} {:>8} {:>8} {:>7} {:>11} {:>7} {:>7}",
        "epoch", "method", "seconds", "files/s", "MB/s", "hits", "stall s", "read s"
    );
    let epochs = report
        .methods
        .iter()
        .map(|(_, run)| run.epochs.len())
        .max()
        .unwrap_or(0);
    for epoch in 0..epochs {
        for (method, run) in report.methods.iter() {
            let Some(e) = run.epochs.get(epoch) else {
                continue;
            };
            let hits = match e.hits {
                Some(h) => format!("{h}/{}", h + e.misses.unwrap_or(0)),
                None => "-".into(),
            };
            let _ = writeln!(
                out,
                "{epoch:>5}  {:<12} {:>8.2} {:>8.0} {:>7.1} {hits:>11} {:>7.2} {:>7.2}",
                method.name(),
                e.seconds,
                per_second(e.files as f64, e.seconds),
                per_second(e.bytes as f64 / MB, e.seconds),
                e.stall_seconds,
                e.read_seconds
            );
        }
    }
    for (method, run) in report.methods.iter() {
        if let Some(why) = &run.skipped {
            let _ = writeln!(out, "{}: skipped: {why}", method.name());
        }
        if let Some(t) = run.copy_seconds {
            let _ = writeln!(out, "{}: copy before epoch 0: {t:.2} s", method.name());
        }
        if let Some(t) = run.mount_seconds {
            let _ = writeln!(out, "{}: mount before epoch 0: {t:.2} s", method.name());
        }
    }
    out.push_str(&ratios(report));
    out
}

/// How many times faster than direct each method read, per epoch and over the whole run
/// (setup included), e.g. `stagefs vs direct: epochs 0.95× 4.10× 4.21×; whole run 2.9×`.
fn ratios(report: &Report) -> String {
    let mut out = String::new();
    let Some(direct) = report
        .methods
        .direct
        .as_ref()
        .filter(|d| d.skipped.is_none())
    else {
        return out;
    };
    for (method, run) in report.methods.iter() {
        if method == Method::Direct || run.skipped.is_some() || run.epochs.is_empty() {
            continue;
        }
        let per_epoch: Vec<String> = (direct.epochs.iter().zip(&run.epochs))
            .map(|(d, m)| format!("{:.2}×", d.seconds / m.seconds))
            .collect();
        let _ = writeln!(
            out,
            "{} vs direct (× faster): epochs {}; whole run with {} {:.2}×",
            method.name(),
            per_epoch.join(" "),
            if method == Method::CopyFirst {
                "the copy"
            } else {
                "the mount"
            },
            direct.total_seconds() / run.total_seconds()
        );
    }
    out.push_str(&against_copy(report));
    out
}

/// How the mount's whole run compares with copying first (the alternative it must beat), e.g.
/// `stagefs vs copy-first: whole run 1.25× faster`.
fn against_copy(report: &Report) -> String {
    let mut out = String::new();
    let ran = |run: Option<&MethodRun>| {
        run.filter(|r| r.skipped.is_none() && !r.epochs.is_empty())
            .cloned()
    };
    let Some(copy) = ran(report.methods.copy_first.as_ref()) else {
        return out;
    };
    for method in [Method::Stagefs, Method::StagefsFuse] {
        if let Some(run) = ran(report.methods.get(method)) {
            let _ = writeln!(
                out,
                "{} vs copy-first: whole run {:.2}× faster",
                method.name(),
                copy.total_seconds() / run.total_seconds()
            );
        }
    }
    out
}

fn per_second(amount: f64, seconds: f64) -> f64 {
    if seconds > 0.0 { amount / seconds } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::{Epoch, MethodRun, Methods, Report, SubsetSummary, table};

    fn epoch(seconds: f64, hits: Option<u64>) -> Epoch {
        Epoch {
            seconds,
            files: 200,
            bytes: 2_000_000,
            stall_seconds: seconds / 2.0,
            read_seconds: seconds / 4.0,
            hits,
            misses: hits.map(|h| 200 - h),
            fuse_opens: hits.map(|_| 0),
        }
    }

    fn report() -> Report {
        Report {
            subset: SubsetSummary {
                files: 200,
                bytes: 2_000_000,
                classes: (0..10).map(|c| format!("n{c:08}")).collect(),
                classes_in_source: 40,
            },
            methods: Methods {
                direct: Some(MethodRun {
                    epochs: vec![epoch(4.0, None), epoch(4.0, None)],
                    ..MethodRun::default()
                }),
                stagefs: Some(MethodRun {
                    mount_seconds: Some(0.5),
                    epochs: vec![epoch(3.5, Some(150)), epoch(1.0, Some(200))],
                    ..MethodRun::default()
                }),
                stagefs_fuse: None,
                copy_first: Some(MethodRun {
                    skipped: Some("no room".into()),
                    ..MethodRun::default()
                }),
            },
            notes: vec![],
        }
    }

    #[test]
    fn json_has_the_documented_shape() {
        let json = serde_json::to_value(report()).unwrap();
        let methods = json["methods"].as_object().unwrap();
        assert_eq!(methods.len(), 3);
        let direct = &methods["direct"]["epochs"];
        assert_eq!(direct.as_array().unwrap().len(), 2);
        for key in ["seconds", "files", "bytes", "stall_seconds", "read_seconds"] {
            assert!(direct[0][key].is_number(), "{key}");
        }
        assert!(direct[0].get("hits").is_none());
        assert_eq!(methods["stagefs"]["epochs"][1]["hits"], 200);
        assert_eq!(methods["stagefs"]["mount_seconds"], 0.5);
        assert_eq!(methods["copy_first"]["skipped"], "no room");
        assert_eq!(json["subset"]["classes"][9], "n00000009");
        assert_eq!(json["subset"]["classes_in_source"], 40);
    }

    #[test]
    fn the_table_shows_every_epoch_and_the_ratios() {
        let text = table(&report());
        assert!(
            text.starts_with("subset: 200 files in 10 of 40 classes, 2.0 MB\n"),
            "{text}"
        );
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_start().starts_with(['0', '1']))
            .collect();
        assert_eq!(rows.len(), 4, "{text}");
        assert!(
            rows[1].contains("stagefs") && rows[1].contains("150/200"),
            "{text}"
        );
        assert!(
            rows[0].contains("direct") && rows[0].contains(" - "),
            "{text}"
        );
        assert!(text.contains("copy-first: skipped: no room"), "{text}");
        // 8 s direct against 0.5 + 3.5 + 1.0 s.
        assert!(
            text.contains(
                "stagefs vs direct (× faster): epochs 1.14× 4.00×; whole run with the mount 1.60×"
            ),
            "{text}"
        );
    }
}
