//! Shared pieces of the broker demos in this package (`cargo run --release --example <name>`
//! from the repository root). The programs themselves live beside this file.
