//! [`KafkaConfig`]: what to consume, where dead letters go, and librdkafka pass-through
//! properties.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use txinbox::redact;

/// Default for [`KafkaConfig::max_buffered_per_partition`].
pub const DEFAULT_MAX_BUFFERED_PER_PARTITION: usize = 500;
/// Default for [`KafkaConfig::revoke_timeout`].
pub const DEFAULT_REVOKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default for [`KafkaConfig::close_timeout`].
pub const DEFAULT_CLOSE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default for [`KafkaConfig::dead_letter_timeout`].
pub const DEFAULT_DEAD_LETTER_TIMEOUT: Duration = Duration::from_secs(30);

/// librdkafka's default `max.poll.interval.ms`.
const DEFAULT_MAX_POLL_INTERVAL_MS: u64 = 300_000;

/// Properties the adapter sets itself; a pass-through value for them is refused.
const OWNED: &[(&str, &str)] = &[
    ("bootstrap.servers", "pass the brokers to KafkaConfig::new"),
    ("metadata.broker.list", "pass the brokers to KafkaConfig::new"),
    ("group.id", "pass the group id to KafkaConfig::new"),
    (
        "enable.auto.offset.store",
        "txinbox stores an offset only after the message's database transaction committed; it always sets this to false",
    ),
];

/// Configuration of a [`KafkaSource`](crate::KafkaSource).
///
/// ```
/// use std::time::Duration;
/// use txinbox_kafka::KafkaConfig;
///
/// let config = KafkaConfig::new("127.0.0.1:9092", "payments")
///     .topic("deposits")
///     .dead_letter_topic("deposits.dlq")
///     .max_buffered_per_partition(200)
///     .revoke_timeout(Duration::from_secs(5))
///     .set("session.timeout.ms", "10000")
///     .set("partition.assignment.strategy", "cooperative-sticky");
/// assert!(config.validate().is_ok());
/// ```
///
/// # Defaults the adapter sets (overridable with [`set`](Self::set) unless noted)
///
/// | property | value | why |
/// |---|---|---|
/// | `enable.auto.offset.store` | `false` (not overridable) | an offset is stored only after its transaction committed |
/// | `enable.auto.commit` | `true` | stored offsets reach the group for lag tools; `false` turns group commits off entirely (the database positions are authoritative either way) |
/// | `auto.offset.reset` | `earliest` | a partition with neither a database position nor a group offset starts at its beginning |
/// | `enable.partition.eof` | `false` | |
///
/// `Debug` masks the values of secret properties (`sasl.password`, `ssl.key.pem`, …; see
/// [`txinbox::redact::is_secret_key`]).
#[derive(Clone)]
pub struct KafkaConfig {
    pub(crate) brokers: String,
    pub(crate) group_id: String,
    pub(crate) topics: Vec<String>,
    pub(crate) dead_letter_topic: Option<String>,
    pub(crate) max_buffered_per_partition: usize,
    pub(crate) revoke_timeout: Duration,
    pub(crate) close_timeout: Duration,
    pub(crate) dead_letter_timeout: Duration,
    pub(crate) properties: BTreeMap<String, String>,
    pub(crate) producer_properties: BTreeMap<String, String>,
    pub(crate) on_missing_position: MissingPosition,
    pub(crate) on_retention_gap: RetentionGap,
    pub(crate) ordering: Ordering,
}

/// Where a partition starts when the database has no position for it but the consumer group
/// has a committed offset ([`KafkaConfig::on_missing_position`]).
///
/// The database is the record of what is done. A group offset without a database position
/// means the database does not know about records the group has passed: it was restored from a
/// dump taken before the partition was first processed, or it is a fresh database, or the
/// service is moving onto txinbox. Starting at the group's offset would skip those records'
/// effects without a word, so by default the consumer does not guess.
///
/// When neither has a position, `auto.offset.reset` applies whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingPosition {
    /// Do not consume the partition: it is assigned but held paused, an ERROR names it, the
    /// group's offset and the ways out, and the gauge
    /// [`txinbox_kafka_partitions_blocked`](crate::telemetry::PARTITIONS_BLOCKED) counts it.
    /// The source re-reads the database every 2 s: once a position is written (`txinbox
    /// positions set --to-earliest`, `txinbox positions adopt`), the partition starts there
    /// without a restart. The default.
    #[default]
    Refuse,
    /// Start at the earliest retained offset: every retained record is applied again; the
    /// inbox turns those whose rows survived into duplicates. Right after a restore.
    Earliest,
    /// Start at the group's committed offset: everything before it counts as done. Right when
    /// an existing service moves onto txinbox (its effects were applied without it).
    AdoptGroupOffset,
}

impl fmt::Display for MissingPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MissingPosition::Refuse => "refuse",
            MissingPosition::Earliest => "earliest",
            MissingPosition::AdoptGroupOffset => "adopt",
        })
    }
}

impl std::str::FromStr for MissingPosition {
    type Err = String;

    /// `refuse`, `earliest` or `adopt`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "refuse" => Ok(MissingPosition::Refuse),
            "earliest" => Ok(MissingPosition::Earliest),
            "adopt" | "adopt-group-offset" => Ok(MissingPosition::AdoptGroupOffset),
            other => Err(format!(
                "unknown missing-position policy {other:?}: use refuse, earliest or adopt"
            )),
        }
    }
}

/// What a partition does when its database position is below the broker's low watermark
/// ([`KafkaConfig::on_retention_gap`]): retention deleted records the consumer never processed.
///
/// It happens after a database restore, or when a consumer stayed stopped (or fell behind)
/// longer than the topic's retention. Seeking to the database position would then be answered
/// by librdkafka's `auto.offset.reset`: with `latest` everything retained is skipped, with
/// `earliest` the deleted range is lost, both without a word. The consumer compares the two on
/// every assignment and never lets that happen silently: it logs an ERROR naming the
/// partition, the position, the low watermark and how many offsets were deleted unprocessed,
/// and counts them in
/// [`txinbox_kafka_offsets_deleted_unprocessed_total`](crate::telemetry::OFFSETS_DELETED_UNPROCESSED).
/// What it then does is this choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RetentionGap {
    /// Do not consume the partition: it is assigned but held paused, the health report names
    /// it (not ready), and the gauge
    /// [`txinbox_kafka_partitions_blocked`](crate::telemetry::PARTITIONS_BLOCKED) counts it.
    /// The source re-reads the database every 2 s: once another position is written (`txinbox
    /// positions set --to-earliest` accepts the gap), the partition starts there without a
    /// restart. The default.
    #[default]
    Refuse,
    /// Start at the earliest retained offset, accepting the gap: the deleted records' effects
    /// are lost. The ERROR and the counter still record it; the consumer stays ready.
    Earliest,
}

impl fmt::Display for RetentionGap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RetentionGap::Refuse => "refuse",
            RetentionGap::Earliest => "earliest",
        })
    }
}

impl std::str::FromStr for RetentionGap {
    type Err = String;

    /// `refuse` or `earliest`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "refuse" => Ok(RetentionGap::Refuse),
            "earliest" => Ok(RetentionGap::Earliest),
            other => Err(format!(
                "unknown retention-gap policy {other:?}: use refuse or earliest"
            )),
        }
    }
}

/// Which records of one partition may be processed at the same time
/// ([`KafkaConfig::ordering`]).
///
/// Whatever the choice, a record's effects are applied once, its offset and database position
/// never pass a record that is not settled, and a record of a key never overtakes an earlier
/// record of the same key in `Partition` and `Key` ordering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Ordering {
    /// One lane per partition: one transaction at a time per partition, records in offset
    /// order. Concurrency is at most the number of assigned partitions. The default.
    #[default]
    Partition,
    /// One lane per record key within a partition: the records of a key are processed one
    /// transaction at a time, in offset order; different keys of a partition run concurrently,
    /// up to the consumer's `concurrency`. Order holds per key, not per partition. Records
    /// without a key go as [`Keyless`] says.
    Key(Keyless),
    /// No order: any record may run beside any other, up to the consumer's `concurrency`. An
    /// in-place retry holds its record and those its transaction took with it. For handlers
    /// whose effects commute.
    Unordered,
}

/// Where [`Ordering::Key`] puts records without a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Keyless {
    /// The keyless records of a partition form one lane of their own, in offset order (as if
    /// they shared one key). The default.
    #[default]
    InOrder,
    /// Keyless records run concurrently with everything, in no order.
    Unordered,
}

impl fmt::Display for Ordering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ordering::Partition => "partition",
            Ordering::Key(Keyless::InOrder) => "key",
            Ordering::Key(Keyless::Unordered) => "key-or-unordered",
            Ordering::Unordered => "unordered",
        })
    }
}

impl std::str::FromStr for Ordering {
    type Err = String;

    /// `partition`, `key` (keyless records in one lane per partition), `key-or-unordered`
    /// (keyless records in no order) or `unordered`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "partition" => Ok(Ordering::Partition),
            "key" => Ok(Ordering::Key(Keyless::InOrder)),
            "key-or-unordered" => Ok(Ordering::Key(Keyless::Unordered)),
            "unordered" => Ok(Ordering::Unordered),
            other => Err(format!(
                "unknown ordering {other:?}: use partition, key, key-or-unordered or unordered"
            )),
        }
    }
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("brokers", &redact::url(&self.brokers))
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("max_buffered_per_partition", &self.max_buffered_per_partition)
            .field("revoke_timeout", &self.revoke_timeout)
            .field("close_timeout", &self.close_timeout)
            .field("dead_letter_timeout", &self.dead_letter_timeout)
            .field("on_missing_position", &self.on_missing_position)
            .field("on_retention_gap", &self.on_retention_gap)
            .field("ordering", &self.ordering)
            .field("properties", &Properties(&self.properties))
            .field("producer_properties", &Properties(&self.producer_properties))
            .finish()
    }
}

/// librdkafka properties for `Debug`, secret values masked.
pub(crate) struct Properties<'a>(pub(crate) &'a BTreeMap<String, String>);

impl fmt::Debug for Properties<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| (k, redact::property(k, v))))
            .finish()
    }
}

/// The text of an error from creating a librdkafka client from `config`, secrets masked:
/// rdkafka's `Display` of a configuration error quotes the property and its value, and
/// librdkafka's own messages can quote values too, so every secret value of `config` is
/// masked wherever it appears.
pub(crate) fn masked_error(e: &rdkafka::error::KafkaError, config: &rdkafka::ClientConfig) -> String {
    let mut text = match e {
        rdkafka::error::KafkaError::ClientConfig(_, desc, key, value) => format!(
            "client configuration error: {desc} ({key}={})",
            redact::property(key, value)
        ),
        other => other.to_string(),
    };
    for (key, value) in config.config_map() {
        // Very short values would mask ordinary words; no secret is that short.
        if redact::is_secret_key(key) && value.len() >= 3 {
            text = text.replace(value, redact::MASK);
        }
    }
    text
}

/// librdkafka properties from one command-line value or environment variable, in order:
/// `KEY=VALUE`, or several separated by `,` — but only where a property name and `=` follow
/// the `,` (a dotted name such as `session.timeout.ms`, or one of librdkafka's undotted `acks`,
/// `debug`, `retries`, `partitioner`, `log_level`). Anything else stays in the value, so
/// `sasl.password=a,b` or a JAAS configuration keeps its commas, and the rule is the one
/// [`txinbox::redact`] masks by: no piece of a value is ever taken for a property of its own.
/// What the `txinbox` CLI's and the examples' `-X` / `--kafka-property` read.
///
/// The error never contains the text (it may hold a secret).
///
/// ```
/// let props = txinbox_kafka::parse_properties("security.protocol=SASL_SSL,sasl.password=a,b").unwrap();
/// assert_eq!(props, [("security.protocol".into(), "SASL_SSL".into()), ("sasl.password".into(), "a,b".into())]);
/// ```
pub fn parse_properties(text: &str) -> Result<Vec<(String, String)>, String> {
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
                    "expected KEY=VALUE, or several as KEY=VALUE,KEY=VALUE (e.g. security.protocol=SSL)"
                        .into(),
                )
            }
        }
    }
    Ok(properties)
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

impl KafkaConfig {
    /// Consume as member of consumer group `group_id` from `brokers` (`host:port[,host:port]`;
    /// use `127.0.0.1`, not `localhost`, for brokers listening on IPv4 only).
    ///
    /// Which consumer's database positions the source reads is not configured here: the
    /// [`txinbox::Consumer`] it is given to hands over its own name and store when it is built.
    pub fn new(brokers: impl Into<String>, group_id: impl Into<String>) -> Self {
        KafkaConfig {
            brokers: brokers.into(),
            group_id: group_id.into(),
            topics: Vec::new(),
            dead_letter_topic: None,
            max_buffered_per_partition: DEFAULT_MAX_BUFFERED_PER_PARTITION,
            revoke_timeout: DEFAULT_REVOKE_TIMEOUT,
            close_timeout: DEFAULT_CLOSE_TIMEOUT,
            dead_letter_timeout: DEFAULT_DEAD_LETTER_TIMEOUT,
            properties: BTreeMap::new(),
            producer_properties: BTreeMap::new(),
            on_missing_position: MissingPosition::default(),
            on_retention_gap: RetentionGap::default(),
            ordering: Ordering::default(),
        }
    }

    /// Where a partition starts when the database has no position for it and the group has a
    /// committed offset (a restored or fresh database): [`MissingPosition::Refuse`] (default),
    /// [`Earliest`](MissingPosition::Earliest) or
    /// [`AdoptGroupOffset`](MissingPosition::AdoptGroupOffset).
    pub fn on_missing_position(mut self, policy: MissingPosition) -> Self {
        self.on_missing_position = policy;
        self
    }

    /// What a partition does when its database position is below the broker's low watermark
    /// (retention deleted records the consumer never processed): [`RetentionGap::Refuse`]
    /// (default: held until another position is written) or
    /// [`Earliest`](RetentionGap::Earliest) (accept the gap). Either way the gap is logged at
    /// ERROR and counted.
    pub fn on_retention_gap(mut self, policy: RetentionGap) -> Self {
        self.on_retention_gap = policy;
        self
    }

    /// Which records of a partition may be processed at the same time: [`Ordering::Partition`]
    /// (default: one transaction at a time per partition, in offset order),
    /// [`Ordering::Key`] (records of one key in offset order, different keys of a partition
    /// concurrently) or [`Ordering::Unordered`].
    ///
    /// Under `Key` and `Unordered` a partition's records settle out of order: its offset and
    /// its database position move only to the contiguous settled prefix, so a restart (or a
    /// rebalance) reads again what settled past it, and the inbox turns that into duplicates.
    /// How many run at once is the consumer's
    /// [`concurrency`](txinbox::ConsumerBuilder::concurrency): raise it, and the database
    /// pool with it, for handlers that wait on I/O.
    pub fn ordering(mut self, ordering: Ordering) -> Self {
        self.ordering = ordering;
        self
    }

    /// Adds a topic to subscribe to.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// Where dead letters are produced, for every subscribed topic. Default: `<topic>.dlq`, per
    /// source topic.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// How many messages of one partition may be received and not yet settled before the
    /// partition is paused; it is resumed when half of them are settled (hysteresis, so a busy
    /// partition is not paused and resumed for every message, each pause discarding librdkafka's
    /// prefetched messages). Default: 500.
    pub fn max_buffered_per_partition(mut self, n: usize) -> Self {
        self.max_buffered_per_partition = n;
        self
    }

    /// How long a revocation waits for the revoked partitions' in-flight messages to finish
    /// before it commits and gives the partitions up. Must stay below `max.poll.interval.ms`.
    /// Messages still running afterwards finish; their offsets are not stored and the new owner
    /// redelivers them (the inbox turns that into duplicates). Default: 10 s.
    pub fn revoke_timeout(mut self, timeout: Duration) -> Self {
        self.revoke_timeout = timeout;
        self
    }

    /// How long [`close`](txinbox::MessageSource::close) waits for the final commit and for
    /// librdkafka to leave the group. Default: 30 s.
    pub fn close_timeout(mut self, timeout: Duration) -> Self {
        self.close_timeout = timeout;
        self
    }

    /// How long one attempt to produce a dead letter may take (the producer's
    /// `message.timeout.ms`). After a transient failure the attempt is repeated while the
    /// partition stays assigned; the original offset is stored only once a dead letter is
    /// confirmed, or refused for good (then the database's dead-letter row is the record).
    /// Default: 30 s.
    pub fn dead_letter_timeout(mut self, timeout: Duration) -> Self {
        self.dead_letter_timeout = timeout;
        self
    }

    /// Sets any librdkafka consumer property (see librdkafka's CONFIGURATION.md), for example
    /// `session.timeout.ms`, `partition.assignment.strategy`, `security.protocol`. Security
    /// properties (`security.protocol`, `sasl.*`, `ssl.*`) are also given to the dead-letter
    /// producer.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(key.into(), value.into());
        self
    }

    /// Sets a librdkafka property of the dead-letter producer only (e.g. `compression.type`).
    pub fn set_producer(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.producer_properties.insert(key.into(), value.into());
        self
    }

    /// The subscribed topics.
    pub fn topics(&self) -> &[String] {
        &self.topics
    }

    /// The dead-letter topic for records of `topic`.
    pub fn dead_letter_topic_for(&self, topic: &str) -> String {
        match &self.dead_letter_topic {
            Some(t) => t.clone(),
            None => format!("{topic}.dlq"),
        }
    }

    /// Whether offsets are committed to the group (`enable.auto.commit`, default true).
    pub(crate) fn group_commits(&self) -> bool {
        self.properties
            .get("enable.auto.commit")
            .is_none_or(|v| !(v.eq_ignore_ascii_case("false") || v == "0"))
    }

    /// Checks the configuration; the error says what to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.brokers.trim().is_empty() {
            return Err("brokers is empty: pass host:port of at least one broker to KafkaConfig::new".into());
        }
        if self.group_id.trim().is_empty() {
            return Err("group id is empty: pass the consumer group to KafkaConfig::new".into());
        }
        if self.topics.is_empty() {
            return Err("no topics: add at least one with KafkaConfig::topic".into());
        }
        if let Some(t) = self.topics.iter().find(|t| t.trim().is_empty()) {
            return Err(format!("topic name {t:?} is empty"));
        }
        for topic in &self.topics {
            let dlq = self.dead_letter_topic_for(topic);
            if self.topics.contains(&dlq) {
                return Err(format!(
                    "the dead-letter topic {dlq:?} is also a subscribed topic: dead letters would be consumed again; choose another with KafkaConfig::dead_letter_topic"
                ));
            }
        }
        if self.max_buffered_per_partition == 0 {
            return Err("max_buffered_per_partition must be at least 1".into());
        }
        for (key, why) in OWNED {
            if let Some(v) = self.properties.get(*key) {
                if *key == "enable.auto.offset.store" && v == "false" {
                    continue;
                }
                return Err(format!(
                    "property {key}={} cannot be set: {why}",
                    redact::property(key, v)
                ));
            }
        }
        let max_poll_ms = match self.properties.get("max.poll.interval.ms") {
            Some(v) => v
                .parse::<u64>()
                .map_err(|_| format!("max.poll.interval.ms={v:?} is not a number of milliseconds"))?,
            None => DEFAULT_MAX_POLL_INTERVAL_MS,
        };
        if self.revoke_timeout.as_millis() >= u128::from(max_poll_ms) {
            return Err(format!(
                "revoke_timeout ({:?}) must be below max.poll.interval.ms ({max_poll_ms} ms): the rebalance \
                 callback blocks the poller while it waits; lower revoke_timeout or raise max.poll.interval.ms",
                self.revoke_timeout
            ));
        }
        if self.dead_letter_timeout < Duration::from_millis(1) {
            return Err("dead_letter_timeout must be at least 1 ms".into());
        }
        Ok(())
    }

    /// Where a partition with neither a database position nor a group offset starts, as
    /// `auto.offset.reset` says (`earliest` unless set otherwise; `error` and unknown values:
    /// left to librdkafka).
    pub(crate) fn reset_offset(&self) -> rdkafka::Offset {
        let reset = self
            .properties
            .get("auto.offset.reset")
            .map_or("earliest", String::as_str);
        match reset {
            "earliest" | "smallest" | "beginning" => rdkafka::Offset::Beginning,
            "latest" | "largest" | "end" => rdkafka::Offset::End,
            _ => rdkafka::Offset::Invalid,
        }
    }

    /// The consumer's librdkafka configuration.
    pub(crate) fn consumer_config(&self) -> rdkafka::ClientConfig {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group_id)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "true")
            .set("enable.partition.eof", "false")
            // Statistics feed the lag gauge and the broker-connected health report.
            .set("statistics.interval.ms", "5000");
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        c.set("enable.auto.offset.store", "false");
        c
    }

    /// The dead-letter producer's librdkafka configuration.
    pub(crate) fn producer_config(&self) -> rdkafka::ClientConfig {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers).set(
            "message.timeout.ms",
            self.dead_letter_timeout.as_millis().max(1).to_string(),
        );
        for (k, v) in &self.properties {
            let shared = k == "security.protocol"
                || k.starts_with("sasl.")
                || k.starts_with("ssl.")
                || k == "client.dns.lookup"
                || k == "broker.address.family";
            if shared {
                c.set(k, v);
            }
        }
        for (k, v) in &self.producer_properties {
            c.set(k, v);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> KafkaConfig {
        KafkaConfig::new("127.0.0.1:9092", "g").topic("t")
    }

    #[test]
    fn defaults_validate_and_dlq_topic_defaults_per_topic() {
        assert!(base().validate().is_ok());
        assert_eq!(base().dead_letter_topic_for("t"), "t.dlq");
        assert_eq!(base().dead_letter_topic("x").dead_letter_topic_for("t"), "x");
        assert!(base().group_commits());
        assert!(!base().set("enable.auto.commit", "false").group_commits());
    }

    #[test]
    fn invalid_configurations_say_what_to_change() {
        let err = |c: KafkaConfig| c.validate().unwrap_err();
        assert!(err(KafkaConfig::new("", "g").topic("t")).contains("brokers"));
        assert!(err(KafkaConfig::new("b", "g")).contains("KafkaConfig::topic"));
        assert!(err(base().set("enable.auto.offset.store", "true")).contains("only after"));
        assert!(err(base().set("group.id", "x")).contains("KafkaConfig::new"));
        assert!(err(base().dead_letter_topic("t")).contains("dead-letter topic"));
        assert!(err(base().max_buffered_per_partition(0)).contains("at least 1"));
        assert!(err(base()
            .set("max.poll.interval.ms", "5000")
            .revoke_timeout(Duration::from_secs(6)))
        .contains("max.poll.interval.ms"));
        assert!(base().set("enable.auto.offset.store", "false").validate().is_ok());
    }
}
