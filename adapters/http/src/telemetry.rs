//! Metrics (through the `metrics` facade) and the span field of the idempotency layer.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `txinbox_http_requests_total` | counter | `route`, `outcome` ([`Outcome::as_str`]) |
//! | `txinbox_http_claim_duration_seconds` | histogram | `route`: BEGIN + claim, including the wait for a concurrent request with the same key |
//! | `txinbox_http_stored_bytes_total` | counter | `route`: response body bytes stored |
//! | `txinbox_http_in_flight` | gauge | `route`: keyed requests between BEGIN and their answer (claiming, waiting for a concurrent duplicate, running, storing) |
//!
//! 409s are `outcome="in_flight"`, replays `outcome="replayed"`, conflicts `outcome="key_reused"`;
//! the wait for a concurrent duplicate is part of the claim duration. Descriptions are
//! registered when an [`IdempotencyLayer`](crate::IdempotencyLayer) is built; the library never
//! installs a recorder.
//!
//! Each request runs in a `txinbox.http.idempotency` span with `http.route`,
//! `http.request.method` and `txinbox.http.outcome`.

use std::time::Duration;

/// Counter: requests through the layer, by `route` and `outcome`.
pub const REQUESTS: &str = "txinbox_http_requests_total";
/// Histogram: BEGIN + claim in seconds, including the wait for a concurrent duplicate.
pub const CLAIM_DURATION: &str = "txinbox_http_claim_duration_seconds";
/// Counter: response body bytes stored.
pub const STORED_BYTES: &str = "txinbox_http_stored_bytes_total";
/// Gauge: keyed requests between BEGIN and their answer.
pub const IN_FLIGHT: &str = "txinbox_http_in_flight";

pub(crate) fn describe() {
    metrics::describe_counter!(
        REQUESTS,
        "requests through the idempotency layer, by route and outcome"
    );
    metrics::describe_histogram!(
        CLAIM_DURATION,
        metrics::Unit::Seconds,
        "BEGIN and key claim, including the wait for a concurrent request with the same key"
    );
    metrics::describe_counter!(
        STORED_BYTES,
        metrics::Unit::Bytes,
        "response body bytes stored with their key"
    );
    metrics::describe_gauge!(IN_FLIGHT, "keyed requests between BEGIN and their answer");
}

/// Counts a keyed request in [`IN_FLIGHT`] until dropped.
pub(crate) struct InFlight(metrics::Gauge);

impl InFlight {
    pub(crate) fn enter(route: &str) -> Self {
        let g = metrics::gauge!(IN_FLIGHT, "route" => route.to_owned());
        g.increment(1.0);
        InFlight(g)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// How a request through the layer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran; its effects and response committed.
    Executed,
    /// A stored response was replayed.
    Replayed,
    /// 422: the key was used with another request.
    KeyReused,
    /// 409: a concurrent request with the key held it longer than the lock wait.
    InFlight,
    /// 400: no key on a route that requires one.
    MissingKey,
    /// 400: a malformed key.
    InvalidKey,
    /// 401: no principal.
    NoPrincipal,
    /// 413: the request body is over the limit.
    TooLarge,
    /// 400: the request body could not be read.
    Unreadable,
    /// 503: the database is unavailable.
    Unavailable,
    /// 503: the COMMIT failed; its outcome is unknown.
    CommitUnknown,
    /// 500: a database error that is not an outage.
    StoreFailed,
    /// The handler answered 5xx (or its service failed): rolled back.
    HandlerFailed,
    /// The handler panicked: rolled back.
    Panicked,
    /// 500: the response could not be stored: rolled back.
    NotStored,
    /// An optional route called without a key.
    NoKey,
}

impl Outcome {
    /// The `outcome` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::KeyReused => "key_reused",
            Outcome::InFlight => "in_flight",
            Outcome::MissingKey => "missing_key",
            Outcome::InvalidKey => "invalid_key",
            Outcome::NoPrincipal => "no_principal",
            Outcome::TooLarge => "too_large",
            Outcome::Unreadable => "unreadable",
            Outcome::Unavailable => "unavailable",
            Outcome::CommitUnknown => "commit_unknown",
            Outcome::StoreFailed => "store_failed",
            Outcome::HandlerFailed => "handler_failed",
            Outcome::Panicked => "panicked",
            Outcome::NotStored => "not_stored",
            Outcome::NoKey => "no_key",
        }
    }
}

pub(crate) fn record(route: &str, outcome: Outcome) {
    tracing::Span::current().record("txinbox.http.outcome", outcome.as_str());
    metrics::counter!(REQUESTS, "route" => route.to_owned(), "outcome" => outcome.as_str()).increment(1);
}

pub(crate) fn claim_duration(route: &str, d: Duration) {
    metrics::histogram!(CLAIM_DURATION, "route" => route.to_owned()).record(d.as_secs_f64());
}

pub(crate) fn stored_bytes(route: &str, n: usize) {
    metrics::counter!(STORED_BYTES, "route" => route.to_owned()).increment(n as u64);
}
