//! One module per subcommand.

pub mod dead_letters;
pub mod purge;
#[cfg(feature = "kafka")]
pub mod replay;
pub mod status;

/// Formats an optional time for text output.
fn when(t: Option<txinbox::ops::Timestamp>) -> String {
    t.map(|t| t.to_string()).unwrap_or_else(|| "-".into())
}

/// Formats an optional number for text output.
fn num(n: Option<i64>) -> String {
    n.map(|n| n.to_string()).unwrap_or_else(|| "-".into())
}
