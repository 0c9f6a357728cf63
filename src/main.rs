//! The `stagefs` command; everything lives in the library (see `lib.rs`).

fn main() {
    std::process::exit(stagefs::cli::run());
}
