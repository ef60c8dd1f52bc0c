//! Trace context across hops (feature `otel`): a trace runs from the producer through the
//! consumer's handler and the outbox to the next consumer.
//!
//! - **In.** A delivery's `txinbox.process` span is made a *child* of the producer's span,
//!   extracted from the message's headers: W3C `traceparent`/`tracestate`, else the CloudEvents
//!   distributed-tracing extension in binary mode (`ce_traceparent` on Kafka,
//!   `cloudEvents:traceparent` or `cloudEvents_traceparent` on AMQP).
//! - **Out.** [`outbox::write`](crate::outbox::write) (and `Context::outbox`) stores the
//!   writing span's context in the row's headers, so the relay publishes it with the message
//!   and the next consumer continues the same trace. A message whose headers already carry a
//!   `traceparent` keeps it. The context is the span current at the write: in a
//!   [`Handler`](crate::Handler) that is the delivery's `txinbox.process` span; a
//!   [`BatchHandler`](crate::handler::BatchHandler) runs for several deliveries at once, so its rows
//!   carry the span current around the batch call, unless it runs the write in the
//!   message's span ([`BatchMessage::span`](crate::handler::BatchMessage::span)).
//!
//! Parent, not link: the OpenTelemetry messaging conventions recommend a link to the creation
//! context for a process span and allow the creation context as its parent when the span
//! processes one message. Every delivery has its own `txinbox.process` span here, batched or
//! not, so the parent keeps the producer, the handler and everything it publishes in one trace,
//! which is what a trace viewer follows.
//!
//! Parsing and formatting are OpenTelemetry's: txinbox asks the application's global
//! propagator ([`opentelemetry::global::set_text_map_propagator`]), and maps `tracing` spans to
//! OpenTelemetry contexts through the application's `tracing_opentelemetry` layer. Without a
//! propagator (the default is a no-op) or without that layer, nothing changes. An application
//! sets both up once:
//!
//! ```ignore
//! opentelemetry::global::set_text_map_propagator(
//!     opentelemetry_sdk::propagation::TraceContextPropagator::new(),
//! );
//! tracing_subscriber::registry()
//!     .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("my-service")))
//!     .init();
//! ```

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::message::Headers;

/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C vendor-specific trace state header.
pub const TRACESTATE: &str = "tracestate";

/// Binary-mode prefixes of CloudEvents attributes: Kafka, then AMQP (`:` and JMS-style `_`).
const CLOUDEVENTS_PREFIXES: [&str; 3] = ["ce_", "cloudEvents:", "cloudEvents_"];

/// Reads a header for a propagator: the header itself, else its CloudEvents binary-mode form
/// (`ce_traceparent`, `cloudEvents:traceparent`, `cloudEvents_traceparent`). Values that are
/// not UTF-8 are absent.
impl Extractor for Headers {
    fn get(&self, key: &str) -> Option<&str> {
        self.get_str(key).or_else(|| {
            CLOUDEVENTS_PREFIXES
                .iter()
                .find_map(|prefix| self.get_str(&format!("{prefix}{key}")))
        })
    }

    fn keys(&self) -> Vec<&str> {
        self.iter().map(|(name, _)| name).collect()
    }
}

/// Sets a header for a propagator, replacing every header of that name. An empty value (the
/// W3C propagator writes an empty `tracestate` when there is none) removes the header: the
/// W3C spec says to omit an empty `tracestate`.
impl Injector for Headers {
    fn set(&mut self, key: &str, value: String) {
        self.replace(key, (!value.is_empty()).then_some(value));
    }
}

/// The context the application's global propagator finds in `headers` (empty if none).
pub fn extract(headers: &Headers) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(headers))
}

/// Writes `cx` into `headers` with the application's global propagator.
pub fn inject(cx: &opentelemetry::Context, headers: &mut Headers) {
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.inject_context(cx, headers));
}

/// Makes `span` (not entered yet) a child of the producer's span found in `headers`, if any.
pub(crate) fn adopt_parent(span: &Span, headers: &Headers) {
    let cx = extract(headers);
    if cx.span().span_context().is_valid() {
        // NOTE: fails only without a `tracing_opentelemetry` layer or for a disabled span,
        // where there is no OpenTelemetry span to parent.
        let _ = span.set_parent(cx);
    }
}

/// `headers` with the current span's context added, for an outbox row; `None` when there is
/// nothing to add (the headers carry a `traceparent` already, or there is no current trace).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn with_current_context(headers: &Headers) -> Option<Headers> {
    if headers.get(TRACEPARENT).is_some() {
        return None;
    }
    let cx = Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut out = headers.clone();
    inject(&cx, &mut out);
    (out != *headers).then_some(out)
}

#[cfg(test)]
mod tests {
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;

    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn trace_id(headers: &Headers) -> String {
        let cx = TraceContextPropagator::new().extract(headers);
        cx.span().span_context().trace_id().to_string()
    }

    #[test]
    fn cloudevents_binary_mode_headers_are_read_when_the_w3c_header_is_absent() {
        for name in [
            "traceparent",
            "ce_traceparent",
            "cloudEvents:traceparent",
            "cloudEvents_traceparent",
        ] {
            let headers = Headers::new().with(name, PARENT);
            assert_eq!(trace_id(&headers), "4bf92f3577b34da6a3ce929d0e0e4736", "{name}");
        }
        // The W3C header wins over the CloudEvents extension.
        let both = Headers::new()
            .with(
                "ce_traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
            .with("traceparent", PARENT);
        assert_eq!(trace_id(&both), "4bf92f3577b34da6a3ce929d0e0e4736");
        // Not UTF-8, not a context: nothing, no panic.
        let bad = Headers::new().with("traceparent", &b"\xff\xfe"[..]);
        assert!(!TraceContextPropagator::new()
            .extract(&bad)
            .span()
            .span_context()
            .is_valid());
    }

    #[test]
    fn injecting_replaces_the_headers_it_writes() {
        let cx = TraceContextPropagator::new().extract(&Headers::new().with("traceparent", PARENT));
        let mut headers = Headers::new()
            .with(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
            .with("tracestate", "old=1")
            .with("other", "x");
        TraceContextPropagator::new().inject_context(&cx, &mut headers);
        let names: Vec<&str> = headers.iter().map(|(n, _)| n).collect();
        // No trace state in the context: the stale header goes, no empty one is written.
        assert_eq!(names, ["other", "traceparent"]);
        assert_eq!(headers.get_str("traceparent"), Some(PARENT));
    }
}
