//! The request fingerprint: what makes "the same key with another request" detectable.

use http::Method;
use sha2::{Digest, Sha256};

/// SHA-256 over the method, the matched route, the canonical query and the body bytes, each
/// length-prefixed (4-byte big-endian) so no two different requests share an input.
///
/// The canonical query is the query string's `&`-separated pairs, empty ones dropped, sorted
/// bytewise and joined with `&`: `?b=2&a=1` and `?a=1&b=2` are the same request. Pairs are
/// compared as sent (no percent-decoding). The body is compared byte for byte: a client that
/// re-serialises its JSON differently on a retry sends another request.
pub fn fingerprint(method: &Method, route: &str, query: Option<&str>, body: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    let query = canonical_query(query.unwrap_or(""));
    for part in [
        method.as_str().as_bytes(),
        route.as_bytes(),
        query.as_bytes(),
        body,
    ] {
        h.update((part.len() as u32).to_be_bytes());
        h.update(part);
    }
    h.finalize().into()
}

/// `&`-separated pairs, empty ones dropped, sorted, joined with `&`.
pub fn canonical_query(query: &str) -> String {
    let mut pairs: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
    pairs.sort_unstable();
    pairs.join("&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_order_does_not_matter() {
        assert_eq!(canonical_query("b=2&a=1&&"), "a=1&b=2");
        let a = fingerprint(&Method::POST, "/p", Some("b=2&a=1"), b"x");
        let b = fingerprint(&Method::POST, "/p", Some("a=1&b=2"), b"x");
        assert_eq!(a, b);
    }

    #[test]
    fn every_part_counts() {
        let base = fingerprint(&Method::POST, "/p", None, b"x");
        assert_ne!(base, fingerprint(&Method::PUT, "/p", None, b"x"));
        assert_ne!(base, fingerprint(&Method::POST, "/q", None, b"x"));
        assert_ne!(base, fingerprint(&Method::POST, "/p", Some("a=1"), b"x"));
        assert_ne!(base, fingerprint(&Method::POST, "/p", None, b"y"));
        // Length prefixes keep the boundaries.
        assert_ne!(
            fingerprint(&Method::POST, "/pa", None, b""),
            fingerprint(&Method::POST, "/p", Some("a"), b"")
        );
    }
}
