//! `txinbox status`.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::json;
use txinbox::ops::status;

use super::{num, when};
use crate::error::{db, CliError};
use crate::kafka::Kafka;
use crate::{Env, Report};

pub async fn run(env: &Env, consumer: Option<&str>, group: Option<&str>) -> Result<Report, CliError> {
    let pool = env.db(false).await?;
    let summaries = status::consumers(&pool, consumer)
        .await
        .map_err(db("reading consumer counters"))?;
    if let Some(c) = consumer {
        if summaries.is_empty() {
            return Err(CliError::failed(format!(
                "the database knows no consumer named {c}: no inbox rows, dead letters or positions"
            )));
        }
    }
    let positions = status::positions(&pool, consumer, None)
        .await
        .map_err(db("reading positions"))?;
    let kafka = match &env.brokers {
        Some(_) => Some(env.kafka("status")?),
        None => None,
    };

    let mut out = Vec::new();
    let mut text = String::new();
    for s in &summaries {
        let group = group.unwrap_or(&s.consumer);
        // Topic → stored positions by partition.
        let mut topics: BTreeMap<&str, BTreeMap<i32, i64>> = BTreeMap::new();
        for p in positions.iter().filter(|p| p.consumer == s.consumer) {
            if let Ok(partition) = p.lane.parse::<i32>() {
                topics
                    .entry(&p.source)
                    .or_default()
                    .insert(partition, p.next_position);
            }
        }
        let mut partitions = Vec::new();
        let mut topic_errors = Vec::new();
        for (topic, stored) in &topics {
            // What the broker says; a topic it no longer knows is reported, not fatal.
            let broker = match &kafka {
                Some(k) => match tokio::task::block_in_place(|| broker_view(k, group, topic)) {
                    Ok(view) => Some(view),
                    Err(e @ CliError::Unreachable { .. }) => return Err(e),
                    Err(e) => {
                        topic_errors.push(json!({ "topic": topic, "error": e.to_string() }));
                        None
                    }
                },
                None => None,
            };
            let all: Vec<i32> = match &broker {
                Some(v) => v.keys().copied().collect(),
                None => stored.keys().copied().collect(),
            };
            for p in all {
                let db_position = stored.get(&p).copied();
                let (group_offset, high) = match broker.as_ref().and_then(|v| v.get(&p)) {
                    Some((g, h)) => (*g, Some(*h)),
                    None => (None, None),
                };
                let lag = high.and_then(|h| db_position.or(group_offset).map(|pos| (h - pos).max(0)));
                partitions.push(json!({
                    "topic": topic, "partition": p, "database_position": db_position,
                    "group_offset": group_offset, "high_watermark": high, "lag": lag,
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
                "  {:<30} {:>9} {:>12} {:>12} {:>14} {:>8}",
                "topic", "partition", "db position", "group offset", "high watermark", "lag"
            );
            for p in &partitions {
                let _ = writeln!(
                    text,
                    "  {:<30} {:>9} {:>12} {:>12} {:>14} {:>8}",
                    p["topic"].as_str().unwrap_or(""),
                    p["partition"],
                    num(p["database_position"].as_i64()),
                    num(p["group_offset"].as_i64()),
                    num(p["high_watermark"].as_i64()),
                    num(p["lag"].as_i64()),
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

/// Partition → (group committed offset, high watermark) for every partition of `topic`.
fn broker_view(k: &Kafka, group: &str, topic: &str) -> Result<BTreeMap<i32, (Option<i64>, i64)>, CliError> {
    let all = k.partitions(topic)?;
    let committed = k.committed(group, topic, &all)?;
    all.into_iter()
        .map(|p| {
            Ok((
                p,
                (committed.get(&p).copied().flatten(), k.watermarks(topic, p)?.1),
            ))
        })
        .collect()
}
