//! Shared pieces of the broker demos in this package (`cargo run --release --example <name>`
//! from the repository root). The programs themselves live beside this file.
//!
//! - [`payments`]: the `ledger` example's events, tables and handler;
//! - [`reconcile`]: what the `chaos` harness checks after its crash matrix: nothing lost,
//!   nothing doubled.

pub mod payments;
pub mod reconcile;
