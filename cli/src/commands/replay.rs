//! `txinbox replay`: move a consumer's Kafka position back (or forward).
//!
//! The database position is what a consumer starts from when it is assigned a partition, so
//! replay writes it (in one transaction for all partitions); it also commits the group offset
//! (for lag tools) when the group has no active member. Applied messages are never applied
//! again because the consumer's inbox deduplicates every replayed delivery; replay refuses to
//! start before the retention horizon (whose IDs may be purged) unless `--force`.

use std::collections::HashMap;
use std::fmt::Write;

use serde_json::json;
use txinbox::ops::replay::{self, Verdict};
use txinbox::ops::{retention, status, Timestamp};
use txinbox::{message::Headers, message::Origin, Message};

use crate::error::{db, CliError};
use crate::kafka::{Kafka, Record};
use crate::{Env, ReplayArgs, Report};

/// Where one partition will start.
struct Plan {
    partition: i32,
    low: i64,
    high: i64,
    start: i64,
    database_position: Option<i64>,
    group_offset: Option<i64>,
}

pub async fn run(env: &Env, a: ReplayArgs) -> Result<Report, CliError> {
    let store = env.db(false).await?;
    let pool = store.ops();
    let kafka = env.kafka("replay")?;
    let topic = a.topic.as_str();
    let group = super::group(pool, &a.consumer, topic, a.group.as_deref()).await?;

    let plans = tokio::task::block_in_place(|| plan(&kafka, &a, &group))?;
    let stored: HashMap<i32, i64> = status::positions(pool, Some(&a.consumer), Some(topic))
        .await
        .map_err(db("reading positions"))?
        .into_iter()
        .filter_map(|p| Some((p.lane.parse().ok()?, p.next_position)))
        .collect();
    let plans: Vec<Plan> = plans
        .into_iter()
        .map(|p| Plan {
            database_position: stored.get(&p.partition).copied(),
            ..p
        })
        .collect();

    // The retention horizon: IDs of messages that finished before it may be purged.
    let horizon = retention::horizon(pool, &a.consumer)
        .await
        .map_err(db("reading the retention horizon"))?;
    let starts: Vec<(i32, i64, i64)> = plans.iter().map(|p| (p.partition, p.start, p.high)).collect();
    let before_horizon = before_horizon(&kafka, topic, &starts, horizon)?;

    let mut report = json!({
        "consumer": a.consumer, "group": group, "topic": topic, "dry_run": a.dry_run,
        "retention_horizon": horizon.map(|t| t.to_string()),
        "before_horizon": before_horizon,
        "partitions": plans.iter().map(|p| json!({
            "partition": p.partition, "low_watermark": p.low, "high_watermark": p.high,
            "start": p.start, "database_position": p.database_position, "group_offset": p.group_offset,
        })).collect::<Vec<_>>(),
    });
    let mut text = String::new();
    for p in &plans {
        let _ = writeln!(
            text,
            "{topic}/{}: start {} (database position {}, group offset {}, watermarks {}..{})",
            p.partition,
            p.start,
            super::num(p.database_position),
            super::num(p.group_offset),
            p.low,
            p.high
        );
    }
    let horizon_refusal = (!before_horizon.is_empty()).then(|| {
        format!(
            "the replay range starts before the retention horizon {} (records produced before it may have had their inbox rows purged, so they would be applied again): choose a later start, or pass --force if re-applying them is acceptable",
            horizon.map(|h| h.to_string()).unwrap_or_default()
        )
    });
    // Moving forward past where the consumer resumes skips records it may never have processed.
    let skipped: Vec<String> = plans
        .iter()
        .filter_map(|p| {
            // Records below the low watermark are gone already: only the rest can be skipped.
            let resume = p.database_position.or(p.group_offset)?.max(p.low);
            (p.start > resume).then(|| format!("partition {} offsets {resume}..{}", p.partition, p.start))
        })
        .collect();
    let skip_refusal = (!skipped.is_empty()).then(|| {
        format!(
            "the start is after where the consumer resumes ({}): those records would never reach the consumer, and any it has not processed yet would be lost: choose an earlier start, or pass --force to skip them",
            skipped.join(", ")
        )
    });
    let refusals: Vec<String> = [horizon_refusal, skip_refusal].into_iter().flatten().collect();

    if a.dry_run {
        let counts = dry_run(env, pool, &kafka, &a, &plans).await?;
        for (key, value) in &counts {
            report[key.as_str()] = json!(value);
        }
        let total: u64 = counts.values().sum();
        let _ = writeln!(
            text,
            "{total} records in the range: {} already applied (would be skipped), {} new, {} conflicting, {} dead-lettered, {} retrying, {} without an ID",
            counts["applied"], counts["new"], counts["conflicting"], counts["dead_lettered"], counts["retrying"], counts["missing_id"]
        );
        for r in &refusals {
            let _ = writeln!(text, "warning: {r}");
        }
        if !refusals.is_empty() {
            report["warning"] = json!(refusals.join("; "));
        }
        return Ok(Report::ok(report, text));
    }

    if !refusals.is_empty() && !a.force {
        return Err(CliError::Failed(refusals.join("; ")));
    }
    for r in &refusals {
        let _ = writeln!(text, "warning (--force): {r}");
    }
    report["forced"] = json!(refusals);
    let members = tokio::task::block_in_place(|| kafka.group_members(&group))?;
    if !members.is_empty() && !a.force {
        return Err(CliError::failed(format!(
            "consumer group {group} has {} active member(s): {}. Stop the consumers first (a running consumer overwrites the database position with its own progress; replay takes effect when they start), or pass --force",
            members.len(),
            members.join(", ")
        )));
    }

    let positions: Vec<(String, i64)> = plans.iter().map(|p| (p.partition.to_string(), p.start)).collect();
    let set = replay::set_positions(pool, &a.consumer, topic, &positions, horizon)
        .await
        .map_err(db("setting the database positions"))?;
    if !set {
        return Err(CliError::failed(
            "a purge moved the retention horizon while replay was checking the range; nothing was changed: run the replay again (it checks the range against the new horizon)",
        ));
    }
    let offsets: Vec<(i32, i64)> = plans.iter().map(|p| (p.partition, p.start)).collect();
    let committed = if members.is_empty() {
        tokio::task::block_in_place(|| kafka.commit(&group, topic, &offsets))
    } else {
        Err("the group has active members".to_owned())
    };
    report["database_positions_set"] = json!(true);
    report["group_offsets_committed"] = json!(committed.is_ok());
    let _ = writeln!(text, "database positions set for {} partition(s)", plans.len());
    match committed {
        Ok(()) => {
            let _ = writeln!(text, "group {group} offsets committed");
        }
        Err(e) => {
            let _ = writeln!(
                text,
                "warning: group {group} offsets not committed ({e}); the database positions decide where the consumers start"
            );
            report["group_commit_error"] = json!(e);
        }
    }
    // A consumer that joined after the check may have read the old positions already.
    let members = if members.is_empty() {
        tokio::task::block_in_place(|| kafka.group_members(&group)).unwrap_or_default()
    } else {
        members
    };
    if !members.is_empty() {
        let warning = format!(
            "the group has {} active member(s): a consumer that holds a partition keeps its own position and overwrites the database position with its next message, so the replay takes effect only for partitions it is assigned afresh; restart the consumers to apply it everywhere",
            members.len()
        );
        let _ = writeln!(text, "warning: {warning}");
        report["warning"] = json!(warning);
    }
    let _ = writeln!(
        text,
        "start the consumers: they resume from these positions; the inbox skips what is already applied"
    );
    Ok(Report::ok(report, text))
}

/// The partitions of `starts` (partition, start, high watermark) whose first record in
/// `[start, high)` was produced before the retention `horizon` (its inbox row may be purged, so
/// it would be applied again), as JSON for reports. Empty without a horizon.
pub(super) fn before_horizon(
    kafka: &Kafka,
    topic: &str,
    starts: &[(i32, i64, i64)],
    horizon: Option<Timestamp>,
) -> Result<Vec<serde_json::Value>, CliError> {
    let mut before = Vec::new();
    let Some(h) = horizon else { return Ok(before) };
    for &(partition, start, high) in starts.iter().filter(|(_, start, high)| start < high) {
        let mut first = None;
        let next = tokio::task::block_in_place(|| {
            kafka.read_range(topic, partition, start, high, |r| {
                first = Some(r.timestamp);
                false
            })
        })?;
        match first {
            Some(Some(ts)) if ts >= h.0 => {}
            Some(ts) => before.push(json!({
                "partition": partition, "offset": start,
                "record_timestamp": ts.map(|t| Timestamp(t).to_string()),
            })),
            // The range holds no record (only markers): nothing to re-apply.
            None if next >= high => {}
            None => {
                return Err(CliError::failed(format!(
                    "could not read the first record of {topic}/{partition} at offset {start} within 10 s, so the range cannot be checked against the retention horizon; try again"
                )))
            }
        }
    }
    Ok(before)
}

/// Resolves the start of every selected partition.
fn plan(kafka: &Kafka, a: &ReplayArgs, group: &str) -> Result<Vec<Plan>, CliError> {
    let view = kafka.view(&a.topic, Some(group), &a.partitions)?;
    let selected: Vec<i32> = view.iter().map(|p| p.partition).collect();
    let by_time = match a.to_timestamp {
        Some(t) => kafka.offsets_for_time(&a.topic, &selected, t.0)?,
        None => HashMap::new(),
    };
    Ok(view
        .into_iter()
        .map(|b| {
            let (low, high) = (b.low, b.high);
            let start = if let Some(o) = a.to_offset {
                o.clamp(low, high)
            } else if a.to_timestamp.is_some() {
                by_time
                    .get(&b.partition)
                    .copied()
                    .flatten()
                    .unwrap_or(high)
                    .clamp(low, high)
            } else {
                low
            };
            Plan {
                partition: b.partition,
                low,
                high,
                start,
                database_position: None,
                group_offset: b.group_offset,
            }
        })
        .collect())
}

/// Reads `[start, high)` of every partition and classifies each record against the inbox.
async fn dry_run(
    env: &Env,
    pool: txinbox::ops::Db<'_>,
    kafka: &Kafka,
    a: &ReplayArgs,
    plans: &[Plan],
) -> Result<std::collections::BTreeMap<String, u64>, CliError> {
    let label = a.id_strategy.label();
    if let Some(stored) = replay::other_strategy(pool, &a.consumer, &label)
        .await
        .map_err(db("checking the ID strategy"))?
    {
        return Err(CliError::BadArgs(format!(
            "--id-strategy {label} is not what consumer {} uses: its inbox rows carry IDs from `{stored}`, so every record would look new; pass the consumer's strategy (e.g. --id-strategy {stored})",
            a.consumer
        )));
    }
    let mut counts: std::collections::BTreeMap<String, u64> = [
        Verdict::New,
        Verdict::Applied,
        Verdict::DeadLettered,
        Verdict::Retrying,
        Verdict::Conflicting,
        Verdict::MissingId,
    ]
    .iter()
    .map(|v| (v.as_str().to_owned(), 0))
    .collect();
    let total: i64 = plans.iter().map(|p| p.high - p.start).sum();
    let bar = env.progress(total.max(0) as u64, "reading the range");
    // First fingerprint of every ID seen earlier in the range: a later copy of a new ID is a
    // duplicate (or conflict) of that copy, not new again.
    let mut seen: HashMap<String, [u8; 32]> = HashMap::new();
    for p in plans {
        // Only the ID and fingerprint of each record are kept, not the records.
        let mut derived_all: Vec<(Option<String>, [u8; 32])> = Vec::new();
        let next = tokio::task::block_in_place(|| {
            kafka.read_range(&a.topic, p.partition, p.start, p.high, |r| {
                bar.inc(1);
                let m = message(&a.topic, p.partition, &r);
                let id = a.id_strategy.derive(&m).ok().map(|id| id.as_str().to_owned());
                derived_all.push((id, a.fingerprint.of(&m)));
                true
            })
        })?;
        if next < p.high {
            bar.finish_and_clear();
            return Err(CliError::failed(format!(
                "reading {}/{} stopped at offset {next} of {}..{}: nothing arrived for 10 s, so the dry run would undercount; try again",
                a.topic, p.partition, p.start, p.high
            )));
        }
        for chunk in derived_all.chunks(1000) {
            let derived = chunk.to_vec();
            let ids: Vec<String> = derived.iter().filter_map(|(id, _)| id.clone()).collect();
            let rows = replay::lookup(pool, &a.consumer, &ids)
                .await
                .map_err(db("looking up the range in the inbox"))?;
            for (id, fp) in derived {
                let verdict = match id {
                    None => Verdict::MissingId,
                    Some(id) => {
                        let v = Verdict::of(rows.get(&id), &fp);
                        match (v, seen.get(&id)) {
                            (Verdict::New | Verdict::Retrying, Some(first)) if *first == fp => {
                                Verdict::Applied
                            }
                            (Verdict::New | Verdict::Retrying, Some(_)) => Verdict::Conflicting,
                            _ => {
                                seen.entry(id).or_insert(fp);
                                v
                            }
                        }
                    }
                };
                *counts.entry(verdict.as_str().to_owned()).or_default() += 1;
            }
        }
    }
    bar.finish_and_clear();
    Ok(counts)
}

/// The record as the Kafka adapter hands it to the consumer (same origin and headers), so the
/// ID strategy and fingerprint see exactly what the consumer sees.
fn message(topic: &str, partition: i32, r: &Record) -> Message {
    let mut headers = Headers::new();
    for (k, v) in &r.headers {
        headers.insert(k.clone(), v.clone());
    }
    let m = Message::new(
        r.payload.clone(),
        Origin::new("kafka", topic).at(partition, r.offset),
    )
    .with_headers(headers);
    match &r.key {
        Some(k) => m.with_key(k.clone()),
        None => m,
    }
}
