//! `--cache-size`, `--read-through-above` and `--lookahead` values: `parse_size` and
//! `parse_lookahead` against an independent statement of the grammar (number, optional unit
//! K/M/G/T/P optionally followed by i, iB or B, case-insensitive, surrounding whitespace),
//! exact values for integers (u128, so overflow is an error and never a wrap), round trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs::cli::size::{parse_lookahead, parse_size};
use stagefs::daemon::Lookahead;

const UNITS: [(&str, u64); 5] = [
    ("K", 1 << 10),
    ("M", 1 << 20),
    ("G", 1 << 30),
    ("T", 1 << 40),
    ("P", 1 << 50),
];

/// The multiplier a unit spelling means, or None if it is not one.
fn multiplier(unit: &str) -> Option<u64> {
    let upper = unit.to_ascii_uppercase();
    if upper.is_empty() || upper == "B" {
        return Some(1);
    }
    UNITS.iter().find_map(|&(letter, m)| {
        ["", "I", "IB", "B"]
            .iter()
            .any(|suffix| upper == format!("{letter}{suffix}"))
            .then_some(m)
    })
}

/// What `parse_size` must return for `input`.
fn expected(input: &str) -> Option<u64> {
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let m = multiplier(unit.trim_start())?;
    let dots = number.matches('.').count();
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') || dots > 1 {
        return None;
    }
    if dots == 0 {
        // Integers are exact: digits of any length, product checked in u128.
        let mut n: u128 = 0;
        for d in number.bytes() {
            n = n.checked_mul(10)?.checked_add(u128::from(d - b'0'))?;
        }
        return u64::try_from(n.checked_mul(u128::from(m))?).ok();
    }
    let value = number.parse::<f64>().ok()? * m as f64;
    (value.is_finite() && value < u64::MAX as f64).then(|| value.round() as u64)
}

fuzz_target!(|data: &[u8]| {
    // Structured half: a number and a unit spelling must give exactly number × unit.
    if let [a, b, c, d, e, f, g, h, unit, form, ..] = *data {
        let n = u64::from_le_bytes([a, b, c, d, e, f, g, h]);
        let (letter, m) = UNITS[unit as usize % UNITS.len()];
        let suffix = ["", "i", "iB", "B", "ib", "IB"][form as usize % 6];
        let text = format!("{n}{letter}{suffix}");
        assert_eq!(
            parse_size(&text).ok(),
            n.checked_mul(m),
            "{text} must be {n} × {m} or an error on overflow"
        );
        assert_eq!(parse_size(&n.to_string()), Ok(n));
        assert_eq!(parse_lookahead(&n.to_string()), Ok(Lookahead::Files(n)));
    }
    let Ok(input) = std::str::from_utf8(data) else {
        return;
    };
    let got = parse_size(input);
    assert_eq!(
        got.as_ref().ok().copied(),
        expected(input),
        "parse_size({input:?})"
    );
    match &got {
        Ok(v) => {
            assert_eq!(parse_size(&v.to_string()), Ok(*v), "round trip of {v}");
            assert_eq!(
                parse_size(&input.to_ascii_lowercase()),
                Ok(*v),
                "units are case-insensitive"
            );
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(input), "message names the input: {msg}");
        }
    }
    // --lookahead: all digits is a file count, anything else must be a valid size.
    let trimmed = input.trim();
    let want = if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
        trimmed.parse().ok().map(Lookahead::Files)
    } else {
        parse_size(trimmed).ok().map(Lookahead::Bytes)
    };
    assert_eq!(
        parse_lookahead(input).ok(),
        want,
        "parse_lookahead({input:?})"
    );
});
