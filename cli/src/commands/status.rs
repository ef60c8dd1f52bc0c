//! `txinbox status`.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::json;
use txinbox::ops::positions as ops_positions;
use txinbox::ops::status;

use super::{num, when};
use crate::error::{db, CliError};
use crate::kafka::BrokerPartition;
use crate::{Env, Report};

pub async fn run(env: &Env, consumer: Option<&str>, group: Option<&str>) -> Result<Report, CliError> {
    let store = env.db(false).await?;
    let pool = store.ops();
    let summaries = status::consumers(pool, consumer)
        .await
        .map_err(db("reading consumer counters"))?;
    if let Some(c) = consumer {
        if summaries.is_empty() {
            return Err(CliError::failed(format!(
                "the database knows no consumer named {c}: no inbox rows, dead letters or positions"
            )));
        }
    }
    let positions = status::positions(pool, consumer, None)
        .await
        .map_err(db("reading positions"))?;
    let kafka = match &env.brokers {
        Some(_) => Some(env.kafka("status")?),
        None => None,
    };

    let mut out = Vec::new();
    let mut text = String::new();
    for s in &summaries {
        // Topic → stored positions by partition; topics with only a recorded group too (a
        // restored or new database: every partition missing).
        let mut topics: BTreeMap<&str, BTreeMap<i32, i64>> = BTreeMap::new();
        for p in positions.iter().filter(|p| p.consumer == s.consumer) {
            if let Ok(partition) = p.lane.parse::<i32>() {
                topics
                    .entry(&p.source)
                    .or_default()
                    .insert(partition, p.next_position);
            }
        }
        let recorded = ops_positions::subscriptions(pool, &s.consumer, ops_positions::KAFKA)
            .await
            .map_err(db(&format!(
                "reading the recorded groups ({})",
                store.table("subscriptions")
            )))?;
        for topic in recorded.keys() {
            topics.entry(topic).or_default();
        }
        let mut partitions = Vec::new();
        let mut topic_errors = Vec::new();
        for (topic, stored) in &topics {
            let group = match ops_positions::resolve_group(recorded.get(*topic).map(String::as_str), group) {
                Ok(g) => Some(g),
                Err(e @ ops_positions::GroupError::Disagrees { .. }) => {
                    return Err(CliError::Failed(e.explain(&s.consumer, topic)))
                }
                Err(e) => {
                    if kafka.is_some() {
                        topic_errors.push(json!({ "topic": topic, "error": e.explain(&s.consumer, topic) }));
                    }
                    None
                }
            };
            // What the broker says; a topic it no longer knows is reported, not fatal.
            let broker = match &kafka {
                Some(k) => match tokio::task::block_in_place(|| k.view(topic, group.as_deref(), &[])) {
                    Ok(view) => Some(view),
                    Err(e @ CliError::Unreachable { .. }) => return Err(e),
                    Err(e) => {
                        topic_errors.push(json!({ "topic": topic, "error": e.to_string() }));
                        None
                    }
                },
                None => None,
            };
            let rows: Vec<(i32, Option<BrokerPartition>)> = match broker {
                Some(v) => v.into_iter().map(|b| (b.partition, Some(b))).collect(),
                None => stored.keys().map(|p| (*p, None)).collect(),
            };
            for (p, b) in rows {
                let db_position = stored.get(&p).copied();
                let group_offset = b.and_then(|b| b.group_offset);
                let high = b.map(|b| b.high);
                let lag = high.and_then(|h| db_position.or(group_offset).map(|pos| (h - pos).max(0)));
                // The status needs the group's offset: without a group, none is claimed.
                let state = b.filter(|_| group.is_some()).map(|b| {
                    ops_positions::PartitionView {
                        partition: p,
                        database_position: db_position,
                        group_offset,
                        low: b.low,
                        high: b.high,
                    }
                    .status()
                    .as_str()
                });
                partitions.push(json!({
                    "topic": topic, "partition": p, "database_position": db_position,
                    "group": group, "group_offset": group_offset,
                    "low_watermark": b.map(|b| b.low), "high_watermark": high, "lag": lag,
                    "status": state,
                }));
            }
        }
        let _ = writeln!(
            text,
            "consumer {}\n  processed {}  duplicates {}  retrying {}  dead-lettered rows {}\n  \
             dead letters {} ({} pending)  conflicts {}\n  oldest retained {}  retention horizon {}",
            s.consumer,
            s.processed,
            s.duplicates,
            s.retrying,
            s.dead_lettered,
            s.dead_letters,
            s.dead_letters_pending,
            s.conflicts,
            when(s.oldest_retained),
            when(s.retention_horizon),
        );
        if !partitions.is_empty() {
            let _ = writeln!(
                text,
                "  {:<30} {:>9} {:>12} {:>12} {:>14} {:>8}  status",
                "topic", "partition", "db position", "group offset", "high watermark", "lag"
            );
            for p in &partitions {
                let _ = writeln!(
                    text,
                    "  {:<30} {:>9} {:>12} {:>12} {:>14} {:>8}  {}",
                    p["topic"].as_str().unwrap_or(""),
                    p["partition"],
                    num(p["database_position"].as_i64()),
                    num(p["group_offset"].as_i64()),
                    num(p["high_watermark"].as_i64()),
                    num(p["lag"].as_i64()),
                    p["status"].as_str().unwrap_or("-"),
                );
            }
            for e in &topic_errors {
                let _ = writeln!(
                    text,
                    "  warning: {}: {}",
                    e["topic"].as_str().unwrap_or(""),
                    e["error"].as_str().unwrap_or("")
                );
            }
            if kafka.is_none() {
                let _ = writeln!(
                    text,
                    "  (pass --brokers or set KAFKA_BROKERS for group offsets, watermarks and lag)"
                );
            }
        }
        out.push(json!({
            "consumer": s.consumer,
            "group": group,
            "processed": s.processed,
            "duplicates": s.duplicates,
            "retrying": s.retrying,
            "dead_lettered_rows": s.dead_lettered,
            "conflicts": s.conflicts,
            "dead_letters": s.dead_letters,
            "dead_letters_pending": s.dead_letters_pending,
            "oldest_retained": s.oldest_retained.map(|t| t.to_string()),
            "retention_horizon": s.retention_horizon.map(|t| t.to_string()),
            "partitions": partitions,
            "topic_errors": topic_errors,
        }));
    }
    if summaries.is_empty() {
        text.push_str("no consumers yet\n");
    }
    Ok(Report::ok(json!({ "consumers": out }), text))
}
