//! Lines sent to a mount's control channel (`stagefs epoch`, the feed hook, anyone the mount
//! admits): any bytes parse to a request or to a one-line error, and a request parsed from a
//! line prints back to JSON that parses to the same request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs::control::Request;

fuzz_target!(|data: &[u8]| {
    match Request::parse(data) {
        Ok(request) => {
            let again =
                serde_json::to_vec(&serde_json::from_slice::<serde_json::Value>(data).unwrap())
                    .unwrap();
            assert_eq!(Request::parse(&again).unwrap(), request);
        }
        Err(e) => assert!(!e.to_string().contains('\n'), "{e}"),
    }
});
