//! Access-order prediction: the exact sequence of sample indices a PyTorch, numpy or Chainer
//! data loader will read, per epoch and rank, so that the stager can fetch files into the
//! local cache just ahead of the reads.
//!
//! The predictors re-implement the libraries' random number generators and shuffles bit for
//! bit (see `docs/access-order.md`; the golden vectors in
//! `tests/data/golden/` are the ground truth). Everything here is pure computation, except
//! reading an `--order-file`. Orders are computed one epoch at a time, never for a whole run.
//! [`detect`] runs the predictors backwards: which sampler and seed produce a job's first opens.

mod config;
pub mod detect;
mod error;
mod mt19937;
mod numpy;
mod parse;
mod pcg64;
mod torch;

#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod prop_tests;

pub use config::{GeneratorSource, SamplerConfig, SamplerKind, SamplerOption, TorchVersion};
pub use error::OrderError;
pub use parse::{parse_order_file, parse_order_text, parse_ranks};
