//! **txinbox-http: a request with an `Idempotency-Key` has its effects at most once and its
//! response replayed on every retry, because the key's claim, the handler's effects (and
//! outbox rows) and the stored response commit in one database transaction or not at all.**
//!
//! ```no_run
//! use axum::{routing::post, Json, Router};
//! use txinbox_http::{IdempotencyLayer, IdempotentTx};
//!
//! async fn pay(mut tx: IdempotentTx, Json(amount): Json<i64>) -> (http::StatusCode, String) {
//!     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = 'a'")
//!         .bind(amount)
//!         .execute(&mut *tx)
//!         .await
//!         .unwrap();
//!     (http::StatusCode::CREATED, "paid".into())
//! }
//!
//! # async fn doc(pool: sqlx::PgPool) {
//! txinbox::postgres::migrate(&pool).await.unwrap();
//! let idempotent = IdempotencyLayer::new(pool)
//!     .principal(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned));
//! let app: Router = Router::new().route("/payments", post(pay).layer(idempotent));
//! # }
//! ```
//!
//! [`IdempotencyLayer`] is a tower `Layer` for axum routes. For each request with a key it
//! validates the key, reads the body (bounded), fingerprints the request, opens a transaction,
//! claims `(principal, route, key)` with one `INSERT … ON CONFLICT` (the decision), runs the
//! handler, which gets that transaction through the [`IdempotentTx`] extractor, stores the
//! response in the claimed row and commits. A retry finds the committed row and gets the
//! stored response back with `Idempotent-Replayed: true`.
//!
//! # What happens
//!
//! | request | database | response |
//! |---|---|---|
//! | new key, handler answers 2xx/4xx | claim, effects and response committed together | the handler's response |
//! | same key, same request, after commit | nothing written | the stored status, stored headers and body, `Idempotent-Replayed: true` |
//! | same key, another request (method, path, query or body; another resource of the route, such as `/pay/a2` after `/pay/a1`) | nothing written | 422 `idempotency-key-reused` |
//! | same key while the first is running | waits up to [`lock_wait`](IdempotencyLayer::lock_wait) on the key's row, then decides as above | or 409 `idempotency-key-in-flight` + `Retry-After` |
//! | handler answers 5xx, errors or panics | rolled back: the key is not used up | the 5xx (a panic: 500 `handler-panicked`) |
//! | a statement on [`IdempotentTx`] failed and the handler answered anyway | rolled back on both stores: the key is not used up | 500 `response-not-stored` |
//! | same key in another scope (principal or route) | a separate record | runs again: another request |
//! | no key, route [`required`](IdempotencyLayer::required) (default) | nothing | 400 `idempotency-key-missing` |
//! | no key, route [`optional`](IdempotencyLayer::optional) | handler in a plain transaction, no record | the handler's response |
//! | malformed, empty, over 255 characters, repeated header | nothing | 400 `idempotency-key-invalid` |
//! | request body over [`max_request_bytes`](IdempotencyLayer::max_request_bytes) | nothing | 413 `request-too-large` |
//! | response body over [`max_response_bytes`](IdempotencyLayer::max_response_bytes) | rolled back, or stored without body ([`OversizedResponse`]) | 500 `response-not-stored`, or the full response |
//! | database unreachable | nothing | 503 `store-unavailable` + `Retry-After` |
//! | COMMIT outcome unknown (connection lost) | committed or not | 503 `store-unavailable` + `Retry-After`; the retry replays or runs afresh |
//! | COMMIT refused (a deferred constraint) | rolled back | 500 `response-not-stored`; the key is not used up |
//! | process killed anywhere before COMMIT | PostgreSQL rolls the transaction back | none; the retry runs afresh |
//! | record older than [`ttl`](IdempotencyLayer::ttl) (24 h) | the key is claimed afresh; [`purge_expired`] (once) or a [`janitor`] (beside the service) deletes old records | as for a new key |
//!
//! All the layer's own errors are RFC 9457 problem details (`application/problem+json`, with
//! a `code` member; see [`Problem`]).
//!
//! # Key and scope
//!
//! `Idempotency-Key: "abc"` (the IETF draft's Structured Field String) and `Idempotency-Key:
//! abc` (bare, as Stripe clients send it) are the same key. A key is scoped by the caller's
//! principal (from [`IdempotencyLayer::principal`], by default the [`Principal`] request
//! extension) and the matched route (the template, `/pay/{account}`): two tenants, or two
//! routes, never see each other's responses. Within a route, the concrete path is part of the
//! fingerprint: one key sent to `/pay/a1` and then to `/pay/a2` is 422 for the second, never a
//! replay of the first. The scope is the template rather than the path so that two spellings
//! of one resource meet in one record (a replay, or 422), where two records would each run.
//!
//! # Fingerprint
//!
//! See [`fingerprint()`]: SHA-256 of method, matched route, normalised concrete path,
//! canonical query and body bytes.
//!
//! # The transaction
//!
//! The handler must do its database effects on [`IdempotentTx`] and nothing irreversible
//! outside it: a call to a payment provider belongs in an outbox row
//! (`txinbox::outbox::write(&mut *tx, &message)`, with an ID from
//! [`IdempotencyContext::derive_id`]), published after COMMIT by `txinbox::outbox::Relay`.
//! Because the response is stored only when COMMIT succeeds and there is no "in progress"
//! record, a crash never leaves a key stuck.
//!
//! On PostgreSQL the lock wait is `SET LOCAL lock_timeout` for the whole transaction, so it also
//! bounds the handler's own lock waits. The embedded SQLite store works too
//! (`IdempotencyLayer::<sqlx::Sqlite>::new(pool)`, `IdempotentTx<sqlx::Sqlite>`); see
//! [`Backend`] for the differences.
//!
//! # Tracing
//!
//! Each request runs in a `txinbox.http.idempotency` span. With feature `otel`, when no span
//! of the application carries a trace yet (no HTTP tracing of its own), that span continues the
//! request's `traceparent` (through the application's OpenTelemetry propagator), so the handler
//! and the outbox rows it writes join the caller's trace (see `txinbox::otel`).

#![cfg_attr(docsrs, feature(doc_cfg))]
// Library crates only: a `pub` item must be reachable from the crate root, so the public API
// is what the root and its public modules show (tests, tools and binaries have none).
#![warn(unreachable_pub)]

mod extract;
mod fingerprint;
mod key;
mod layer;
mod problem;
mod service;
mod store;
pub mod telemetry;

pub use extract::{IdempotencyContext, IdempotentTx, TxRejection};
pub use fingerprint::{canonical_query, fingerprint};
pub use key::{IdempotencyKey, KeyError, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, MAX_KEY_LEN};
pub use layer::{
    IdempotencyLayer, OversizedResponse, Principal, DEFAULT_LOCK_WAIT, DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_RETRY_AFTER, DEFAULT_TTL,
};
pub use problem::{Problem, PROBLEM_TYPE_PREFIX};
pub use service::{Idempotency, IDEMPOTENT_REPLAYED_BODY};
pub use store::{janitor, purge_expired, Backend, IdempotencySweep};
