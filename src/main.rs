//! stagefs: a FUSE file system that stages a training dataset from a shared parallel file
//! system to node-local storage in the exact order the job will read it.
//!
//! Data flows one way: [`catalog`] (files as the dataset class sees them) → [`order`]
//! (samplers) → [`plan`] (the node's stream and where the reader is) → [`stager`] (copies ahead)
//! → [`cache`] (the local directory) → [`fs`] (FUSE operations). [`stats`] counts, [`cli`] wires.

mod cache;
mod catalog;
mod cli;
mod fs;
mod order;
mod plan;
mod stager;
mod stats;

fn main() {
    std::process::exit(cli::run());
}
