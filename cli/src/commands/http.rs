//! `txinbox http purge`: deletes expired HTTP Idempotency-Key records (`txinbox-http`), after
//! showing how many and a confirmation (`--yes` without a terminal).
//!
//! An expired key is new again whether or not its record is still there (the layer takes an
//! expired record over), so deleting expired records changes no answer: it only frees space.
//! The window is the layer's TTL, chosen when each record was written.

use serde_json::json;

use crate::error::{db, CliError};
use crate::{Env, HttpPurgeArgs, Report, Store};

pub async fn purge(env: &Env, a: HttpPurgeArgs) -> Result<Report, CliError> {
    let store = env.db(false).await?;
    let table = store.table("http_idempotency");
    let now = match store {
        Store::Postgres(_) => "now()",
        Store::Sqlite(_) => "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    };
    let count = format!(
        "SELECT count(*), CAST(coalesce(sum(body_size), 0) AS bigint) FROM {table} WHERE expires_at <= {now}"
    );
    let counted: Result<(i64, i64), _> = match &store {
        Store::Postgres(pool) => {
            txinbox::sqlx::query_as(txinbox::sqlx::AssertSqlSafe(count))
                .fetch_one(pool)
                .await
        }
        Store::Sqlite(pool) => {
            txinbox::sqlx::query_as(txinbox::sqlx::AssertSqlSafe(count))
                .fetch_one(pool)
                .await
        }
    };
    let (expired, bytes) =
        counted.map_err(db(&format!("counting expired Idempotency-Key records ({table})")))?;
    let plan = format!(
        "would delete {expired} expired Idempotency-Key records ({bytes} bytes of stored responses) of {table}\n"
    );
    let report = |deleted: u64| json!({ "expired": expired, "deleted": deleted, "dry_run": a.dry_run });
    if a.dry_run {
        return Ok(Report::ok(report(0), format!("{plan}dry run: nothing deleted\n")));
    }
    if expired == 0 {
        return Ok(Report::ok(report(0), format!("{plan}nothing to delete\n")));
    }
    crate::commands::confirm(
        env.json,
        &plan,
        &format!("delete {expired} expired Idempotency-Key records"),
        a.yes,
    )?;
    let deleted = match &store {
        Store::Postgres(pool) => txinbox_http::purge_expired(pool, a.batch_size).await,
        Store::Sqlite(pool) => txinbox_http::purge_expired(pool, a.batch_size).await,
    }
    .map_err(db("deleting expired Idempotency-Key records"))?;
    Ok(Report::ok(
        report(deleted),
        format!("deleted {deleted} expired Idempotency-Key records\n"),
    ))
}
