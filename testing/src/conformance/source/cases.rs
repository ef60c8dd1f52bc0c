//! The cases of the source suite, one `pub async fn` each (see the table in the module docs).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use txinbox::{
    dead_letter::DeadLetter, dead_letter::DeadLetterReason, source::Lane, source::RetryMode,
    source::Settlement, Delivery, MessageSource,
};

use super::support::{ack, payload, poll_once, settle, Case};
use super::Harness;
use crate::conformance::skipped;

/// Payload and headers arrive as published; an acked delivery is never delivered again, not
/// by the open source and not by one opened after `close`.
pub async fn ack_is_final<H: Harness>(harness: H) {
    let case = Case::new(harness, "ack_is_final");
    let mut source = case.open().await;
    let published = [
        case.publish("one", None).await,
        case.publish("two", None).await,
        case.publish("three", None).await,
    ];
    let mut received = Vec::new();
    for _ in 0..published.len() {
        let d = case
            .expect(&mut source, "one of the three messages published")
            .await;
        let label = d
            .message()
            .headers()
            .get_str("conformance-label")
            .map(str::to_owned);
        let p = payload(&d);
        assert_eq!(
            label.as_deref(),
            p.rsplit('/').next(),
            "header `conformance-label` must arrive with its message {p:?}"
        );
        ack(d).await;
        received.push(p);
    }
    received.sort();
    let mut expected = published.to_vec();
    expected.sort();
    assert_eq!(received, expected, "each published message is delivered once");
    let again = case.leftovers(&mut source, "marker-open").await;
    assert!(
        again.is_empty(),
        "acked messages delivered again by the open source: {again:?}"
    );
    case.close(source).await;

    let mut reopened = case.open().await;
    let again = case.leftovers(&mut reopened, "marker-reopened").await;
    assert!(
        again.is_empty(),
        "acked messages delivered again after a reopen: {again:?}"
    );
    case.close(reopened).await;
    case.harness.cleanup().await;
}

/// `Settlement::Retry { after }` delivers the message again, not before `after`, and the
/// retried copy can be acked for good. Sources with [`RetryMode::InPlace`] are never given
/// `Retry` (the runtime re-runs the delivery itself): skipped for them.
pub async fn retry_redelivers_later<H: Harness>(harness: H) {
    let case = Case::new(harness, "retry_redelivers_later");
    let mut source = case.open().await;
    if source.capabilities().retry == RetryMode::InPlace {
        skipped(
            case.name,
            "the source's RetryMode is InPlace: it is never given Settlement::Retry",
        );
        case.close(source).await;
        case.harness.cleanup().await;
        return;
    }
    let p = case.publish("retried", None).await;
    let d = case.expect(&mut source, "the message to retry").await;
    assert_eq!(payload(&d), p);
    let after = Duration::from_millis(600);
    let settled = Instant::now();
    settle(d, Settlement::Retry { after }).await;
    let again = case.expect(&mut source, "the retried message").await;
    let waited = settled.elapsed();
    assert_eq!(payload(&again), p, "the retried message comes back");
    // A broker timer may round: 10 % of slack, never less than half.
    assert!(
        waited >= after.mul_f64(0.9),
        "Retry {{ after: {after:?} }} came back after only {waited:?}"
    );
    ack(again).await;
    let left = case.leftovers(&mut source, "marker").await;
    assert!(left.is_empty(), "the acked retry copy came back: {left:?}");
    case.close(source).await;
    case.harness.cleanup().await;
}

/// `Settlement::DeadLetter` ends the delivery: it is not delivered again (open source or
/// reopened), and the message reaches the dead-letter target (when the harness can read it).
pub async fn dead_letter_moves_it_aside<H: Harness>(harness: H) {
    let case = Case::new(harness, "dead_letter_moves_it_aside");
    let mut source = case.open().await;
    let p = case.publish("poison", None).await;
    let d = case.expect(&mut source, "the message to dead-letter").await;
    assert_eq!(payload(&d), p);
    let dl = DeadLetter {
        reason: DeadLetterReason::Permanent,
        error: "conformance: a permanent failure".into(),
    };
    settle(d, Settlement::DeadLetter(dl)).await;
    let left = case.leftovers(&mut source, "marker-open").await;
    assert!(
        left.is_empty(),
        "a dead-lettered message was delivered again: {left:?}"
    );
    case.close(source).await;
    let mut reopened = case.open().await;
    let left = case.leftovers(&mut reopened, "marker-reopened").await;
    assert!(
        left.is_empty(),
        "a dead-lettered message was delivered again after a reopen: {left:?}"
    );
    case.close(reopened).await;
    match case.harness.dead_letters(1, case.features.patience).await {
        None => skipped(
            case.name,
            "the harness cannot read dead letters back (Harness::dead_letters)",
        ),
        Some(dead) => {
            let payloads: Vec<String> = dead
                .iter()
                .map(|m| String::from_utf8_lossy(m.payload()).into_owned())
                .collect();
            assert_eq!(payloads, [p], "the dead-letter target holds the message, once");
        }
    }
    case.harness.cleanup().await;
}

/// A delivery dropped without being settled is not acknowledged: it comes back, from the open
/// source when [`Features::redelivers_while_open`](super::Features::redelivers_while_open),
/// and in any case from a source opened after `close`. Settled neighbours stay settled.
pub async fn dropped_delivery_is_redelivered<H: Harness>(harness: H) {
    let case = Case::new(harness, "dropped_delivery_is_redelivered");
    let mut source = case.open().await;
    let first = case.publish("acked", None).await;
    let second = case.publish("dropped", None).await;
    let d = case.expect(&mut source, "the first message").await;
    assert_eq!(payload(&d), first, "delivered in publish order");
    ack(d).await;
    let d = case.expect(&mut source, "the second message").await;
    assert_eq!(payload(&d), second, "delivered in publish order");
    drop(d);
    if case.features.redelivers_while_open {
        let d = case.expect(&mut source, "the dropped message, redelivered").await;
        assert_eq!(payload(&d), second, "the dropped message comes back");
        drop(d); // dropped again: now it must survive a close as well
    } else {
        skipped(
            case.name,
            "redelivery by the open source (Features::redelivers_while_open is false); checked after a reopen",
        );
    }
    case.close(source).await;
    let mut reopened = case.open().await;
    let left = case.leftovers(&mut reopened, "marker").await;
    assert_eq!(
        left,
        [second],
        "after a reopen, exactly the dropped message comes back (the acked one does not)"
    );
    case.close(reopened).await;
    case.harness.cleanup().await;
}

/// `close` returns (within the patience) although a delivery it handed out is still held and
/// unsettled; that delivery, never settled, comes back from the next source.
pub async fn close_returns_with_a_delivery_in_flight<H: Harness>(harness: H) {
    let case = Case::new(harness, "close_returns_with_a_delivery_in_flight");
    let mut source = case.open().await;
    let p = case.publish("in-flight", None).await;
    let held = case.expect(&mut source, "the message").await;
    assert_eq!(payload(&held), p);
    case.close(source).await;
    drop(held);
    let mut reopened = case.open().await;
    let left = case.leftovers(&mut reopened, "marker").await;
    assert_eq!(left, [p], "the delivery held across close comes back, once");
    case.close(reopened).await;
    case.harness.cleanup().await;
}

/// `receive` is cancellation safe: futures dropped after one, two or three polls (with the
/// broker given time in between) lose nothing; every message is still received, by the same
/// source, and acked messages do not come back.
pub async fn receive_survives_cancellation<H: Harness>(harness: H) {
    let case = Case::new(harness, "receive_survives_cancellation");
    let mut source = case.open().await;
    let mut published = Vec::new();
    for i in 0..6 {
        published.push(case.publish(&format!("m{i}"), None).await);
    }
    let mut received: Vec<String> = Vec::new();
    let started = Instant::now();
    let mut attempt = 0u32;
    while received.len() < published.len() {
        assert!(
            started.elapsed() < case.features.patience,
            "after cancelled receives, only {received:?} of {published:?} arrived within {:?}: a message was lost",
            case.features.patience
        );
        attempt += 1;
        let polls = 1 + attempt % 3;
        let mut fut = source.receive();
        let mut got = None;
        for i in 0..polls {
            if let std::task::Poll::Ready(r) = poll_once(&mut fut) {
                got = Some(r);
                break;
            }
            if i + 1 < polls {
                // Let the broker's tasks and threads move while the future is pending.
                tokio::time::sleep(Duration::from_millis(u64::from(attempt % 7))).await;
            }
        }
        drop(fut); // cancelled here unless it completed
        match got {
            None => tokio::time::sleep(Duration::from_millis(2)).await,
            Some(Ok(Some(d))) => {
                received.push(payload(&d));
                ack(d).await;
            }
            Some(Ok(None)) => panic!("receive returned Ok(None) (finished) on an open stream"),
            Some(Err(e)) => panic!("receive failed: {e}"),
        }
    }
    let mut sorted = received.clone();
    sorted.sort();
    let mut expected = published.clone();
    expected.sort();
    assert_eq!(
        sorted, expected,
        "each message received exactly once despite {attempt} receive calls"
    );
    let left = case.leftovers(&mut source, "marker-open").await;
    assert!(left.is_empty(), "acked messages came back: {left:?}");
    case.close(source).await;
    let mut reopened = case.open().await;
    let left = case.leftovers(&mut reopened, "marker-reopened").await;
    assert!(
        left.is_empty(),
        "acked messages came back after a reopen: {left:?}"
    );
    case.close(reopened).await;
    case.harness.cleanup().await;
}

/// A `settle` future dropped after one poll may or may not have settled (the contract), but
/// the message is never lost: a dropped `Retry` comes back, a dropped `DeadLetter` comes back
/// or is in the dead-letter target, a dropped `Ack` comes back at most once. The source keeps
/// working afterwards.
pub async fn settle_survives_cancellation<H: Harness>(harness: H) {
    let case = Case::new(harness, "settle_survives_cancellation");
    let mut source = case.open().await;
    let redeliver = source.capabilities().retry == RetryMode::Redeliver;
    let mut settlements = vec![
        ("ack", Settlement::Ack),
        (
            "dead-letter",
            Settlement::DeadLetter(DeadLetter {
                reason: DeadLetterReason::Permanent,
                error: "conformance".into(),
            }),
        ),
    ];
    if redeliver {
        settlements.push((
            "retry",
            Settlement::Retry {
                after: Duration::from_millis(50),
            },
        ));
    } else {
        skipped(case.name, "a cancelled Retry: the source's RetryMode is InPlace");
    }
    let mut published = HashMap::new();
    for (label, s) in &settlements {
        published.insert(case.publish(label, None).await, s.clone());
    }
    for _ in 0..settlements.len() {
        let d = case.expect(&mut source, "a message to settle").await;
        let s = published
            .get(&payload(&d))
            .unwrap_or_else(|| panic!("unexpected message {:?}", payload(&d)))
            .clone();
        let mut fut = d.settle(s);
        let _ = poll_once(&mut fut);
        drop(fut);
    }
    // Retries are delayed: give them time before the marker goes in behind them.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut after = case.leftovers(&mut source, "marker-open").await;
    case.close(source).await;
    let mut reopened = case.open().await;
    after.extend(case.leftovers(&mut reopened, "marker-reopened").await);
    case.close(reopened).await;
    let count = |p: &String| after.iter().filter(|x| *x == p).count();
    for (p, s) in &published {
        match s {
            Settlement::Ack => assert!(
                count(p) <= 1,
                "a cancelled Ack came back {} times: {after:?}",
                count(p)
            ),
            Settlement::Retry { .. } => assert!(
                count(p) >= 1,
                "a cancelled Retry lost the message {p:?} (delivered afterwards: {after:?})"
            ),
            Settlement::DeadLetter(_) if count(p) >= 1 => {}
            Settlement::DeadLetter(_) => match case.harness.dead_letters(1, case.features.patience).await {
                Some(dead) => assert!(
                    dead.iter().any(|m| m.payload() == p.as_bytes()),
                    "a cancelled DeadLetter lost the message {p:?}: neither delivered again nor dead-lettered"
                ),
                None => skipped(
                    case.name,
                    "whether a cancelled DeadLetter reached the target (Harness::dead_letters); it was not delivered again",
                ),
            },
        }
    }
    case.harness.cleanup().await;
}

/// Deliveries in an ordered lane arrive in publish order per key: six messages each of two
/// keys, published interleaved.
pub async fn lanes_keep_publish_order<H: Harness>(harness: H) {
    let case = Case::new(harness, "lanes_keep_publish_order");
    let mut source = case.open().await;
    let keys = ["k1", "k2"];
    let mut order: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for i in 0..6 {
        for key in keys {
            let p = case.publish(&format!("{key}-{i}"), Some(key)).await;
            order.entry(key).or_default().push(p);
        }
    }
    let mut seen: BTreeMap<&str, Vec<(String, Lane)>> = BTreeMap::new();
    for _ in 0..12 {
        let d = case.expect(&mut source, "one of the twelve keyed messages").await;
        let p = payload(&d);
        let key = keys
            .into_iter()
            .find(|k| p.contains(&format!("/{k}-")))
            .unwrap_or_else(|| panic!("unexpected message {p:?}"));
        seen.entry(key).or_default().push((p, d.lane()));
        ack(d).await;
    }
    let mut checked = false;
    for key in keys {
        let got = &seen[key];
        let lanes: Vec<&Lane> = got.iter().map(|(_, l)| l).collect();
        if !lanes
            .iter()
            .all(|l| matches!(l, Lane::Ordered(_)) && *l == lanes[0])
        {
            continue; // no ordering promised for this key
        }
        checked = true;
        let payloads: Vec<&String> = got.iter().map(|(p, _)| p).collect();
        let expected: Vec<&String> = order[key].iter().collect();
        assert_eq!(
            payloads, expected,
            "key {key} in lane {:?}: not in publish order",
            lanes[0]
        );
    }
    if !checked {
        skipped(case.name, "the source put no key's messages in one ordered lane");
    }
    case.close(source).await;
    case.harness.cleanup().await;
}
