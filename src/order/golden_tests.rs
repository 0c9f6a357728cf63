//! Every case of the golden vectors in `tests/data/golden/` (made by the real torch and numpy)
//! must come out of the predictors identically: compared by sha256 of the order written as
//! decimal lines, plus the `head`/`order` prefixes for readable failures.

use std::fmt::Write as _;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::{GeneratorSource, SamplerConfig, SamplerKind, TorchVersion, torch};

/// Fields a case may carry; anything else means the golden data grew and this test must learn it.
const KNOWN_FIELDS: &[&str] = &[
    "sampler",
    "seed",
    "len",
    "epoch",
    "world_size",
    "rank",
    "drop_last",
    "shuffle",
    "set_epoch",
    "generator",
    "persistent_workers",
    "order_len",
    "head",
    "order",
    "sha256",
];

fn load(file: &str) -> (TorchVersion, Vec<Map<String, Value>>) {
    let path = format!("{}/tests/data/golden/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let json: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    // "torch 1.13.0a0" / "numpy 1.24.2": the torch version the vectors come from.
    let produced_by = json["produced_by"].as_str().expect("produced_by");
    let version = match produced_by.split_once(' ') {
        Some(("torch", v)) => v.parse().expect("torch version in produced_by"),
        _ => TorchVersion::NEWEST,
    };
    let cases = json["cases"].as_array().expect("cases").iter();
    (
        version,
        cases
            .map(|c| c.as_object().expect("case object").clone())
            .collect(),
    )
}

/// sha256 of `order` as decimal lines each ending in "\n" (what `... | sha256sum` prints).
fn digest(order: &[u32]) -> String {
    let mut hasher = Sha256::new();
    let mut buf = String::with_capacity(1 << 16);
    for chunk in order.chunks(4096) {
        buf.clear();
        for x in chunk {
            writeln!(buf, "{x}").unwrap();
        }
        hasher.update(buf.as_bytes());
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn u64_field(case: &Map<String, Value>, key: &str, default: u64) -> u64 {
    case.get(key).map_or(default, |v| {
        v.as_u64().unwrap_or_else(|| panic!("{key} is not a u64"))
    })
}

fn bool_field(case: &Map<String, Value>, key: &str, default: bool) -> bool {
    case.get(key).map_or(default, |v| {
        v.as_bool().unwrap_or_else(|| panic!("{key} is not a bool"))
    })
}

/// The order the predictors give for one case.
fn compute(case: &Map<String, Value>, version: TorchVersion) -> Result<Vec<u32>, String> {
    let sampler = case["sampler"].as_str().expect("sampler");
    let seed = &case["seed"];
    let seed = seed
        .as_i64()
        .map(i128::from)
        .or(seed.as_u64().map(i128::from))
        .expect("integer seed");
    let len = u64_field(case, "len", 0);
    if sampler == "torch-randperm" {
        let mut g = torch::generator(seed as u64);
        return Ok(torch::randperm(len, &mut g, version));
    }
    let kind = SamplerKind::ALL
        .into_iter()
        .find(|k| k.name() == sampler)
        .ok_or_else(|| format!("unknown sampler {sampler:?}"))?;
    let mut cfg = SamplerConfig::new(kind);
    cfg.seed = seed;
    cfg.torch_version = version;
    cfg.world_size = u64_field(case, "world_size", 1) as u32;
    cfg.drop_last = bool_field(case, "drop_last", false);
    cfg.shuffle = bool_field(case, "shuffle", true);
    cfg.set_epoch = bool_field(case, "set_epoch", true);
    cfg.persistent_workers = bool_field(case, "persistent_workers", false);
    if let Some(g) = case.get("generator") {
        let name = g.as_str().expect("generator");
        cfg.generator = GeneratorSource::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| format!("unknown generator {name:?}"))?;
    }
    let rank = u64_field(case, "rank", 0) as u32;
    cfg.epoch_order(len, u64_field(case, "epoch", 0), rank)
        .map_err(|e| format!("{e}"))
}

/// Why `got` is not the case's order, if it is not.
fn mismatch(case: &Map<String, Value>, got: &[u32]) -> Option<String> {
    let want_len = u64_field(case, "order_len", u64::MAX);
    if got.len() as u64 != want_len {
        return Some(format!("length {} instead of {want_len}", got.len()));
    }
    for key in ["order", "head"] {
        let Some(want) = case.get(key).and_then(Value::as_array) else {
            continue;
        };
        let want: Vec<u64> = want.iter().map(|v| v.as_u64().expect("index")).collect();
        if let Some(i) = want.iter().zip(got).position(|(&w, &g)| w != u64::from(g)) {
            return Some(format!("{key}[{i}] is {} instead of {}", got[i], want[i]));
        }
    }
    let want = case["sha256"].as_str().expect("sha256");
    let have = digest(got);
    (have != want).then(|| format!("sha256 {have} instead of {want}"))
}

fn check_file(file: &str) {
    let (version, cases) = load(file);
    assert!(!cases.is_empty(), "{file} has no cases");
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let unknown: Vec<&String> = case
            .keys()
            .filter(|k| !KNOWN_FIELDS.contains(&k.as_str()))
            .collect();
        assert!(
            unknown.is_empty(),
            "{file} case {i} has unknown fields {unknown:?}"
        );
        let params: Map<String, Value> = case
            .iter()
            .filter(|(k, _)| !["head", "order", "sha256"].contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let problem = match compute(case, version) {
            Ok(order) => mismatch(case, &order),
            Err(e) => Some(format!("error: {e}")),
        };
        if let Some(p) = problem {
            failures.push(format!("{file} case {i} {}: {p}", Value::Object(params)));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} golden cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn digest_matches_sha256sum() {
    // printf '0\n1\n' | sha256sum
    assert_eq!(
        digest(&[0, 1]),
        "82c1315e6c757f33c4a77ca58b2a184f5a88614470c05ec77f3d28918db6b8ae"
    );
}

#[test]
fn golden_torch() {
    check_file("torch.json");
}

#[test]
fn golden_numpy() {
    check_file("numpy.json");
}

/// `DataLoader(sampler=RandomSampler(ds, generator=g))`, and DistributedSampler without
/// `set_epoch` (made by `more.py`).
#[test]
fn golden_more_torch() {
    check_file("more_torch.json");
}

/// `np.random.shuffle(idx)` in place every epoch (made by `more.py`).
#[test]
fn golden_more_numpy() {
    check_file("more_numpy.json");
}
