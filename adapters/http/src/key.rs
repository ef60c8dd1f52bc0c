//! The `Idempotency-Key` header: parsing and validation.

use std::fmt;

use http::HeaderMap;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header set on a replayed response.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Longest key accepted, in characters (Stripe's limit; keys are ASCII, so also bytes).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] printable ASCII characters.
///
/// The header may carry it as a Structured Field String (`"abc"`, the IETF draft's form, with
/// `\"` and `\\` escapes) or as a bare value (`abc`, what Stripe clients send); both give the
/// same key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The key's text (unquoted, unescaped).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Parses one header value. Surrounding spaces and tabs are ignored.
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let v = trim_ows(value);
        let key = match v.first() {
            Some(b'"') => parse_sf_string(v)?,
            _ => parse_bare(v)?,
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(key.len()));
        }
        Ok(IdempotencyKey(key))
    }

    /// The key of a request: `Ok(None)` without the header, an error when it is malformed or
    /// given more than once.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes()).map(Some)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why an `Idempotency-Key` header was refused (400).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters (its length).
    TooLong(usize),
    /// The header appears more than once.
    Repeated,
    /// The value is neither a Structured Field String nor a bare printable ASCII value.
    Malformed(&'static str),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("the Idempotency-Key is empty"),
            KeyError::TooLong(n) => write!(
                f,
                "the Idempotency-Key has {n} characters; at most {MAX_KEY_LEN} are accepted"
            ),
            KeyError::Repeated => f.write_str("the Idempotency-Key header is given more than once"),
            KeyError::Malformed(why) => write!(f, "the Idempotency-Key is malformed: {why}"),
        }
    }
}

impl std::error::Error for KeyError {}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// RFC 8941 §4.2.5: `"` then printable ASCII with `\"` and `\\` escapes, then `"`, nothing after.
fn parse_sf_string(v: &[u8]) -> Result<String, KeyError> {
    let mut out = String::with_capacity(v.len());
    let mut i = 1;
    while i < v.len() {
        match v[i] {
            b'\\' => match v.get(i + 1) {
                Some(&c @ (b'"' | b'\\')) => {
                    out.push(c as char);
                    i += 2;
                }
                _ => return Err(KeyError::Malformed("a backslash escapes only `\"` and `\\`")),
            },
            b'"' => {
                if i + 1 != v.len() {
                    return Err(KeyError::Malformed("characters after the closing quote"));
                }
                return Ok(out);
            }
            c @ 0x20..=0x7e => {
                out.push(c as char);
                i += 1;
            }
            _ => return Err(KeyError::Malformed("only printable ASCII characters are allowed")),
        }
    }
    Err(KeyError::Malformed("the quoted string is not closed"))
}

/// A bare value: printable ASCII without spaces, quotes or backslashes.
fn parse_bare(v: &[u8]) -> Result<String, KeyError> {
    for &c in v {
        match c {
            b'"' | b'\\' => {
                return Err(KeyError::Malformed(
                    "quotes and backslashes only inside a quoted string",
                ))
            }
            0x21..=0x7e => {}
            b' ' | b'\t' => return Err(KeyError::Malformed("spaces only inside a quoted string")),
            _ => return Err(KeyError::Malformed("only printable ASCII characters are allowed")),
        }
    }
    // Only printable ASCII bytes: valid UTF-8.
    Ok(String::from_utf8(v.to_vec()).expect("ASCII"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &str) -> Result<String, KeyError> {
        IdempotencyKey::parse(v.as_bytes()).map(|k| k.0)
    }

    #[test]
    fn quoted_and_bare_are_the_same_key() {
        assert_eq!(key("\"abc\"").unwrap(), "abc");
        assert_eq!(key("abc").unwrap(), "abc");
        assert_eq!(key("  \"abc\"\t").unwrap(), "abc");
        assert_eq!(
            key("8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
    }

    #[test]
    fn sf_string_escapes_and_spaces() {
        assert_eq!(key(r#""a \"b\" \\c""#).unwrap(), r#"a "b" \c"#);
        assert!(matches!(key(r#""a\x""#), Err(KeyError::Malformed(_))));
        assert!(matches!(key("\"abc"), Err(KeyError::Malformed(_))));
        assert!(matches!(key("\"abc\";p=1"), Err(KeyError::Malformed(_))));
        assert!(matches!(key("a b"), Err(KeyError::Malformed(_))));
        assert!(matches!(key("a\"b"), Err(KeyError::Malformed(_))));
        assert!(matches!(
            IdempotencyKey::parse(b"\"\xc3\xa9\""),
            Err(KeyError::Malformed(_))
        ));
    }

    #[test]
    fn length_is_bounded() {
        assert_eq!(key(""), Err(KeyError::Empty));
        assert_eq!(key("\"\""), Err(KeyError::Empty));
        let max = "k".repeat(MAX_KEY_LEN);
        assert_eq!(key(&max).unwrap(), max);
        assert_eq!(key(&format!("\"{max}\"")).unwrap(), max);
        assert_eq!(key(&"k".repeat(256)), Err(KeyError::TooLong(256)));
        // Escapes count once: 255 characters after unescaping.
        let escaped = format!("\"{}\\\\\"", "k".repeat(254));
        assert_eq!(key(&escaped).unwrap().len(), 255);
    }

    #[test]
    fn repeated_header_is_refused() {
        let mut h = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&h), Ok(None));
        h.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        assert_eq!(IdempotencyKey::from_headers(&h).unwrap().unwrap().as_str(), "a");
        h.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        assert_eq!(IdempotencyKey::from_headers(&h), Err(KeyError::Repeated));
    }
}
