//! Keeping secrets out of logs, errors and `Debug` output: one redaction for every connection
//! string and every configuration property txinbox and its adapters print.
//!
//! Everything here errs towards hiding too much: a host that is cut along with a password is a
//! nuisance, a password in a log aggregator is an incident.

/// The replacement for a secret.
pub const MASK: &str = "***";

/// `uri` with every secret replaced by [`MASK`]: the password of `scheme://user:password@host…`
/// and the value of any query parameter whose name looks secret (`password`, `sslpassword`,
/// `token`, …; see [`is_secret_key`]).
///
/// Passwords are often pasted into URLs unencoded, so the userinfo is taken to end at the
/// **last** `@` before the query, whatever `/`, `?`, `#` or `@` the password holds: for
/// `amqp://u:pa/ss@host/vhost` the result is `amqp://u:***@host/vhost`. A string that is not a
/// URL but holds an `@` after a `:` is masked from that `:` on, to be safe.
///
/// ```
/// use txinbox::redact;
/// assert_eq!(redact::url("amqp://guest:s3cret@127.0.0.1:5672/%2f"), "amqp://guest:***@127.0.0.1:5672/%2f");
/// assert_eq!(redact::url("amqp://u:pa/ss@h/v"), "amqp://u:***@h/v");
/// assert_eq!(redact::url("postgres://app@db/x?password=hunter2&sslmode=require"),
///            "postgres://app@db/x?password=***&sslmode=require");
/// // An unencoded '&' or '#' inside the password: its pieces go too.
/// assert_eq!(redact::url("postgres://db/x?password=a&b&sslmode=require"),
///            "postgres://db/x?password=***&sslmode=require");
/// assert_eq!(redact::url("postgres://db/x?password=a#b"), "postgres://db/x?password=***");
/// ```
pub fn url(uri: &str) -> String {
    let Some(scheme_end) = uri.find("://") else {
        // Not a URL: `user:password@host` (a DSN without a scheme) or anything else.
        return match (uri.find(':'), uri.rfind('@')) {
            (Some(colon), Some(at)) if colon < at => format!("{}:{MASK}{}", &uri[..colon], &uri[at..]),
            _ => uri.to_owned(),
        };
    };
    let prefix = &uri[..scheme_end + 3];
    let rest = &uri[scheme_end + 3..];
    // The userinfo ends at the last '@' of everything before the query; a query cannot hold
    // the userinfo, but a password can hold '?' too, so when the last '@' is after a '?', it
    // still wins.
    let (authority_and_path, query) = match rest.rfind('@') {
        Some(at) => match rest[at..].find('?') {
            Some(q) => rest.split_at(at + q),
            None => (rest, ""),
        },
        None => match rest.find('?') {
            Some(q) => rest.split_at(q),
            None => (rest, ""),
        },
    };
    let mut out = String::with_capacity(uri.len());
    out.push_str(prefix);
    match authority_and_path.rfind('@') {
        Some(at) => {
            let userinfo = &authority_and_path[..at];
            match userinfo.find(':') {
                Some(colon) => {
                    out.push_str(&userinfo[..colon]);
                    out.push(':');
                    out.push_str(MASK);
                }
                None => out.push_str(userinfo),
            }
            out.push_str(&authority_and_path[at..]);
        }
        None => out.push_str(authority_and_path),
    }
    out.push_str(&query_without_secrets(query));
    out
}

/// `?a=1&password=x#frag` with the values of secret-looking parameters masked.
fn query_without_secrets(query: &str) -> String {
    let Some(params) = query.strip_prefix('?') else {
        return query.to_owned();
    };
    let (params, fragment) = match params.find('#') {
        Some(h) => params.split_at(h),
        None => (params, ""),
    };
    // An unencoded '&' or '#' in a secret's value splits it: a piece without '=' after a
    // secret, and the fragment after one, may be the rest of it, so they are masked too.
    let mut in_secret = false;
    let mut any_secret = false;
    let masked: Vec<String> = params
        .split('&')
        .filter_map(|pair| match pair.split_once('=') {
            Some((key, _)) if is_secret_key(key) => {
                (in_secret, any_secret) = (true, true);
                Some(format!("{key}={MASK}"))
            }
            Some(_) => {
                in_secret = false;
                Some(pair.to_owned())
            }
            None if in_secret => None,
            None => Some(pair.to_owned()),
        })
        .collect();
    let fragment = if any_secret && !fragment.is_empty() {
        ""
    } else {
        fragment
    };
    format!("?{}{fragment}", masked.join("&"))
}

/// Whether a configuration property or query parameter called `key` holds a secret: its name
/// mentions a password, secret, token, credential, private key, key material (`ssl.key.*`,
/// `*.pem`, keystores) or a JAAS / OAuth configuration. Case-insensitive.
///
/// Used for librdkafka properties (`sasl.password`, `ssl.key.pem`,
/// `sasl.oauthbearer.client.secret`, …) and URL query parameters.
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    const WORDS: &[&str] = &[
        "password",
        "passwd",
        "secret",
        "token",
        "credential",
        "private",
        "jaas",
        "oauthbearer.config",
        "ssl.key",
        "keystore",
        "pem",
        "apikey",
        "api_key",
        "api.key",
    ];
    WORDS.iter().any(|w| key.contains(w))
}

/// `value`, or [`MASK`] when `key` names a secret ([`is_secret_key`]).
pub fn property<'a>(key: &str, value: &'a str) -> &'a str {
    if is_secret_key(key) {
        MASK
    } else {
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked_whatever_they_contain() {
        let cases = [
            (
                "amqp://guest:s3cret@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            ("amqps://u:p@h/v?heartbeat=5", "amqps://u:***@h/v?heartbeat=5"),
            ("amqp://h:5672/%2f", "amqp://h:5672/%2f"),
            ("amqp://user@h", "amqp://user@h"),
            ("amqp://u:p@ss@h/x", "amqp://u:***@h/x"),
            // Unencoded '/', '?', '#' and ':' in the password.
            ("amqp://u:pa/ss@h/x", "amqp://u:***@h/x"),
            ("amqp://u:pa?ss@h/x", "amqp://u:***@h/x"),
            ("amqp://u:pa#ss@h/x", "amqp://u:***@h/x"),
            (
                "amqp://u:a:b/c?d#e@f@h:5672/v?heartbeat=1",
                "amqp://u:***@h:5672/v?heartbeat=1",
            ),
            (
                "postgres://app:pw@db:5432/x?sslmode=require",
                "postgres://app:***@db:5432/x?sslmode=require",
            ),
            (
                "postgres://app@db/x?password=hunter2&sslmode=require",
                "postgres://app@db/x?password=***&sslmode=require",
            ),
            (
                "postgres:///x?host=/run&sslpassword=k",
                "postgres:///x?host=/run&sslpassword=***",
            ),
            ("u:p/w@h", "u:***@h"),
            ("plain", "plain"),
        ];
        for (raw, want) in cases {
            assert_eq!(url(raw), want, "{raw}");
        }
    }

    #[test]
    fn no_secret_survives_in_a_url_with_a_known_password() {
        for pw in ["s3cret", "s/3?c#r@e:t", "@@@", "a%2Fb"] {
            for template in [
                "amqp://guest:{pw}@127.0.0.1:5672/%2f",
                "amqps://guest:{pw}@broker/vhost?heartbeat=10",
                "postgres://app:{pw}@db:5432/app",
                "postgres://app@db:5432/app?password={pw}",
            ] {
                let raw = template.replace("{pw}", pw);
                let shown = url(&raw);
                assert!(!shown.contains(pw), "{raw} -> {shown}");
            }
        }
    }

    #[test]
    fn secret_properties_are_recognised() {
        for k in [
            "sasl.password",
            "ssl.key.password",
            "ssl.key.pem",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
            "sasl.jaas.config",
            "SASL.PASSWORD",
        ] {
            assert!(is_secret_key(k), "{k}");
            assert_eq!(property(k, "x"), MASK);
        }
        for k in [
            "bootstrap.servers",
            "session.timeout.ms",
            "sasl.mechanism",
            "security.protocol",
        ] {
            assert!(!is_secret_key(k), "{k}");
            assert_eq!(property(k, "x"), "x");
        }
    }
}
