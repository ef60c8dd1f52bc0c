//! The connection flags the `ledger`, the `observability` example and the crash matrix
//! (`tools/chaos`) share, each one struct to `#[command(flatten)]` into a program's own flags:
//! same names, environment variables, defaults and help text everywhere. Three structs rather
//! than one, so that a program takes only the flags it uses (the observability example has no
//! RabbitMQ). And [`KafkaPropertiesParser`], for librdkafka properties given on the command line.
//!
//! Every flag read from the environment hides its value in `--help` (`hide_env_values`): these
//! values hold passwords.

use std::path::PathBuf;

use txinbox_amqp::{AmqpConfig, AmqpTls, QueueType};

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

/// `--amqp-url` / `AMQP_URL`, the TLS files of `amqps://`, and the queues the consumer declares.
#[derive(Debug, Clone, clap::Args)]
pub struct Amqp {
    /// AMQP: the broker URI (`amqps://` for TLS, verified against the system's root certificates
    /// and --amqp-ca-file; `?auth_mechanism=external` to log in with --amqp-client-cert). Its
    /// value is never printed.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// AMQP over TLS: a PEM file of CA certificates that sign the broker's certificate (trusted
    /// besides the system's roots).
    #[arg(long, env = "AMQP_CA_FILE", hide_env_values = true)]
    pub amqp_ca_file: Option<PathBuf>,
    /// AMQP over TLS: a client certificate (PEM) to present, e.g. for SASL EXTERNAL; with
    /// --amqp-client-key.
    #[arg(
        long,
        env = "AMQP_CLIENT_CERT",
        hide_env_values = true,
        requires = "amqp_client_key"
    )]
    pub amqp_client_cert: Option<PathBuf>,
    /// AMQP over TLS: the client certificate's private key (PEM, unencrypted).
    #[arg(
        long,
        env = "AMQP_CLIENT_KEY",
        hide_env_values = true,
        requires = "amqp_client_cert"
    )]
    pub amqp_client_key: Option<PathBuf>,
    /// AMQP: the type of the work and dead-letter queues the consumer declares, `classic` or
    /// `quorum`; it must match queues declared beforehand (the retry queue is a quorum queue
    /// either way).
    #[arg(
        long,
        env = "AMQP_QUEUE_TYPE",
        hide_env_values = true,
        default_value = "classic"
    )]
    pub amqp_queue_type: QueueType,
    /// AMQP, quorum queues: the work queue's `x-delivery-limit` (declared, and kept below: a
    /// message near it is republished as a fresh copy, never dropped by the broker). Default:
    /// not declared, 20 assumed (RabbitMQ 4's default).
    #[arg(long, env = "AMQP_DELIVERY_LIMIT", hide_env_values = true)]
    pub amqp_delivery_limit: Option<u32>,
    /// AMQP: declare the work, retry and dead-letter queues (`false`: use them as they are,
    /// declared elsewhere with arguments of their own).
    #[arg(
        long,
        env = "AMQP_DECLARE",
        hide_env_values = true,
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub amqp_declare: bool,
}

impl Amqp {
    /// The TLS files as the adapter takes them.
    pub fn tls(&self) -> AmqpTls {
        let mut tls = AmqpTls::new();
        if let Some(ca) = &self.amqp_ca_file {
            tls = tls.ca_file(ca);
        }
        if let (Some(cert), Some(key)) = (&self.amqp_client_cert, &self.amqp_client_key) {
            tls = tls.client_certificate(cert, key);
        }
        tls
    }

    /// A source configuration for `queue` with these flags.
    pub fn config(&self, queue: &str) -> AmqpConfig {
        let mut config = AmqpConfig::new(&self.amqp_url, queue)
            .tls(self.tls())
            .queue_type(self.amqp_queue_type)
            .declare_topology(self.amqp_declare);
        if let Some(limit) = self.amqp_delivery_limit {
            config = config.delivery_limit(limit);
        }
        config
    }

    /// These flags as arguments for another program that flattens [`Amqp`] (the crash matrix
    /// starting ledgers), all but the URL: it may hold a password, so it goes in `AMQP_URL`.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!("--amqp-queue-type={}", self.amqp_queue_type),
            format!("--amqp-declare={}", self.amqp_declare),
        ];
        let path = |flag: &str, p: &Option<PathBuf>| p.as_ref().map(|p| format!("--{flag}={}", p.display()));
        args.extend(path("amqp-ca-file", &self.amqp_ca_file));
        args.extend(path("amqp-client-cert", &self.amqp_client_cert));
        args.extend(path("amqp-client-key", &self.amqp_client_key));
        args.extend(
            self.amqp_delivery_limit
                .map(|l| format!("--amqp-delivery-limit={l}")),
        );
        args
    }
}

/// librdkafka properties from one `--kafka-property` (or its environment variable), in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KafkaProperties(pub Vec<(String, String)>);

/// Reads [`KafkaProperties`] by [`txinbox_kafka::parse_properties`]: `KEY=VALUE`, or several
/// separated by `,` where a property name and `=` follow it (`sasl.password=a,b` keeps its
/// comma).
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

/// See [`KafkaPropertiesParser`]: [`txinbox_kafka::parse_properties`].
pub fn kafka_properties(text: &str) -> Result<KafkaProperties, String> {
    txinbox_kafka::parse_properties(text).map(KafkaProperties)
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
