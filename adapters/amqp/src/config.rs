//! [`AmqpConfig`]: where to connect, what to consume, how to recover.

use std::fmt;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};

use crate::error::AmqpError;
use crate::tls::AmqpTls;

/// Default [`AmqpConfig::prefetch`].
pub const DEFAULT_PREFETCH: u16 = 64;
/// Default [`AmqpConfig::publish_timeout`].
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`AmqpConfig::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default lower bound of [`AmqpConfig::reconnect_backoff`].
pub const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Default upper bound of [`AmqpConfig::reconnect_backoff`].
pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(10);
/// Default [`AmqpConfig::requeue_delay`].
pub const DEFAULT_REQUEUE_DELAY: Duration = Duration::from_secs(5);
/// Default [`AmqpConfig::delivery_limit`]: RabbitMQ 4's default `delivery-limit` of quorum
/// queues.
pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

/// The type of the work and dead-letter queues the source declares
/// ([`AmqpConfig::queue_type`]). The retry queue is a quorum queue with either: its
/// dead-lettering back to the work queue must be at least once, which only quorum queues do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A classic queue (`x-queue-type` not set): the default, and what RabbitMQ declares
    /// without arguments.
    #[default]
    Classic,
    /// A quorum queue (`x-queue-type = quorum`): replicated, the type RabbitMQ recommends for
    /// data that must not be lost (RabbitMQ 4 has no classic mirroring).
    Quorum,
}

impl QueueType {
    /// `classic` or `quorum`.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for QueueType {
    type Err = String;

    /// `classic` or `quorum` (any case).
    fn from_str(s: &str) -> Result<QueueType, String> {
        match s.to_ascii_lowercase().as_str() {
            "classic" => Ok(QueueType::Classic),
            "quorum" => Ok(QueueType::Quorum),
            _ => Err(format!("unknown queue type {s:?}: expected classic or quorum")),
        }
    }
}

/// AMQP names (queues, consumer tags, headers) are AMQP short strings: at most 255 bytes.
const MAX_SHORT_STRING: usize = 255;

/// Configuration of an [`AmqpSource`](crate::AmqpSource).
///
/// Built with [`AmqpConfig::new`] and the builder methods; checked by
/// [`validate`](AmqpConfig::validate) (which [`AmqpSource::connect`](crate::AmqpSource::connect)
/// calls). `Debug` prints the URI with its password replaced by `***`; the URI is never logged.
///
/// | setting | default |
/// |---|---|
/// | [`prefetch`](Self::prefetch) | 64 (`basic.qos`, per consumer, re-applied on every reconnect) |
/// | [`consumer_tag`](Self::consumer_tag) | `txinbox-<pid>-<n>` |
/// | [`tls`](Self::tls) | none: `amqps://` verifies the broker against the system's root certificates |
/// | [`declare_topology`](Self::declare_topology) | `true`: work queue, `<queue>.retry`, `<queue>.dlq`, all durable |
/// | [`queue_type`](Self::queue_type) | classic work and dead-letter queues (the retry queue is always a quorum queue) |
/// | [`delivery_limit`](Self::delivery_limit) | not declared; deliveries near 20 (RabbitMQ 4's default) are replaced by a fresh copy |
/// | [`retry_queue`](Self::retry_queue) | `<queue>.retry` |
/// | [`dead_letter_queue`](Self::dead_letter_queue) | `<queue>.dlq` |
/// | [`lane_header`](Self::lane_header) | none: competing consumers, no ordering |
/// | [`reconnect_backoff`](Self::reconnect_backoff) | 100 ms doubling to 10 s, with jitter |
/// | [`connect_timeout`](Self::connect_timeout) | 10 s |
/// | [`publish_timeout`](Self::publish_timeout) | 10 s (publish + broker confirm of a retry or dead-letter copy) |
/// | [`requeue_delay`](Self::requeue_delay) | 5 s |
#[derive(Clone)]
pub struct AmqpConfig {
    pub(crate) uri: String,
    pub(crate) queue: String,
    pub(crate) prefetch: u16,
    pub(crate) consumer_tag: Option<String>,
    pub(crate) declare_topology: bool,
    pub(crate) retry_queue: Option<String>,
    pub(crate) dead_letter_queue: Option<String>,
    pub(crate) lane_header: Option<String>,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) publish_timeout: Duration,
    pub(crate) requeue_delay: Duration,
    pub(crate) connection_name: Option<String>,
    pub(crate) tls: AmqpTls,
    pub(crate) queue_type: QueueType,
    pub(crate) delivery_limit: Option<u32>,
}

impl AmqpConfig {
    /// Consume `queue` on the broker at `uri`.
    ///
    /// `uri` is an AMQP URI: `amqp://user:password@host:5672/%2f` (the vhost `/` is written
    /// `%2f`), or `amqps://…` for TLS, verified against the system's root certificates and the
    /// [`tls`](Self::tls) settings. Query parameters `heartbeat` (seconds), `connection_timeout`
    /// (ms), `frame_max`, `channel_max` and `auth_mechanism` (`plain`, `external`, …) are
    /// understood.
    pub fn new(uri: impl Into<String>, queue: impl Into<String>) -> Self {
        AmqpConfig {
            uri: uri.into(),
            queue: queue.into(),
            prefetch: DEFAULT_PREFETCH,
            consumer_tag: None,
            declare_topology: true,
            retry_queue: None,
            dead_letter_queue: None,
            lane_header: None,
            reconnect_min: DEFAULT_RECONNECT_MIN,
            reconnect_max: DEFAULT_RECONNECT_MAX,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
            requeue_delay: DEFAULT_REQUEUE_DELAY,
            connection_name: None,
            tls: AmqpTls::default(),
            queue_type: QueueType::Classic,
            delivery_limit: None,
        }
    }

    /// The CA and client certificate of an `amqps://` connection (see [`AmqpTls`]). Setting
    /// any with a plaintext `amqp://` URI is refused by [`validate`](Self::validate).
    pub fn tls(mut self, tls: AmqpTls) -> Self {
        self.tls = tls;
        self
    }

    /// The type of the work and dead-letter queues declared on every (re)connect (default
    /// [`QueueType::Classic`]). It must match how existing queues were declared: a queue that
    /// exists with other arguments is refused at connect with RabbitMQ's own words naming the
    /// argument (`PRECONDITION_FAILED - inequivalent arg 'x-queue-type' …`), and what to set.
    /// Without effect when [`declare_topology`](Self::declare_topology) is off.
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// The work queue's `x-delivery-limit` (quorum queues only): how many times the broker
    /// gives a message back (its consumer died or lost its connection with it unacknowledged, a
    /// `basic.nack`) before it drops the message, or dead-letters it to the queue's own
    /// dead-letter exchange, behind txinbox's back. Declared with a quorum work queue when set;
    /// leave it unset for a queue declared without one. At least 1.
    ///
    /// txinbox never gives a message back on purpose (a retry is a copy through the retry
    /// queue, then an ack), so the count grows only when consumers die or lose their
    /// connection. And a delivery whose next give-back could be the broker's last
    /// (`x-delivery-count` + 1 ≥ the limit) is replaced before the handler sees it: a fresh copy
    /// goes to the work queue (confirmed, then the original is acked; its count starts over).
    /// That keeps a live consumer's messages away from the limit. It cannot help a message that
    /// waits in the prefetch buffer of consumers that die again and again before they reach it:
    /// each death counts for every delivered message. So keep the limit far above the number
    /// of crashes in a row you tolerate, or have none: RabbitMQ 3.x quorum queues have no
    /// limit unless one is set; RabbitMQ 4 sets 20 by default, and `-1` (queue argument or
    /// policy `delivery-limit`) turns it off there (on 3.x, `-1` drops a message at its first
    /// give-back). Set this to the queue's limit when it is below [`DEFAULT_DELIVERY_LIMIT`]
    /// (20, RabbitMQ 4's default).
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// The delivery limit txinbox keeps messages under: [`delivery_limit`](Self::delivery_limit)
    /// or [`DEFAULT_DELIVERY_LIMIT`].
    pub fn delivery_limit_or_default(&self) -> u32 {
        self.delivery_limit.unwrap_or(DEFAULT_DELIVERY_LIMIT)
    }

    /// The queues the source declares (with [`declare_topology`](Self::declare_topology) on),
    /// in order, each with its arguments: the work queue, the retry queue
    /// ([`retry_queue_arguments`]) and the dead-letter queue. All durable. For declaring them
    /// yourself the same way.
    pub fn topology(&self) -> [(String, FieldTable); 3] {
        let typed = |limit: Option<u32>| {
            let mut t = FieldTable::default();
            if self.queue_type == QueueType::Quorum {
                t.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
                if let Some(limit) = limit {
                    t.insert(
                        "x-delivery-limit".into(),
                        AMQPValue::LongLongInt(i64::from(limit)),
                    );
                }
            }
            t
        };
        [
            (self.queue.clone(), typed(self.delivery_limit)),
            (self.retry_queue_name(), retry_queue_arguments(&self.queue)),
            (self.dead_letter_queue_name(), typed(None)),
        ]
    }

    /// How many unacknowledged deliveries the broker may push to this consumer (`basic.qos`
    /// prefetch count, applied before `basic.consume` and again after every reconnect). It is
    /// the ceiling of the consumer's concurrency: set it at least to the `Consumer`'s
    /// `concurrency`, better to its `max_in_flight` or a few times the concurrency.
    /// 1 to 65535; default 64.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n;
        self
    }

    /// The consumer tag, shown in the management UI. Default `txinbox-<pid>-<n>`.
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = Some(tag.into());
        self
    }

    /// The connection name shown in the management UI (client property `connection_name`).
    /// Default `txinbox:<queue>`.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Whether to declare the topology on every (re)connect (default `true`):
    ///
    /// - the work queue: durable, of the [`queue_type`](Self::queue_type) (with
    ///   [`delivery_limit`](Self::delivery_limit), if set);
    /// - the retry queue: [`retry_queue_arguments`], so a copy whose per-message TTL expires
    ///   goes back to the work queue through the default exchange, at least once;
    /// - the dead-letter queue: durable, of the [`queue_type`](Self::queue_type).
    ///
    /// ([`topology`](Self::topology) lists them.) A queue that exists with other arguments is
    /// refused at connect, naming the argument. Turn this off when the queues are managed
    /// elsewhere with arguments of their own (a length limit, a policy-free DLX, …): they are
    /// then used as they are, and the retry and dead-letter queues must exist with the
    /// arguments above (a missing one is reported in the consumer's health).
    pub fn declare_topology(mut self, declare: bool) -> Self {
        self.declare_topology = declare;
        self
    }

    /// The retry queue. Default `<queue>.retry`.
    pub fn retry_queue(mut self, name: impl Into<String>) -> Self {
        self.retry_queue = Some(name.into());
        self
    }

    /// The dead-letter queue. Default `<queue>.dlq`.
    pub fn dead_letter_queue(mut self, name: impl Into<String>) -> Self {
        self.dead_letter_queue = Some(name.into());
        self
    }

    /// Processes messages carrying this header in order per header value
    /// ([`Lane::Ordered`](txinbox::source::Lane)); messages without it are unordered. Default: none,
    /// every message unordered (competing consumers).
    ///
    /// The order holds only **within one consumer instance** (RabbitMQ spreads a queue across
    /// its consumers) and only for messages that do **not** go through the retry queue (a
    /// retried message comes back behind later ones). For a strict per-key order use a single
    /// consumer instance and let the retry policy dead-letter rather than retry, or a
    /// partitioned broker.
    pub fn lane_header(mut self, header: impl Into<String>) -> Self {
        self.lane_header = Some(header.into());
        self
    }

    /// Delay between reconnect attempts: starts at `min`, doubles up to `max`, each with
    /// jitter (50–100 %). Default 100 ms to 10 s.
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_min = min;
        self.reconnect_max = max;
        self
    }

    /// Longest wait for a TCP + AMQP handshake. Default 10 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Longest wait for publishing a retry or dead-letter copy and its publisher confirm
    /// (lapin #409: a publish can hang when the server goes away), and for sending an ack.
    /// On timeout the original is not acknowledged; it is redelivered and the inbox
    /// deduplicates. Default 10 s.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// When the broker refuses a retry or dead-letter copy (unroutable, negatively confirmed,
    /// timed out) while the channel is still open, the original is given back with
    /// `basic.nack(requeue)` after this delay (for a retry: after the retry's delay, if that is
    /// longer), so a broken topology never becomes a hot loop nor a stuck delivery.
    /// Default 5 s.
    pub fn requeue_delay(mut self, delay: Duration) -> Self {
        self.requeue_delay = delay;
        self
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The retry queue's name.
    pub fn retry_queue_name(&self) -> String {
        self.retry_queue
            .clone()
            .unwrap_or_else(|| format!("{}.retry", self.queue))
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_queue_name(&self) -> String {
        self.dead_letter_queue
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.queue))
    }

    pub(crate) fn connection_name_or_default(&self) -> String {
        self.connection_name
            .clone()
            .unwrap_or_else(|| format!("txinbox:{}", self.queue))
    }

    /// The URI with its password replaced by `***`, for logs and `Debug`
    /// ([`txinbox::redact::url`]).
    pub fn redacted_uri(&self) -> String {
        txinbox::redact::url(&self.uri)
    }

    /// Checks the configuration; the error says what to change.
    pub fn validate(&self) -> Result<(), AmqpError> {
        let err = |m: String| Err(AmqpError::Config(m));
        self.tls.check(&self.uri, "AmqpConfig uri")?;
        if self.delivery_limit == Some(0) {
            return err(
                "AmqpConfig delivery_limit must be at least 1 (a quorum queue with limit 0 drops a message the first time it is given back)"
                    .into(),
            );
        }
        let short = |what: &str, v: &str| -> Result<(), AmqpError> {
            if v.is_empty() {
                return Err(AmqpError::Config(format!("AmqpConfig {what} must not be empty")));
            }
            if v.len() > MAX_SHORT_STRING {
                return Err(AmqpError::Config(format!(
                    "AmqpConfig {what} is {} bytes long; AMQP names are at most {MAX_SHORT_STRING} bytes",
                    v.len()
                )));
            }
            Ok(())
        };
        short("queue", &self.queue)?;
        if self.queue.starts_with("amq.") && self.declare_topology {
            return err(format!(
                "AmqpConfig queue {:?}: names starting with `amq.` are reserved by the broker; pick another name or use declare_topology(false)",
                self.queue
            ));
        }
        let retry = self.retry_queue_name();
        let dlq = self.dead_letter_queue_name();
        short("retry_queue", &retry)?;
        short("dead_letter_queue", &dlq)?;
        if retry == self.queue || dlq == self.queue || retry == dlq {
            return err(format!(
                "AmqpConfig queue ({:?}), retry_queue ({retry:?}) and dead_letter_queue ({dlq:?}) must be three different queues",
                self.queue
            ));
        }
        if let Some(tag) = &self.consumer_tag {
            short("consumer_tag", tag)?;
        }
        if let Some(h) = &self.lane_header {
            short("lane_header", h)?;
        }
        if self.prefetch == 0 {
            return err(
                "AmqpConfig prefetch must be at least 1 (0 would mean unlimited: the broker would push the whole queue)"
                    .into(),
            );
        }
        if self.reconnect_min.is_zero() || self.reconnect_min > self.reconnect_max {
            return err(format!(
                "AmqpConfig reconnect_backoff: min ({:?}) must be above zero and at most max ({:?})",
                self.reconnect_min, self.reconnect_max
            ));
        }
        for (what, d) in [
            ("connect_timeout", self.connect_timeout),
            ("publish_timeout", self.publish_timeout),
            ("requeue_delay", self.requeue_delay),
        ] {
            if d.is_zero() {
                return err(format!("AmqpConfig {what} must be above zero"));
            }
        }
        Ok(())
    }
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("uri", &self.redacted_uri())
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("declare_topology", &self.declare_topology)
            .field("retry_queue", &self.retry_queue_name())
            .field("dead_letter_queue", &self.dead_letter_queue_name())
            .field("lane_header", &self.lane_header)
            .field("reconnect_backoff", &(self.reconnect_min, self.reconnect_max))
            .field("connect_timeout", &self.connect_timeout)
            .field("publish_timeout", &self.publish_timeout)
            .field("requeue_delay", &self.requeue_delay)
            .field("tls", &self.tls)
            .field("queue_type", &self.queue_type)
            .field("delivery_limit", &self.delivery_limit)
            .finish()
    }
}

/// The arguments of the retry queue of work queue `queue`: a quorum queue that dead-letters
/// expired copies back to `queue` through the default exchange, **at least once**
/// (`x-dead-letter-strategy = at-least-once`, which needs `x-overflow = reject-publish`).
/// A classic queue dead-letters at most once: a copy lost on the way would leave its message
/// acked and never retried. Declare your own retry queue with these when
/// [`AmqpConfig::declare_topology`] is off.
pub fn retry_queue_arguments(queue: &str) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    t.insert(
        "x-dead-letter-strategy".into(),
        AMQPValue::LongString("at-least-once".into()),
    );
    t.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    t.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
    t.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(queue.into()),
    );
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    const URI: &str = "amqp://guest:s3cret@127.0.0.1:5672/%2f";

    #[test]
    fn defaults_are_valid_and_derive_queue_names() {
        let c = AmqpConfig::new(URI, "payments");
        c.validate().unwrap();
        assert_eq!(c.retry_queue_name(), "payments.retry");
        assert_eq!(c.dead_letter_queue_name(), "payments.dlq");
        assert_eq!(c.prefetch, DEFAULT_PREFETCH);
    }

    #[test]
    fn password_never_shows_in_debug() {
        let c = AmqpConfig::new(URI, "payments");
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("s3cret"), "{dbg}");
        assert!(dbg.contains("amqp://guest:***@127.0.0.1:5672/%2f"), "{dbg}");
    }

    fn invalid(c: AmqpConfig, needle: &str) {
        match c.validate() {
            Err(AmqpError::Config(m)) => assert!(m.contains(needle), "{m:?} should mention {needle:?}"),
            other => panic!("expected a config error mentioning {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn invalid_settings_say_what_to_change() {
        invalid(AmqpConfig::new("http://x", "q"), "amqp://");
        let bad = AmqpConfig::new("amqp://guest:s3cret@host:notaport/%2f", "q");
        let msg = format!("{:?}", bad.validate().unwrap_err());
        assert!(
            msg.contains("not an AMQP URI") && !msg.contains("s3cret"),
            "{msg}"
        );
        invalid(AmqpConfig::new(URI, ""), "queue must not be empty");
        invalid(AmqpConfig::new(URI, "x".repeat(256)), "at most 255 bytes");
        invalid(
            AmqpConfig::new(URI, "q").prefetch(0),
            "prefetch must be at least 1",
        );
        invalid(
            AmqpConfig::new(URI, "q").retry_queue("q"),
            "three different queues",
        );
        invalid(
            AmqpConfig::new(URI, "q").retry_queue("z").dead_letter_queue("z"),
            "three different queues",
        );
        invalid(AmqpConfig::new(URI, "amq.q"), "reserved");
        AmqpConfig::new(URI, "amq.q")
            .declare_topology(false)
            .validate()
            .unwrap();
        invalid(
            AmqpConfig::new(URI, "q").lane_header(""),
            "lane_header must not be empty",
        );
        invalid(
            AmqpConfig::new(URI, "q").consumer_tag("t".repeat(300)),
            "consumer_tag",
        );
        invalid(
            AmqpConfig::new(URI, "q").reconnect_backoff(Duration::from_secs(5), Duration::from_secs(1)),
            "reconnect_backoff",
        );
        invalid(
            AmqpConfig::new(URI, "q").reconnect_backoff(Duration::ZERO, Duration::from_secs(1)),
            "reconnect_backoff",
        );
        invalid(
            AmqpConfig::new(URI, "q").publish_timeout(Duration::ZERO),
            "publish_timeout",
        );
        invalid(
            AmqpConfig::new(URI, "q").connect_timeout(Duration::ZERO),
            "connect_timeout",
        );
        invalid(
            AmqpConfig::new(URI, "q").requeue_delay(Duration::ZERO),
            "requeue_delay",
        );
        AmqpConfig::new("amqps://u:p@broker.example:5671/vh?heartbeat=10", "q")
            .validate()
            .unwrap();
        invalid(
            AmqpConfig::new(URI, "q").delivery_limit(0),
            "delivery_limit must be at least 1",
        );
        invalid(
            AmqpConfig::new(URI, "q").tls(AmqpTls::new().ca_file("/etc/hostname")),
            "use amqps://",
        );
    }

    #[test]
    fn the_queue_type_decides_the_declared_arguments() {
        let names = |c: &AmqpConfig| {
            c.topology()
                .iter()
                .map(|(name, args)| {
                    let mut keys: Vec<String> = args.inner().keys().map(|k| k.to_string()).collect();
                    keys.sort();
                    format!("{name}:{}", keys.join(","))
                })
                .collect::<Vec<_>>()
        };
        let retry = "q.retry:x-dead-letter-exchange,x-dead-letter-routing-key,x-dead-letter-strategy,x-overflow,x-queue-type";
        let classic = AmqpConfig::new(URI, "q");
        assert_eq!(names(&classic), ["q:", retry, "q.dlq:"]);
        let quorum = AmqpConfig::new(URI, "q").queue_type(QueueType::Quorum);
        assert_eq!(names(&quorum), ["q:x-queue-type", retry, "q.dlq:x-queue-type"]);
        let limited = quorum.clone().delivery_limit(5);
        assert_eq!(
            names(&limited),
            ["q:x-delivery-limit,x-queue-type", retry, "q.dlq:x-queue-type"]
        );
        assert_eq!(quorum.delivery_limit_or_default(), DEFAULT_DELIVERY_LIMIT);
        assert_eq!(limited.delivery_limit_or_default(), 5);
        assert_eq!("Quorum".parse::<QueueType>(), Ok(QueueType::Quorum));
        assert!("lazy"
            .parse::<QueueType>()
            .unwrap_err()
            .contains("classic or quorum"));
    }
}
