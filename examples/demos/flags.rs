//! The connection flags the `ledger`, the `observability` example and the crash matrix
//! (`tools/chaos`) share, each one struct to `#[command(flatten)]` into a program's own flags:
//! same names, environment variables, defaults and help text everywhere. Three structs rather
//! than one, so that a program takes only the flags it uses (the observability example has no
//! RabbitMQ). And [`KafkaPropertiesParser`], for librdkafka properties given on the command line.
//!
//! Every flag read from the environment hides its value in `--help` (`hide_env_values`): these
//! values hold passwords.

/// `--database-url` / `DATABASE_URL`.
#[derive(Debug, Clone, clap::Args)]
pub struct Postgres {
    /// PostgreSQL: where the balances, the ledger entries and the inbox live. TLS as with libpq:
    /// `?sslmode=verify-full&sslrootcert=/path/to/ca.pem` (`sslcert`, `sslkey` for a client
    /// certificate). Its value is never printed.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
}

/// `--brokers` / `KAFKA_BROKERS`.
#[derive(Debug, Clone, clap::Args)]
pub struct Kafka {
    /// Kafka: bootstrap brokers, comma-separated host:port (use 127.0.0.1 rather than localhost for
    /// brokers that listen on IPv4 only). Its value is never printed (it may hold SASL
    /// credentials).
    #[arg(
        long,
        env = "KAFKA_BROKERS",
        hide_env_values = true,
        default_value = "127.0.0.1:9092"
    )]
    pub brokers: String,
}

/// `--amqp-url` / `AMQP_URL`.
#[derive(Debug, Clone, clap::Args)]
pub struct Amqp {
    /// AMQP: the broker URI (`amqps://` for TLS). Its value is never printed.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
}

/// librdkafka properties from one `--kafka-property` (or its environment variable), in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KafkaProperties(pub Vec<(String, String)>);

/// Reads [`KafkaProperties`]: `KEY=VALUE`, or several separated by `,` — but only where a
/// property name and `=` follow the `,` (a dotted name such as `session.timeout.ms`, or one of
/// librdkafka's undotted `acks`, `debug`, `retries`, `partitioner`, `log_level`). Anything
/// else stays in the value, so `sasl.password=a,b` or a JAAS configuration keeps its commas,
/// and the rule is the one `txinbox::redact` masks by: no piece of a value is ever taken for a
/// property of its own.
///
/// A malformed value is refused without being shown (it may hold a secret), unlike clap's own
/// "invalid value '…'" errors.
#[derive(Debug, Clone, Copy)]
pub struct KafkaPropertiesParser;

impl clap::builder::TypedValueParser for KafkaPropertiesParser {
    type Value = KafkaProperties;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<KafkaProperties, clap::Error> {
        let refuse = |why: &str| {
            let flag = arg.map_or_else(|| "--kafka-property".to_owned(), |a| a.to_string());
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("{flag}: {why} (the value is not shown: it may hold a secret)\n"),
            )
            .with_cmd(cmd)
        };
        let text = value.to_str().ok_or_else(|| refuse("not UTF-8"))?;
        kafka_properties(text).map_err(|why| refuse(&why))
    }
}

/// See [`KafkaPropertiesParser`].
pub fn kafka_properties(text: &str) -> Result<KafkaProperties, String> {
    let mut starts = vec![0];
    for (comma, _) in text.match_indices(',') {
        let rest = &text[comma + 1..];
        if rest
            .split_once('=')
            .is_some_and(|(key, _)| is_property_name(key.trim()))
        {
            starts.push(comma + 1);
        }
    }
    starts.push(text.len() + 1);
    let mut properties = Vec::new();
    for pair in starts.windows(2) {
        let piece = &text[pair[0]..pair[1] - 1];
        match piece.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => {
                properties.push((key.trim().to_owned(), value.to_owned()))
            }
            _ => {
                return Err(
                    "expected KEY=VALUE, or several as KEY=VALUE,KEY=VALUE (e.g. session.timeout.ms=6000)"
                        .into(),
                )
            }
        }
    }
    Ok(KafkaProperties(properties))
}

/// A librdkafka property name: dotted lowercase (`sasl.password`), or an undotted one.
fn is_property_name(key: &str) -> bool {
    let dotted = key.contains('.')
        && key.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_')
        });
    dotted || ["acks", "debug", "retries", "partitioner", "log_level"].contains(&key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> KafkaProperties {
        KafkaProperties(list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn a_value_keeps_its_commas_unless_a_property_follows() {
        for (text, want) in [
            ("sasl.password=a,b", pairs(&[("sasl.password", "a,b")])),
            ("sasl.password=a,b=c", pairs(&[("sasl.password", "a,b=c")])),
            (
                "session.timeout.ms=6000,debug=cgrp,sasl.password=x,y",
                pairs(&[
                    ("session.timeout.ms", "6000"),
                    ("debug", "cgrp"),
                    ("sasl.password", "x,y"),
                ]),
            ),
            (
                "sasl.jaas.config=m required username=\"u\" password=\"p,q\";",
                pairs(&[("sasl.jaas.config", "m required username=\"u\" password=\"p,q\";")]),
            ),
            ("ssl.cipher.suites=A,B", pairs(&[("ssl.cipher.suites", "A,B")])),
            (" acks = all", pairs(&[("acks", " all")])),
        ] {
            assert_eq!(kafka_properties(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn a_malformed_list_is_refused_without_its_value() {
        for text in ["secret", "=x", ",a.b=c"] {
            let why = kafka_properties(text).unwrap_err();
            assert!(!why.contains(text), "{why}");
        }
    }
}
