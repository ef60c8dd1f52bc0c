//! Shared pieces of the broker demos in this package (`cargo run --release --example <name>`
//! from the repository root). The programs themselves live beside this file.
//!
//! - [`flags`]: the connection flags the demos and the crash matrix share;
//! - [`payments`]: the `ledger` example's events, tables and handler;
//! - [`reconcile`]: what the crash matrix (`tools/chaos`) checks after its runs: nothing lost,
//!   nothing doubled;
//! - [`sabotage`]: a source that acknowledges before the commit, for the harness's proof that
//!   its database-outage check can fail;
//! - [`with_database`]: a PostgreSQL URL pointed at a scratch database.

pub mod flags;
pub mod payments;
pub mod reconcile;
pub mod sabotage;

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
