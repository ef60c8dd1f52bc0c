//! Shared pieces of the broker demos in this package (`cargo run --release --example <name>`
//! from the repository root). The programs themselves live beside this file.
//!
//! - [`flags`]: the connection flags the demos and the crash matrix share;
//! - [`payments`]: the `ledger` example's events, tables and handler;
//! - [`reconcile`]: what the crash matrix (`tools/chaos`) checks after its runs: nothing lost,
//!   nothing doubled;
//! - [`sabotage`]: a source that acknowledges before the commit, for the harness's proof that
//!   its database-outage check can fail;
//! - [`with_database`]: a PostgreSQL URL pointed at a scratch database;
//! - [`init_logs`], [`parse_args`]: logs and command line without secrets in them.

pub mod flags;
pub mod payments;
pub mod reconcile;
pub mod sabotage;

/// Installs the demos' log subscriber, on stderr: the filter is `RUST_LOG`, or `default`
/// without it, plus [`txinbox::redact::LOG_DIRECTIVES`] whatever `RUST_LOG` says, which keep
/// the dependencies' events that carry credentials out (sqlx's unrecognized URL parameters,
/// lapin's AMQP frames at trace).
pub fn init_logs(default: &str) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    for directive in txinbox::redact::LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse().expect("a valid directive"));
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, never in a file or a log collector.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// [`clap::Parser::parse`], with clap's errors through [`txinbox::redact::url`]: an unknown or
/// misspelt flag is echoed with its value (`--databse-url=postgres://app:pw@db`), which must
/// not show a password. `--help` and `--version` print as usual.
pub fn parse_args<T: clap::Parser>() -> T {
    T::try_parse().unwrap_or_else(|e| {
        let text = e.render().to_string();
        if e.use_stderr() {
            eprint!("{}", txinbox::redact::url(&text));
        } else {
            print!("{text}");
        }
        std::process::exit(e.exit_code());
    })
}

/// `url` with its database replaced by `name` (query parameters kept).
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let base = match base[authority_start..].find('/') {
        Some(slash) => &base[..authority_start + slash],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn the_database_is_replaced_and_the_rest_kept() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgres://u:p@h/db?sslmode=require", "x"),
            "postgres://u:p@h/x?sslmode=require"
        );
        assert_eq!(with_database("postgres://h:5432", "x"), "postgres://h:5432/x");
        assert_eq!(
            with_database("postgres://h:5432?sslmode=disable", "x"),
            "postgres://h:5432/x?sslmode=disable"
        );
    }
}
