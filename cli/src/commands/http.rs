//! `txinbox http purge`: deletes expired HTTP Idempotency-Key records (`txinbox-http`), after
//! showing how many and a confirmation (`--yes` without a terminal).
//!
//! An expired key is new again whether or not its record is still there (the layer takes an
//! expired record over), so deleting expired records changes no answer: it only frees space.
//! The window is the layer's TTL, chosen when each record was written.

use serde_json::json;

use crate::error::{db, CliError};
use crate::{Env, HttpPurgeArgs, Report};

pub async fn purge(env: &Env, a: HttpPurgeArgs) -> Result<Report, CliError> {
    let pool = env.pg("http purge").await?;
    let (expired, bytes): (i64, i64) = txinbox::sqlx::query_as(
        "SELECT count(*), coalesce(sum(body_size), 0)::bigint
         FROM txinbox.http_idempotency WHERE expires_at <= now()",
    )
    .fetch_one(&pool)
    .await
    .map_err(db(
        "counting expired Idempotency-Key records (txinbox.http_idempotency)",
    ))?;
    let plan = format!(
        "would delete {expired} expired Idempotency-Key records ({bytes} bytes of stored responses) of txinbox.http_idempotency\n"
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
    let deleted = txinbox_http::purge_expired(&pool, a.batch_size)
        .await
        .map_err(db("deleting expired Idempotency-Key records"))?;
    Ok(Report::ok(
        report(deleted),
        format!("deleted {deleted} expired Idempotency-Key records\n"),
    ))
}
