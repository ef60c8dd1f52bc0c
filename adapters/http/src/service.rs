//! [`Idempotency`]: the tower `Service` the layer wraps a route in.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{MatchedPath, OriginalUri};
use bytes::{Bytes, BytesMut};
use futures::{FutureExt, StreamExt};
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower::Service;
use tracing::Instrument;
use txinbox::{sqlx, StatementFailed, TrackedTransaction};

use crate::extract::{IdempotencyContext, TxSlot};
use crate::fingerprint::{self, fingerprint};
use crate::key::{IdempotencyKey, IDEMPOTENT_REPLAYED};
use crate::layer::{Config, OversizedResponse};
use crate::problem::Problem;
use crate::store::{self, Backend, Claimed, Failure, Scope};
use crate::telemetry::{self, Outcome};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The header set on a replay whose body was not stored ([`OversizedResponse::StoreHeadersOnly`]).
pub const IDEMPOTENT_REPLAYED_BODY: &str = "idempotent-replayed-body";

/// The middleware built by [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct Idempotency<S, DB: Backend = sqlx::Postgres> {
    pub(crate) inner: S,
    pub(crate) config: Arc<Config<DB>>,
}

impl<S: Clone, DB: Backend> Clone for Idempotency<S, DB> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S, DB: Backend> fmt::Debug for Idempotency<S, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency").finish_non_exhaustive()
    }
}

impl<S, ResBody, DB: Backend> Service<Request<Body>> for Idempotency<S, DB>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The ready service handles this request; the clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        // The concrete path as the client sent it: a nested router sees its part only.
        let path = req
            .extensions()
            .get::<OriginalUri>()
            .map_or_else(|| req.uri().path(), |u| u.path())
            .to_owned();
        // The scope's route: the template, so one key on two resources of a route meets the
        // fingerprint (422), never two records that each run; outside a router, the path.
        let route = req
            .extensions()
            .get::<MatchedPath>()
            .map(|m| m.as_str().to_owned())
            .unwrap_or_else(|| fingerprint::normalize(&path).into_owned());
        let span = tracing::info_span!(
            "txinbox.http.idempotency",
            http.route = %route,
            http.request.method = %req.method(),
            txinbox.http.outcome = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        continue_callers_trace(&span, req.headers());
        Box::pin(
            async move {
                let (outcome, res) = run(&config, inner, req, route.clone(), path).await;
                telemetry::record(&route, outcome);
                res
            }
            .instrument(span),
        )
    }
}

/// Makes `span` a child of the caller's span (`traceparent`, read by the application's global
/// propagator) unless the application's own HTTP tracing already put the request in a trace:
/// its spans are never re-parented.
#[cfg(feature = "otel")]
fn continue_callers_trace(span: &tracing::Span, headers: &http::HeaderMap) {
    use opentelemetry::propagation::Extractor;
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct Carrier<'a>(&'a http::HeaderMap);
    impl Extractor for Carrier<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }

    if tracing::Span::current()
        .context()
        .span()
        .span_context()
        .is_valid()
    {
        return;
    }
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Carrier(headers)));
    if cx.span().span_context().is_valid() {
        // NOTE: fails only without a `tracing_opentelemetry` layer or for a disabled span.
        let _ = span.set_parent(cx);
    }
}

type Answer<E> = (Outcome, Result<Response<Body>, E>);

fn problem<E, DB: Backend>(
    outcome: Outcome,
    p: Problem,
    detail: impl Into<String>,
    c: &Config<DB>,
) -> Answer<E> {
    (outcome, Ok(p.response(detail, c.retry_after)))
}

/// A database error before the handler ran.
fn db_problem<E, DB: Backend>(e: &sqlx::Error, c: &Config<DB>) -> Answer<E> {
    match DB::classify(e) {
        Failure::LockWait => problem(
            Outcome::InFlight,
            Problem::InFlight,
            "another request with this Idempotency-Key is still being processed, or the database reported a deadlock or serialization failure; retry later with the same key",
            c,
        ),
        Failure::Unavailable => {
            tracing::warn!(error = %e, "idempotency store unavailable");
            problem(
                Outcome::Unavailable,
                Problem::Unavailable,
                "the database is unavailable; nothing was stored; retry later with the same key",
                c,
            )
        }
        Failure::Aborted | Failure::Fatal => {
            tracing::error!(error = %e, "idempotency store failed");
            problem(
                Outcome::StoreFailed,
                Problem::StoreFailed,
                "the idempotency store failed; nothing was stored",
                c,
            )
        }
    }
}

async fn run<S, ResBody, DB: Backend>(
    c: &Config<DB>,
    inner: S,
    req: Request<Body>,
    route: String,
    path: String,
) -> Answer<S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let key = match IdempotencyKey::from_headers(req.headers()) {
        Ok(key) => key,
        Err(e) => return problem(Outcome::InvalidKey, Problem::InvalidKey, e.to_string(), c),
    };
    let Some(key) = key else {
        if c.required {
            return problem(
                Outcome::MissingKey,
                Problem::MissingKey,
                "send an Idempotency-Key header (a unique value per operation, e.g. a UUID) and reuse it when retrying",
                c,
            );
        }
        return run_without_key(c, inner, req, route).await;
    };
    let (mut parts, body) = req.into_parts();
    let Some(principal) = (c.principal)(&parts) else {
        return problem(
            Outcome::NoPrincipal,
            Problem::NoPrincipal,
            "the request is not authenticated, so its Idempotency-Key has no scope",
            c,
        );
    };

    // The body, whole and bounded: the fingerprint needs it and nothing is cut.
    let too_large = || {
        problem(
            Outcome::TooLarge,
            Problem::RequestTooLarge,
            format!("the request body is larger than {} bytes", c.max_request_bytes),
            c,
        )
    };
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > c.max_request_bytes as u64) {
        return too_large();
    }
    let bytes = match Limited::new(body, c.max_request_bytes).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => return too_large(),
        Err(e) => {
            return problem(
                Outcome::Unreadable,
                Problem::UnreadableBody,
                format!("the request body could not be read: {e}"),
                c,
            )
        }
    };
    let fp = fingerprint(&parts.method, &route, &path, parts.uri.query(), &bytes);
    let scope = Scope {
        principal: &principal,
        route: &route,
        key: key.as_str(),
    };

    // BEGIN (with the bounded lock wait), then the claim: the decision.
    let _in_flight = telemetry::InFlight::enter(&route);
    let started = Instant::now();
    let mut tx = match DB::begin(&c.pool, c.lock_wait).await {
        Ok(tx) => tx,
        Err(e) => return db_problem(&e, c),
    };
    let claimed = DB::claim(&mut tx, &scope, &fp, c.ttl).await;
    telemetry::claim_duration(&route, started.elapsed());
    match claimed {
        Ok(Claimed::New) => {}
        Ok(Claimed::Existing(stored)) => {
            // Read only: end it now, so the connection goes back to the pool clean.
            let _ = tx.rollback().await;
            if stored.fingerprint[..] == fp[..] {
                return (Outcome::Replayed, Ok(replay(stored)));
            }
            // NOTE: a record stored before the fingerprint covered the path. It identifies the
            // request only on a route without parameters; elsewhere it may be another
            // resource's, and a replay would hand this request another resource's response.
            let legacy = fingerprint::legacy_fingerprint(&parts.method, &route, parts.uri.query(), &bytes);
            if stored.fingerprint[..] == legacy[..] {
                if fingerprint::legacy_identifies(&route, &path) {
                    return (Outcome::Replayed, Ok(replay(stored)));
                }
                return problem(
                    Outcome::KeyReused,
                    Problem::KeyReused,
                    "this Idempotency-Key was recorded, for this route, method, query and body, by an earlier version that did not record the path, so it may have been another resource's; nothing was run: check whether this request took effect before sending it with a new key",
                    c,
                );
            }
            return problem(
                Outcome::KeyReused,
                Problem::KeyReused,
                "this Idempotency-Key was already used with a different request (method, path, query or body); use a new key for a new request",
                c,
            );
        }
        Ok(Claimed::Unsettled) => {
            drop(tx);
            return problem(
                Outcome::InFlight,
                Problem::InFlight,
                "the record of this Idempotency-Key changed while it was read (expired or purged); retry with the same key",
                c,
            );
        }
        Err(e) => return db_problem(&e, c),
    }

    // Claimed: the handler runs in the transaction.
    let slot = TxSlot::new(TrackedTransaction::new(tx));
    parts.extensions.insert(slot.clone());
    parts.extensions.insert(IdempotencyContext {
        principal: Some(principal.clone()),
        route: route.clone(),
        request: Some((key.clone(), fp)),
    });
    let req = Request::from_parts(parts, Body::from(bytes));
    let result = call(inner, req).await;
    let tx = slot.take();
    let res = match result {
        Err(()) => {
            drop(tx);
            return problem(
                Outcome::Panicked,
                Problem::HandlerPanicked,
                "the handler failed; its effects were rolled back and the Idempotency-Key can be retried",
                c,
            );
        }
        Ok(Err(e)) => return (Outcome::HandlerFailed, Err(e)),
        Ok(Ok(res)) => res,
    };
    let Some(tx) = tx else {
        tracing::error!("the handler kept its IdempotentTx beyond its response; rolled back");
        return problem(
            Outcome::NotStored,
            Problem::NotStored,
            "the handler kept the transaction beyond its response; its effects were rolled back",
            c,
        );
    };
    if res.status().is_server_error() {
        // NOTE: a 5xx is transient by contract: roll back, do not burn the key.
        drop(tx);
        return (Outcome::HandlerFailed, Ok(res.map(Body::new)));
    }
    let mut tx = match tx.into_transaction().await {
        Ok(tx) => tx,
        Err(e) => return statement_failed(&e, c),
    };

    // The response body, bounded; never cut silently.
    let (rparts, rbody) = res.into_parts();
    let mut stream = Body::new(rbody).into_data_stream();
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut size = 0usize;
    let mut oversized = false;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(chunk) => {
                size += chunk.len();
                chunks.push(chunk);
                if size > c.max_response_bytes {
                    oversized = true;
                    break;
                }
            }
            Err(e) => {
                drop(tx);
                tracing::error!(error = %e, "the response body failed; rolled back");
                return problem(
                    Outcome::NotStored,
                    Problem::NotStored,
                    "the response body failed; the effects were rolled back and the Idempotency-Key can be retried",
                    c,
                );
            }
        }
    }
    if oversized && c.oversized_response == OversizedResponse::Refuse {
        drop(tx);
        return problem(
            Outcome::NotStored,
            Problem::NotStored,
            format!(
                "the response body is larger than the {} bytes that can be stored; the effects were rolled back",
                c.max_response_bytes
            ),
            c,
        );
    }
    let body = (!oversized).then(|| {
        let mut b = BytesMut::with_capacity(size);
        for chunk in &chunks {
            b.extend_from_slice(chunk);
        }
        b.freeze()
    });
    let (mut names, mut values) = (Vec::new(), Vec::new());
    for name in &c.stored_headers {
        for value in rparts.headers.get_all(name) {
            names.push(name.as_str());
            values.push(value.as_bytes());
        }
    }
    let stored = DB::store(
        &mut tx,
        &scope,
        &store::Response {
            status: rparts.status.as_u16(),
            header_names: names,
            header_values: values,
            body: body.as_deref(),
            body_size: body.as_ref().map_or(0, |b| b.len() as i64),
        },
    )
    .await;
    match stored {
        Ok(true) => {}
        Ok(false) => {
            drop(tx);
            tracing::error!("the claimed idempotency row is gone (the handler changed it); rolled back");
            return problem(
                Outcome::NotStored,
                Problem::NotStored,
                "the handler changed the idempotency record; its effects were rolled back",
                c,
            );
        }
        // A failed statement run on the connection directly (not tracked), on PostgreSQL.
        Err(e) if DB::classify(&e) == Failure::Aborted => {
            drop(tx);
            tracing::error!("a statement of the handler failed and the handler went on; rolled back");
            return problem(
                Outcome::NotStored,
                Problem::NotStored,
                "a database statement of the handler failed, so its transaction was aborted; nothing was committed",
                c,
            );
        }
        Err(e) => return db_problem(&e, c),
    }
    // Crash-matrix tests (feature `crash-points`): killed with effects and response written,
    // COMMIT not sent.
    #[cfg(feature = "crash-points")]
    txinbox::crash::hit(txinbox::crash::AFTER_HANDLER);
    if let Err(e) = tx.commit().await {
        return commit_failed(&e, c);
    }
    // Crash-matrix tests: killed after COMMIT, before the response leaves.
    #[cfg(feature = "crash-points")]
    txinbox::crash::hit(txinbox::crash::AFTER_COMMIT);
    telemetry::stored_bytes(&route, body.as_ref().map_or(0, |b| b.len()));
    let body = match body {
        Some(b) => Body::from(b),
        None => Body::from_stream(futures::stream::iter(chunks.into_iter().map(Ok)).chain(stream)),
    };
    (Outcome::Executed, Ok(Response::from_parts(rparts, body)))
}

/// An optional route called without a key: a plain transaction, committed below 500.
async fn run_without_key<S, ResBody, DB: Backend>(
    c: &Config<DB>,
    inner: S,
    mut req: Request<Body>,
    route: String,
) -> Answer<S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let principal = {
        let (parts, body) = req.into_parts();
        let p = (c.principal)(&parts);
        req = Request::from_parts(parts, body);
        p
    };
    // The same BEGIN as with a key (SQLite: IMMEDIATE, so a writer never has to upgrade).
    let tx = match DB::begin(&c.pool, c.lock_wait).await {
        Ok(tx) => tx,
        Err(e) => return db_problem(&e, c),
    };
    let slot = TxSlot::new(TrackedTransaction::new(tx));
    req.extensions_mut().insert(slot.clone());
    req.extensions_mut().insert(IdempotencyContext {
        principal,
        route,
        request: None,
    });
    let result = call(inner, req).await;
    let tx = slot.take();
    let res = match result {
        Err(()) => {
            return problem(
                Outcome::Panicked,
                Problem::HandlerPanicked,
                "the handler failed; its effects were rolled back",
                c,
            )
        }
        Ok(Err(e)) => return (Outcome::HandlerFailed, Err(e)),
        Ok(Ok(res)) => res,
    };
    let Some(tx) = tx else {
        return problem(
            Outcome::NotStored,
            Problem::NotStored,
            "the handler kept the transaction beyond its response; its effects were rolled back",
            c,
        );
    };
    if res.status().is_server_error() {
        drop(tx);
        return (Outcome::HandlerFailed, Ok(res.map(Body::new)));
    }
    // NOTE: PostgreSQL would roll an aborted transaction back at COMMIT without an error, and
    // SQLite would commit what succeeded: either way the handler's answer would be a lie.
    let tx = match tx.into_transaction().await {
        Ok(tx) => tx,
        Err(e) => return statement_failed(&e, c),
    };
    if let Err(e) = tx.commit().await {
        return commit_failed(&e, c);
    }
    (Outcome::NoKey, Ok(res.map(Body::new)))
}

/// A statement of the handler failed and the handler answered anyway: rolled back.
fn statement_failed<E, DB: Backend>(e: &StatementFailed, c: &Config<DB>) -> Answer<E> {
    tracing::error!(
        error = e.error(),
        "a statement of the handler failed and the handler went on; rolled back"
    );
    problem(
        Outcome::NotStored,
        Problem::NotStored,
        "a database statement of the handler failed and the handler went on; nothing was committed and the Idempotency-Key can be retried",
        c,
    )
}

/// A failed COMMIT. An error the database answered (a deferred constraint, a serialization
/// failure) means it rolled back; a lost connection leaves the outcome unknown.
fn commit_failed<E, DB: Backend>(e: &sqlx::Error, c: &Config<DB>) -> Answer<E> {
    match DB::classify(e) {
        Failure::Fatal | Failure::Aborted => {
            tracing::error!(error = %e, "the database refused the COMMIT; rolled back");
            problem(
                Outcome::NotStored,
                Problem::NotStored,
                "the database refused to commit the handler's effects (e.g. a deferred constraint); nothing was committed",
                c,
            )
        }
        Failure::Unavailable | Failure::LockWait => {
            // NOTE: the outcome may be unknown. The retry finds the stored response or nothing.
            tracing::warn!(error = %e, "COMMIT failed, outcome unknown");
            problem(
                Outcome::CommitUnknown,
                Problem::Unavailable,
                "the database failed while committing; retry with the same key: it replays the stored response or runs afresh",
                c,
            )
        }
    }
}

/// Calls the inner service; `Err(())` if it panicked.
async fn call<S, B>(mut inner: S, req: Request<Body>) -> Result<Result<Response<B>, S::Error>, ()>
where
    S: Service<Request<Body>, Response = Response<B>>,
{
    AssertUnwindSafe(async move { inner.call(req).await })
        .catch_unwind()
        .await
        .map_err(|_| tracing::error!("the handler panicked; rolled back"))
}

/// The stored response, marked `Idempotent-Replayed: true`.
fn replay(s: store::Stored) -> Response<Body> {
    let omitted = s.body.is_none();
    let mut res = Response::new(Body::from(s.body.unwrap_or_default()));
    *res.status_mut() = StatusCode::from_u16(s.status as u16).unwrap_or(StatusCode::OK);
    for (name, value) in s.header_names.iter().zip(&s.header_values) {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            res.headers_mut().append(n, v);
        }
    }
    res.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if omitted {
        res.headers_mut()
            .insert(IDEMPOTENT_REPLAYED_BODY, HeaderValue::from_static("omitted"));
    }
    res
}
