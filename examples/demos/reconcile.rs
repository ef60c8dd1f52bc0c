//! Reconciliation: what was published against what the ledger's database holds.
//!
//! [`Expected`] is built by whoever published the events; [`observe`] reads the database;
//! [`Reconciliation::compare`] says what was lost, doubled or wrong. Kept apart from the
//! brokers so that its verdicts can be tested on rows made by hand.

use std::collections::{BTreeMap, BTreeSet};

use txinbox::sqlx::{self, PgPool};

use crate::payments::Payment;

/// What was published.
#[derive(Debug, Clone, Default)]
pub struct Expected {
    /// Every unique valid event: event ID → payment.
    pub events: BTreeMap<String, Payment>,
    /// IDs of the events whose payload is not a payment; each must be dead-lettered.
    pub malformed: BTreeSet<String>,
    /// Messages published, counting every copy.
    pub messages: u64,
}

impl Expected {
    /// Expected balance per account.
    pub fn balances(&self) -> BTreeMap<String, i64> {
        let mut balances = BTreeMap::new();
        for p in self.events.values() {
            *balances.entry(p.account.clone()).or_insert(0) += p.amount_cents;
        }
        balances
    }

    /// Sum of the unique events' amounts.
    pub fn total(&self) -> i64 {
        self.events.values().map(|p| p.amount_cents).sum()
    }

    /// Published copies beyond the first of each event (valid or malformed).
    pub fn duplicate_copies(&self) -> u64 {
        self.messages
            .saturating_sub((self.events.len() + self.malformed.len()) as u64)
    }
}

/// One row of `ledger_entries`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The message ID the entry was applied for.
    pub event_id: String,
    /// The account booked.
    pub account: String,
    /// The amount booked.
    pub amount_cents: i64,
}

/// What the ledger's database holds.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// Every row of `ledger_entries`.
    pub entries: Vec<Entry>,
    /// `accounts`: account → balance.
    pub balances: BTreeMap<String, i64>,
    /// Message IDs with a dead letter recorded in `txinbox.dead_letters`.
    pub dead_lettered: BTreeSet<String>,
}

/// Reads `ledger_entries`, `accounts` and the dead-lettered message IDs.
pub async fn observe(pool: &PgPool) -> Result<Observed, sqlx::Error> {
    let entries: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT event_id, account, amount_cents FROM ledger_entries ORDER BY id")
            .fetch_all(pool)
            .await?;
    let balances: Vec<(String, i64)> = sqlx::query_as("SELECT account, balance_cents FROM accounts")
        .fetch_all(pool)
        .await?;
    let dead_lettered: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT message_id FROM txinbox.dead_letters WHERE message_id IS NOT NULL",
    )
    .fetch_all(pool)
    .await?;
    Ok(Observed {
        entries: entries
            .into_iter()
            .map(|(event_id, account, amount_cents)| Entry {
                event_id,
                account,
                amount_cents,
            })
            .collect(),
        balances: balances.into_iter().collect(),
        dead_lettered: dead_lettered.into_iter().collect(),
    })
}

/// The verdict. Clean when every list is empty and the totals agree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reconciliation {
    /// Unique valid events published.
    pub unique: u64,
    /// Events published but never applied.
    pub lost: Vec<String>,
    /// Events applied more than once: ID → number of entries.
    pub doubled: BTreeMap<String, u64>,
    /// Entries that match no published event, or book another account or amount than it.
    pub unexpected: Vec<Entry>,
    /// Accounts whose balance differs from the sum of their unique events: (account,
    /// expected, actual).
    pub wrong_balances: Vec<(String, i64, i64)>,
    /// Sum of the unique events' amounts.
    pub expected_total: i64,
    /// Sum of all balances.
    pub actual_total: i64,
    /// Malformed events without a recorded dead letter.
    pub malformed_not_dead_lettered: Vec<String>,
}

impl Reconciliation {
    /// Compares what was published with what the database holds.
    pub fn compare(expected: &Expected, observed: &Observed) -> Reconciliation {
        let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
        let mut unexpected = Vec::new();
        for entry in &observed.entries {
            match expected.events.get(&entry.event_id) {
                Some(p) if p.account == entry.account && p.amount_cents == entry.amount_cents => {
                    *counts.entry(&entry.event_id).or_insert(0) += 1;
                }
                _ => unexpected.push(entry.clone()),
            }
        }
        let lost = expected
            .events
            .keys()
            .filter(|id| !counts.contains_key(id.as_str()))
            .cloned()
            .collect();
        let doubled = counts
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(id, n)| (id.to_string(), *n))
            .collect();
        let expected_balances = expected.balances();
        let accounts: BTreeSet<&String> = expected_balances.keys().chain(observed.balances.keys()).collect();
        let wrong_balances = accounts
            .into_iter()
            .filter_map(|account| {
                let want = expected_balances.get(account).copied().unwrap_or(0);
                let have = observed.balances.get(account).copied().unwrap_or(0);
                (want != have).then(|| (account.clone(), want, have))
            })
            .collect();
        let malformed_not_dead_lettered = expected
            .malformed
            .iter()
            .filter(|id| !observed.dead_lettered.contains(*id))
            .cloned()
            .collect();
        Reconciliation {
            unique: expected.events.len() as u64,
            lost,
            doubled,
            unexpected,
            wrong_balances,
            expected_total: expected.total(),
            actual_total: observed.balances.values().sum(),
            malformed_not_dead_lettered,
        }
    }

    /// Entries beyond the first of each event.
    pub fn doubled_count(&self) -> u64 {
        self.doubled.values().map(|n| n - 1).sum()
    }

    /// Whether nothing was lost, doubled or wrong.
    pub fn is_clean(&self) -> bool {
        self.lost.is_empty()
            && self.doubled.is_empty()
            && self.unexpected.is_empty()
            && self.wrong_balances.is_empty()
            && self.expected_total == self.actual_total
            && self.malformed_not_dead_lettered.is_empty()
    }

    /// The problems, one per line, at most `limit` examples of each kind.
    pub fn problems(&self, limit: usize) -> Vec<String> {
        let mut out = Vec::new();
        let some = |v: Vec<String>| {
            let more = v.len().saturating_sub(limit);
            let mut s = v.into_iter().take(limit).collect::<Vec<_>>().join(", ");
            if more > 0 {
                s.push_str(&format!(" and {more} more"));
            }
            s
        };
        if !self.lost.is_empty() {
            out.push(format!("lost {}: {}", self.lost.len(), some(self.lost.clone())));
        }
        if !self.doubled.is_empty() {
            let v = self.doubled.iter().map(|(id, n)| format!("{id} ×{n}")).collect();
            out.push(format!("doubled {}: {}", self.doubled_count(), some(v)));
        }
        if !self.unexpected.is_empty() {
            let v = self.unexpected.iter().map(|e| format!("{e:?}")).collect();
            out.push(format!(
                "unexpected entries {}: {}",
                self.unexpected.len(),
                some(v)
            ));
        }
        if !self.wrong_balances.is_empty() {
            let v = self
                .wrong_balances
                .iter()
                .map(|(a, want, have)| format!("{a}: expected {want}, found {have}"))
                .collect();
            out.push(format!(
                "wrong balances {}: {}",
                self.wrong_balances.len(),
                some(v)
            ));
        }
        if self.expected_total != self.actual_total {
            out.push(format!(
                "sum of balances {} ≠ sum of the unique events' amounts {}",
                self.actual_total, self.expected_total
            ));
        }
        if !self.malformed_not_dead_lettered.is_empty() {
            out.push(format!(
                "malformed events without a dead letter {}: {}",
                self.malformed_not_dead_lettered.len(),
                some(self.malformed_not_dead_lettered.clone())
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payment(account: &str, amount_cents: i64) -> Payment {
        Payment {
            account: account.into(),
            amount_cents,
        }
    }

    fn entry(id: &str, account: &str, amount_cents: i64) -> Entry {
        Entry {
            event_id: id.into(),
            account: account.into(),
            amount_cents,
        }
    }

    fn expected() -> Expected {
        Expected {
            events: [
                ("e1", payment("a", 100)),
                ("e2", payment("a", -30)),
                ("e3", payment("b", 5)),
            ]
            .into_iter()
            .map(|(id, p)| (id.to_string(), p))
            .collect(),
            malformed: ["bad1".to_string()].into(),
            messages: 6,
        }
    }

    fn clean() -> Observed {
        Observed {
            entries: vec![entry("e1", "a", 100), entry("e2", "a", -30), entry("e3", "b", 5)],
            balances: [("a".to_string(), 70), ("b".to_string(), 5)].into(),
            dead_lettered: ["bad1".to_string()].into(),
        }
    }

    #[test]
    fn exactly_once_is_clean() {
        let r = Reconciliation::compare(&expected(), &clean());
        assert!(r.is_clean(), "{:?}", r.problems(5));
        assert_eq!((r.unique, r.expected_total, r.actual_total), (3, 75, 75));
        assert_eq!(expected().duplicate_copies(), 2);
    }

    #[test]
    fn a_doubled_entry_is_caught_even_when_the_balance_was_not_touched() {
        let mut observed = clean();
        observed.entries.push(entry("e3", "b", 5));
        let r = Reconciliation::compare(&expected(), &observed);
        assert!(!r.is_clean());
        assert_eq!(r.doubled_count(), 1);
        assert_eq!(r.doubled.get("e3"), Some(&2));
        assert!(r.lost.is_empty());
    }

    #[test]
    fn a_doubled_effect_is_caught_in_balances_and_entries() {
        let mut observed = clean();
        observed.entries.push(entry("e1", "a", 100));
        *observed.balances.get_mut("a").unwrap() += 100;
        let r = Reconciliation::compare(&expected(), &observed);
        assert_eq!(r.doubled_count(), 1);
        assert_eq!(r.wrong_balances, vec![("a".to_string(), 70, 170)]);
        assert_eq!(r.actual_total, 175);
        assert!(r.problems(5).iter().any(|p| p.contains("sum of balances 175")));
    }

    #[test]
    fn a_lost_event_is_caught() {
        let mut observed = clean();
        observed.entries.retain(|e| e.event_id != "e2");
        *observed.balances.get_mut("a").unwrap() += 30;
        let r = Reconciliation::compare(&expected(), &observed);
        assert_eq!(r.lost, vec!["e2".to_string()]);
        assert!(!r.is_clean());
    }

    #[test]
    fn wrong_amounts_unknown_events_and_missing_dead_letters_are_caught() {
        let mut observed = clean();
        observed.entries[0].amount_cents = 99;
        observed.entries.push(entry("nobody-sent-this", "c", 1));
        observed.dead_lettered.clear();
        let r = Reconciliation::compare(&expected(), &observed);
        assert_eq!(r.unexpected.len(), 2);
        assert_eq!(r.lost, vec!["e1".to_string()]);
        assert_eq!(r.malformed_not_dead_lettered, vec!["bad1".to_string()]);
        assert!(!r.is_clean());
    }
}
