//! Whole command lines (NUL-separated arguments after `stagefs`): clap's parse with the
//! crate's argument definitions (debug assertions on, so an inconsistent definition fails
//! here), then the typed mount settings (sampler, sizes, lookahead) the daemon gets from
//! them. Every outcome is a value or a one-line error; nothing panics.
#![no_main]

use clap::Parser;
use libfuzzer_sys::fuzz_target;
use stagefs::cli::{Cli, Command, SamplerArgs};
use stagefs::daemon::MountConfig;
use stagefs::order::SamplerKind;

/// What `order` does with the sampler options before touching any file.
fn check_sampler(sampler: &mut SamplerArgs) {
    // Never read files named by fuzz input (a device could block or never end).
    sampler.order_file = None;
    match sampler.config(SamplerKind::TorchDistributed, &[]) {
        Ok((cfg, ranks)) => {
            if let Err(e) = cfg.validate(1000, &ranks) {
                assert!(!e.to_string().contains('\n'));
            }
        }
        Err(e) => assert!(!e.to_string().contains('\n'), "{e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let argv = std::iter::once("stagefs").chain(text.split('\0'));
    let Ok(cli) = Cli::try_parse_from(argv) else {
        return;
    };
    match cli.command {
        Command::Mount(mut args) => {
            args.sampler.order_file = None;
            // The typed mount settings the daemon gets: sampler, sizes and lookahead.
            if let Err(e) = MountConfig::try_from(&*args) {
                assert!(!e.to_string().contains('\n'), "{e}");
            }
        }
        Command::Order(mut args) => check_sampler(&mut args.sampler),
        _ => {}
    }
});
