//! `stagefs epoch MOUNTPOINT EPOCH`: tells a running mount that the job (re)starts at an
//! epoch, over the mount's control channel, so staging starts there at once (a resumed job,
//! or one whose sampler's epoch the mount lost track of).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

use super::stats_cmd::read_xattr;

#[derive(Args, Debug)]
pub struct EpochArgs {
    /// The stagefs mount
    pub mountpoint: PathBuf,
    /// The epoch the job is at (what it passes to set_epoch)
    pub epoch: u64,
}

pub fn run(args: EpochArgs) -> Result<()> {
    let address = read_xattr(&args.mountpoint, crate::fs::CONTROL_XATTR)?;
    let address = String::from_utf8_lossy(&address).into_owned();
    let reply = crate::control::request(&address, &json!({"op": "epoch", "epoch": args.epoch}))
        .with_context(|| format!("{}: the daemon did not answer", args.mountpoint.display()))?;
    if reply["ok"] != true {
        bail!(
            "{}: {}",
            args.mountpoint.display(),
            reply["error"].as_str().unwrap_or("refused")
        );
    }
    Ok(())
}
