//! Configuration a service loads from a file or the environment: serde-deserializable settings
//! for the database connection ([`DatabaseSettings`]), the consumer ([`ConsumerSettings`]) and
//! the outbox relay ([`RelaySettings`]), with the builders' defaults for whatever is left out.
//!
//! Durations are strings with one unit (`"250ms"`, `"30s"`, `"5min"`, `"1h"`, `"7d"`), read by
//! [`duration`], the one duration syntax of txinbox: the `txinbox` CLI's flags and the adapters'
//! settings use it too. Unknown fields are refused (`deny_unknown_fields`), so a misspelt key is
//! an error rather than a default silently kept. `Debug` never shows a secret.
//!
//! ```
//! # #[cfg(feature = "postgres")] {
//! use txinbox::settings::{ConsumerSettings, DatabaseSettings};
//!
//! #[derive(serde::Deserialize)]
//! struct ServiceSettings {
//!     database: DatabaseSettings,
//!     #[serde(default)]
//!     consumer: ConsumerSettings,
//! }
//!
//! let text = r#"
//!     [database]
//!     url = "postgres://app:secret@db.example.com/app?sslmode=verify-full"
//!     ssl_root_cert = "/etc/ssl/certs/provider-ca.pem"
//!     max_connections = 16
//!
//!     [consumer]
//!     concurrency = 12
//!     batch_linger = "5ms"
//!     retry = { max_attempts = 5, max_delay = "30s" }
//! "#;
//! # let _ = text;
//! // let settings: ServiceSettings = toml::from_str(text)?;  (or figment, config, envy, …)
//! // let inbox = settings.database.connect().await?;
//! // let consumer = Consumer::builder("payments").settings(&settings.consumer)
//! //     .source(source).inbox(inbox).handler(handler).build()?;
//! # }
//! ```

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use crate::consumer::{
    ConsumerBuilder, DEFAULT_BATCH_LINGER, DEFAULT_BATCH_MAX_DURATION, DEFAULT_BATCH_SIZE,
    DEFAULT_CONCURRENCY, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_MESSAGE_BYTES,
};
use crate::message::{Fingerprint, IdStrategy};
use crate::retry::RetryPolicy;

/// Durations as text: a whole number and one unit, `ms`, `s`, `min`, `h`, `d` or `w`
/// (`250ms`, `90s`, `30min`, `12h`, `7d`, `2w`). Never `m` (minutes or months?), a bare number
/// or a fraction. The one parser of txinbox's durations, and a serde helper for fields:
///
/// ```
/// use std::time::Duration;
///
/// #[derive(serde::Deserialize)]
/// struct Settings {
///     #[serde(with = "txinbox::settings::duration")]
///     timeout: Duration,
///     #[serde(default, with = "txinbox::settings::duration::option")]
///     linger: Option<Duration>,
/// }
/// # let s: Settings = serde_json::from_str(r#"{"timeout": "30s"}"#).unwrap();
/// # assert_eq!(s.timeout, Duration::from_secs(30));
/// # assert_eq!(s.linger, None);
/// assert_eq!(txinbox::settings::duration::parse("250ms"), Ok(Duration::from_millis(250)));
/// assert!(txinbox::settings::duration::parse("5m").is_err());
/// ```
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Reads `s`: a whole number and one unit (`ms`, `s`, `min`, `h`, `d`, `w`). The error
    /// names the accepted units.
    pub fn parse(s: &str) -> Result<Duration, String> {
        let bad = |why: &str| {
            format!(
                "`{s}` is not a duration{why}: use a whole number and one of the units ms, s, min, h, d or w (milliseconds, seconds, minutes, hours, days, weeks), e.g. 250ms, 90s, 30min, 12h, 7d, 2w"
            )
        };
        let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (n, unit) = s.split_at(digits);
        if n.is_empty() {
            return Err(bad(""));
        }
        let millis: u64 = match unit {
            "ms" => 1,
            "s" => 1000,
            "min" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 604_800_000,
            "m" | "M" | "mo" | "mon" | "month" | "months" => {
                return Err(bad(
                    " (`m` could mean minutes or months; write min for minutes, d or w for longer)",
                ))
            }
            "" => return Err(bad(" (no unit)")),
            _ => return Err(bad("")),
        };
        let n: u64 = n.parse().map_err(|_| bad(""))?;
        n.checked_mul(millis)
            .map(Duration::from_millis)
            .ok_or_else(|| bad(" (too long)"))
    }

    /// `d` as the shortest exact text [`parse`] reads back in days at most (`7d`, `14d`,
    /// `36h`, `90s`, `250ms`); below a millisecond it is cut to whole milliseconds.
    pub fn format(d: Duration) -> String {
        let ms = d.as_millis();
        match ms {
            0 => "0s".into(),
            _ if ms.is_multiple_of(86_400_000) => format!("{}d", ms / 86_400_000),
            _ if ms.is_multiple_of(3_600_000) => format!("{}h", ms / 3_600_000),
            _ if ms.is_multiple_of(60_000) => format!("{}min", ms / 60_000),
            _ if ms.is_multiple_of(1000) => format!("{}s", ms / 1000),
            _ => format!("{ms}ms"),
        }
    }

    /// `#[serde(with = "txinbox::settings::duration")]`: reads [`parse`]'s text.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        parse(&text).map_err(serde::de::Error::custom)
    }

    /// `#[serde(with = "txinbox::settings::duration")]`: writes [`format()`]'s text.
    pub fn serialize<S: Serializer>(d: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format(*d))
    }

    /// The same for an `Option<Duration>` (`#[serde(default, with = "…::duration::option")]`).
    pub mod option {
        use std::time::Duration;

        use serde::{Deserialize, Deserializer, Serializer};

        /// Reads an optional duration.
        pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
            Option::<String>::deserialize(deserializer)?
                .map(|text| super::parse(&text).map_err(serde::de::Error::custom))
                .transpose()
        }

        /// Writes an optional duration.
        pub fn serialize<S: Serializer>(d: &Option<Duration>, serializer: S) -> Result<S::Ok, S::Error> {
            match d {
                Some(d) => serializer.serialize_some(&super::format(*d)),
                None => serializer.serialize_none(),
            }
        }
    }
}

/// A [`RetryPolicy`] as settings: each field left out keeps the default of where it is used
/// (the consumer's [`RetryPolicy::default`], the relay's own).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySettings {
    /// Total attempts, the first included, before dead-lettering.
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Upper bound of the first retry's delay (`"200ms"`).
    #[serde(default, with = "duration::option")]
    pub initial_delay: Option<Duration>,
    /// Upper bound of any retry's delay (`"60s"`).
    #[serde(default, with = "duration::option")]
    pub max_delay: Option<Duration>,
}

impl RetrySettings {
    /// `base` with the fields that are set.
    pub fn apply(&self, mut base: RetryPolicy) -> RetryPolicy {
        if let Some(n) = self.max_attempts {
            base = base.max_attempts(n);
        }
        if let Some(d) = self.initial_delay {
            base = base.initial_delay(d);
        }
        if let Some(d) = self.max_delay {
            base = base.max_delay(d);
        }
        base
    }
}

/// A consumer's settings; see the [`ConsumerBuilder`] method of each field. The defaults are
/// the builder's. Apply them with [`ConsumerBuilder::settings`].
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsumerSettings {
    /// [`ConsumerBuilder::concurrency`].
    pub concurrency: usize,
    /// [`ConsumerBuilder::max_in_flight`].
    pub max_in_flight: usize,
    /// [`ConsumerBuilder::batch_size`].
    pub batch_size: usize,
    /// [`ConsumerBuilder::batch_linger`] (`"5ms"`).
    #[serde(with = "duration")]
    pub batch_linger: Duration,
    /// [`ConsumerBuilder::batch_max_duration`] (`"50ms"`); unset: none.
    #[serde(with = "duration::option")]
    pub batch_max_duration: Option<Duration>,
    /// [`ConsumerBuilder::max_message_bytes`].
    pub max_message_bytes: usize,
    /// [`ConsumerBuilder::dead_letter_payload_limit`]; unset: `max_message_bytes`.
    pub dead_letter_payload_limit: Option<usize>,
    /// [`ConsumerBuilder::retry_policy`]: the fields set replace [`RetryPolicy::default`]'s.
    pub retry: RetrySettings,
    /// [`ConsumerBuilder::id_strategy`], as [`IdStrategy`]'s text (`"cloudevents"`,
    /// `"header:message-id"`, `"json:/id"`, `"sha256"`, …); unset: the source's default.
    #[serde(deserialize_with = "from_str_option")]
    pub id_strategy: Option<IdStrategy>,
    /// [`ConsumerBuilder::fingerprint`]: `"bytes"` (the default) or `"canonical-json"`.
    #[serde(deserialize_with = "fingerprint")]
    pub fingerprint: Fingerprint,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        ConsumerSettings {
            concurrency: DEFAULT_CONCURRENCY,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            batch_size: DEFAULT_BATCH_SIZE,
            batch_linger: DEFAULT_BATCH_LINGER,
            batch_max_duration: DEFAULT_BATCH_MAX_DURATION,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            dead_letter_payload_limit: None,
            retry: RetrySettings::default(),
            id_strategy: None,
            fingerprint: Fingerprint::default(),
        }
    }
}

impl<Src, St, H> ConsumerBuilder<Src, St, H> {
    /// Applies `settings`: every field, so what the settings leave out is the builder's
    /// default, whatever was set before. Call it first and adjust afterwards. The values are
    /// checked by [`build`](ConsumerBuilder::build), as when set one by one.
    pub fn settings(self, settings: &ConsumerSettings) -> Self {
        let mut builder = self
            .concurrency(settings.concurrency)
            .max_in_flight(settings.max_in_flight)
            .batch_size(settings.batch_size)
            .batch_linger(settings.batch_linger)
            .max_message_bytes(settings.max_message_bytes)
            .retry_policy(settings.retry.apply(RetryPolicy::default()))
            .fingerprint(settings.fingerprint);
        if let Some(n) = settings.dead_letter_payload_limit {
            builder = builder.dead_letter_payload_limit(n);
        }
        if let Some(max) = settings.batch_max_duration {
            builder = builder.batch_max_duration(max);
        }
        if let Some(strategy) = &settings.id_strategy {
            builder = builder.id_strategy(strategy.clone());
        }
        builder
    }
}

fn from_str_option<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: fmt::Display,
{
    Option::<String>::deserialize(deserializer)?
        .map(|text| text.parse().map_err(serde::de::Error::custom))
        .transpose()
}

fn fingerprint<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Fingerprint, D::Error> {
    match String::deserialize(deserializer)?.as_str() {
        "bytes" => Ok(Fingerprint::PayloadBytes),
        "canonical-json" => Ok(Fingerprint::CanonicalJson),
        other => Err(serde::de::Error::custom(format!(
            "`{other}` is not a fingerprint: use bytes or canonical-json"
        ))),
    }
}

/// The outbox relay's settings; see the [`RelayConfig`](crate::outbox::RelayConfig) method of
/// each field. The defaults are `RelayConfig::default()`'s. Turn them into a configuration
/// with `RelayConfig::from`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelaySettings {
    /// `RelayConfig::name`: the `relay` label of its metrics.
    pub name: String,
    /// `RelayConfig::batch_size`.
    pub batch_size: usize,
    /// `RelayConfig::poll_interval` (`"1s"`).
    #[serde(with = "duration")]
    pub poll_interval: Duration,
    /// `RelayConfig::publish_timeout` (`"20s"`).
    #[serde(with = "duration")]
    pub publish_timeout: Duration,
    /// `RelayConfig::retry_policy`: the fields set replace the relay's default policy's
    /// (20 attempts, 500 ms initial delay, 60 s maximum).
    pub retry: RetrySettings,
    /// `RelayConfig::retention` (`"24h"`).
    #[serde(with = "duration")]
    pub retention: Duration,
    /// `RelayConfig::retention_schedule`'s interval (`"60s"`).
    #[serde(with = "duration")]
    pub retention_interval: Duration,
    /// `RelayConfig::retention_schedule`'s rows per `DELETE`.
    pub retention_batch: usize,
    /// `RelayConfig::metrics_interval` (`"5s"`).
    #[serde(with = "duration")]
    pub metrics_interval: Duration,
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl RelaySettings {
    /// The relay's default retry policy (as `RelayConfig::default()` has it).
    fn default_retry() -> RetryPolicy {
        RetryPolicy::default()
            .max_attempts(20)
            .initial_delay(Duration::from_millis(500))
            .max_delay(Duration::from_secs(60))
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl Default for RelaySettings {
    fn default() -> Self {
        RelaySettings {
            name: "outbox".into(),
            batch_size: 256,
            poll_interval: Duration::from_secs(1),
            publish_timeout: Duration::from_secs(20),
            retry: RetrySettings::default(),
            retention: Duration::from_secs(24 * 3600),
            retention_interval: Duration::from_secs(60),
            retention_batch: 1000,
            metrics_interval: Duration::from_secs(5),
        }
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl From<&RelaySettings> for crate::outbox::RelayConfig {
    fn from(s: &RelaySettings) -> Self {
        crate::outbox::RelayConfig::default()
            .name(s.name.clone())
            .batch_size(s.batch_size)
            .poll_interval(s.poll_interval)
            .publish_timeout(s.publish_timeout)
            .retry_policy(s.retry.apply(RelaySettings::default_retry()))
            .retention(s.retention)
            .retention_schedule(s.retention_interval, s.retention_batch)
            .metrics_interval(s.metrics_interval)
    }
}

/// The PostgreSQL connection: a URL (with its TLS parameters, as libpq's: `sslmode`,
/// `sslrootcert`, `sslcert`, `sslkey`), or the TLS files beside it, which take precedence.
/// [`connect`](Self::connect) builds the inbox's pool. `Debug` shows the URL through
/// [`redact::url`](crate::redact::url) and never the key's path.
#[cfg(feature = "postgres")]
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    /// `postgres://user:password@host:port/database?sslmode=verify-full&…` (percent-encode
    /// `/ ? # @` in the password).
    pub url: String,
    /// Connections in the pool. Default 10; at least the consumer's concurrency.
    #[serde(default = "DatabaseSettings::default_max_connections")]
    pub max_connections: u32,
    /// `sslmode`: `disable`, `prefer` (the URL's default: TLS when the server offers it,
    /// unverified), `require` (TLS, unverified), `verify-ca`, `verify-full` (what a managed
    /// database wants).
    #[serde(default, deserialize_with = "from_str_option")]
    pub ssl_mode: Option<sqlx::postgres::PgSslMode>,
    /// `sslrootcert`: the CA certificate (PEM) the server's certificate must chain to, beside
    /// the system's root certificates.
    #[serde(default)]
    pub ssl_root_cert: Option<std::path::PathBuf>,
    /// `sslcert`: a client certificate (PEM), with `ssl_key`.
    #[serde(default)]
    pub ssl_cert: Option<std::path::PathBuf>,
    /// `sslkey`: the client certificate's private key (PEM).
    #[serde(default)]
    pub ssl_key: Option<std::path::PathBuf>,
}

#[cfg(feature = "postgres")]
impl DatabaseSettings {
    fn default_max_connections() -> u32 {
        10
    }

    /// Settings for `url`, everything else at its default.
    pub fn new(url: impl Into<String>) -> Self {
        DatabaseSettings {
            url: url.into(),
            max_connections: Self::default_max_connections(),
            ssl_mode: None,
            ssl_root_cert: None,
            ssl_cert: None,
            ssl_key: None,
        }
    }

    /// The connection options: the URL's, with the TLS fields that are set in their place.
    /// Checks that the certificate and key files can be read, so a wrong path is named here.
    pub fn connect_options(&self) -> Result<sqlx::postgres::PgConnectOptions, crate::store::StoreError> {
        use crate::store::StoreError;
        crate::postgres::check_tls_files(&self.url).map_err(StoreError::fatal)?;
        let mut options: sqlx::postgres::PgConnectOptions = self.url.parse().map_err(|_| {
            StoreError::fatal("database.url does not parse; expected postgres://user@host:port/database (with TLS: ?sslmode=verify-full&sslrootcert=/path/to/ca.pem)")
        })?;
        for (field, path) in [
            ("ssl_root_cert", &self.ssl_root_cert),
            ("ssl_cert", &self.ssl_cert),
            ("ssl_key", &self.ssl_key),
        ] {
            if let Some(path) = path {
                crate::store::postgres::readable(&format!("database.{field}"), path, field == "ssl_key")
                    .map_err(StoreError::fatal)?;
            }
        }
        if let Some(mode) = self.ssl_mode {
            options = options.ssl_mode(mode);
        }
        if let Some(path) = &self.ssl_root_cert {
            options = options.ssl_root_cert(path);
        }
        if let Some(path) = &self.ssl_cert {
            options = options.ssl_client_cert(path);
        }
        if let Some(path) = &self.ssl_key {
            options = options.ssl_client_key(path);
        }
        Ok(options)
    }

    /// Connects: [`PostgresInbox::connect_with`](crate::PostgresInbox::connect_with) with
    /// [`connect_options`](Self::connect_options) and `max_connections`. A refused TLS
    /// connection is a fatal error that says what to change.
    pub async fn connect(&self) -> Result<crate::PostgresInbox, crate::store::StoreError> {
        crate::PostgresInbox::connect_with(self.connect_options()?, self.max_connections).await
    }
}

#[cfg(feature = "postgres")]
impl fmt::Debug for DatabaseSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseSettings")
            .field("url", &crate::redact::url(&self.url))
            .field("max_connections", &self.max_connections)
            .field("ssl_mode", &self.ssl_mode)
            .field("ssl_root_cert", &self.ssl_root_cert)
            .field("ssl_cert", &self.ssl_cert)
            .field("ssl_key", &self.ssl_key.as_ref().map(|_| crate::redact::MASK))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_one_unit_and_read_back_what_they_print() {
        for (text, d) in [
            ("250ms", Duration::from_millis(250)),
            ("0s", Duration::ZERO),
            ("90s", Duration::from_secs(90)),
            ("30min", Duration::from_secs(1800)),
            ("12h", Duration::from_secs(43_200)),
            ("7d", Duration::from_secs(604_800)),
            ("2w", Duration::from_secs(1_209_600)),
        ] {
            assert_eq!(duration::parse(text), Ok(d), "{text}");
            assert_eq!(duration::parse(&duration::format(d)), Ok(d), "{text}");
        }
        assert_eq!(duration::format(Duration::from_millis(1500)), "1500ms");
        assert_eq!(duration::format(Duration::from_secs(36 * 3600)), "36h");
        for bad in [
            "90m",
            "3M",
            "1mo",
            "90",
            "7x",
            "min",
            "1.5h",
            "1d2h",
            "",
            "-1s",
            "99999999999999999999w",
        ] {
            let e = duration::parse(bad).unwrap_err();
            assert!(e.contains("ms, s, min, h, d or w"), "{bad}: {e}");
        }
    }

    /// Left out, every field is the builder's default: the builder with default settings is
    /// the builder without them, field for field.
    #[test]
    fn default_settings_are_the_builders_defaults() {
        let plain = format!("{:?}", crate::Consumer::builder("c"));
        let set = format!(
            "{:?}",
            crate::Consumer::builder("c").settings(&ConsumerSettings::default())
        );
        assert_eq!(plain, set);
        let parsed: ConsumerSettings = toml::from_str("").unwrap();
        assert_eq!(parsed, ConsumerSettings::default());
        assert_eq!(
            RetrySettings::default().apply(RetryPolicy::default()),
            RetryPolicy::default()
        );
    }

    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    #[test]
    fn default_relay_settings_are_the_relays_defaults() {
        use crate::outbox::RelayConfig;
        let shown = |c: RelayConfig| format!("{c:?}");
        assert_eq!(
            shown(RelayConfig::from(&RelaySettings::default())),
            shown(RelayConfig::default())
        );
        // A retry table that sets one field keeps the relay's other defaults, not the
        // consumer's.
        let s: RelaySettings = toml::from_str("retry = { max_attempts = 3 }").unwrap();
        assert_eq!(
            shown(RelayConfig::from(&s)),
            shown(RelayConfig::default().retry_policy(RelaySettings::default_retry().max_attempts(3)))
        );
    }

    #[test]
    fn settings_read_from_toml_with_units_and_refuse_unknown_fields() {
        let s: ConsumerSettings = toml::from_str(
            r#"
            concurrency = 4
            max_in_flight = 800
            batch_size = 50
            batch_linger = "5ms"
            batch_max_duration = "50ms"
            max_message_bytes = 65536
            dead_letter_payload_limit = 4096
            retry = { max_attempts = 5, initial_delay = "100ms", max_delay = "30s" }
            id_strategy = "header:message-id"
            fingerprint = "canonical-json"
            "#,
        )
        .unwrap();
        assert_eq!(s.batch_linger, Duration::from_millis(5));
        assert_eq!(
            s.retry.apply(RetryPolicy::default()),
            RetryPolicy::default()
                .max_attempts(5)
                .initial_delay(Duration::from_millis(100))
                .max_delay(Duration::from_secs(30))
        );
        assert_eq!(s.id_strategy, Some(IdStrategy::Header("message-id".into())));
        assert_eq!(s.fingerprint, Fingerprint::CanonicalJson);
        let built = format!("{:?}", crate::Consumer::builder("c").settings(&s));
        let by_hand = format!(
            "{:?}",
            crate::Consumer::builder("c")
                .concurrency(4)
                .max_in_flight(800)
                .batch_size(50)
                .batch_linger(Duration::from_millis(5))
                .batch_max_duration(Duration::from_millis(50))
                .max_message_bytes(65536)
                .dead_letter_payload_limit(4096)
                .retry_policy(s.retry.apply(RetryPolicy::default()))
                .id_strategy(IdStrategy::Header("message-id".into()))
                .fingerprint(Fingerprint::CanonicalJson)
        );
        assert_eq!(built, by_hand);

        for (text, says) in [
            ("concurency = 4", "unknown field `concurency`"),
            ("batch_linger = \"5m\"", "minutes or months"),
            ("batch_linger = 5", "invalid type"),
            ("fingerprint = \"md5\"", "bytes or canonical-json"),
            ("retry = { attempts = 3 }", "unknown field `attempts`"),
        ] {
            let e = toml::from_str::<ConsumerSettings>(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn database_settings_never_show_a_secret_in_debug() {
        let s: DatabaseSettings = toml::from_str(
            r#"
            url = "postgres://app:Kx9-Secret-Tail@db.example.com/app?sslmode=verify-full&sslpassword=Kx9-Secret-Tail"
            ssl_mode = "verify-full"
            ssl_root_cert = "/etc/ca.pem"
            ssl_cert = "/etc/app.pem"
            ssl_key = "/etc/Kx9-Secret-Tail.key"
            "#,
        )
        .unwrap();
        assert_eq!(s.max_connections, 10);
        assert!(
            matches!(s.ssl_mode, Some(sqlx::postgres::PgSslMode::VerifyFull)),
            "{s:?}"
        );
        let shown = format!("{s:?} {s:#?}");
        assert!(!shown.contains("Kx9") && !shown.contains("Secret"), "{shown}");
        assert!(
            shown.contains("db.example.com") && shown.contains("/etc/ca.pem"),
            "{shown}"
        );
        let e = toml::from_str::<DatabaseSettings>("url = \"postgres://db\"\nssl_mode = \"verify\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ssl_mode") || e.contains("verify"), "{e}");
        let e = toml::from_str::<DatabaseSettings>("url = \"postgres://db\"\npassword = \"x\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `password`"), "{e}");
    }
}
