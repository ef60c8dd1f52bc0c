//! `txinbox purge`: scoped to one consumer unless `--all-consumers`; a window inside the dedup
//! window only with `--force`; the plan first, then a confirmation (`--yes` without a terminal).

use std::fmt::Write;

use serde_json::json;
use txinbox::ops::retention::{self, PurgePlan};

use crate::error::{db, CliError};
use crate::{show_duration, Env, PurgeArgs, Report};

pub async fn run(env: &Env, a: PurgeArgs) -> Result<Report, CliError> {
    let window = show_duration(a.older_than);
    // The guard the consumer's retention applies too; a dry run only shows what would go.
    let warnings = retention::check_window(a.older_than, a.force || a.dry_run, None)
        .map_err(|e| CliError::failed(format!("--older-than {window}: {e} (--force)")))?;
    let inside = a.older_than < retention::DEFAULT_WINDOW;
    let store = env.db(false).await?;
    let pool = store.ops();
    let inbox = store.table("inbox");
    let consumers = match a.consumer {
        Some(c) => vec![c],
        None => retention::consumers(pool)
            .await
            .map_err(db("listing consumers"))?,
    };
    let mut plans: Vec<(String, PurgePlan)> = Vec::new();
    for consumer in consumers {
        let plan = retention::plan(pool, &consumer, a.older_than)
            .await
            .map_err(db("counting purgeable rows"))?;
        plans.push((consumer, plan));
    }
    let total: i64 = plans.iter().map(|(_, p)| p.candidates).sum();
    let mut plan_text = String::new();
    for (consumer, plan) in &plans {
        let _ = writeln!(
            plan_text,
            "{consumer}: would delete {} terminal rows of {inbox} that finished before {} (older than {window})",
            plan.candidates, plan.cutoff,
        );
    }
    if plans.is_empty() {
        plan_text.push_str("no inbox rows\n");
    }
    for warning in &warnings {
        let _ = writeln!(plan_text, "warning: {warning}");
    }
    let report_of = |deleted: &[u64]| {
        json!({
            "window_seconds": a.older_than.as_secs(),
            "batch_size": a.batch_size,
            "dry_run": a.dry_run,
            "forced": inside,
            "consumers": plans.iter().enumerate().map(|(i, (consumer, plan))| json!({
                "consumer": consumer,
                "cutoff": plan.cutoff.to_string(),
                "candidates": plan.candidates,
                "deleted": deleted.get(i).copied().unwrap_or(0),
                "dry_run": a.dry_run,
            })).collect::<Vec<_>>(),
        })
    };
    if a.dry_run {
        plan_text.push_str("dry run: nothing deleted\n");
        return Ok(Report::ok(report_of(&[]), plan_text));
    }
    if total == 0 {
        plan_text.push_str("nothing to delete\n");
        return Ok(Report::ok(report_of(&[]), plan_text));
    }
    crate::commands::confirm(
        env.json,
        &plan_text,
        &format!("delete {total} inbox rows of {} consumer(s)", plans.len()),
        a.yes,
    )?;

    let mut done: Vec<u64> = Vec::new();
    let mut text = String::new();
    for (consumer, plan) in &plans {
        let mut deleted = 0u64;
        if plan.candidates > 0 {
            // The horizon first: a replay checked meanwhile already refuses the purged range.
            retention::record_horizon(pool, consumer, plan.cutoff)
                .await
                .map_err(db("recording the retention horizon"))?;
            let bar = env.progress(plan.candidates as u64, &format!("purging {consumer}"));
            loop {
                let n = match retention::delete_batch(pool, consumer, plan.cutoff, a.batch_size).await {
                    Ok(n) => n,
                    Err(e) => {
                        bar.finish_and_clear();
                        let e = db("deleting a batch")(e);
                        let so_far: Vec<String> = plans
                            .iter()
                            .zip(done.iter().chain([&deleted]))
                            .map(|((c, _), n)| format!("{n} of {c}"))
                            .collect();
                        return Err(e.with_note(&format!(
                            "deleted so far: {} (the horizon is recorded; run the purge again to finish)",
                            so_far.join(", ")
                        )));
                    }
                };
                if n == 0 {
                    break;
                }
                deleted += n;
                bar.inc(n);
            }
            bar.finish_and_clear();
        }
        let _ = writeln!(
            text,
            "{consumer}: deleted {deleted} terminal rows that finished before {} (older than {window})",
            plan.cutoff,
        );
        done.push(deleted);
    }
    Ok(Report::ok(report_of(&done), text))
}
