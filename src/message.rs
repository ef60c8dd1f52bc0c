//! The broker-neutral message, its identity and its fingerprint.
//!
//! Payloads and headers are untrusted bytes: nothing here panics on invalid UTF-8, missing
//! headers or malformed JSON. A message whose identity cannot be derived gets a
//! [`IdError`] and is dead-lettered by the runtime, never processed without deduplication.

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
    timestamp: Option<Timestamp>,
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
            timestamp: None,
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

    /// Sets the broker's timestamp of the message (the Kafka record timestamp).
    pub fn with_timestamp(mut self, timestamp: Timestamp) -> Self {
        self.timestamp = Some(timestamp);
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

    /// The broker's timestamp of the message, and what it means: on Kafka the record timestamp,
    /// set by the producer ([`TimestampKind::CreateTime`]) or by the broker when it appended
    /// the record ([`TimestampKind::LogAppendTime`]), as the topic's `message.timestamp.type`
    /// says. `None` when the broker gives none (the in-memory broker, AMQP, a record without
    /// one).
    pub fn timestamp(&self) -> Option<Timestamp> {
        self.timestamp
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
        self.decode(|p| serde_json::from_slice(p))
    }

    /// Decodes the payload with any codec: `msg.decode(|p| Order::decode(p))?` (prost),
    /// `msg.decode(|p| ciborium::from_reader(p))?`, ….
    ///
    /// As with [`json`](Self::json), a failure is *permanent* with the `undecodable`
    /// dead-letter reason: the same bytes fail the same way on every attempt. Use it for
    /// decoding the payload only; an error of `decode` that a retry may fix (it read from
    /// elsewhere) would be dead-lettered too.
    pub fn decode<T, E>(&self, decode: impl FnOnce(&[u8]) -> Result<T, E>) -> Result<T, crate::HandlerError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        decode(&self.payload).map_err(crate::HandlerError::undecodable)
    }
}

/// A broker's timestamp of a message: milliseconds since the Unix epoch, and who set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp {
    /// Milliseconds since the Unix epoch (UTC).
    pub millis: i64,
    /// Who set it.
    pub kind: TimestampKind,
}

impl Timestamp {
    /// A timestamp of `millis` milliseconds since the Unix epoch, set as `kind` says.
    pub fn new(millis: i64, kind: TimestampKind) -> Self {
        Timestamp { millis, kind }
    }

    /// As a [`SystemTime`](std::time::SystemTime).
    pub fn to_system_time(&self) -> std::time::SystemTime {
        let magnitude = std::time::Duration::from_millis(self.millis.unsigned_abs());
        if self.millis >= 0 {
            std::time::UNIX_EPOCH + magnitude
        } else {
            std::time::UNIX_EPOCH - magnitude
        }
    }
}

/// Who set a [`Timestamp`]: Kafka's two timestamp types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimestampKind {
    /// The producer's clock when it created the record (`message.timestamp.type=CreateTime`,
    /// Kafka's default): the event's time as the producer says, which may be late or skewed.
    CreateTime,
    /// The broker's clock when it appended the record to the log
    /// (`message.timestamp.type=LogAppendTime`).
    LogAppendTime,
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

    /// Removes every header called `name`, then appends `value` under that name, if any.
    #[cfg(feature = "otel")]
    pub(crate) fn replace(&mut self, name: &str, value: Option<impl Into<Bytes>>) {
        self.0.retain(|(n, _)| n != name);
        if let Some(value) = value {
            self.0.push((name.into(), value.into()));
        }
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
        self.label_cow().into_owned()
    }

    /// [`label`](Self::label), without an allocation for the strategies without a parameter:
    /// every message's ID carries it.
    fn label_cow(&self) -> std::borrow::Cow<'static, str> {
        match self {
            IdStrategy::Native => "native".into(),
            IdStrategy::Header(name) => format!("header:{name}").into(),
            IdStrategy::CloudEvents => "cloudevents".into(),
            IdStrategy::JsonPointer(ptr) => format!("json:{ptr}").into(),
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

    /// Derives the ID of `message`: `Ok` only for an ID that can be stored (at most
    /// [`MAX_ID_LEN`] bytes, no NUL character).
    pub fn derive(&self, message: &Message) -> Result<MessageId, IdError> {
        self.derive_from(message, true)
    }

    /// [`derive`](Self::derive), without looking into the payload when `read_payload` is
    /// false (a message over the size limit): strategies that need it (JSON pointer, a
    /// structured CloudEvent, the payload hash) then report the ID missing. The value is
    /// checked before it is copied.
    pub(crate) fn derive_from(&self, message: &Message, read_payload: bool) -> Result<MessageId, IdError> {
        let parsed;
        let payload_json = |ptr: Option<&str>| -> Option<serde_json::Value> {
            if !read_payload {
                return None;
            }
            let v: serde_json::Value = serde_json::from_slice(message.payload()).ok()?;
            match ptr {
                Some(ptr) => v.pointer(ptr).cloned(),
                None => Some(v),
            }
        };
        let value: Option<std::borrow::Cow<'_, str>> = match self {
            IdStrategy::Native => message.native_id().map(Into::into),
            IdStrategy::Header(name) => message.headers().get_str(name).map(Into::into),
            IdStrategy::CloudEvents => match ["ce_id", "cloudEvents:id", "cloudEvents_id"]
                .iter()
                .find_map(|h| message.headers().get_str(h))
            {
                Some(v) => Some(v.into()),
                None => {
                    parsed = payload_json(None);
                    parsed
                        .as_ref()
                        .filter(|v| v.get("specversion").is_some())
                        .and_then(|v| json_scalar(v.get("id")?))
                        .map(Into::into)
                }
            },
            IdStrategy::JsonPointer(ptr) => payload_json(Some(ptr))
                .as_ref()
                .and_then(json_scalar)
                .map(Into::into),
            IdStrategy::Offset => {
                let o = message.origin();
                match (o.partition, o.offset) {
                    (Some(p), Some(off)) => Some(format!("{}/{p}/{off}", o.destination).into()),
                    _ => None,
                }
            }
            IdStrategy::PayloadHash if read_payload => Some(hex(&Sha256::digest(message.payload())).into()),
            IdStrategy::PayloadHash => None,
        };
        let value = match value {
            Some(v) if !v.is_empty() => v,
            _ => {
                return Err(IdError::Missing {
                    strategy: self.label(),
                })
            }
        };
        let invalid = |problem: String| IdError::Invalid {
            strategy: self.label(),
            problem,
        };
        if value.len() > MAX_ID_LEN {
            return Err(invalid(format!(
                "the message ID is {} bytes long; the limit is {MAX_ID_LEN}",
                value.len()
            )));
        }
        if value.contains('\0') {
            return Err(invalid("the message ID contains a NUL character".into()));
        }
        Ok(MessageId {
            value: value.into_owned(),
            strategy: self.label_cow(),
        })
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
    strategy: std::borrow::Cow<'static, str>,
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
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.value)
    }
}

/// Why a message has no usable ID. The runtime dead-letters such a message
/// ([`reason`](IdError::reason)), never processes it without deduplication.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdError {
    /// The message carries no ID under the strategy.
    Missing {
        /// The strategy's [label](IdStrategy::label).
        strategy: String,
    },
    /// The ID cannot be stored: longer than [`MAX_ID_LEN`] bytes, or containing NUL.
    Invalid {
        /// The strategy's [label](IdStrategy::label).
        strategy: String,
        /// What is wrong with it.
        problem: String,
    },
}

impl IdError {
    /// The dead-letter reason: `missing_id` or `invalid_id`.
    pub fn reason(&self) -> crate::dead_letter::DeadLetterReason {
        match self {
            IdError::Missing { .. } => crate::dead_letter::DeadLetterReason::MissingId,
            IdError::Invalid { .. } => crate::dead_letter::DeadLetterReason::InvalidId,
        }
    }
}

impl fmt::Display for IdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdError::Missing { strategy } => write!(
                f,
                "the message has no ID under strategy `{strategy}`; the producer must set it, or configure another IdStrategy"
            ),
            IdError::Invalid { strategy, problem } => write!(
                f,
                "{problem} (strategy `{strategy}`); such a message cannot be deduplicated"
            ),
        }
    }
}

impl std::error::Error for IdError {}

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
                    Ok(v) => {
                        let mut canonical = String::with_capacity(message.payload().len());
                        write_canonical(&v, &mut canonical);
                        Sha256::digest(canonical.as_bytes()).into()
                    }
                    Err(_) => Sha256::digest(message.payload()).into(),
                }
            }
        }
    }
}

/// Writes `v` as canonical JSON: object keys sorted by their bytes, no insignificant
/// whitespace, integers as integers and every other number as the shortest text of its `f64`.
///
/// NOTE: written out rather than `v.to_string()`, whose key order is serde_json's `Map` order:
/// sorted by default, but insertion order as soon as any crate in the build turns on serde_json's
/// `preserve_order` feature (features unify across the dependency graph), and whose number text
/// follows the input under `arbitrary_precision`. A fingerprint must not change with the
/// application's dependencies: it would turn every redelivery into a conflict.
fn write_canonical(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                out.push_str(&serde_json::to_string(&f).unwrap_or_else(|_| "null".into()));
            }
        }
        Value::String(s) => out.push_str(&serde_json::to_string(s).expect("a string serializes")),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(key).expect("a string serializes"));
                out.push(':');
                write_canonical(value, out);
            }
            out.push('}');
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

/// Parses the [`label`](IdStrategy::label) of a strategy: `cloudevents`, `header:NAME`,
/// `json:/POINTER`, `sha256`, `offset` or `native`, e.g. from a command line. The error lists
/// the accepted forms.
///
/// ```
/// use txinbox::IdStrategy;
///
/// assert_eq!("header:event-id".parse(), Ok(IdStrategy::Header("event-id".into())));
/// assert!("uuid".parse::<IdStrategy>().unwrap_err().contains("header:NAME"));
/// ```
impl std::str::FromStr for IdStrategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let strategy = match s {
            "cloudevents" => IdStrategy::CloudEvents,
            "sha256" => IdStrategy::PayloadHash,
            "offset" => IdStrategy::Offset,
            "native" => IdStrategy::Native,
            _ => match (s.strip_prefix("header:"), s.strip_prefix("json:")) {
                (Some(name), _) if !name.is_empty() => IdStrategy::Header(name.into()),
                (_, Some(pointer)) if pointer.starts_with('/') => IdStrategy::JsonPointer(pointer.into()),
                _ => {
                    return Err(format!(
                        "`{s}` is not an ID strategy: use cloudevents, header:NAME, json:/POINTER, sha256, offset or native"
                    ))
                }
            },
        };
        Ok(strategy)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn id_strategies_parse_from_their_labels_and_nothing_else() {
        for strategy in [
            IdStrategy::CloudEvents,
            IdStrategy::PayloadHash,
            IdStrategy::Offset,
            IdStrategy::Native,
            IdStrategy::Header("ce_id".into()),
            IdStrategy::JsonPointer("/event/id".into()),
        ] {
            assert_eq!(strategy.label().parse(), Ok(strategy));
        }
        for bad in ["", "uuid", "header:", "json:", "json:id", "CloudEvents"] {
            let error = bad.parse::<IdStrategy>().unwrap_err();
            assert!(
                error.contains(&format!("`{bad}`"))
                    && error.contains("cloudevents, header:NAME, json:/POINTER"),
                "{error}"
            );
        }
    }

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
    fn unstorable_ids_are_refused_before_they_are_copied() {
        let with = |v: &str| msg(b"{}").with_headers(Headers::new().with("x-id", v.to_owned()));
        let header = IdStrategy::Header("x-id".into());
        assert_eq!(header.derive(&with("ok")).unwrap().as_str(), "ok");
        let nul = header.derive(&with("a\0b")).unwrap_err();
        assert_eq!(nul.reason(), crate::dead_letter::DeadLetterReason::InvalidId);
        assert!(nul.to_string().contains("NUL"), "{nul}");
        let long = header.derive(&with(&"x".repeat(MAX_ID_LEN + 1))).unwrap_err();
        assert_eq!(long.reason(), crate::dead_letter::DeadLetterReason::InvalidId);
        assert!(long.to_string().contains("1025 bytes"), "{long}");
        assert!(
            header.derive(&with(&"x".repeat(MAX_ID_LEN))).is_ok(),
            "the limit itself is fine"
        );
        assert_eq!(
            header.derive(&msg(b"{}")).unwrap_err().reason(),
            crate::dead_letter::DeadLetterReason::MissingId
        );
    }

    #[test]
    fn without_the_payload_only_header_and_offset_strategies_find_an_id() {
        let m = msg(br#"{"specversion":"1.0","id":"evt-1"}"#)
            .with_headers(Headers::new().with("x-id", "h-1"))
            .with_native_id("n-1");
        let found = |s: IdStrategy| s.derive_from(&m, false).ok().map(|id| id.as_str().to_owned());
        assert_eq!(found(IdStrategy::Native).as_deref(), Some("n-1"));
        assert_eq!(found(IdStrategy::Header("x-id".into())).as_deref(), Some("h-1"));
        assert_eq!(found(IdStrategy::Offset).as_deref(), Some("q/3/42"));
        assert_eq!(
            found(IdStrategy::CloudEvents),
            None,
            "structured mode needs the payload"
        );
        assert_eq!(found(IdStrategy::JsonPointer("/id".into())), None);
        assert_eq!(found(IdStrategy::PayloadHash), None);
    }

    /// Pinned: the canonical form, hence every stored `CanonicalJson` fingerprint, must not
    /// change with serde_json's features. The root crate's dev-dependencies turn on
    /// `preserve_order`, so this test runs with insertion-ordered maps.
    #[test]
    fn canonical_json_does_not_depend_on_serde_json_features() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b":{"z":1,"a":[1e2,-0.5,18446744073709551615]},"a":"\u00e9"}"#)
                .unwrap();
        let mut text = String::new();
        write_canonical(&v, &mut text);
        assert_eq!(
            text,
            r#"{"a":"é","b":{"a":[100.0,-0.5,18446744073709551615],"z":1}}"#
        );
        let m = msg(br#"{ "b" : {"a":[100.0, -0.5, 18446744073709551615], "z":1}, "a":"\u00e9"}"#);
        assert_eq!(
            hex(&Fingerprint::CanonicalJson.of(&m)),
            hex(&Sha256::digest(text.as_bytes())),
        );
    }
}
