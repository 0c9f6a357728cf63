//! Values written to `user.stagefs.epoch` (`setfattr -v`): `parse_epoch` accepts exactly
//! decimal digits (surrounding whitespace allowed) whose value fits u64, and round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs::fs::parse_epoch;

fn expected(value: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(value).ok()?.trim();
    if text.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for b in text.bytes() {
        if !b.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(n)
}

fuzz_target!(|data: &[u8]| {
    let got = parse_epoch(data);
    assert_eq!(got, expected(data), "parse_epoch({data:?})");
    if let Some(e) = got {
        for text in [e.to_string(), format!(" {e}\n"), format!("000{e}")] {
            assert_eq!(parse_epoch(text.as_bytes()), Some(e), "{text:?}");
        }
    }
});
