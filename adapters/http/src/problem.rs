//! RFC 9457 problem details for the layer's own responses.

use std::time::Duration;

use axum::body::Body;
use http::{header, HeaderValue, Response, StatusCode};

/// The `type` URI prefix of the layer's problems; the suffix is [`Problem::code`].
pub const PROBLEM_TYPE_PREFIX: &str = "urn:txinbox:http:";

/// One of the layer's own error responses, as `application/problem+json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    MissingKey,
    /// 400: the `Idempotency-Key` is malformed, empty, too long or repeated.
    InvalidKey,
    /// 401: the principal function found no principal to scope the key with.
    NoPrincipal,
    /// 413: the request body is larger than the configured limit.
    RequestTooLarge,
    /// 400: the request body could not be read.
    UnreadableBody,
    /// 422: the key was used before with another request (method, path, query or body).
    KeyReused,
    /// 409: a request with this key is still being processed.
    InFlight,
    /// 503: the database is unavailable, or the COMMIT's outcome is unknown.
    Unavailable,
    /// 500: the handler panicked; its effects were rolled back and the key is not used up.
    HandlerPanicked,
    /// 500: the response could not be stored (too large under `OversizedResponse::Refuse`,
    /// unreadable, or the transaction was aborted by a failed statement the handler ignored);
    /// the effects were rolled back and the key is not used up.
    NotStored,
    /// 500: a database error that is not an outage (e.g. the migration has not run).
    StoreFailed,
}

impl Problem {
    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Problem::MissingKey | Problem::InvalidKey | Problem::UnreadableBody => StatusCode::BAD_REQUEST,
            Problem::NoPrincipal => StatusCode::UNAUTHORIZED,
            Problem::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::InFlight => StatusCode::CONFLICT,
            Problem::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Problem::HandlerPanicked | Problem::NotStored | Problem::StoreFailed => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The machine-readable code: the `type` URI's suffix and the `code` member.
    pub fn code(self) -> &'static str {
        match self {
            Problem::MissingKey => "idempotency-key-missing",
            Problem::InvalidKey => "idempotency-key-invalid",
            Problem::NoPrincipal => "no-principal",
            Problem::RequestTooLarge => "request-too-large",
            Problem::UnreadableBody => "request-body-unreadable",
            Problem::KeyReused => "idempotency-key-reused",
            Problem::InFlight => "idempotency-key-in-flight",
            Problem::Unavailable => "store-unavailable",
            Problem::HandlerPanicked => "handler-panicked",
            Problem::NotStored => "response-not-stored",
            Problem::StoreFailed => "store-failed",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Problem::MissingKey => "This endpoint requires an Idempotency-Key header",
            Problem::InvalidKey => "The Idempotency-Key header is invalid",
            Problem::NoPrincipal => "The request has no principal to scope its Idempotency-Key",
            Problem::RequestTooLarge => "The request body is too large",
            Problem::UnreadableBody => "The request body could not be read",
            Problem::KeyReused => "This Idempotency-Key was used with another request",
            Problem::InFlight => "A request with this Idempotency-Key is still being processed",
            Problem::Unavailable => "The idempotency store is unavailable",
            Problem::HandlerPanicked => "The request failed; nothing was stored",
            Problem::NotStored => "The response could not be stored; nothing was committed",
            Problem::StoreFailed => "The idempotency store failed",
        }
    }

    /// Whether the client should retry later with the same key (`Retry-After` is set).
    pub fn retryable(self) -> bool {
        matches!(self, Problem::InFlight | Problem::Unavailable)
    }

    /// The response: `application/problem+json` with `type`, `title`, `status`, `detail` and
    /// `code`, and `Retry-After` (whole seconds, at least 1) for retryable problems.
    pub fn response(self, detail: impl Into<String>, retry_after: Duration) -> Response<Body> {
        let status = self.status();
        let body = serde_json::json!({
            "type": format!("{PROBLEM_TYPE_PREFIX}{}", self.code()),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": detail.into(),
            "code": self.code(),
        });
        let mut res = Response::new(Body::from(body.to_string()));
        *res.status_mut() = status;
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if self.retryable() {
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}
