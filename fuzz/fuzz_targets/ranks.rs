//! `--ranks` lists: `parse_ranks` yields the sorted, deduplicated union of the items
//! (`3`, `0-7`), at most 65536 ranks; any malformed or reversed item is an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs::order::parse_ranks;

const MAX_RANKS: u64 = 1 << 16;

fn number(t: &str) -> Option<u32> {
    let t = t.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse().ok()
}

/// The inclusive ranges the list names, or None if an item is malformed or reversed.
fn items(s: &str) -> Option<Vec<(u32, u32)>> {
    s.split(',')
        .map(|item| {
            let (lo, hi) = match item.split_once('-') {
                Some((a, b)) => (number(a)?, number(b)?),
                None => (number(item)?, number(item)?),
            };
            (lo <= hi).then_some((lo, hi))
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let got = parse_ranks(s);
    let Some(ranges) = items(s) else {
        assert!(got.is_err(), "{s:?} is malformed but parsed as {got:?}");
        return;
    };
    // The parser caps the running total of items (before deduplication).
    let total: u64 = ranges.iter().map(|&(lo, hi)| u64::from(hi - lo) + 1).sum();
    match got {
        Ok(ranks) => {
            assert!(total <= MAX_RANKS, "{total} ranks accepted");
            assert!(ranks.windows(2).all(|w| w[0] < w[1]), "sorted and unique");
            for &(lo, hi) in &ranges {
                for r in [lo, hi, lo + (hi - lo) / 2] {
                    assert!(ranks.binary_search(&r).is_ok(), "{r} missing");
                }
            }
            assert!(
                ranks
                    .iter()
                    .all(|r| ranges.iter().any(|&(lo, hi)| (lo..=hi).contains(r))),
                "a rank no item names"
            );
        }
        Err(e) => {
            assert!(total > MAX_RANKS, "{s:?} is well formed but refused: {e}");
            assert!(!e.to_string().contains('\n'));
        }
    }
});
