//! What RabbitMQ takes, and the retry and dead-letter copies of a delivery made to fit it.
//!
//! A copy carries the original's properties and headers plus this crate's own. AMQP 0-9-1 sends
//! all properties in one content-header frame, which must fit in the connection's negotiated
//! `frame_max` (131,072 bytes on RabbitMQ by default); a larger one makes the broker close the
//! whole connection (`FRAME_ERROR`). So a copy whose headers would not fit is never sent:
//!
//! - a dead-letter copy leaves the original headers out ([`headers::HEADERS`] = `omitted`),
//!   then cuts its [`headers::ERROR`] to what is left; the database's dead letter keeps both;
//! - a retry copy cannot leave anything out (the handler needs the headers): [`retry`] says it
//!   does not fit and the caller gives the original back to the queue instead.
//!
//! The body is split over as many frames as it needs; what limits it is the broker's
//! `max_message_size` (RabbitMQ 3.10: 128 MiB by default, at most 512 MiB), a server setting a
//! client cannot read. A copy's body is the original's, which that broker accepted, so it is
//! refused only if the limit was lowered since. RabbitMQ then closes the publishing channel with
//! `PRECONDITION_FAILED` ([`is_size_refusal`]), and the dead-letter copy is made again without
//! the payload ([`headers::PAYLOAD`] = `omitted`). Whenever something is left out, the payload's
//! size and SHA-256 ([`headers::ORIGINAL_SIZE`], [`headers::ORIGINAL_SHA256`]) say which dead
//! letter of the database (`payload_size`, `payload_sha256`) the copy stands for.

use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use sha2::Digest as _;

use crate::confirm::Unconfirmed;
use crate::headers;

/// Longest `x-txinbox-error` value, in bytes.
pub(crate) const MAX_ERROR_HEADER: usize = 4096;
/// A dead-letter copy keeps the original headers only if at least this much of the error (or
/// all of a shorter one) fits beside them.
const MIN_ERROR_HEADER: usize = 256;
/// The bytes of a content-header frame besides its properties: frame type, channel and size
/// (7), class, weight and body size (12), frame end (1).
const HEADER_FRAME_OVERHEAD: usize = 20;

/// What a dead-letter copy leaves out of the original.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// Everything: payload, properties, headers.
    Whole,
    /// The original headers: they do not fit in a frame beside the `x-txinbox-*` ones.
    HeadersOmitted,
    /// The payload: the broker refused its size.
    PayloadOmitted,
    /// Both.
    PayloadAndHeadersOmitted,
}

impl Form {
    /// The `form` label of [`DEAD_LETTERS_REDUCED`](crate::telemetry::DEAD_LETTERS_REDUCED).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Form::Whole => "whole",
            Form::HeadersOmitted => "headers_omitted",
            Form::PayloadOmitted => "payload_omitted",
            Form::PayloadAndHeadersOmitted => "payload_and_headers_omitted",
        }
    }

    fn keeps_headers(self) -> bool {
        matches!(self, Form::Whole | Form::PayloadOmitted)
    }

    /// Whether the copy carries the payload.
    pub(crate) fn keeps_payload(self) -> bool {
        matches!(self, Form::Whole | Form::HeadersOmitted)
    }
}

/// A dead-letter copy that fits: its properties and what it leaves out.
#[derive(Debug)]
pub(crate) struct DeadLetterCopy {
    pub(crate) properties: BasicProperties,
    pub(crate) form: Form,
}

/// What a dead-letter copy says about the original, besides the original itself.
#[derive(Debug)]
pub(crate) struct Why<'a> {
    pub(crate) reason: &'a str,
    pub(crate) error: &'a str,
    pub(crate) queue: &'a str,
}

/// The largest dead-letter copy of a message with `original` properties and `payload` whose
/// content-header frame fits in `frame_max` (0: no limit): whole if it fits (the error cut to
/// [`MAX_ERROR_HEADER`], or further as long as [`MIN_ERROR_HEADER`] of it stays), else without
/// the original headers (the error cut to what fits). After the broker refused the payload's
/// size (`payload_refused`), the same without the payload. `None` only if not even the
/// properties of the original that every copy keeps fit, which a `frame_max` of at least
/// 4,096 bytes (AMQP's minimum) rules out.
pub(crate) fn dead_letter(
    original: &BasicProperties,
    payload: &[u8],
    why: &Why<'_>,
    frame_max: u32,
    payload_refused: bool,
) -> Option<DeadLetterCopy> {
    let forms = if payload_refused {
        [Form::PayloadOmitted, Form::PayloadAndHeadersOmitted]
    } else {
        [Form::Whole, Form::HeadersOmitted]
    };
    let limit = if frame_max == 0 {
        usize::MAX
    } else {
        frame_max as usize
    };
    let wanted = why.error.len().min(MAX_ERROR_HEADER);
    for (i, form) in forms.into_iter().enumerate() {
        let last = i + 1 == forms.len();
        let mut table = if form.keeps_headers() {
            original.headers().clone().unwrap_or_default()
        } else {
            FieldTable::default()
        };
        table.insert(headers::REASON.into(), long_string(why.reason));
        table.insert(headers::ERROR.into(), long_string(""));
        table.insert(headers::ORIGINAL_QUEUE.into(), long_string(why.queue));
        if form != Form::Whole {
            let omitted = || long_string("omitted");
            if !form.keeps_headers() {
                table.insert(headers::HEADERS.into(), omitted());
            }
            if !form.keeps_payload() {
                table.insert(headers::PAYLOAD.into(), omitted());
            }
            table.insert(
                headers::ORIGINAL_SIZE.into(),
                AMQPValue::LongLongInt(payload.len() as i64),
            );
            table.insert(headers::ORIGINAL_SHA256.into(), long_string(&hex_sha256(payload)));
        }
        // With an empty error, whose 4-byte length is counted: each byte of it adds one.
        let len = header_frame_len(&copy_properties(original, table.clone(), None));
        if len > limit {
            continue;
        }
        let error_len = wanted.min(limit - len);
        if !last && error_len < wanted.min(MIN_ERROR_HEADER) {
            continue;
        }
        table.insert(headers::ERROR.into(), long_string(truncate(why.error, error_len)));
        return Some(DeadLetterCopy {
            properties: copy_properties(original, table, None),
            form,
        });
    }
    None
}

/// The retry copy of a message with `original` properties: its headers with
/// [`headers::RETRY`] = `count`, `expiration` = `expiration_ms`. `None` if its content-header
/// frame does not fit in `frame_max` (0: no limit).
pub(crate) fn retry(
    original: &BasicProperties,
    count: i64,
    expiration_ms: &str,
    frame_max: u32,
) -> Option<BasicProperties> {
    let mut table = original.headers().clone().unwrap_or_default();
    table.insert(headers::RETRY.into(), AMQPValue::LongLongInt(count));
    let properties = copy_properties(original, table, Some(expiration_ms.into()));
    (frame_max == 0 || header_frame_len(&properties) <= frame_max as usize).then_some(properties)
}

/// Whether a message (an outbox row's) with `properties` fits in a content-header frame of
/// `frame_max` bytes (0: no limit). `Err` says how large it is.
pub(crate) fn check(properties: &BasicProperties, frame_max: u32) -> Result<(), String> {
    let len = header_frame_len(properties);
    if frame_max == 0 || len <= frame_max as usize {
        return Ok(());
    }
    Err(format!(
        "its properties and headers need a content-header frame of {len} bytes; the connection's frame_max is {frame_max}"
    ))
}

/// Whether the broker refused a publish for its body size: RabbitMQ closes the channel with
/// `PRECONDITION_FAILED - message size N is larger than [configured] max size M`
/// (`max_message_size`).
pub(crate) fn is_size_refusal(e: &Unconfirmed) -> bool {
    let Unconfirmed::Failed(e) = e else {
        return false;
    };
    let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
        return false;
    };
    let text = amqp.get_message().as_str();
    matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    ) && text.contains("message size")
        && text.contains("larger than")
}

/// The length of the content-header frame lapin writes for `properties`.
pub(crate) fn header_frame_len(properties: &BasicProperties) -> usize {
    match lapin::protocol::basic::gen_properties::<Vec<u8>>(properties)(Vec::new().into()) {
        Ok(written) => HEADER_FRAME_OVERHEAD + written.position as usize,
        // Writing to a Vec does not fail; should it, the copy counts as too large.
        Err(_) => usize::MAX,
    }
}

/// The properties of a copy: everything of the original except `expiration` (replaced),
/// `user_id` and `cluster_id`; headers replaced; always persistent.
pub(crate) fn copy_properties(
    p: &BasicProperties,
    headers: FieldTable,
    expiration: Option<ShortString>,
) -> BasicProperties {
    // The broker's counters of the original: a copy is a new message.
    let counters = [headers::DELIVERY_COUNT, headers::ACQUIRED_COUNT];
    let headers = if counters.iter().any(|c| headers.contains_key(c)) {
        let mut map = headers.inner().clone();
        map.retain(|k, _| !counters.contains(&k.as_str()));
        FieldTable::from(map)
    } else {
        headers
    };
    let mut c = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    if let Some(v) = p.content_type() {
        c = c.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        c = c.with_content_encoding(v.clone());
    }
    if let Some(v) = p.priority() {
        c = c.with_priority(*v);
    }
    if let Some(v) = p.correlation_id() {
        c = c.with_correlation_id(v.clone());
    }
    if let Some(v) = p.reply_to() {
        c = c.with_reply_to(v.clone());
    }
    if let Some(v) = expiration {
        c = c.with_expiration(v);
    }
    if let Some(v) = p.message_id() {
        c = c.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        c = c.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        c = c.with_type(v.clone());
    }
    if let Some(v) = p.app_id() {
        c = c.with_app_id(v.clone());
    }
    c
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn hex_sha256(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut hex = String::with_capacity(64);
    for b in sha2::Sha256::digest(bytes) {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub(crate) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::AMQPError;

    const FRAME_MAX: u32 = 131_072;

    fn why(error: &str) -> Why<'_> {
        Why {
            reason: "undecodable",
            error,
            queue: "payments",
        }
    }

    /// Properties with one header `pad` whose content-header frame is `target` bytes long.
    fn original(target: usize) -> BasicProperties {
        let with = |n: usize| {
            let mut t = FieldTable::default();
            t.insert("pad".into(), long_string(&"x".repeat(n)));
            BasicProperties::default()
                .with_message_id("m-1".into())
                .with_correlation_id("corr".into())
                .with_headers(t)
        };
        let p = with(target - header_frame_len(&with(0)));
        assert_eq!(header_frame_len(&p), target);
        p
    }

    fn header<'a>(p: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
        p.headers().as_ref()?.inner().get(name)
    }

    fn text(p: &BasicProperties, name: &str) -> Option<String> {
        match header(p, name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            other => Some(format!("{other:?}")),
        }
    }

    #[test]
    fn the_frame_length_is_what_lapin_writes() {
        // Flags (2) and an empty table (4): 26 bytes, as counted by hand from AMQP 0-9-1 §4.2.6.
        let empty = BasicProperties::default().with_headers(FieldTable::default());
        assert_eq!(header_frame_len(&empty), 20 + 2 + 4);
        let id = BasicProperties::default().with_message_id("abc".into());
        assert_eq!(header_frame_len(&id), 20 + 2 + 1 + 3);
    }

    #[test]
    fn a_copy_that_fits_is_whole_with_the_original_headers() {
        let p = original(1_000);
        let c = dead_letter(&p, b"payload", &why("boom"), FRAME_MAX, false).unwrap();
        assert_eq!(c.form, Form::Whole);
        assert!(header(&c.properties, "pad").is_some());
        assert_eq!(text(&c.properties, headers::ERROR).as_deref(), Some("boom"));
        assert_eq!(
            text(&c.properties, headers::ORIGINAL_QUEUE).as_deref(),
            Some("payments")
        );
        assert_eq!(header(&c.properties, headers::ORIGINAL_SHA256), None);
        assert_eq!(
            c.properties.message_id().as_ref().map(|s| s.as_str()),
            Some("m-1")
        );
    }

    #[test]
    fn headers_within_a_few_hundred_bytes_of_frame_max_are_left_out() {
        for headroom in [0, 64, 150, 300] {
            let p = original(FRAME_MAX as usize - headroom);
            let c = dead_letter(&p, b"not json", &why(&"e".repeat(500)), FRAME_MAX, false).unwrap();
            assert_eq!(c.form, Form::HeadersOmitted, "headroom {headroom}");
            assert!(header_frame_len(&c.properties) <= FRAME_MAX as usize);
            assert_eq!(header(&c.properties, "pad"), None);
            assert_eq!(text(&c.properties, headers::HEADERS).as_deref(), Some("omitted"));
            assert_eq!(
                header(&c.properties, headers::PAYLOAD),
                None,
                "the payload is kept"
            );
            assert_eq!(
                header(&c.properties, headers::ORIGINAL_SIZE),
                Some(&AMQPValue::LongLongInt(8))
            );
            assert_eq!(
                text(&c.properties, headers::ORIGINAL_SHA256).as_deref(),
                Some(hex_sha256(b"not json").as_str())
            );
            assert_eq!(text(&c.properties, headers::ERROR).map(|e| e.len()), Some(500));
            assert_eq!(
                c.properties.correlation_id().as_ref().map(|s| s.as_str()),
                Some("corr")
            );
        }
    }

    #[test]
    fn a_long_error_is_cut_before_the_original_headers_are() {
        let error = "é".repeat(2_000); // 4,000 bytes
        let p = original(FRAME_MAX as usize - 1_500);
        let c = dead_letter(&p, b"p", &why(&error), FRAME_MAX, false).unwrap();
        assert_eq!(
            c.form,
            Form::Whole,
            "1,500 bytes leave room for some of the error"
        );
        assert!(header_frame_len(&c.properties) <= FRAME_MAX as usize);
        let kept = text(&c.properties, headers::ERROR).unwrap();
        assert!(
            kept.len() >= MIN_ERROR_HEADER && kept.len() < 1_500,
            "{}",
            kept.len()
        );
        assert!(error.starts_with(&kept), "cut on a character boundary");
    }

    #[test]
    fn at_the_smallest_frame_max_the_error_is_cut_to_fit() {
        let p = original(4_000);
        let error = "x".repeat(MAX_ERROR_HEADER * 2);
        let c = dead_letter(&p, b"p", &why(&error), 4_096, false).unwrap();
        assert_eq!(c.form, Form::HeadersOmitted);
        assert!(header_frame_len(&c.properties) <= 4_096);
        let kept = text(&c.properties, headers::ERROR).unwrap().len();
        assert!(kept > 3_000, "what fits of the error is kept: {kept}");
        assert_eq!(header_frame_len(&c.properties), 4_096, "and no more");
    }

    #[test]
    fn without_a_frame_limit_everything_is_kept() {
        let p = original(1_000_000);
        let c = dead_letter(&p, b"p", &why("e"), 0, false).unwrap();
        assert_eq!(c.form, Form::Whole);
    }

    /// `max_message_size` limits the body, which the copy shares with the original; the broker
    /// refuses it only if its limit was lowered since the original was published. Then the
    /// copy leaves the payload out, and the headers too if they do not fit.
    #[test]
    fn after_a_size_refusal_the_payload_is_left_out() {
        let small = original(500);
        let c = dead_letter(&small, b"big body", &why("e"), FRAME_MAX, true).unwrap();
        assert_eq!(c.form, Form::PayloadOmitted);
        assert!(!c.form.keeps_payload());
        assert!(header(&c.properties, "pad").is_some());
        assert_eq!(text(&c.properties, headers::PAYLOAD).as_deref(), Some("omitted"));
        assert_eq!(
            text(&c.properties, headers::ORIGINAL_SHA256).as_deref(),
            Some(hex_sha256(b"big body").as_str())
        );
        let big = original(FRAME_MAX as usize - 10);
        let c = dead_letter(&big, b"big body", &why("e"), FRAME_MAX, true).unwrap();
        assert_eq!(c.form, Form::PayloadAndHeadersOmitted);
        assert_eq!(header(&c.properties, "pad"), None);
    }

    #[test]
    fn a_retry_copy_fits_or_says_so() {
        let small = original(1_000);
        let c = retry(&small, 3, "250", FRAME_MAX).unwrap();
        assert_eq!(header(&c, headers::RETRY), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(c.expiration().as_ref().map(|s| s.as_str()), Some("250"));
        assert!(header(&c, "pad").is_some());
        // The counter (25 bytes) and the expiration (4) do not fit in 8 bytes of headroom.
        assert!(retry(&original(FRAME_MAX as usize - 8), 1, "250", FRAME_MAX).is_none());
        assert!(retry(&original(FRAME_MAX as usize - 8), 1, "250", 0).is_some());
    }

    #[test]
    fn an_outbox_message_over_frame_max_is_told_apart() {
        assert!(check(&original(FRAME_MAX as usize), FRAME_MAX).is_ok());
        let e = check(&original(FRAME_MAX as usize + 1), FRAME_MAX).unwrap_err();
        assert!(e.contains("131073") && e.contains("frame_max is 131072"), "{e}");
    }

    #[test]
    fn only_a_size_precondition_is_a_size_refusal() {
        let closed = |kind, text: &str| {
            Unconfirmed::Failed(lapin::Error::from(lapin::ErrorKind::ProtocolError(
                AMQPError::new(kind, text.into()),
            )))
        };
        let precondition = AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED);
        assert!(is_size_refusal(&closed(
            precondition.clone(),
            "PRECONDITION_FAILED - message size 200 is larger than configured max size 100"
        )));
        assert!(is_size_refusal(&closed(
            precondition.clone(),
            "PRECONDITION_FAILED - message size 600000000 is larger than max size 536870912"
        )));
        assert!(!is_size_refusal(&closed(
            precondition,
            "PRECONDITION_FAILED - inequivalent arg 'durable'"
        )));
        assert!(!is_size_refusal(&closed(
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED),
            "ACCESS_REFUSED - access to exchange 'amq.default' refused"
        )));
        assert!(!is_size_refusal(&Unconfirmed::Nack));
    }

    #[test]
    fn copies_keep_identity_but_not_user_or_expiration() {
        let mut h = FieldTable::default();
        h.insert("a".into(), long_string("1"));
        let p = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_user_id("someone-else".into())
            .with_cluster_id("c".into())
            .with_expiration("60000".into())
            .with_correlation_id("corr".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(1)
            .with_headers(h.clone());
        let c = copy_properties(&p, h.clone(), Some("250".into()));
        assert_eq!(c.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(c.correlation_id().as_ref().map(|s| s.as_str()), Some("corr"));
        assert_eq!(
            c.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(c.expiration().as_ref().map(|s| s.as_str()), Some("250"));
        assert_eq!(c.user_id(), &None);
        assert_eq!(c.cluster_id(), &None);
        assert_eq!(c.delivery_mode(), &Some(2), "copies are persistent");
        assert_eq!(c.headers().as_ref(), Some(&h));
        let dl = copy_properties(&p, h, None);
        assert_eq!(dl.expiration(), &None, "dead letters never expire");
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        assert_eq!(truncate("ééé", 3), "é");
    }
}
