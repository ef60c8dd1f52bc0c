//! The events a chaos run publishes: unique payments, duplicate copies (racing and late), a few
//! malformed payloads; split in two waves.

use txinbox_demos::payments::Payment;
use txinbox_demos::reconcile::Expected;

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The event ID (`ce_id` header on Kafka, `message_id` property on AMQP).
    pub id: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// Which copy of the event this is (0 for the first).
    pub copy: u32,
    /// The Kafka record key: the payment's account (the ledger under key ordering keeps each
    /// account's payments of a partition in order, and they batch), the ID for a malformed one.
    pub key: String,
}

/// Everything a chaos run publishes, and what the database must end up holding.
#[derive(Debug)]
pub struct Plan {
    /// Published before the first run.
    pub first_wave: Vec<Outgoing>,
    /// Published once the crash-point matrix is through: later events, plus late copies of
    /// events of the first wave (already applied by then: a producer's retry, say).
    pub second_wave: Vec<Outgoing>,
    /// Unique events and malformed IDs; `messages` counts every copy of both waves.
    pub expected: Expected,
}

/// Builds a plan of `events` unique payments over `accounts` accounts, `duplicate_percent`
/// of them published twice (half right behind the first copy, so the two race; half late),
/// and `malformed` payloads that are not payments (the first of them published twice).
pub fn plan(
    tag: &str,
    events: usize,
    duplicate_percent: u32,
    malformed: usize,
    rng: &mut fastrand::Rng,
) -> Plan {
    let accounts = (events / 50).clamp(1, 40);
    let first_len = events * 3 / 5;
    let mut expected = Expected::default();
    let mut waves = [Vec::new(), Vec::new()];
    let mut late = Vec::new();
    for i in 0..events {
        let id = format!("pay-{tag}-{i}");
        let payment = Payment {
            account: format!("acct-{}", rng.usize(0..accounts)),
            amount_cents: match rng.i64(-5_000..20_000) {
                0 => 1,
                a => a,
            },
        };
        let payload = serde_json::to_vec(&payment).expect("a payment serialises");
        let payment_account = payment.account.clone();
        expected.events.insert(id.clone(), payment);
        let wave = usize::from(i >= first_len);
        let first = Outgoing {
            id: id.clone(),
            payload,
            copy: 0,
            key: payment_account,
        };
        if rng.u32(0..100) < duplicate_percent {
            let second = Outgoing {
                copy: 1,
                ..first.clone()
            };
            if rng.bool() {
                waves[wave].push(first);
                waves[wave].push(second); // racing: right behind the first copy
            } else {
                waves[wave].push(first);
                late.push(second);
            }
        } else {
            waves[wave].push(first);
        }
    }
    for i in 0..malformed {
        let id = format!("bad-{tag}-{i}");
        expected.malformed.insert(id.clone());
        let payload = match i % 3 {
            0 => b"{not json".to_vec(),
            1 => br#"{"account": "acct-0"}"#.to_vec(),
            _ => br#"{"account": "", "amount_cents": 5}"#.to_vec(),
        };
        let wave = usize::from(i % 2 == 1);
        let copies = if i == 0 { 2 } else { 1 };
        for copy in 0..copies {
            let at = rng.usize(0..=waves[wave].len());
            waves[wave].insert(
                at,
                Outgoing {
                    id: id.clone(),
                    payload: payload.clone(),
                    copy,
                    key: id.clone(),
                },
            );
        }
    }
    // Late copies of the first wave's events come with the second wave, scattered through it.
    let [first_wave, mut second_wave] = waves;
    for copy in late {
        let at = rng.usize(0..=second_wave.len());
        second_wave.insert(at, copy);
    }
    expected.messages = (first_wave.len() + second_wave.len()) as u64;
    Plan {
        first_wave,
        second_wave,
        expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_counts_every_copy_and_keeps_ids_unique_per_event() {
        let mut rng = fastrand::Rng::with_seed(7);
        let p = plan("t", 1000, 20, 3, &mut rng);
        let all: Vec<&Outgoing> = p.first_wave.iter().chain(&p.second_wave).collect();
        assert_eq!(all.len() as u64, p.expected.messages);
        assert_eq!(p.expected.events.len(), 1000);
        assert_eq!(p.expected.malformed.len(), 3);
        let copies = all.iter().filter(|o| o.copy > 0).count() as u64;
        assert_eq!(copies, p.expected.duplicate_copies());
        assert!((150..250).contains(&copies), "about 20% duplicates, got {copies}");
        // Every copy of an event carries the same payload.
        for o in &all {
            if let Some(payment) = p.expected.events.get(&o.id) {
                assert_eq!(serde_json::from_slice::<Payment>(&o.payload).unwrap(), *payment);
            }
        }
    }
}
