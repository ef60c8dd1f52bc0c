//! `txinbox dead-letters list | show | requeue | discard`.

use std::fmt::Write;

use serde_json::{json, Value};
use txinbox::ops::dead_letters::{self, DeadLetterRow, Filter, Requeue};

use crate::error::{db, exit, CliError};
use crate::{amqp, kafka, DeadLetterCommand, Env, Report};

/// Header added to a requeued copy: the dead letter it came from (not part of the fingerprint).
pub const REQUEUED_FROM: &str = "txinbox.requeued.dead-letter-id";

pub async fn run(env: &Env, command: DeadLetterCommand) -> Result<Report, CliError> {
    let store = env.db(false).await?;
    let pool = store.ops();
    match command {
        DeadLetterCommand::List(a) => {
            if a.limit < 1 {
                return Err(CliError::BadArgs("--limit must be at least 1".into()));
            }
            let filter = Filter {
                consumer: a.consumer,
                reason: a.reason,
                since: a.since,
                state: a.state,
                limit: a.limit,
            };
            let rows = dead_letters::list(pool, &filter)
                .await
                .map_err(db("listing dead letters"))?;
            let mut text = format!(
                "{:>8} {:<20} {:<24} {:<16} {:<9} {:<24} {}\n",
                "id", "consumer", "message id", "reason", "state", "dead-lettered at", "origin"
            );
            for r in &rows {
                let _ = writeln!(
                    text,
                    "{:>8} {:<20} {:<24} {:<16} {:<9} {:<24} {}",
                    r.id,
                    r.consumer,
                    r.message_id.as_deref().unwrap_or("-"),
                    r.reason,
                    r.state(),
                    r.dead_lettered_at.to_string(),
                    origin(r)
                );
            }
            let _ = writeln!(text, "{} dead letter(s)", rows.len());
            Ok(Report::ok(
                json!({ "dead_letters": rows.iter().map(summary).collect::<Vec<_>>() }),
                text,
            ))
        }
        DeadLetterCommand::Show { id } => {
            let r = dead_letters::get(pool, id)
                .await
                .map_err(db("reading the dead letter"))?
                .ok_or_else(|| CliError::failed(format!("no dead letter {id}")))?;
            let full = full(&r);
            let mut text = String::new();
            for (k, v) in full.as_object().into_iter().flatten() {
                let v = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                let _ = writeln!(text, "{k:<18} {v}");
            }
            Ok(Report::ok(full, text))
        }
        DeadLetterCommand::Discard { ids, reason } => {
            let mut out = Vec::new();
            let mut text = String::new();
            let mut code = exit::OK;
            for id in ids {
                match dead_letters::discard(pool, id, &reason)
                    .await
                    .map_err(db("discarding"))?
                {
                    Some(r) => {
                        let _ = writeln!(
                            text,
                            "dead letter {id} discarded at {} ({})",
                            super::when(r.discarded_at),
                            r.discard_reason.as_deref().unwrap_or("")
                        );
                        out.push(json!({ "id": id, "discarded": true, "discarded_at": r.discarded_at.map(|t| t.to_string()), "reason": r.discard_reason }));
                    }
                    None => {
                        code = exit::FAILED;
                        let _ = writeln!(text, "no dead letter {id}");
                        out.push(json!({ "id": id, "discarded": false, "error": "no such dead letter" }));
                    }
                }
            }
            Ok(Report {
                json: json!({ "results": out }),
                text,
                code,
            })
        }
        DeadLetterCommand::Requeue { ids, force } => {
            let mut out = Vec::new();
            let mut text = String::new();
            let mut code = exit::OK;
            let mut services = Publishers::default();
            for (i, &id) in ids.iter().enumerate() {
                match requeue(env, pool, &mut services, id, force).await {
                    Ok((json, line)) => {
                        out.push(json);
                        text.push_str(&line);
                    }
                    Err(e @ CliError::Failed(_)) => {
                        code = exit::FAILED;
                        let _ = writeln!(text, "dead letter {id} not requeued: {e}");
                        out.push(json!({ "id": id, "requeued": false, "error": e.to_string() }));
                    }
                    // A missing service or argument fails every other requeue the same way: stop,
                    // but report what was already requeued.
                    Err(e) if i == 0 => return Err(e),
                    Err(e) => {
                        code = e.exit_code();
                        let _ = writeln!(text, "dead letter {id} not requeued: {e}");
                        out.push(json!({ "id": id, "requeued": false, "error": e.to_string() }));
                        for id in &ids[i + 1..] {
                            let _ = writeln!(text, "dead letter {id} not attempted");
                            out.push(json!({ "id": id, "requeued": false, "error": "not attempted" }));
                        }
                        break;
                    }
                }
            }
            if code != exit::OK {
                eprint!("{text}");
            }
            Ok(Report {
                json: json!({ "results": out }),
                text,
                code,
            })
        }
    }
}

/// What a failed publish leaves behind. A timed-out publish may still have delivered the copy.
const NOT_RECORDED: &str = "the requeue is not recorded and the inbox row is unchanged, so a copy that reached the broker anyway is deduplicated against it (a dead-lettered row sends it to the dead letters again): requeue it again";

/// Broker connections opened on first use, shared by the requeues of one run.
#[derive(Default)]
struct Publishers {
    kafka: Option<(kafka::Kafka, kafka::Producer)>,
    amqp: Option<amqp::Amqp>,
}

async fn requeue(
    env: &Env,
    pool: txinbox::ops::Db<'_>,
    services: &mut Publishers,
    id: i64,
    force: bool,
) -> Result<(Value, String), CliError> {
    let Some(rq) = Requeue::begin(pool, id)
        .await
        .map_err(db("locking the dead letter"))?
    else {
        return Err(CliError::failed("no such dead letter"));
    };
    let r = &rq.row;
    if r.truncated {
        return Err(CliError::failed(format!(
            "its payload or headers were stored cut ({} bytes received; Consumer::dead_letter_payload_limit): a copy would be a different message. Republish the original from {} (SHA-256 {}) if the broker still has it",
            r.payload_size.map_or("?".into(), |n| n.to_string()),
            origin(r),
            r.payload_sha256.as_deref().map_or("unknown".into(), hex)
        )));
    }
    if r.discarded_at.is_some() && !force {
        return Err(CliError::failed(format!(
            "it was discarded ({}); pass --force to requeue it anyway",
            r.discard_reason.as_deref().unwrap_or("no reason")
        )));
    }
    if rq.inbox_before.is_none() && r.requeue_count > 0 && !force {
        return Err(CliError::failed(format!(
            "it was requeued {} time(s) before and its inbox row is gone (purged): if an earlier copy was applied, this one would be applied again. Check the effects of message {}, then pass --force to requeue it anyway",
            r.requeue_count,
            r.message_id.as_deref().unwrap_or("-")
        )));
    }
    if r.message_id.is_none() {
        return Err(CliError::failed(format!(
            "it has no message ID (reason {}): a copy would be dead-lettered again; fix the producer and publish the message anew",
            r.reason
        )));
    }
    if r.reason == "conflict" {
        return Err(CliError::failed(
            "it is a conflict: the inbox holds a different payload under the same ID, so a copy would conflict again; publish it under a new ID if it is a different message",
        ));
    }
    match r.id_strategy.as_deref() {
        Some("offset") | Some("native") if r.source_system == "kafka" => {
            return Err(CliError::failed(format!(
                "its ID came from strategy `{}`, which a republished copy cannot reproduce (it would get a new ID and bypass deduplication)",
                r.id_strategy.as_deref().unwrap_or("")
            )))
        }
        _ => {}
    }
    let mut headers: Vec<(String, Vec<u8>)> = r
        .original_headers()
        .iter()
        .map(|(k, v)| (k.to_owned(), v.to_vec()))
        .collect();
    // A copy of a copy names only this dead letter.
    headers.retain(|(k, _)| k != REQUEUED_FROM);
    headers.push((REQUEUED_FROM.into(), id.to_string().into_bytes()));
    // The inbox row stays locked until commit: a consumer receiving the copy first waits, then
    // sees the reopened row.
    let (partition, offset) = match r.source_system.as_str() {
        "kafka" => {
            let message_id = r.message_id.as_deref().unwrap_or_default();
            let others = dead_letters::readers_without_row(pool, &r.consumer, &r.destination, message_id)
                .await
                .map_err(db("looking for other consumers of the topic"))?;
            if !others.is_empty() && !force {
                return Err(CliError::failed(format!(
                    "other consumers also read {} and their inbox holds no row for message {message_id}: {}. The copy reaches them too and they would take it for a new message (applying it again if they processed the original under another ID or purged its row); pass --force if that is intended",
                    r.destination,
                    others.join(", ")
                )));
            }
            if services.kafka.is_none() {
                let k = env.kafka("requeueing a Kafka dead letter")?;
                let producer = k.producer()?;
                services.kafka = Some((k, producer));
            }
            let (_, producer) = services.kafka.as_ref().expect("connected above");
            let (p, o) = kafka::produce(producer, &r.destination, r.source_partition, &r.payload, &headers)
                .await
                .map_err(|e| CliError::failed(format!("publishing to {} failed ({e}); {NOT_RECORDED}", r.destination)))?;
            (Some(p), Some(o))
        }
        "rabbitmq" => {
            if services.amqp.is_none() {
                services.amqp = Some(env.amqp("requeueing a RabbitMQ dead letter").await?);
            }
            let amqp = services.amqp.as_ref().expect("connected above");
            headers.retain(|(k, _)| !amqp::is_bookkeeping(k));
            let native = (r.id_strategy.as_deref() == Some("native")).then_some(r.message_id.as_deref()).flatten();
            amqp.publish(&r.destination, &r.payload, &headers, native)
                .await
                .map_err(|e| CliError::failed(format!("publishing to queue {} failed ({e}); {NOT_RECORDED}", r.destination)))?;
            (None, None)
        }
        other => {
            return Err(CliError::failed(format!(
                "it came from `{other}`, which this tool cannot publish to; only Kafka and RabbitMQ dead letters can be requeued"
            )))
        }
    };
    let (reopened, before, consumer, message_id, topic) = (
        rq.reopened,
        rq.inbox_before.map(|s| s.as_str()),
        r.consumer.clone(),
        r.message_id.clone(),
        r.destination.clone(),
    );
    rq.commit().await.map_err(|e| {
        CliError::failed(format!(
            "the copy was published to {topic}, but recording the requeue failed ({e}); the inbox row is unchanged, so the consumer dead-letters the copy again: run the requeue again"
        ))
    })?;
    let outcome = if reopened {
        "the consumer will process it (inbox row reopened)"
    } else if before == Some("processed") {
        "the inbox row is processed: the consumer will skip the copy as a duplicate"
    } else if before.is_none() {
        "no inbox row (purged?): the consumer will process it"
    } else {
        "the inbox row was left as it is"
    };
    let line = format!(
        "dead letter {id} ({consumer}, message {}) requeued to {topic}{}: {outcome}\n",
        message_id.as_deref().unwrap_or("-"),
        match (partition, offset) {
            (Some(p), Some(o)) => format!("/{p}@{o}"),
            _ => String::new(),
        }
    );
    Ok((
        json!({
            "id": id, "requeued": true, "consumer": consumer, "message_id": message_id,
            "topic": topic, "partition": partition, "offset": offset,
            "inbox_status_before": before, "inbox_reopened": reopened,
        }),
        line,
    ))
}

fn origin(r: &DeadLetterRow) -> String {
    match (r.source_partition, r.source_offset) {
        (Some(p), Some(o)) => format!("{}:{}/{p}@{o}", r.source_system, r.destination),
        _ => format!("{}:{}", r.source_system, r.destination),
    }
}

fn summary(r: &DeadLetterRow) -> Value {
    json!({
        "id": r.id, "consumer": r.consumer, "message_id": r.message_id, "reason": r.reason,
        "state": r.state(), "dead_lettered_at": r.dead_lettered_at.to_string(),
        "source_system": r.source_system, "destination": r.destination,
        "partition": r.source_partition, "offset": r.source_offset,
    })
}

fn full(r: &DeadLetterRow) -> Value {
    let mut v = summary(r);
    v["id_strategy"] = json!(r.id_strategy);
    v["fingerprint"] = json!(r.fingerprint.as_deref().map(hex));
    v["error"] = json!(r.error);
    v["attempts"] = json!(r.attempts);
    match std::str::from_utf8(&r.payload) {
        Ok(s) => v["payload"] = json!(s),
        Err(_) => v["payload_hex"] = json!(hex(&r.payload)),
    }
    v["headers"] = r.headers.clone();
    v["requeued_at"] = json!(r.requeued_at.map(|t| t.to_string()));
    v["requeue_count"] = json!(r.requeue_count);
    v["discarded_at"] = json!(r.discarded_at.map(|t| t.to_string()));
    v["discard_reason"] = json!(r.discard_reason);
    v["payload_size"] = json!(r.payload_size);
    v["payload_sha256"] = json!(r.payload_sha256.as_deref().map(hex));
    v["truncated"] = json!(r.truncated);
    v
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
