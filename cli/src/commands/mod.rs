//! One module per subcommand, and what several of them share: the recorded group, asking for
//! confirmation.

pub mod dead_letters;
pub mod http;
#[cfg(feature = "kafka")]
pub mod positions;
pub mod purge;
#[cfg(feature = "kafka")]
pub mod replay;
pub mod status;

use std::io::{BufRead as _, IsTerminal as _, Write as _};

use crate::error::CliError;

/// Formats an optional time for text output.
fn when(t: Option<txinbox::ops::Timestamp>) -> String {
    t.map(|t| t.to_string()).unwrap_or_else(|| "-".into())
}

/// Formats an optional number for text output.
fn num(n: Option<i64>) -> String {
    n.map(|n| n.to_string()).unwrap_or_else(|| "-".into())
}

/// The Kafka group `consumer` reads `topic` through: the one recorded in
/// `txinbox.subscriptions`, which `given` (`--group`) must agree with; `given` only when
/// nothing is recorded; otherwise a refusal that says to pass `--group`.
#[cfg(feature = "kafka")]
pub async fn group(
    pool: txinbox::ops::Db<'_>,
    consumer: &str,
    topic: &str,
    given: Option<&str>,
) -> Result<String, CliError> {
    use txinbox::ops::positions as ops_positions;
    let recorded = ops_positions::subscription(pool, consumer, ops_positions::KAFKA, topic)
        .await
        .map_err(crate::error::db(&format!(
            "reading the recorded group ({})",
            pool.table("subscriptions")
        )))?;
    ops_positions::resolve_group(recorded.as_deref(), given)
        .map_err(|e| CliError::Failed(e.explain(consumer, topic)))
}

/// Shows `plan` on stderr and asks to `action` (e.g. "delete 120 inbox rows"): on a terminal
/// the answer must be `y` or `yes`; without one (CI, a pipe) nothing can be asked, so only
/// `yes` (`--yes`) goes on. Never waits on a stdin that is not a terminal.
pub fn confirm(json: bool, plan: &str, action: &str, yes: bool) -> Result<(), CliError> {
    if !(json && yes) {
        eprint!("{plan}");
    }
    if yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(CliError::failed(format!(
            "not confirmed, nothing changed: stdin is not a terminal, so nothing can be asked; check the plan above and pass --yes to {action}"
        )));
    }
    eprint!("{action}? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    tokio::task::block_in_place(|| stdin.lock().read_line(&mut answer))
        .map_err(|e| CliError::failed(format!("reading the answer: {e}")))?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(())
    } else {
        Err(CliError::failed("not confirmed, nothing changed"))
    }
}
