//! The cache manifest (`stagefs/manifest.json`): whatever the file holds, loading it never
//! panics and a manifest is trusted only for the exact SOURCE it names; and every SOURCE
//! path (any bytes, as Linux allows) can be recorded and recognised again.
#![no_main]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use stagefs::cache::Manifest;

fuzz_target!(|data: &[u8]| {
    // Half one: the bytes as a manifest file found on disk.
    if let Some(m) = Manifest::parse(data) {
        assert_eq!(m.holds(&m.source), m.format == 1, "format 1 only");
        let again = Manifest::parse(&m.to_bytes()).expect("a loaded manifest re-serializes");
        assert_eq!(again, m);
        let other = m.source.join("x");
        assert!(
            !m.holds(&other),
            "a manifest for {:?} must not hold {other:?}",
            m.source
        );
    }
    // Half two: the bytes as the SOURCE path of a new cache.
    let source = Path::new(OsStr::from_bytes(data));
    let written = Manifest::for_source(source).to_bytes();
    let read = Manifest::parse(&written).expect("a written manifest loads");
    assert!(
        read.holds(source),
        "manifest for {source:?} is not recognised"
    );
    assert_eq!(read.source.as_os_str().as_bytes(), data);
});
