//! The request fingerprint: what makes "the same key with another request" detectable.

use std::borrow::Cow;

use http::Method;
use sha2::{Digest, Sha256};

/// SHA-256 over the method, the matched route, the normalised path, the canonical query and
/// the body bytes, each length-prefixed (4-byte big-endian) so no two different requests share
/// an input.
///
/// The path is the concrete one (`/pay/a1`, not the route `/pay/{account}`), so one key sent
/// to two resources of one route is two requests. It is normalised as RFC 3986 §6.2.2 allows
/// without knowing the application: percent-encoded unreserved characters are decoded
/// (`/pay/%61%31` is `/pay/a1`) and the hex digits of the other escapes are upper-cased
/// (`%2f` is `%2F`). Nothing else: case and a trailing slash are significant, as they are to
/// the router, and an encoded reserved character (`%2F`) stays apart from the character
/// itself. So two spellings that a router could route to different resources never share a
/// fingerprint; a spelling that differs otherwise is refused (422), never run twice.
///
/// The canonical query is the query string's `&`-separated pairs, empty ones dropped,
/// normalised as the path is, sorted bytewise and joined with `&`: `?b=2&a=1` and `?a=1&b=2`
/// are the same request. The body is compared byte for byte: a client that re-serialises its
/// JSON differently on a retry sends another request.
pub fn fingerprint(method: &Method, route: &str, path: &str, query: Option<&str>, body: &[u8]) -> [u8; 32] {
    let path = normalize(path);
    let query = canonical_query(query.unwrap_or(""));
    digest([
        method.as_str().as_bytes(),
        route.as_bytes(),
        path.as_bytes(),
        query.as_bytes(),
        body,
    ])
}

/// `&`-separated pairs, empty ones dropped, percent-encoding normalised (see [`fingerprint()`]),
/// sorted, joined with `&`.
pub fn canonical_query(query: &str) -> String {
    let mut pairs: Vec<Cow<'_, str>> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(normalize)
        .collect();
    pairs.sort_unstable();
    pairs.join("&")
}

/// The fingerprint of txinbox-http 0.1 pre-releases, which left the path out: method, route,
/// the query's pairs sorted as sent, body. Only to recognise records stored before the
/// upgrade; they expire after the TTL, and this goes with them in a later release.
pub(crate) fn legacy_fingerprint(method: &Method, route: &str, query: Option<&str>, body: &[u8]) -> [u8; 32] {
    let mut pairs: Vec<&str> = query.unwrap_or("").split('&').filter(|p| !p.is_empty()).collect();
    pairs.sort_unstable();
    let query = pairs.join("&");
    digest([
        method.as_str().as_bytes(),
        route.as_bytes(),
        query.as_bytes(),
        body,
    ])
}

/// Whether a record with the [`legacy_fingerprint`] identifies the request: only when the
/// scope's route is the path itself (a route without parameters, or a request outside a
/// router). On a route with parameters it may have been another resource's.
pub(crate) fn legacy_identifies(route: &str, path: &str) -> bool {
    route == path && !route.contains('{')
}

fn digest<const N: usize>(parts: [&[u8]; N]) -> [u8; 32] {
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u32).to_be_bytes());
        h.update(part);
    }
    h.finalize().into()
}

/// RFC 3986 §6.2.2.1–2: unreserved characters decoded, other escapes with upper-case hex.
/// A `%` not followed by two hex digits is left as it is.
pub(crate) fn normalize(s: &str) -> Cow<'_, str> {
    if !s.contains('%') {
        return Cow::Borrowed(s);
    }
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        let escape = match b[i] {
            b'%' if i + 2 < b.len() => hex(b[i + 1]).zip(hex(b[i + 2])),
            _ => None,
        };
        match escape {
            Some((hi, lo)) => {
                let c = hi << 4 | lo;
                if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                    out.push(c as char);
                } else {
                    out.push('%');
                    out.push(HEX[hi as usize] as char);
                    out.push(HEX[lo as usize] as char);
                }
                i += 3;
            }
            None => {
                let len = utf8_len(b[i]);
                out.push_str(&s[i..i + len]);
                i += len;
            }
        }
    }
    Cow::Owned(out)
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn hex(c: u8) -> Option<u8> {
    (c as char).to_digit(16).map(|d| d as u8)
}

/// The length of the UTF-8 sequence that starts with `first` (1 for ASCII).
fn utf8_len(first: u8) -> usize {
    match first {
        0xF0.. => 4,
        0xE0.. => 3,
        0xC0.. => 2,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(path: &str, query: Option<&str>, body: &[u8]) -> [u8; 32] {
        fingerprint(&Method::POST, "/p/{id}", path, query, body)
    }

    #[test]
    fn query_order_does_not_matter() {
        assert_eq!(canonical_query("b=2&a=1&&"), "a=1&b=2");
        assert_eq!(
            fp("/p/1", Some("b=2&a=1"), b"x"),
            fp("/p/1", Some("a=1&b=2"), b"x")
        );
    }

    #[test]
    fn every_part_counts() {
        let base = fp("/p/1", None, b"x");
        assert_ne!(base, fingerprint(&Method::PUT, "/p/{id}", "/p/1", None, b"x"));
        assert_ne!(base, fingerprint(&Method::POST, "/q/{id}", "/p/1", None, b"x"));
        assert_ne!(base, fp("/p/2", None, b"x"), "another resource of the route");
        assert_ne!(base, fp("/p/1", Some("a=1"), b"x"));
        assert_ne!(base, fp("/p/1", None, b"y"));
        // Length prefixes keep the boundaries.
        assert_ne!(fp("/p/1a", None, b""), fp("/p/1", Some("a"), b""));
    }

    #[test]
    fn spellings_of_one_resource_share_a_fingerprint() {
        assert_eq!(normalize("/pay/%61%31"), "/pay/a1");
        assert_eq!(normalize("/p/%7e%2D%2e%5F"), "/p/~-._");
        assert_eq!(normalize("/p/a%2fb%c3%A9"), "/p/a%2Fb%C3%A9");
        assert_eq!(fp("/p/%61", None, b""), fp("/p/a", None, b""));
        assert_eq!(fp("/p/a%2fb", None, b""), fp("/p/a%2Fb", None, b""));
        assert_eq!(fp("/p/1", Some("q=%61"), b""), fp("/p/1", Some("q=a"), b""));
    }

    #[test]
    fn what_a_router_tells_apart_stays_apart() {
        // Case, a trailing slash, an encoded reserved character and the character itself.
        assert_ne!(fp("/p/a", None, b""), fp("/p/A", None, b""));
        assert_ne!(fp("/p/a", None, b""), fp("/p/a/", None, b""));
        assert_ne!(fp("/p/a%2Fb", None, b""), fp("/p/a/b", None, b""));
        assert_ne!(fp("/p/1", Some("a=%26b"), b""), fp("/p/1", Some("a=&b"), b""));
    }

    #[test]
    fn malformed_escapes_and_multibyte_text_are_kept() {
        assert_eq!(normalize("/p/%"), "/p/%");
        assert_eq!(normalize("/p/%4"), "/p/%4");
        assert_eq!(normalize("/p/%zz%41"), "/p/%zzA");
        assert_eq!(normalize("/p/é%41"), "/p/éA");
    }

    #[test]
    fn legacy_records_identify_the_request_only_without_parameters() {
        assert!(legacy_identifies("/payments", "/payments"));
        assert!(!legacy_identifies("/pay/{account}", "/pay/a1"));
        assert!(!legacy_identifies("/pay/{account}", "/pay/{account}"));
        // The pre-release formula, unchanged.
        let mut h = Sha256::new();
        for part in [&b"POST"[..], b"/p", b"a=1&b=2", b"x"] {
            h.update((part.len() as u32).to_be_bytes());
            h.update(part);
        }
        let old: [u8; 32] = h.finalize().into();
        assert_eq!(
            legacy_fingerprint(&Method::POST, "/p", Some("b=2&a=1"), b"x"),
            old
        );
    }
}
