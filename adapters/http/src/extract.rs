//! What the handler receives: [`IdempotentTx`] (the transaction) and [`IdempotencyContext`].

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use tokio::sync::{Mutex, OwnedMutexGuard};
use txinbox::sqlx::Postgres;
use txinbox::TrackedTransaction;

use crate::key::IdempotencyKey;
use crate::problem::Problem;
use crate::store::Backend;

/// The request's transaction as the handler gets it: a statement that fails on it is seen.
pub(crate) type Tx<DB> = TrackedTransaction<DB>;

/// The request's transaction, shared between the layer and the extractor.
pub(crate) struct TxSlot<DB: Backend>(pub(crate) Arc<Mutex<Option<Tx<DB>>>>);

impl<DB: Backend> Clone for TxSlot<DB> {
    fn clone(&self) -> Self {
        TxSlot(self.0.clone())
    }
}

impl<DB: Backend> TxSlot<DB> {
    pub(crate) fn new(tx: Tx<DB>) -> Self {
        TxSlot(Arc::new(Mutex::new(Some(tx))))
    }

    /// Takes the transaction back after the handler; `None` if the handler still holds it
    /// (an [`IdempotentTx`] moved into a task that outlived the handler).
    pub(crate) fn take(&self) -> Option<Tx<DB>> {
        self.0.try_lock().ok().and_then(|mut g| g.take())
    }
}

/// The database transaction in which the request's key was claimed: run the handler's effects
/// (and any `txinbox::outbox::write`) on it. The layer stores the response in it and commits.
///
/// Derefs to a [`TrackedTransaction`], an executor that derefs in turn to the connection
/// (`PgConnection`, or `SqliteConnection` for `IdempotentTx<sqlx::Sqlite>` under an
/// `IdempotencyLayer<sqlx::Sqlite>`): `sqlx::query(...).execute(&mut *tx)`. If a statement run
/// on it fails, nothing commits and the layer answers 500 `response-not-stored` (the key is not
/// used up), whatever the handler answers, on both stores (see [`TrackedTransaction`] for a
/// failure you expect). Do not commit or roll it back yourself (it is not yours to end: a 5xx
/// response rolls it back), and do not keep it beyond the handler: the layer then cannot store
/// the response and answers 500.
///
/// Extract it at most once per request. Rejected with a 500 problem when the route has no
/// [`IdempotencyLayer`](crate::IdempotencyLayer) or it was extracted already.
pub struct IdempotentTx<DB: Backend = Postgres> {
    guard: OwnedMutexGuard<Option<Tx<DB>>>,
}

impl<DB: Backend> std::fmt::Debug for IdempotentTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

impl<DB: Backend> Deref for IdempotentTx<DB> {
    type Target = TrackedTransaction<DB>;

    fn deref(&self) -> &TrackedTransaction<DB> {
        self.guard
            .as_ref()
            .expect("the slot holds the transaction while extracted")
    }
}

impl<DB: Backend> DerefMut for IdempotentTx<DB> {
    fn deref_mut(&mut self) -> &mut TrackedTransaction<DB> {
        self.guard
            .as_mut()
            .expect("the slot holds the transaction while extracted")
    }
}

/// Why [`IdempotentTx`] could not be extracted (500, a programming error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TxRejection {
    /// The route has no `IdempotencyLayer`.
    NoLayer,
    /// The transaction was extracted already in this request.
    AlreadyTaken,
}

impl IntoResponse for TxRejection {
    fn into_response(self) -> Response {
        let detail = match self {
            TxRejection::NoLayer => {
                "the route has no IdempotencyLayer, so there is no transaction to extract"
            }
            TxRejection::AlreadyTaken => "IdempotentTx was extracted twice in one request",
        };
        let res: Response<Body> = Problem::StoreFailed.response(detail, Default::default());
        res
    }
}

impl<S: Send + Sync, DB: Backend> FromRequestParts<S> for IdempotentTx<DB> {
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let slot = parts.extensions.get::<TxSlot<DB>>().ok_or(TxRejection::NoLayer)?;
        let guard = slot
            .0
            .clone()
            .try_lock_owned()
            .map_err(|_| TxRejection::AlreadyTaken)?;
        if guard.is_none() {
            return Err(TxRejection::AlreadyTaken);
        }
        Ok(IdempotentTx { guard })
    }
}

/// The request's idempotency scope and key, for handlers that derive IDs from them (outbox
/// message IDs, the downstream's idempotency key). A request extension set by the layer;
/// extract it with `axum::Extension<IdempotencyContext>`.
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    pub(crate) principal: Option<String>,
    pub(crate) route: String,
    /// The key and the request's [`fingerprint`](crate::fingerprint()); `None` without a key.
    pub(crate) request: Option<(IdempotencyKey, [u8; 32])>,
}

impl IdempotencyContext {
    /// The principal that scopes the key (`None` on an optional route called without a key).
    pub fn principal(&self) -> Option<&str> {
        self.principal.as_deref()
    }

    /// The matched route (the template, such as `/pay/{account}`).
    pub fn route(&self) -> &str {
        &self.route
    }

    /// The request's key, `None` on an optional route called without one.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.request.as_ref().map(|(key, _)| key)
    }

    /// A stable ID for `step` of this request: the same principal, key, request and step give
    /// the same ID on every retry. `None` without a key.
    ///
    /// The request is its [`fingerprint`](crate::fingerprint()) (method, route, concrete path,
    /// query, body), so two resources of one route (`/pay/a1`, `/pay/a2`) never share an ID,
    /// even with one key after it expired. It is `txinbox::outbox::derive_id` with the
    /// fingerprint (hex) as scope and the length-prefixed principal and key as parent.
    pub fn derive_id(&self, step: &str) -> Option<String> {
        let (key, fingerprint) = self.request.as_ref()?;
        let principal = self.principal.as_deref().unwrap_or("");
        let parent = format!("{}:{principal}{}", principal.len(), key.as_str());
        let scope: String = fingerprint.iter().map(|b| format!("{b:02x}")).collect();
        Some(txinbox::outbox::derive_id(&scope, &parent, step))
    }
}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;
    use crate::fingerprint::fingerprint;

    fn cx(principal: &str, key: &str, path: &str) -> IdempotencyContext {
        let fp = fingerprint(&Method::POST, "/pay/{account}", path, None, b"{}");
        IdempotencyContext {
            principal: Some(principal.into()),
            route: "/pay/{account}".into(),
            request: Some((IdempotencyKey::parse(key.as_bytes()).unwrap(), fp)),
        }
    }

    #[test]
    fn derived_ids_are_stable_and_differ_per_resource_principal_and_key() {
        let a1 = cx("t", "k", "/pay/a1").derive_id("event");
        assert_eq!(
            a1,
            cx("t", "k", "/pay/a1").derive_id("event"),
            "stable on a retry"
        );
        assert_eq!(a1, cx("t", "k", "/pay/%61%31").derive_id("event"), "one resource");
        assert_ne!(a1, cx("t", "k", "/pay/a2").derive_id("event"), "another resource");
        assert_ne!(
            a1,
            cx("u", "k", "/pay/a1").derive_id("event"),
            "another principal"
        );
        assert_ne!(a1, cx("t", "j", "/pay/a1").derive_id("event"), "another key");
        assert_ne!(a1, cx("t", "k", "/pay/a1").derive_id("other"), "another step");
        let no_key = IdempotencyContext {
            request: None,
            ..cx("t", "k", "/pay/a1")
        };
        assert_eq!(no_key.derive_id("event"), None);
    }
}
