//! `txinbox positions show|adopt|set|rebind`: a consumer's database positions against its
//! group's committed offsets and the watermarks, and writing them on purpose.
//!
//! A Kafka consumer starts an assigned partition at its database position. After a database
//! restore (or on a new database) a partition with a committed group offset but no database
//! position is refused by the consumer: `adopt` takes the group's offsets as done, `set
//! --to-earliest` re-reads everything the broker holds (the inbox skips what is applied).
//! Every write prints its plan, is checked by one rule for both commands ([`refusals`]:
//! retention horizon, skipped records, active members; `--force` overrides it), writes nothing
//! with `--dry-run`, asks on a terminal or needs `--yes`, and writes in one transaction only if
//! the positions are still what the plan saw.

use std::collections::BTreeSet;
use std::fmt::Write;

use serde_json::json;
use txinbox::ops::positions::{self as ops, Applied, Change, PartitionView, Skip};
use txinbox::ops::Db;
use txinbox::ops::{retention, status, Timestamp};

use super::{confirm, num};
use crate::error::{db, CliError};
use crate::kafka::Kafka;
use crate::{
    Env, PositionsAdoptArgs, PositionsCommand, PositionsRebindArgs, PositionsSetArgs, PositionsShowArgs,
    Report, WriteFlags,
};

pub async fn run(env: &Env, c: PositionsCommand) -> Result<Report, CliError> {
    match c {
        PositionsCommand::Show(a) => show(env, a).await,
        PositionsCommand::Adopt(a) => adopt(env, a).await,
        PositionsCommand::Set(a) => set(env, a).await,
        PositionsCommand::Rebind(a) => rebind(env, a).await,
    }
}

/// The database's and the broker's view of `partitions` of `topic` (all when empty).
async fn views(
    pool: Db<'_>,
    kafka: &Kafka,
    consumer: &str,
    topic: &str,
    group: &str,
    partitions: &[i32],
) -> Result<Vec<PartitionView>, CliError> {
    let stored = ops::stored(pool, consumer, topic)
        .await
        .map_err(db("reading positions"))?;
    let broker = tokio::task::block_in_place(|| kafka.view(topic, Some(group), partitions))?;
    Ok(broker
        .into_iter()
        .map(|b| PartitionView {
            partition: b.partition,
            database_position: stored.get(&b.partition).copied(),
            group_offset: b.group_offset,
            low: b.low,
            high: b.high,
        })
        .collect())
}

fn view_json(topic: &str, group: &str, v: &PartitionView) -> serde_json::Value {
    let status = v.status();
    json!({
        "topic": topic, "group": group, "partition": v.partition,
        "database_position": v.database_position, "group_offset": v.group_offset,
        "low_watermark": v.low, "high_watermark": v.high,
        "status": status.as_str(), "meaning": status.meaning(),
    })
}

async fn show(env: &Env, a: PositionsShowArgs) -> Result<Report, CliError> {
    let store = env.db(false).await?;
    let pool = store.ops();
    let kafka = env.kafka("positions show")?;
    let consumer = a.consumer.consumer.as_str();
    let topics: Vec<String> = match a.consumer.topic {
        Some(t) => vec![t],
        None => {
            let mut topics: BTreeSet<String> = ops::subscriptions(pool, consumer, ops::KAFKA)
                .await
                .map_err(db("reading the recorded groups"))?
                .into_keys()
                .collect();
            topics.extend(
                status::positions(pool, Some(consumer), None)
                    .await
                    .map_err(db("reading positions"))?
                    .into_iter()
                    .map(|p| p.source),
            );
            if topics.is_empty() {
                return Err(CliError::failed(format!(
                    "consumer {consumer} has no stored positions and no recorded group: pass --topic (and --group)"
                )));
            }
            topics.into_iter().collect()
        }
    };
    let mut partitions = Vec::new();
    let mut groups = serde_json::Map::new();
    let mut text = String::new();
    for topic in &topics {
        let group = super::group(pool, consumer, topic, a.group.as_deref()).await?;
        let views = views(pool, &kafka, consumer, topic, &group, &[]).await?;
        let _ = writeln!(text, "consumer {consumer}, topic {topic}, group {group}");
        let _ = writeln!(
            text,
            "  {:>9} {:>12} {:>12} {:>12} {:>12}  status",
            "partition", "db position", "group offset", "low", "high"
        );
        for v in &views {
            let status = v.status();
            let _ = writeln!(
                text,
                "  {:>9} {:>12} {:>12} {:>12} {:>12}  {}: {}",
                v.partition,
                num(v.database_position),
                num(v.group_offset),
                v.low,
                v.high,
                status,
                status.meaning()
            );
            partitions.push(view_json(topic, &group, v));
        }
        groups.insert(topic.clone(), json!(group));
    }
    let distinct: BTreeSet<&str> = groups.values().filter_map(|g| g.as_str()).collect();
    let group = match distinct.len() {
        1 => json!(distinct.into_iter().next()),
        _ => serde_json::Value::Null,
    };
    Ok(Report::ok(
        json!({ "consumer": consumer, "group": group, "groups": groups, "partitions": partitions }),
        text,
    ))
}

/// The text and JSON of a write plan.
fn plan_report(
    what: &str,
    consumer: &str,
    topic: &str,
    group: &str,
    changes: &[Change],
    skips: &[Skip],
) -> (String, serde_json::Value) {
    let mut text = format!("consumer {consumer}, topic {topic}, group {group}: {what}\n");
    for c in changes {
        let _ = writeln!(
            text,
            "  partition {}: database position {} -> {}",
            c.partition,
            num(c.from),
            c.to
        );
    }
    for s in skips {
        let _ = writeln!(text, "  partition {}: unchanged ({})", s.partition, s.reason);
    }
    if changes.is_empty() {
        text.push_str("  nothing to write\n");
    }
    let json = json!({
        "consumer": consumer, "topic": topic, "group": group,
        "changes": changes.iter().map(|c| json!({ "partition": c.partition, "from": c.from, "to": c.to })).collect::<Vec<_>>(),
        "skipped": skips.iter().map(|s| json!({ "partition": s.partition, "reason": s.reason })).collect::<Vec<_>>(),
    });
    (text, json)
}

/// Prints-or-asks, then writes `changes` if the plan still holds; the report says what happened.
#[allow(clippy::too_many_arguments)]
async fn write(
    env: &Env,
    pool: Db<'_>,
    consumer: &str,
    topic: &str,
    changes: &[Change],
    horizon: Option<Timestamp>,
    flags: &WriteFlags,
    mut text: String,
    mut report: serde_json::Value,
) -> Result<Report, CliError> {
    report["dry_run"] = json!(flags.dry_run);
    report["written"] = json!(false);
    if flags.dry_run {
        text.push_str("dry run: nothing written\n");
        return Ok(Report::ok(report, text));
    }
    if changes.is_empty() {
        return Ok(Report::ok(report, text));
    }
    confirm(
        env.json,
        &text,
        &format!("write {} database position(s)", changes.len()),
        flags.yes,
    )?;
    match ops::apply(pool, consumer, topic, changes, horizon)
        .await
        .map_err(db("writing the positions"))?
    {
        Applied::Done => {}
        Applied::HorizonMoved => {
            return Err(CliError::failed(
                "a purge moved the retention horizon while the plan was made; nothing was written: run the command again",
            ))
        }
        Applied::Changed { partition, now } => {
            return Err(CliError::failed(format!(
                "the database position of partition {partition} changed since the plan was made (now {}: a running consumer or another operator wrote it); nothing was written: stop the consumers and run the command again",
                num(now)
            )))
        }
    }
    report["written"] = json!(true);
    let _ = writeln!(
        text,
        "{} database position(s) written; consumers start from them when they are assigned the partitions (restart running ones)",
        changes.len()
    );
    Ok(Report::ok(report, text))
}

async fn adopt(env: &Env, a: PositionsAdoptArgs) -> Result<Report, CliError> {
    let store = env.db(false).await?;
    let pool = store.ops();
    let kafka = env.kafka("positions adopt")?;
    let (consumer, topic) = (a.target.consumer.as_str(), a.target.topic.as_str());
    let group = super::group(pool, consumer, topic, a.group.as_deref()).await?;
    let horizon = retention::horizon(pool, consumer)
        .await
        .map_err(db("reading the retention horizon"))?;
    let views = views(pool, &kafka, consumer, topic, &group, &a.partitions).await?;
    let (changes, skips) = ops::adopt_plan(&views, a.overwrite);
    let (mut text, mut report) = plan_report(
        "store the group's committed offsets as database positions (the records before them count as done)",
        consumer,
        topic,
        &group,
        &changes,
        &skips,
    );
    let refused = refusals(&kafka, topic, &group, &views, &changes, horizon)?;
    guard(&mut text, &mut report, &refused, a.force, a.write.dry_run)?;
    write(
        env, pool, consumer, topic, &changes, horizon, &a.write, text, report,
    )
    .await
}

async fn set(env: &Env, a: PositionsSetArgs) -> Result<Report, CliError> {
    let store = env.db(false).await?;
    let pool = store.ops();
    let kafka = env.kafka("positions set")?;
    let (consumer, topic) = (a.target.consumer.as_str(), a.target.topic.as_str());
    let group = super::group(pool, consumer, topic, a.group.as_deref()).await?;
    let horizon = retention::horizon(pool, consumer)
        .await
        .map_err(db("reading the retention horizon"))?;
    let views = views(pool, &kafka, consumer, topic, &group, &a.partitions).await?;
    if let Some(o) = a.offset {
        if let Some(v) = views.iter().find(|v| o < v.low || o > v.high) {
            return Err(CliError::BadArgs(format!(
                "--offset {o} is outside {topic}/{}'s offsets {}..{} (low..high watermark)",
                v.partition, v.low, v.high
            )));
        }
    }
    let (changes, skips) = ops::set_plan(&views, |v| a.offset.unwrap_or(v.low));
    let what = match a.offset {
        Some(o) => format!("store offset {o}"),
        None => "store the earliest offset the broker holds (the inbox skips what is already applied)".into(),
    };
    let (mut text, mut report) = plan_report(&what, consumer, topic, &group, &changes, &skips);
    let refused = refusals(&kafka, topic, &group, &views, &changes, horizon)?;
    guard(&mut text, &mut report, &refused, a.force, a.write.dry_run)?;
    write(
        env, pool, consumer, topic, &changes, horizon, &a.write, text, report,
    )
    .await
}

/// Why writing `changes` is refused, one reason each; empty when nothing refuses it. The one
/// check of every command that writes positions (`set`, `adopt`):
///
/// - a new position before the retention horizon: records produced before it may have had
///   their inbox rows purged, so they would be applied again;
/// - a new position after where the consumer resumes: the records in between would never
///   reach it;
/// - any write while the group has active members, which overwrite a partition's position
///   with their own progress; except for partitions a consumer holds
///   ([`PositionStatus::held_by_consumer`](ops::PositionStatus::held_by_consumer)), which it
///   never writes and picks up within seconds (the point of writing them).
fn refusals(
    kafka: &Kafka,
    topic: &str,
    group: &str,
    views: &[PartitionView],
    changes: &[Change],
    horizon: Option<Timestamp>,
) -> Result<Vec<String>, CliError> {
    let view = |partition: i32| views.iter().find(|v| v.partition == partition);
    let mut refusals = Vec::new();
    let starts: Vec<(i32, i64, i64)> = changes
        .iter()
        .filter_map(|c| Some((c.partition, c.to, view(c.partition)?.high)))
        .collect();
    if !super::replay::before_horizon(kafka, topic, &starts, horizon)?.is_empty() {
        refusals.push(format!(
            "the new positions are before the retention horizon {} (records produced before it may have had their inbox rows purged, so they would be applied again)",
            horizon.map(|h| h.to_string()).unwrap_or_default()
        ));
    }
    let skipped: Vec<String> = changes
        .iter()
        .filter_map(|c| {
            let v = view(c.partition)?;
            // Neither a position nor a group offset: the consumer would start at the low
            // watermark (auto.offset.reset = earliest), so that is what a later start skips.
            let resume = c.from.or(v.group_offset).unwrap_or(v.low).max(v.low);
            (c.to > resume).then(|| format!("partition {} offsets {resume}..{}", c.partition, c.to))
        })
        .collect();
    if !skipped.is_empty() {
        refusals.push(format!(
            "the new positions are after where the consumer resumes ({}): those records would never reach it (after a restore: the effects it lost; `positions set --to-earliest` re-applies them instead)",
            skipped.join(", ")
        ));
    }
    let only_held = changes
        .iter()
        .all(|c| view(c.partition).is_some_and(|v| v.status().held_by_consumer()));
    if !changes.is_empty() && !only_held {
        let members = tokio::task::block_in_place(|| kafka.group_members(group))?;
        if !members.is_empty() {
            refusals.push(format!(
                "group {group} has {} active member(s): {}; a consumer that holds a partition overwrites its database position with its own progress: stop the consumers first",
                members.len(),
                members.join(", ")
            ));
        }
    }
    Ok(refusals)
}

/// Shows `refused` in the plan (as warnings with `--force` or `--dry-run`) and in the report's
/// `warnings`; an error that writes nothing unless forced or a dry run.
fn guard(
    text: &mut String,
    report: &mut serde_json::Value,
    refused: &[String],
    force: bool,
    dry_run: bool,
) -> Result<(), CliError> {
    for r in refused {
        let _ = writeln!(
            text,
            "{}: {r}",
            if force || dry_run { "warning" } else { "refused" }
        );
    }
    report["warnings"] = json!(refused);
    if !refused.is_empty() && !force && !dry_run {
        return Err(CliError::Failed(format!(
            "{}; nothing was written (pass --force to write anyway)",
            refused.join("; ")
        )));
    }
    Ok(())
}

async fn rebind(env: &Env, a: PositionsRebindArgs) -> Result<Report, CliError> {
    let store = env.db(false).await?;
    let pool = store.ops();
    let (consumer, topic) = (a.target.consumer.as_str(), a.target.topic.as_str());
    let recorded = ops::subscription(pool, consumer, ops::KAFKA, topic)
        .await
        .map_err(db("reading the recorded group"))?;
    let mut report = json!({
        "consumer": consumer, "topic": topic, "group": a.group,
        "previous_group": recorded, "dry_run": a.write.dry_run, "written": false,
    });
    if recorded.as_deref() == Some(a.group.as_str()) {
        return Ok(Report::ok(
            report,
            format!(
                "consumer {consumer} already reads {topic} through group {}: nothing to write\n",
                a.group
            ),
        ));
    }
    let mut text = format!(
        "consumer {consumer}, topic {topic}: record group {} (was {}) in {}\n  the database positions stay; a consumer of the old group is refused at its next assignment (running ones go on until then): stop them first, then start them with group.id {}\n",
        a.group,
        recorded.as_deref().unwrap_or("none recorded"),
        pool.table("subscriptions"),
        a.group
    );
    if a.write.dry_run {
        text.push_str("dry run: nothing written\n");
        return Ok(Report::ok(report, text));
    }
    confirm(env.json, &text, &format!("record group {}", a.group), a.write.yes)?;
    let before = ops::rebind(pool, consumer, ops::KAFKA, topic, &a.group)
        .await
        .map_err(db("recording the group"))?;
    report["previous_group"] = json!(before);
    report["written"] = json!(true);
    let _ = writeln!(text, "group {} recorded", a.group);
    Ok(Report::ok(report, text))
}
