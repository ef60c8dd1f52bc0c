//! [`IdempotencyLayer`]: the configuration and the tower `Layer`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderName};
use http::request::Parts;
use tower::Layer;
use txinbox::sqlx::{Pool, Postgres};

use crate::service::Idempotency;
use crate::store::Backend;

/// Default time a concurrent duplicate waits for the first request with its key (then 409).
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(5);
/// Default `Retry-After` on 409 and 503.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Default lifetime of a stored response: 24 hours (Stripe's).
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Default request body limit: 1 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// Default stored response body limit: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// The principal a key is scoped by, as a request extension.
///
/// The default principal function reads it: an authentication layer that runs before the
/// idempotency layer inserts it (`req.extensions_mut().insert(Principal::new(tenant))`).
/// Alternatively set [`IdempotencyLayer::principal`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Principal(pub String);

impl Principal {
    /// A principal (tenant, API key ID, user).
    pub fn new(p: impl Into<String>) -> Self {
        Principal(p.into())
    }
}

/// What to do with a 2xx/4xx response whose body is larger than
/// [`IdempotencyLayer::max_response_bytes`] (a large or streaming body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OversizedResponse {
    /// Roll the effects back and answer 500 `response-not-stored`: the key is not used up.
    #[default]
    Refuse,
    /// Commit the effects with status and headers only; this response streams its whole
    /// body, a replay returns the status and headers with an empty body and
    /// `Idempotent-Replayed-Body: omitted`.
    StoreHeadersOnly,
}

type PrincipalFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

pub(crate) struct Config<DB: Backend> {
    pub(crate) pool: Pool<DB>,
    pub(crate) required: bool,
    pub(crate) principal: Arc<PrincipalFn>,
    pub(crate) lock_wait: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) ttl: Duration,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) oversized_response: OversizedResponse,
    pub(crate) stored_headers: Vec<HeaderName>,
}

/// The tower `Layer` that makes a route idempotent; see the [crate docs](crate).
///
/// Apply it per route (`route_layer`, or `post(handler).layer(...)`), once with
/// [`required`](Self::required) and once with [`optional`](Self::optional) where routes differ.
/// Cloning is cheap (one `Arc`). `DB` is `sqlx::Postgres` (default) or `sqlx::Sqlite`; see
/// [`Backend`] for how they differ.
pub struct IdempotencyLayer<DB: Backend = Postgres> {
    pub(crate) config: Arc<Config<DB>>,
}

impl<DB: Backend> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            config: self.config.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for IdempotencyLayer<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("required", &c.required)
            .field("lock_wait", &c.lock_wait)
            .field("retry_after", &c.retry_after)
            .field("ttl", &c.ttl)
            .field("max_request_bytes", &c.max_request_bytes)
            .field("max_response_bytes", &c.max_response_bytes)
            .field("oversized_response", &c.oversized_response)
            .field("stored_headers", &c.stored_headers)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> IdempotencyLayer<DB> {
    /// A layer on `pool` (migrated with `txinbox::postgres::migrate` or `txinbox::sqlite::migrate`), with the defaults: key required,
    /// principal from the [`Principal`] extension, [`DEFAULT_LOCK_WAIT`],
    /// [`DEFAULT_RETRY_AFTER`], [`DEFAULT_TTL`], 1 MiB request and stored response limits,
    /// [`OversizedResponse::Refuse`], and the stored headers `content-type`,
    /// `content-language`, `content-location`, `location`, `etag`, `last-modified`,
    /// `cache-control`, `link`.
    pub fn new(pool: Pool<DB>) -> Self {
        crate::telemetry::describe();
        IdempotencyLayer {
            config: Arc::new(Config {
                pool,
                required: true,
                principal: Arc::new(|parts: &Parts| parts.extensions.get::<Principal>().map(|p| p.0.clone())),
                lock_wait: DEFAULT_LOCK_WAIT,
                retry_after: DEFAULT_RETRY_AFTER,
                ttl: DEFAULT_TTL,
                max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
                oversized_response: OversizedResponse::Refuse,
                stored_headers: vec![
                    header::CONTENT_TYPE,
                    header::CONTENT_LANGUAGE,
                    header::CONTENT_LOCATION,
                    header::LOCATION,
                    header::ETAG,
                    header::LAST_MODIFIED,
                    header::CACHE_CONTROL,
                    header::LINK,
                ],
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config<DB>)) -> Self {
        let c = Arc::get_mut(&mut self.config);
        match c {
            Some(c) => f(c),
            None => {
                let old = &self.config;
                let mut c = Config {
                    pool: old.pool.clone(),
                    required: old.required,
                    principal: old.principal.clone(),
                    lock_wait: old.lock_wait,
                    retry_after: old.retry_after,
                    ttl: old.ttl,
                    max_request_bytes: old.max_request_bytes,
                    max_response_bytes: old.max_response_bytes,
                    oversized_response: old.oversized_response,
                    stored_headers: old.stored_headers.clone(),
                };
                f(&mut c);
                self.config = Arc::new(c);
            }
        }
        self
    }

    /// Requests without `Idempotency-Key` are refused with 400 (the default).
    pub fn required(self) -> Self {
        self.with(|c| c.required = true)
    }

    /// Requests without `Idempotency-Key` run without idempotency (still in a transaction the
    /// handler gets with [`IdempotentTx`](crate::IdempotentTx), committed for any status
    /// below 500).
    pub fn optional(self) -> Self {
        self.with(|c| c.required = false)
    }

    /// How the principal that scopes keys is found; `None` answers 401 `no-principal`.
    ///
    /// Two principals using one key are two requests; so are two routes.
    pub fn principal(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.with(|c| c.principal = Arc::new(f))
    }

    /// How long a request waits for a concurrent request with its key (it blocks on the key's
    /// row until that one commits or rolls back) before it gets 409 with `Retry-After`.
    ///
    /// PostgreSQL: `SET LOCAL lock_timeout` for the request's transaction, so it also bounds
    /// each lock wait of the handler's own statements (a handler can `SET LOCAL` its own).
    /// SQLite: not used; the write lock is waited for up to the pool's `busy_timeout`.
    pub fn lock_wait(self, wait: Duration) -> Self {
        self.with(|c| c.lock_wait = wait.max(Duration::from_millis(1)))
    }

    /// The `Retry-After` sent with 409 and 503 (rounded up to whole seconds, at least 1).
    pub fn retry_after(self, d: Duration) -> Self {
        self.with(|c| c.retry_after = d)
    }

    /// How long a stored response is replayed; after that the key may be used afresh and
    /// [`purge_expired`](crate::purge_expired) deletes it.
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.ttl = ttl)
    }

    /// Largest request body read (413 `request-too-large` above it, before anything runs).
    pub fn max_request_bytes(self, n: usize) -> Self {
        self.with(|c| c.max_request_bytes = n)
    }

    /// Largest response body stored; see [`oversized_response`](Self::oversized_response).
    pub fn max_response_bytes(self, n: usize) -> Self {
        self.with(|c| c.max_response_bytes = n)
    }

    /// What happens to a response body over [`max_response_bytes`](Self::max_response_bytes).
    pub fn oversized_response(self, o: OversizedResponse) -> Self {
        self.with(|c| c.oversized_response = o)
    }

    /// Also stores and replays this response header.
    pub fn store_header(self, name: HeaderName) -> Self {
        self.with(|c| {
            if !c.stored_headers.contains(&name) {
                c.stored_headers.push(name)
            }
        })
    }
}

/// A layer on the pool of a consumer's PostgreSQL inbox: HTTP requests and messages then share
/// one database, one schema and one migration ledger.
impl From<&txinbox::PostgresInbox> for IdempotencyLayer<Postgres> {
    fn from(inbox: &txinbox::PostgresInbox) -> Self {
        Self::new(inbox.pool().clone())
    }
}

/// A layer on the pool of an embedded SQLite inbox (with its connection settings: WAL,
/// `synchronous = FULL`, busy timeout).
impl From<&txinbox::SqliteInbox> for IdempotencyLayer<txinbox::sqlx::Sqlite> {
    fn from(inbox: &txinbox::SqliteInbox) -> Self {
        Self::new(inbox.pool().clone())
    }
}

impl<S, DB: Backend> Layer<S> for IdempotencyLayer<DB> {
    type Service = Idempotency<S, DB>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            config: self.config.clone(),
        }
    }
}
