//! The `tessera` command line.
//!
//! **What this crate must not know:** anything below the engine's public
//! API: no block ids, no tensors.
//!
//! Status: no subcommand works yet; the model issue brings `run`,
//! `tokenize`, `detokenize` and `inspect`, the engine issue `chat`, `serve`
//! and `bench`. Until then the binary says so and exits with an error.

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!(
        "tessera {}: no subcommand is available yet in this build; see README.md for what works today",
        env!("CARGO_PKG_VERSION")
    );
    ExitCode::FAILURE
}
