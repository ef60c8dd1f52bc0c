//! Headers this crate writes: on retry and dead-letter copies, and on outbox messages.
//!
//! (Inside the crate: AMQP field tables to txinbox [`Headers`], and reading the retry
//! counter.)

use lapin::types::{AMQPValue, FieldTable};
use txinbox::message::Headers;

/// How often a message went through the retry queue (1 on the first retry copy).
/// Informational: attempts are counted in the inbox database, not here.
pub const RETRY: &str = "x-txinbox-retry";
/// Dead letters: the machine-readable reason (`permanent_error`, `missing_id`, …).
pub const REASON: &str = "x-txinbox-reason";
/// Dead letters: the human-readable error.
pub const ERROR: &str = "x-txinbox-error";
/// Dead letters: the queue the message was consumed from.
pub const ORIGINAL_QUEUE: &str = "x-txinbox-original-queue";
/// Dead letters: `omitted` when the copy leaves out the original headers (they did not fit in
/// a frame of the connection's `frame_max` beside the `x-txinbox-*` ones). The database's dead
/// letter keeps them.
pub const HEADERS: &str = "x-txinbox-headers";
/// Dead letters: `omitted` when the copy leaves out the payload (the broker refused its size,
/// `max_message_size`). The database's dead letter keeps it up to `dead_letter_payload_limit`.
pub const PAYLOAD: &str = "x-txinbox-payload";
/// Dead letters that leave something out: the payload's size in bytes (a long integer), as the
/// database's `payload_size`.
pub const ORIGINAL_SIZE: &str = "x-txinbox-original-size";
/// Dead letters that leave something out: the payload's SHA-256, lowercase hex, as the
/// database's `payload_sha256`.
pub const ORIGINAL_SHA256: &str = "x-txinbox-original-sha256";
/// Set by RabbitMQ on deliveries of a quorum queue: how often the message was given back
/// before (absent the first time). Never copied: a copy (retry, dead letter, fresh copy) is a new
/// message whose count starts over, and a stale count would read as its own.
pub const DELIVERY_COUNT: &str = "x-delivery-count";
/// Set by RabbitMQ 4.3+ on deliveries of a quorum queue: how often the message was handed to a
/// consumer. Never copied, as [`DELIVERY_COUNT`].
pub const ACQUIRED_COUNT: &str = "x-acquired-count";
/// Outbox messages: the row's key. A consumer that must apply one key's messages in order sets
/// [`AmqpConfig::lane_header`](crate::AmqpConfig::lane_header) to it.
pub const KEY: &str = "message-key";

/// Converts an AMQP headers table: strings become their UTF-8 (or raw) bytes, byte arrays
/// their bytes, numbers, booleans, decimals and timestamps their decimal string form, `void` an
/// empty value, arrays and nested tables compact JSON.
pub(crate) fn to_headers(table: Option<&FieldTable>) -> Headers {
    let mut headers = Headers::new();
    if let Some(table) = table {
        for (name, value) in table {
            headers.insert(name.as_str(), value_bytes(value));
        }
    }
    headers
}

fn value_bytes(value: &AMQPValue) -> Vec<u8> {
    match value {
        AMQPValue::LongString(s) => s.as_bytes().to_vec(),
        AMQPValue::ShortString(s) => s.as_str().as_bytes().to_vec(),
        AMQPValue::ByteArray(b) => b.as_slice().to_vec(),
        AMQPValue::Void => Vec::new(),
        AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_) => to_json(value).to_string().into_bytes(),
        scalar => scalar_string(scalar).unwrap_or_default().into_bytes(),
    }
}

fn scalar_string(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(v) => v.to_string(),
        AMQPValue::ShortShortUInt(v) => v.to_string(),
        AMQPValue::ShortInt(v) => v.to_string(),
        AMQPValue::ShortUInt(v) => v.to_string(),
        AMQPValue::LongInt(v) => v.to_string(),
        AMQPValue::LongUInt(v) => v.to_string(),
        AMQPValue::LongLongInt(v) => v.to_string(),
        AMQPValue::Float(v) => v.to_string(),
        AMQPValue::Double(v) => v.to_string(),
        AMQPValue::Timestamp(v) => v.to_string(),
        AMQPValue::DecimalValue(d) => {
            let digits = d.value.to_string();
            let scale = d.scale as usize;
            if scale == 0 {
                digits
            } else if digits.len() > scale {
                let (int, frac) = digits.split_at(digits.len() - scale);
                format!("{int}.{frac}")
            } else {
                format!("0.{}{digits}", "0".repeat(scale - digits.len()))
            }
        }
        _ => return None,
    })
}

fn to_json(value: &AMQPValue) -> serde_json::Value {
    use serde_json::Value;
    match value {
        AMQPValue::Void => Value::Null,
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::LongString(s) => Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::ByteArray(b) => Value::String(String::from_utf8_lossy(b.as_slice()).into_owned()),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(to_json).collect()),
        AMQPValue::FieldTable(t) => Value::Object(
            t.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), to_json(v)))
                .collect(),
        ),
        AMQPValue::DecimalValue(_) | AMQPValue::Float(_) | AMQPValue::Double(_) => {
            let s = scalar_string(value).unwrap_or_default();
            s.parse::<serde_json::Number>()
                .map(Value::Number)
                .unwrap_or(Value::String(s))
        }
        other => {
            let s = scalar_string(other).unwrap_or_default();
            s.parse::<serde_json::Number>()
                .map(Value::Number)
                .unwrap_or(Value::String(s))
        }
    }
}

/// Reads an integer header (any AMQP integer type, or a decimal string).
pub(crate) fn int_header(table: Option<&FieldTable>, name: &str) -> Option<i64> {
    match table?.inner().get(name)? {
        AMQPValue::ShortShortInt(v) => Some((*v).into()),
        AMQPValue::ShortShortUInt(v) => Some((*v).into()),
        AMQPValue::ShortInt(v) => Some((*v).into()),
        AMQPValue::ShortUInt(v) => Some((*v).into()),
        AMQPValue::LongInt(v) => Some((*v).into()),
        AMQPValue::LongUInt(v) => Some((*v).into()),
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.trim().parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().trim().parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{ByteArray, DecimalValue, FieldArray, LongString, ShortString};

    fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(ShortString::from(k), v);
        }
        t
    }

    #[test]
    fn values_convert_to_bytes() {
        let nested = table(vec![
            ("count", AMQPValue::LongLongInt(2)),
            ("queue", AMQPValue::LongString("q".into())),
        ]);
        let t = table(vec![
            ("s", AMQPValue::LongString("héllo".into())),
            ("raw", AMQPValue::LongString(LongString::from(vec![0xff, 0x00]))),
            ("short", AMQPValue::ShortString("abc".into())),
            ("bytes", AMQPValue::ByteArray(ByteArray::from(vec![1u8, 2, 3]))),
            ("bool", AMQPValue::Boolean(true)),
            ("i8", AMQPValue::ShortShortInt(-5)),
            ("u16", AMQPValue::ShortUInt(65535)),
            ("i64", AMQPValue::LongLongInt(-9_000_000_000)),
            ("f64", AMQPValue::Double(1.5)),
            (
                "dec",
                AMQPValue::DecimalValue(DecimalValue {
                    scale: 2,
                    value: 12345,
                }),
            ),
            (
                "dec_small",
                AMQPValue::DecimalValue(DecimalValue { scale: 3, value: 5 }),
            ),
            ("ts", AMQPValue::Timestamp(1_700_000_000)),
            ("void", AMQPValue::Void),
            (
                "arr",
                AMQPValue::FieldArray(FieldArray::from(vec![
                    AMQPValue::LongInt(1),
                    AMQPValue::LongString("two".into()),
                    AMQPValue::FieldTable(nested.clone()),
                ])),
            ),
            ("tbl", AMQPValue::FieldTable(nested)),
        ]);
        let h = to_headers(Some(&t));
        assert_eq!(h.len(), 15);
        assert_eq!(h.get_str("s"), Some("héllo"));
        assert_eq!(
            h.get("raw"),
            Some(&[0xff, 0x00][..]),
            "non-UTF-8 strings keep their bytes"
        );
        assert_eq!(h.get_str("short"), Some("abc"));
        assert_eq!(h.get("bytes"), Some(&[1u8, 2, 3][..]));
        assert_eq!(h.get_str("bool"), Some("true"));
        assert_eq!(h.get_str("i8"), Some("-5"));
        assert_eq!(h.get_str("u16"), Some("65535"));
        assert_eq!(h.get_str("i64"), Some("-9000000000"));
        assert_eq!(h.get_str("f64"), Some("1.5"));
        assert_eq!(h.get_str("dec"), Some("123.45"));
        assert_eq!(h.get_str("dec_small"), Some("0.005"));
        assert_eq!(h.get_str("ts"), Some("1700000000"));
        assert_eq!(h.get("void"), Some(&b""[..]));
        assert_eq!(h.get_str("arr"), Some(r#"[1,"two",{"count":2,"queue":"q"}]"#));
        assert_eq!(h.get_str("tbl"), Some(r#"{"count":2,"queue":"q"}"#));
        assert!(to_headers(None).is_empty());
    }

    #[test]
    fn cloudevents_amqp_binding_headers_feed_the_core_id_strategy() {
        use txinbox::{message::Origin, IdStrategy, Message};
        for name in ["cloudEvents:id", "cloudEvents_id"] {
            let t = table(vec![(name, AMQPValue::LongString("evt-9".into()))]);
            let m = Message::new(&b"{}"[..], Origin::new("rabbitmq", "q")).with_headers(to_headers(Some(&t)));
            assert_eq!(IdStrategy::CloudEvents.derive(&m).unwrap().as_str(), "evt-9");
        }
    }

    #[test]
    fn retry_counter_reads_any_integer_type() {
        let t = table(vec![
            ("a", AMQPValue::LongLongInt(3)),
            ("b", AMQPValue::ShortShortUInt(4)),
            ("c", AMQPValue::LongString("5".into())),
            ("d", AMQPValue::Boolean(true)),
        ]);
        assert_eq!(int_header(Some(&t), "a"), Some(3));
        assert_eq!(int_header(Some(&t), "b"), Some(4));
        assert_eq!(int_header(Some(&t), "c"), Some(5));
        assert_eq!(int_header(Some(&t), "d"), None);
        assert_eq!(int_header(Some(&t), "missing"), None);
        assert_eq!(int_header(None, "a"), None);
    }
}
