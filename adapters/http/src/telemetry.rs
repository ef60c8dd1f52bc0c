//! Metrics (through the `metrics` facade) and the span field of the idempotency layer.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `txinbox_http_requests_total` | counter | `route`, `outcome` ([`Outcome::as_str`]) |
//! | `txinbox_http_claim_duration_seconds` | histogram | `route`: BEGIN + claim, including the wait for a concurrent request with the same key |
//! | `txinbox_http_stored_bytes_total` | counter | `route`: response body bytes stored |
//!
//! Each request runs in a `txinbox.http.idempotency` span with `http.route`,
//! `http.request.method` and `txinbox.http.outcome`.

use std::time::Duration;

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
    metrics::counter!("txinbox_http_requests_total", "route" => route.to_owned(), "outcome" => outcome.as_str())
        .increment(1);
}

pub(crate) fn claim_duration(route: &str, d: Duration) {
    metrics::histogram!("txinbox_http_claim_duration_seconds", "route" => route.to_owned())
        .record(d.as_secs_f64());
}

pub(crate) fn stored_bytes(route: &str, n: usize) {
    metrics::counter!("txinbox_http_stored_bytes_total", "route" => route.to_owned()).increment(n as u64);
}
