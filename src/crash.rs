//! Named crash points: a test build aborts the process at a chosen point, so a crash-matrix test
//! can kill the consumer exactly where a crash is most dangerous.
//!
//! With the feature `crash-points` off (the default) [`hit`] is an empty inline function.
//! With it on, set `TXINBOX_CRASH_AT=<point>` or `TXINBOX_CRASH_AT=<point>:<n>`: the `n`-th
//! time (default the first) the process reaches `<point>`, it calls
//! [`std::process::abort`] — no unwinding, no destructors, no flush, no ack: for the database
//! and the broker it is the same as `SIGKILL`. Unknown names in the variable are refused at the
//! first [`hit`] with a panic, so a typo cannot make a crash test pass by never crashing.
//!
//! The points, in the order a message meets them:
//!
//! | point | where |
//! |---|---|
//! | [`AFTER_CLAIM`] | the inbox row is inserted, the transaction is open, the handler has not run |
//! | [`AFTER_HANDLER`] | the handler returned `Ok`, COMMIT not yet sent |
//! | [`BATCH_OPEN`] | a micro-batch transaction holds several claimed messages, not committed |
//! | [`AFTER_COMMIT`] | COMMIT succeeded, the broker is not yet acked / the offset not stored |
//! | [`REBALANCE`] | a Kafka partition revoke is in progress (adapter `txinbox-kafka`) |
//! | [`RELAY_PUBLISHED`] | the outbox relay's broker confirmed a batch; the rows are not yet marked published |

// Without feature `crash-points` this module is private and only `hit` (an empty inline
// function) is used; the names exist for the armed build.
#![cfg_attr(not(feature = "crash-points"), allow(dead_code, unreachable_pub))]

/// The inbox row is inserted and the transaction open; the handler has not run.
pub const AFTER_CLAIM: &str = "after_claim";
/// The handler returned `Ok`; COMMIT has not been sent.
pub const AFTER_HANDLER: &str = "after_handler";
/// A micro-batch transaction holds claimed messages and is not committed.
pub const BATCH_OPEN: &str = "batch_open";
/// COMMIT succeeded; the delivery is not yet settled with the broker.
pub const AFTER_COMMIT: &str = "after_commit";
/// A partition revoke is in progress (Kafka adapter).
pub const REBALANCE: &str = "rebalance";
/// The outbox relay published a batch and the broker confirmed it; the rows are not yet marked.
pub const RELAY_PUBLISHED: &str = "relay_published";

/// Every named point, for tools that iterate the matrix.
pub const POINTS: [&str; 6] = [
    AFTER_CLAIM,
    AFTER_HANDLER,
    BATCH_OPEN,
    AFTER_COMMIT,
    REBALANCE,
    RELAY_PUBLISHED,
];

/// The environment variable read by builds with feature `crash-points`.
pub const ENV: &str = "TXINBOX_CRASH_AT";

/// Marks a crash point. Aborts the process if this build has feature `crash-points` and
/// [`ENV`] names this point (and its count is reached); otherwise does nothing.
#[inline(always)]
pub fn hit(point: &'static str) {
    #[cfg(feature = "crash-points")]
    armed::hit(point);
    #[cfg(not(feature = "crash-points"))]
    let _ = point;
}

#[cfg(feature = "crash-points")]
mod armed {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    struct Target {
        point: String,
        nth: u64,
        seen: AtomicU64,
    }

    fn target() -> Option<&'static Target> {
        static TARGET: OnceLock<Option<Target>> = OnceLock::new();
        TARGET
            .get_or_init(|| {
                let value = std::env::var(super::ENV).ok().filter(|v| !v.is_empty())?;
                let (point, nth) = match value.split_once(':') {
                    Some((p, n)) => (
                        p,
                        n.parse()
                            .unwrap_or_else(|_| panic!("{}={value}: bad count", super::ENV)),
                    ),
                    None => (value.as_str(), 1),
                };
                assert!(
                    super::POINTS.contains(&point),
                    "{}={value}: unknown crash point; known: {:?}",
                    super::ENV,
                    super::POINTS
                );
                Some(Target {
                    point: point.to_owned(),
                    nth,
                    seen: AtomicU64::new(0),
                })
            })
            .as_ref()
    }

    pub(super) fn hit(point: &'static str) {
        if let Some(t) = target() {
            if t.point == point && t.seen.fetch_add(1, Ordering::SeqCst) + 1 == t.nth {
                eprintln!(
                    "txinbox: crash point {point} reached, aborting ({}={}:{})",
                    super::ENV,
                    t.point,
                    t.nth
                );
                std::process::abort();
            }
        }
    }
}
