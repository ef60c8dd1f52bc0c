//! The broker-neutral message, its identity and its fingerprint.
//!
//! Payloads and headers are untrusted bytes: nothing here panics on invalid UTF-8, missing
//! headers or malformed JSON. A message whose identity cannot be derived gets a
//! [`MissingId`] and is dead-lettered by the runtime, never processed without deduplication.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// Longest message ID accepted, in bytes. Longer IDs are dead-lettered as `invalid_id`.
pub const MAX_ID_LEN: usize = 1024;

/// One message as a handler sees it, whatever broker it came from.
///
/// Adapters build it with [`Message::new`] and the `with_*` methods; handlers read it.
/// Cloning is cheap: the payload and key are reference-counted [`Bytes`].
#[derive(Debug, Clone)]
pub struct Message {
    payload: Bytes,
    key: Option<Bytes>,
    headers: Headers,
    origin: Origin,
    native_id: Option<String>,
    redelivered: bool,
}

impl Message {
    /// A message with this payload, received from `origin`.
    pub fn new(payload: impl Into<Bytes>, origin: Origin) -> Self {
        Message {
            payload: payload.into(),
            key: None,
            headers: Headers::default(),
            origin,
            native_id: None,
            redelivered: false,
        }
    }

    /// Sets the partitioning key (Kafka record key, or any key the broker carries).
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the headers.
    pub fn with_headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// Sets the broker's own message identifier (AMQP `message_id` property), used by
    /// [`IdStrategy::Native`]. Never pass a delivery tag or any per-connection counter here.
    pub fn with_native_id(mut self, id: impl Into<String>) -> Self {
        self.native_id = Some(id.into());
        self
    }

    /// Marks the message as a redelivery (the broker says it may have been seen before).
    pub fn with_redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }

    /// The payload bytes, exactly as received.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The partitioning key, if the broker carries one.
    pub fn key(&self) -> Option<&Bytes> {
        self.key.as_ref()
    }

    /// The headers (AMQP headers table, Kafka record headers).
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// Where the message came from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The broker's own message identifier, if it has one.
    pub fn native_id(&self) -> Option<&str> {
        self.native_id.as_deref()
    }

    /// Whether the broker flagged this delivery as a redelivery. A hint only: the inbox, not this
    /// flag, decides what is a duplicate.
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// The message type, for routing: the CloudEvents `type` (binary-mode header `ce_type`,
    /// `cloudEvents:type` or `cloudEvents_type`), else a `type` header.
    pub fn message_type(&self) -> Option<&str> {
        ["ce_type", "cloudEvents:type", "cloudEvents_type", "type"]
            .iter()
            .find_map(|name| self.headers.get_str(name))
    }

    /// Decodes the payload as JSON into `T`.
    ///
    /// A decoding failure is a [`HandlerError`](crate::HandlerError) that is *permanent* and
    /// carries the `undecodable` dead-letter reason: a malformed payload will not decode on a
    /// retry either, so it must not wedge its lane.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, crate::HandlerError> {
        serde_json::from_slice(&self.payload).map_err(crate::HandlerError::undecodable)
    }
}

/// Where a message came from, in OpenTelemetry messaging terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// `messaging.system`: `kafka`, `rabbitmq`, `memory`, …
    pub system: &'static str,
    /// `messaging.destination.name`: topic or queue.
    pub destination: Arc<str>,
    /// Kafka partition, when there is one.
    pub partition: Option<i32>,
    /// Kafka offset (or another per-partition sequence number), when there is one.
    pub offset: Option<i64>,
}

impl Origin {
    /// An origin with no partition or offset.
    pub fn new(system: &'static str, destination: impl Into<Arc<str>>) -> Self {
        Origin {
            system,
            destination: destination.into(),
            partition: None,
            offset: None,
        }
    }

    /// Adds partition and offset coordinates.
    pub fn at(mut self, partition: i32, offset: i64) -> Self {
        self.partition = Some(partition);
        self.offset = Some(offset);
        self
    }
}

/// Message headers: an ordered list of name/value pairs whose values are untrusted bytes.
///
/// Lookups are exact-match on the name; the first occurrence wins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, Bytes)>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Headers(Vec::new())
    }

    /// Appends a header.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<Bytes>) {
        self.0.push((name.into(), value.into()));
    }

    /// Appends a header, builder style.
    pub fn with(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.insert(name, value);
        self
    }

    /// The raw value of the first header called `name`.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_ref())
    }

    /// The value of the first header called `name`, if it is valid UTF-8.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// All headers in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_ref()))
    }

    /// Number of headers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Total size of names and values in bytes, for the size limit.
    pub(crate) fn byte_len(&self) -> usize {
        self.0.iter().map(|(n, v)| n.len() + v.len()).sum()
    }
}

/// How a message's identity is derived. The strategy's [label](IdStrategy::label) is recorded
/// on every inbox row, so an operator can tell which rule produced an ID.
///
/// Never the AMQP delivery tag, never an in-memory counter: those change on redelivery and would
/// turn every redelivery into a "new" message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdStrategy {
    /// The broker's own message ID ([`Message::native_id`]): the AMQP `message_id` property.
    Native,
    /// A named header, e.g. the Debezium outbox `id` header.
    Header(String),
    /// CloudEvents: binary mode headers (`ce_id` on Kafka, `cloudEvents:id` or `cloudEvents_id`
    /// on AMQP) first, else structured mode (the `id` member of a JSON payload that has a
    /// `specversion` member).
    CloudEvents,
    /// A JSON pointer (RFC 6901, e.g. `/event/id`) into the payload; the target must be a
    /// string or an integer.
    JsonPointer(String),
    /// The source coordinates `destination/partition/offset`. Correct for a Kafka topic whose
    /// producers never send the same event twice; it does not catch producer-side duplicates.
    Offset,
    /// SHA-256 of the payload: two messages with identical bytes are the same message.
    PayloadHash,
}

impl IdStrategy {
    /// The stable name recorded on inbox rows, e.g. `header:ce_id` or `json:/id`.
    pub fn label(&self) -> String {
        match self {
            IdStrategy::Native => "native".into(),
            IdStrategy::Header(name) => format!("header:{name}"),
            IdStrategy::CloudEvents => "cloudevents".into(),
            IdStrategy::JsonPointer(ptr) => format!("json:{ptr}"),
            IdStrategy::Offset => "offset".into(),
            IdStrategy::PayloadHash => "sha256".into(),
        }
    }

    /// Checks the strategy's own configuration (for example a JSON pointer's syntax).
    pub(crate) fn validate(&self) -> Result<(), String> {
        match self {
            IdStrategy::Header(name) if name.is_empty() => {
                Err("IdStrategy::Header needs a non-empty header name".into())
            }
            IdStrategy::JsonPointer(ptr) if !ptr.is_empty() && !ptr.starts_with('/') => Err(format!(
                "IdStrategy::JsonPointer({ptr:?}) must be empty or start with '/', as in \"/id\""
            )),
            _ => Ok(()),
        }
    }

    /// Derives the ID of `message`.
    pub fn derive(&self, message: &Message) -> Result<MessageId, MissingId> {
        let missing = || MissingId {
            strategy: self.label(),
        };
        let value = match self {
            IdStrategy::Native => message.native_id().map(str::to_owned),
            IdStrategy::Header(name) => message.headers().get_str(name).map(str::to_owned),
            IdStrategy::CloudEvents => ["ce_id", "cloudEvents:id", "cloudEvents_id"]
                .iter()
                .find_map(|h| message.headers().get_str(h))
                .map(str::to_owned)
                .or_else(|| {
                    let v: serde_json::Value = serde_json::from_slice(message.payload()).ok()?;
                    v.get("specversion")?;
                    json_scalar(v.get("id")?)
                }),
            IdStrategy::JsonPointer(ptr) => serde_json::from_slice::<serde_json::Value>(message.payload())
                .ok()
                .and_then(|v| v.pointer(ptr).and_then(json_scalar)),
            IdStrategy::Offset => {
                let o = message.origin();
                match (o.partition, o.offset) {
                    (Some(p), Some(off)) => Some(format!("{}/{p}/{off}", o.destination)),
                    _ => None,
                }
            }
            IdStrategy::PayloadHash => Some(hex(&Sha256::digest(message.payload()))),
        };
        match value {
            Some(v) if !v.is_empty() => Ok(MessageId {
                value: v,
                strategy: self.label(),
            }),
            _ => Err(missing()),
        }
    }
}

fn json_scalar(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    }
}

/// A message's identity, and the strategy that produced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageId {
    value: String,
    strategy: String,
}

impl MessageId {
    /// The ID itself.
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// The [label](IdStrategy::label) of the strategy that produced it.
    pub fn strategy(&self) -> &str {
        &self.strategy
    }

    /// Why this ID cannot be stored, if it cannot: too long, or containing NUL (which
    /// PostgreSQL text cannot hold). Such messages are dead-lettered as `invalid_id`.
    pub(crate) fn problem(&self) -> Option<String> {
        if self.value.len() > MAX_ID_LEN {
            Some(format!(
                "message ID is {} bytes long; the limit is {MAX_ID_LEN}",
                self.value.len()
            ))
        } else if self.value.contains('\0') {
            Some("message ID contains a NUL character".into())
        } else {
            None
        }
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.value)
    }
}

/// The message carried no ID under the configured strategy.
#[derive(Debug, Clone)]
pub struct MissingId {
    strategy: String,
}

impl fmt::Display for MissingId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the message has no ID under strategy `{}`; the producer must set it, or configure another IdStrategy",
            self.strategy
        )
    }
}

impl std::error::Error for MissingId {}

/// How the payload fingerprint is computed. The fingerprint tells a duplicate (same ID, same
/// fingerprint) from a conflict (same ID, other fingerprint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fingerprint {
    /// SHA-256 of the payload bytes exactly as received.
    #[default]
    PayloadBytes,
    /// SHA-256 of the payload parsed as JSON and re-serialised with sorted object keys and no
    /// insignificant whitespace, so producers that re-encode the same event are not flagged as
    /// conflicts. A payload that is not JSON falls back to its bytes.
    CanonicalJson,
}

impl Fingerprint {
    /// The 32-byte fingerprint of `message`.
    pub fn of(self, message: &Message) -> [u8; 32] {
        match self {
            Fingerprint::PayloadBytes => Sha256::digest(message.payload()).into(),
            Fingerprint::CanonicalJson => {
                match serde_json::from_slice::<serde_json::Value>(message.payload()) {
                    // serde_json's Map is ordered by key unless `preserve_order` is enabled.
                    Ok(v) => Sha256::digest(v.to_string().as_bytes()).into(),
                    Err(_) => Sha256::digest(message.payload()).into(),
                }
            }
        }
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(payload: &'static [u8]) -> Message {
        Message::new(payload, Origin::new("memory", "q").at(3, 42))
    }

    #[test]
    fn strategies_derive_ids_and_report_missing_ones() {
        let m = msg(br#"{"specversion":"1.0","id":"evt-1","data":{"n":7}}"#)
            .with_headers(Headers::new().with("x-id", "h-1").with("bad", &b"\xff\xfe"[..]))
            .with_native_id("amqp-1");
        assert_eq!(IdStrategy::Native.derive(&m).unwrap().as_str(), "amqp-1");
        assert_eq!(
            IdStrategy::Header("x-id".into()).derive(&m).unwrap().as_str(),
            "h-1"
        );
        assert!(
            IdStrategy::Header("bad".into()).derive(&m).is_err(),
            "invalid UTF-8 is no ID"
        );
        assert_eq!(IdStrategy::CloudEvents.derive(&m).unwrap().as_str(), "evt-1");
        assert_eq!(
            IdStrategy::JsonPointer("/data/n".into())
                .derive(&m)
                .unwrap()
                .as_str(),
            "7"
        );
        assert_eq!(IdStrategy::Offset.derive(&m).unwrap().as_str(), "q/3/42");
        assert_eq!(IdStrategy::PayloadHash.derive(&m).unwrap().as_str().len(), 64);

        let bare = msg(b"not json");
        for s in [
            IdStrategy::Native,
            IdStrategy::Header("x-id".into()),
            IdStrategy::CloudEvents,
            IdStrategy::JsonPointer("/id".into()),
        ] {
            let err = s.derive(&bare).unwrap_err();
            assert!(err.to_string().contains(&s.label()), "{err}");
        }
    }

    #[test]
    fn cloudevents_binary_header_wins_over_structured_body() {
        let m =
            msg(br#"{"specversion":"1.0","id":"body"}"#).with_headers(Headers::new().with("ce_id", "header"));
        assert_eq!(IdStrategy::CloudEvents.derive(&m).unwrap().as_str(), "header");
        // A JSON body without `specversion` is not a structured CloudEvent.
        let plain = msg(br#"{"id":"x"}"#);
        assert!(IdStrategy::CloudEvents.derive(&plain).is_err());
    }

    #[test]
    fn canonical_json_fingerprint_ignores_key_order_and_whitespace() {
        let a = msg(br#"{"a":1,"b":[1,2]}"#);
        let b = msg(br#"{ "b": [1, 2], "a": 1 }"#);
        let c = msg(br#"{"a":2,"b":[1,2]}"#);
        assert_ne!(Fingerprint::PayloadBytes.of(&a), Fingerprint::PayloadBytes.of(&b));
        assert_eq!(
            Fingerprint::CanonicalJson.of(&a),
            Fingerprint::CanonicalJson.of(&b)
        );
        assert_ne!(
            Fingerprint::CanonicalJson.of(&a),
            Fingerprint::CanonicalJson.of(&c)
        );
    }

    #[test]
    fn unstorable_ids_are_reported() {
        let id = |v: &str| MessageId {
            value: v.into(),
            strategy: "x".into(),
        };
        assert!(id("ok").problem().is_none());
        assert!(id("a\0b").problem().is_some());
        assert!(id(&"x".repeat(MAX_ID_LEN + 1)).problem().is_some());
    }
}
