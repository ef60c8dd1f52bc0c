//! `txinbox purge`.

use std::fmt::Write;

use serde_json::json;
use txinbox::ops::retention;

use crate::error::{db, CliError};
use crate::{Env, PurgeArgs, Report};

pub async fn run(env: &Env, a: PurgeArgs) -> Result<Report, CliError> {
    let pool = env.db(false).await?;
    let consumers = match a.consumer {
        Some(c) => vec![c],
        None => retention::consumers(&pool)
            .await
            .map_err(db("listing consumers"))?,
    };
    let mut out: Vec<serde_json::Value> = Vec::new();
    let mut text = String::new();
    for consumer in consumers {
        let plan = retention::plan(&pool, &consumer, a.older_than)
            .await
            .map_err(db("counting purgeable rows"))?;
        let mut deleted = 0u64;
        if !a.dry_run && plan.candidates > 0 {
            // The horizon first: a replay checked meanwhile already refuses the purged range.
            retention::record_horizon(&pool, &consumer, plan.cutoff)
                .await
                .map_err(db("recording the retention horizon"))?;
            let bar = env.progress(plan.candidates as u64, &format!("purging {consumer}"));
            loop {
                let n = match retention::delete_batch(&pool, &consumer, plan.cutoff, a.batch_size).await {
                    Ok(n) => n,
                    Err(e) => {
                        bar.finish_and_clear();
                        let e = db("deleting a batch")(e);
                        let done: Vec<String> = out
                            .iter()
                            .map(|c| format!("{} of {}", c["deleted"], c["consumer"].as_str().unwrap_or("")))
                            .chain([format!("{deleted} of {consumer}")])
                            .collect();
                        return Err(e.with_note(&format!(
                            "deleted so far: {} (the horizon is recorded; run the purge again to finish)",
                            done.join(", ")
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
            "{consumer}: {} {} terminal rows older than {} (window {}s)",
            if a.dry_run { "would delete" } else { "deleted" },
            if a.dry_run {
                plan.candidates as u64
            } else {
                deleted
            },
            plan.cutoff,
            a.older_than.as_secs(),
        );
        out.push(json!({
            "consumer": consumer,
            "cutoff": plan.cutoff.to_string(),
            "candidates": plan.candidates,
            "deleted": deleted,
            "dry_run": a.dry_run,
        }));
    }
    if out.is_empty() {
        text.push_str("no inbox rows\n");
    }
    Ok(Report::ok(
        json!({ "window_seconds": a.older_than.as_secs(), "batch_size": a.batch_size, "consumers": out }),
        text,
    ))
}
