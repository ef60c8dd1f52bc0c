//! Keeping secrets out of logs, errors and `Debug` output: one redaction for every connection
//! string and every configuration property txinbox and its adapters print.
//!
//! Everything here errs towards hiding too much: a host that is cut along with a password is a
//! nuisance, a password in a log aggregator is an incident.

/// The replacement for a secret.
pub const MASK: &str = "***";

/// Tracing filter directives that keep dependencies' events carrying credentials out of a
/// program's logs, whatever `RUST_LOG` says; every example and tool of this project adds them
/// to its filter (`EnvFilter::add_directive`), and an application should too:
///
/// - `sqlx_postgres::options::parse=error`: while parsing a PostgreSQL URL, sqlx logs each
///   query parameter it does not know **with its value** at WARN: `sslpassword=…`, or the rest
///   of a password after an unencoded `&`. That module logs nothing else.
/// - `lapin=debug`, `amq_protocol_tcp=debug`: at TRACE, lapin logs the AMQP frames it sends,
///   the connection's `StartOk` with the SASL response (user and password) among them, and
///   amq-protocol-tcp the URI it connects to, password included.
///
/// ```
/// # fn filter(rust_log: &str) -> Vec<String> {
/// // With tracing-subscriber: let mut filter = EnvFilter::new(rust_log);
/// let mut directives = vec![rust_log.to_owned()];
/// for d in txinbox::redact::LOG_DIRECTIVES {
///     directives.push((*d).to_owned()); // filter = filter.add_directive(d.parse()?);
/// }
/// # directives }
/// # assert_eq!(filter("trace").len(), 4);
/// ```
pub const LOG_DIRECTIVES: &[&str] = &[
    "sqlx_postgres::options::parse=error",
    "lapin=debug",
    "amq_protocol_tcp=debug",
];

/// `text`, a connection string in any form, with every secret replaced by [`MASK`]:
///
/// - the password of a URL (`scheme://user:password@host…`) or of `user:password@host`;
/// - the value of every `key=value` whose key names a secret ([`is_secret_key`]): URL query
///   parameters (`?password=…`, `sslpassword`, `sslkey`), libpq `key=value` strings
///   (`host=db password='…'`), Kafka property lists (`sasl.password=…,sasl.jaas.config=…`);
///
/// Passwords are often pasted unencoded, so the rules assume the worst:
///
/// - the userinfo ends at the **last** `@`, whatever `/`, `?`, `#`, `:` or `@` the password
///   holds: `amqp://u:pa/ss@host/vhost` gives `amqp://u:***@host/vhost`;
/// - a secret value runs to the next `key=` that follows a separator (whitespace, `,`, `;`,
///   `&`, `?`), or to the end: a `#`, or a `&` or `,` without a `key=` after it, is part of it;
///   a quoted value (`'…'`, `"…"`) runs to its closing quote;
/// - the pairs after a secret are masked with it until a key that is a known connection
///   parameter or a dotted (Kafka) property: `password=ab&cd=ef` may be one password cut by
///   an unencoded `&`.
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
/// assert_eq!(redact::url("host=db user=app password='a b' dbname=x"),
///            "host=db user=app password=*** dbname=x");
/// assert_eq!(redact::url("sasl.password=a,b,security.protocol=SASL_SSL"),
///            "sasl.password=***,security.protocol=SASL_SSL");
/// ```
pub fn url(text: &str) -> String {
    pairs_masked(&userinfo_masked(text))
}

/// The character that ends the user and password of `uri` early when a URL parser reads it,
/// because the password was pasted unencoded: `/`, `?` or `#` before the userinfo's last `@`.
/// `postgres://app:12/ab@db/x` gives `Some('/')`: a parser takes `app` for the host, `12` for
/// the port and `ab@db/x` for the database. `None` for a URL without that mistake (or not a URL).
///
/// An `@` after a `=` is not counted (`?application_name=me@host` is a parameter, not a
/// userinfo), so a password holding `=` as well is not always caught; [`url()`] masks it anyway.
///
/// ```
/// use txinbox::redact::unencoded_in_userinfo;
/// assert_eq!(unencoded_in_userinfo("postgres://app:12/ab@db/x"), Some('/'));
/// assert_eq!(unencoded_in_userinfo("amqp://u:p?w@mq/%2f"), Some('?'));
/// assert_eq!(unencoded_in_userinfo("postgres://app:p%2Fw@db/x"), None);
/// assert_eq!(unencoded_in_userinfo("postgres://app:p@w@db/x"), None); // the last '@' is taken
/// assert_eq!(unencoded_in_userinfo("postgres://db/x?application_name=me@host"), None);
/// ```
pub fn unencoded_in_userinfo(uri: &str) -> Option<char> {
    let rest = &uri[uri.find("://")? + 3..];
    let authority_end = rest.find(['/', '?', '#'])?;
    let last_at = rest.rfind('@')?;
    (last_at > authority_end && !rest[authority_end..last_at].contains('='))
        .then(|| rest[authority_end..].chars().next())
        .flatten()
}

/// The password of `scheme://user:password@…` or `user:password@…` masked: from the first
/// `:` of the userinfo to its last `@`.
fn userinfo_masked(text: &str) -> String {
    let (prefix, rest) = match text.find("://") {
        Some(i) => text.split_at(i + 3),
        None => ("", text),
    };
    let Some(at) = rest.rfind('@') else {
        return text.to_owned();
    };
    match rest[..at].find(':') {
        Some(colon) => format!("{prefix}{}:{MASK}{}", &rest[..colon], &rest[at..]),
        None => text.to_owned(),
    }
}

/// A `key=value` pair in a connection string or a property list: byte ranges into the text.
struct Pair {
    key: std::ops::Range<usize>,
    value: std::ops::Range<usize>,
}

/// The pairs of `text` (see [`url()`] for where a value ends).
fn pairs(text: &str) -> Vec<Pair> {
    let b = text.as_bytes();
    let is_separator = |c: u8| c.is_ascii_whitespace() || matches!(c, b',' | b';' | b'&' | b'?');
    let is_key_char =
        |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-' | b'%' | b'[' | b']');
    let mut found: Vec<Pair> = Vec::new();
    let mut i = 0;
    let mut after_separator = true;
    while i < b.len() {
        if after_separator && is_key_char(b[i]) {
            let key_end = (i..b.len()).find(|&j| !is_key_char(b[j])).unwrap_or(b.len());
            let eq = (key_end..b.len()).find(|&j| b[j] != b' ' && b[j] != b'\t');
            if let Some(eq) = eq.filter(|&eq| b[eq] == b'=') {
                let value_start = (eq + 1..b.len())
                    .find(|&j| b[j] != b' ' && b[j] != b'\t')
                    .unwrap_or(b.len());
                if let Some(last) = found.last_mut() {
                    last.value.end = value_end(b, last.value.start, i);
                }
                found.push(Pair {
                    key: i..key_end,
                    value: value_start..b.len(),
                });
                i = value_start;
                // A quoted value runs to its closing quote, separators and all.
                if i < b.len() && (b[i] == b'\'' || b[i] == b'"') {
                    let quote = b[i];
                    i += 1;
                    while i < b.len() && b[i] != quote {
                        i += if b[i] == b'\\' { 2 } else { 1 };
                    }
                    i += 1;
                }
                after_separator = false;
                continue;
            }
        }
        after_separator = is_separator(b[i]);
        i += 1;
    }
    found
}

/// Where a value that starts at `start` ends when the next pair starts at `next`: before the
/// separators in between.
fn value_end(b: &[u8], start: usize, next: usize) -> usize {
    let mut end = next;
    while end > start && (b[end - 1].is_ascii_whitespace() || matches!(b[end - 1], b',' | b';' | b'&' | b'?'))
    {
        end -= 1;
    }
    end
}

/// `text` with the values of secret pairs, and the unknown pairs right after them, masked.
fn pairs_masked(text: &str) -> String {
    let mut spans: Vec<std::ops::Range<usize>> = Vec::new();
    let mut in_secret = false;
    for pair in pairs(text) {
        let key = percent_decoded(&text[pair.key.clone()]);
        if is_secret_key(&key) {
            in_secret = true;
            spans.push(pair.value.clone());
        } else if in_secret && !is_known_parameter(&key) {
            // Maybe the rest of the secret before it, cut at an unencoded separator.
            if let Some(last) = spans.last_mut() {
                last.end = pair.value.end;
            }
        } else {
            in_secret = false;
        }
    }
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for span in spans {
        out.push_str(&text[at..span.start]);
        out.push_str(MASK);
        at = span.end;
    }
    out.push_str(&text[at..]);
    out
}

/// Whether `key` is a connection parameter that is not a secret, so it ends the masking after
/// a secret pair: a libpq, sqlx or AMQP URI parameter, or a dotted name (Kafka properties).
fn is_known_parameter(key: &str) -> bool {
    const KNOWN: &[&str] = &[
        // libpq and sqlx (PostgreSQL)
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "options",
        "application_name",
        "fallback_application_name",
        "connect_timeout",
        "client_encoding",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
        "sslmode",
        "ssl-mode",
        "sslcert",
        "ssl-cert",
        "sslrootcert",
        "ssl-root-cert",
        "ssl-ca",
        "sslcrl",
        "sslcompression",
        "sslnegotiation",
        "requiressl",
        "gssencmode",
        "krbsrvname",
        "service",
        "target_session_attrs",
        "load_balance_hosts",
        "channel_binding",
        "require_auth",
        "statement-cache-capacity",
        // AMQP URI query
        "heartbeat",
        "connection_timeout",
        "channel_max",
        "frame_max",
        "auth_mechanism",
        "cacertfile",
        "certfile",
        "verify",
        "server_name_indication",
        // SQLite
        "mode",
        "cache",
        "immutable",
        "vfs",
    ];
    let key = key.to_ascii_lowercase();
    key.contains('.') || KNOWN.contains(&key.as_str())
}

/// `s` with `%XX` escapes decoded (invalid ones kept as they are).
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether a configuration property or query parameter called `key` holds a secret: its name
/// mentions a password, secret, token, credential, private key, key material (`ssl.key.*`,
/// `sslkey`, `*.pem`, keystores) or a JAAS / OAuth configuration. Case-insensitive; `-`, `_`
/// and `.` are the same.
///
/// Used for librdkafka properties (`sasl.password`, `ssl.key.pem`,
/// `sasl.oauthbearer.client.secret`, …), URL query parameters and libpq `key=value` strings
/// (`password`, `sslpassword`, `sslkey`).
pub fn is_secret_key(key: &str) -> bool {
    // `ssl-key`, `ssl_key` and `ssl.key` alike.
    let key = key.to_ascii_lowercase().replace(['-', '_'], ".");
    const WORDS: &[&str] = &[
        "password",
        "passwd",
        "pwd",
        "secret",
        "token",
        "credential",
        "private",
        "jaas",
        "oauthbearer.config",
        "ssl.key",
        "sslkey",
        "keystore",
        "pem",
        "apikey",
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

    /// Every form a connection string takes, with the secret wherever users put it: none of
    /// it survives, in whole or in a piece, and what is not secret stays readable.
    #[test]
    fn every_form_of_connection_string_loses_its_secrets() {
        let cases = [
            // A URL parser would take `postgres` for the host and `6543` for the port.
            (
                "postgres://postgres:6543/Sx-Secret@127.0.0.1:5432/app",
                "postgres://postgres:***@127.0.0.1:5432/app",
            ),
            (
                "postgres://app@db/x?password=Sx&Qz=Tail&sslmode=require",
                "postgres://app@db/x?password=***&sslmode=require",
            ),
            (
                "postgres://app@db/x?sslmode=require&sslpassword=Sx-Secret&application_name=a",
                "postgres://app@db/x?sslmode=require&sslpassword=***&application_name=a",
            ),
            (
                "postgres://app@db/x?sslkey=/keys/Sx-Secret.key&sslcert=/keys/c.crt",
                "postgres://app@db/x?sslkey=***&sslcert=/keys/c.crt",
            ),
            (
                "postgres://app@db/x?pass%77ord=Sx-Secret",
                "postgres://app@db/x?pass%77ord=***",
            ),
            (
                "host=db port=5432 user=app password=Sx-Secret dbname=x",
                "host=db port=5432 user=app password=*** dbname=x",
            ),
            (
                "host=db password = 'Sx Secret dbname=y' dbname=x",
                "host=db password = *** dbname=x",
            ),
            (
                "host=db password=Sx Qz=Tail dbname=x",
                "host=db password=*** dbname=x",
            ),
            (
                "bootstrap.servers=k:9093,sasl.password=Sx,Secret,security.protocol=SASL_SSL",
                "bootstrap.servers=k:9093,sasl.password=***,security.protocol=SASL_SSL",
            ),
            (
                "sasl.password=Sx-Secret,ssl.key.password=Sx-Secret,ssl.keystore.password=Sx-Secret",
                "sasl.password=***,ssl.key.password=***,ssl.keystore.password=***",
            ),
            (
                "sasl.oauthbearer.client.secret=Sx-Secret,sasl.mechanism=OAUTHBEARER",
                "sasl.oauthbearer.client.secret=***,sasl.mechanism=OAUTHBEARER",
            ),
            (
                "sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required \
                 username=\"u\" password=\"Sx,Secret=Tail\";,client.id=x",
                // `username="u"` may be part of the JAAS value: masked with it.
                "sasl.jaas.config=*** password=***;,client.id=x",
            ),
        ];
        for (raw, want) in cases {
            let shown = url(raw);
            assert_eq!(shown, want, "{raw}");
            for piece in ["Sx-Secret", "Secret", "Tail"] {
                assert!(!shown.contains(piece), "{raw} -> {shown}");
            }
        }
    }

    #[test]
    fn an_unencoded_userinfo_is_recognised() {
        for (uri, want) in [
            ("postgres://postgres:6543/Sx@127.0.0.1:5432/app", Some('/')),
            ("postgres://u:a#b@h/x", Some('#')),
            ("amqp://u:a?b@h/%2f", Some('?')),
            ("postgres://u:a%2Fb@h/x", None),
            ("postgres://u:a@b@h/x", None),
            ("postgres://u:a&b:c@h/x", None),
            ("postgres://h/x?application_name=me@home", None),
            ("postgres://h/x", None),
            ("host=h password=a/b@c", None),
        ] {
            assert_eq!(unencoded_in_userinfo(uri), want, "{uri}");
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
            "sslpassword",
            "sslkey",
            "ssl-key",
            "api_key",
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
