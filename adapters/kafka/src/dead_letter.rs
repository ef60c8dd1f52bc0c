//! Dead letters of a [`KafkaDelivery`]: the record with its `txinbox.dlq.*` headers, the
//! reduced copies when it is too large, and the retries while the topic is unavailable.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};

use crate::connection::ConnectionContext;
use txinbox::dead_letter::DeadLetter;
use txinbox::retry::Backoff;
use txinbox::source::SettleError;

use crate::config::KafkaConfig;
use crate::delivery::KafkaDelivery;
use crate::produce::{self, Failure};
use crate::state::{problem, Shared};
use crate::{headers, telemetry};

/// How long one look-up of a dead-letter topic in the broker's metadata may take.
const TOPIC_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often dead-letter topics are looked up again while one is missing (or could not be
/// looked up).
const TOPIC_RECHECK: Duration = Duration::from_secs(10);

/// A dead letter waiting on a transient failure logs a warning on its first failure and then
/// on every this many.
const DEAD_LETTER_WARN_EVERY: u32 = 10;
/// Between attempts to produce a dead letter after a transient failure: 200 ms doubling to 5 s.
const RETRY_BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

impl KafkaDelivery {
    /// Produces the dead letter and waits for the broker's confirmation.
    ///
    /// - Too large for the producer or the topic: the copy leaves the payload out, then the
    ///   original headers too, with headers saying so ([`headers::PAYLOAD`]).
    /// - Refused for good (authorization, invalid topic, still too large): logged at ERROR,
    ///   counted ([`telemetry::DEAD_LETTERS_REFUSED`]) and settled: the runtime has
    ///   already recorded the dead letter in the database, which is the record; the partition
    ///   goes on.
    /// - Transient: retried while the partition stays assigned (fail closed), counted in the
    ///   gauge [`telemetry::DEAD_LETTERS_WAITING`] and logged with the partition on the
    ///   first failure and every [`DEAD_LETTER_WARN_EVERY`] after it.
    pub(crate) async fn produce_dead_letter(&self, dl: &DeadLetter) -> Result<(), SettleError> {
        let config = &self.shared.config;
        let topic = config.dead_letter_topic_for(&self.topic);
        let mut form = Form::Whole;
        let mut digest: Option<(String, String)> = None;
        let mut failures: u32 = 0;
        let mut waiting: Option<Waiting> = None;
        loop {
            if form != Form::Whole && digest.is_none() {
                let payload = self.message.payload();
                digest = Some((payload.len().to_string(), sha256_hex(payload)));
            }
            let (failure, error, code) = match self.try_produce(&topic, dl, form, digest.as_ref()).await {
                Ok(()) => {
                    metrics::counter!(telemetry::DEAD_LETTERS_PRODUCED, "topic" => topic.clone())
                        .increment(1);
                    if form != Form::Whole {
                        metrics::counter!(telemetry::DEAD_LETTERS_REDUCED, "topic" => topic.clone(), "form" => form.name())
                            .increment(1);
                    }
                    if failures > 0 {
                        tracing::info!(dead_letter_topic = %topic, topic = %self.topic, partition = self.partition, offset = self.offset, failures, "dead letter confirmed after transient failures; the partition goes on");
                    }
                    return Ok(());
                }
                Err(failed) => failed,
            };
            match failure {
                Failure::TooLarge if form.smaller().is_some() => {
                    let smaller = form.smaller().unwrap_or(form);
                    tracing::warn!(
                        dead_letter_topic = %topic,
                        topic = %self.topic,
                        partition = self.partition,
                        offset = self.offset,
                        %error,
                        form = smaller.name(),
                        "the dead letter is too large for the dead-letter topic; sending a reduced copy (the database's dead_letters row keeps the payload up to dead_letter_payload_limit; beyond it, the whole record is only on the source topic until its retention)"
                    );
                    form = smaller;
                    continue;
                }
                Failure::TooLarge | Failure::Refused => {
                    tracing::error!(
                        dead_letter_topic = %topic,
                        topic = %self.topic,
                        partition = self.partition,
                        offset = self.offset,
                        %error,
                        "the dead-letter topic refused the dead letter for good; the database's dead_letters row is its record and the partition goes on; fix the topic (ACLs, name, max.message.bytes) and requeue it from the database if needed"
                    );
                    metrics::counter!(telemetry::DEAD_LETTERS_REFUSED, "topic" => topic.clone(), "code" => code)
                        .increment(1);
                    return Ok(());
                }
                Failure::Transient => {}
            }
            failures += 1;
            if self.shared.stopping()
                || !self
                    .shared
                    .is_assigned(&self.topic, self.partition, self.generation.epoch)
            {
                return Err(SettleError::new(format!(
                    "dead letter to {topic} not confirmed ({error}); offset {} of {}/{} is not stored",
                    self.offset, self.topic, self.partition
                )));
            }
            if waiting.is_none() {
                waiting = Some(Waiting::new(topic.clone()));
            }
            let delay = RETRY_BACKOFF.ceiling(failures);
            if failures == 1 || failures.is_multiple_of(DEAD_LETTER_WARN_EVERY) {
                tracing::warn!(
                    dead_letter_topic = %topic,
                    topic = %self.topic,
                    partition = self.partition,
                    offset = self.offset,
                    %error,
                    failures,
                    "producing a dead letter failed; the partition waits for it (fail closed) and it is retried"
                );
            } else {
                tracing::debug!(dead_letter_topic = %topic, %error, failures, ?delay, "producing a dead letter failed; retrying");
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// One attempt: `Err((how it failed, error text))`.
    async fn try_produce(
        &self,
        topic: &str,
        dl: &DeadLetter,
        form: Form,
        digest: Option<&(String, String)>,
    ) -> Result<(), (Failure, String, String)> {
        let failed = |e: KafkaError| {
            let code = e
                .rdkafka_error_code()
                .map_or_else(|| "none".to_owned(), |c| format!("{c:?}"));
            (produce::classify(&e), e.to_string(), code)
        };
        let record = self.dead_letter_record(topic, dl, form, digest);
        let delivery = self
            .shared
            .producer
            .send_result(record)
            .map_err(|(e, _)| failed(e))?;
        let wait = self.shared.config.dead_letter_timeout + Duration::from_secs(5);
        let transient = |text: String| (Failure::Transient, text, "none".to_owned());
        match tokio::time::timeout(wait, delivery).await {
            Ok(Ok(Ok(_))) => Ok(()),
            Ok(Ok(Err((e, _)))) => Err(failed(e)),
            Ok(Err(_)) => Err(transient("the dead-letter producer was dropped".to_owned())),
            Err(_) => Err(transient(format!("no delivery report within {wait:?}"))),
        }
    }

    fn dead_letter_record<'a>(
        &'a self,
        topic: &'a str,
        dl: &'a DeadLetter,
        form: Form,
        digest: Option<&'a (String, String)>,
    ) -> FutureRecord<'a, [u8], [u8]> {
        let mut h = OwnedHeaders::new_with_capacity(self.message.headers().len() + 11);
        if form != Form::HeadersOmitted {
            for (key, value) in self.message.headers().iter() {
                h = h.insert(Header {
                    key,
                    value: Some(value),
                });
            }
        }
        let partition = self.partition.to_string();
        let offset = self.offset.to_string();
        let timestamp = self.timestamp.map(|t| t.to_string()).unwrap_or_default();
        let fields: [(&str, &str); 7] = [
            (headers::REASON, dl.reason.as_str()),
            (headers::ERROR, &dl.error),
            (headers::TOPIC, &self.topic),
            (headers::PARTITION, &partition),
            (headers::OFFSET, &offset),
            (headers::TIMESTAMP, &timestamp),
            (headers::CONSUMER, self.shared.consumer_name()),
        ];
        for (key, value) in fields {
            h = h.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        if form != Form::Whole {
            let (size, sha256) = match digest {
                Some((size, sha256)) => (size.as_str(), sha256.as_str()),
                None => ("", ""),
            };
            for (key, value) in [
                (headers::PAYLOAD, "omitted"),
                (headers::ORIGINAL_SIZE, size),
                (headers::ORIGINAL_SHA256, sha256),
            ] {
                h = h.insert(Header {
                    key,
                    value: Some(value.as_bytes()),
                });
            }
        }
        if form == Form::HeadersOmitted {
            h = h.insert(Header {
                key: headers::HEADERS,
                value: Some("omitted".as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic).headers(h);
        if form == Form::Whole {
            record = record.payload(self.message.payload().as_ref());
        }
        if let Some(key) = self.message.key() {
            record = record.key(key.as_ref());
        }
        record
    }
}

/// The form of a dead-letter copy: whole, or cut down because the whole one was too large.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// Key, payload and headers of the original, plus the `txinbox.dlq.*` headers.
    Whole,
    /// Without the payload; its size and SHA-256 in headers.
    PayloadOmitted,
    /// Without the payload and the original headers.
    HeadersOmitted,
}

impl Form {
    fn smaller(self) -> Option<Form> {
        match self {
            Form::Whole => Some(Form::PayloadOmitted),
            Form::PayloadOmitted => Some(Form::HeadersOmitted),
            Form::HeadersOmitted => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Form::Whole => "whole",
            Form::PayloadOmitted => "payload_omitted",
            Form::HeadersOmitted => "headers_omitted",
        }
    }
}

/// One dead letter counted in [`telemetry::DEAD_LETTERS_WAITING`] while it lives (also
/// when the settlement is dropped: shutdown, revocation).
struct Waiting {
    topic: String,
}

impl Waiting {
    fn new(topic: String) -> Self {
        metrics::gauge!(telemetry::DEAD_LETTERS_WAITING, "topic" => topic.clone()).increment(1.0);
        Waiting { topic }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        metrics::gauge!(telemetry::DEAD_LETTERS_WAITING, "topic" => self.topic.clone()).decrement(1.0);
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    use std::fmt::Write as _;
    let digest = sha2::Sha256::digest(bytes);
    let mut hex = String::with_capacity(64);
    for b in digest {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

/// The dead-letter topics of `config`'s subscriptions, each with the topics whose dead letters
/// go there. A pattern subscription (`^…`) has none unless one dead-letter topic is configured.
fn dead_letter_topics(config: &KafkaConfig) -> BTreeMap<String, Vec<String>> {
    let mut topics: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for topic in &config.topics {
        if topic.starts_with('^') && config.dead_letter_topic.is_none() {
            continue;
        }
        topics
            .entry(config.dead_letter_topic_for(topic))
            .or_default()
            .push(topic.clone());
    }
    topics
}

/// What the broker says about a dead-letter topic.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Lookup {
    Exists,
    /// `UNKNOWN_TOPIC_OR_PART`: it does not exist (and the broker does not create it).
    Missing,
    /// No answer (broker unreachable, timeout) or another error: it cannot tell now.
    Unknown(String),
}

/// One metadata request for `topic`, through the dead-letter producer (with the producer's own
/// `allow.auto.create.topics`, so a broker that would create the topic for the first dead
/// letter creates it now instead). Blocks up to [`TOPIC_LOOKUP_TIMEOUT`].
fn look_up(producer: &FutureProducer<ConnectionContext>, topic: &str) -> Lookup {
    let metadata = match producer
        .client()
        .fetch_metadata(Some(topic), TOPIC_LOOKUP_TIMEOUT)
    {
        Ok(m) => m,
        Err(e) => return Lookup::Unknown(e.to_string()),
    };
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Lookup::Unknown("the broker's metadata does not mention it".into());
    };
    match t.error().map(RDKafkaErrorCode::from) {
        None => Lookup::Exists,
        Some(RDKafkaErrorCode::UnknownTopicOrPartition) => Lookup::Missing,
        // Being created (auto-creation answers so at first) or moving: it exists.
        Some(RDKafkaErrorCode::LeaderNotAvailable | RDKafkaErrorCode::NotLeaderForPartition) => {
            Lookup::Exists
        }
        Some(code) => Lookup::Unknown(format!("{code:?}")),
    }
}

/// Looks the dead-letter topics up in the broker's metadata when the source starts, and again
/// every [`TOPIC_RECHECK`] until every one is found. A topic the broker says does not exist
/// would hold the partition of the first record that must be dead-lettered (its produce fails
/// transiently until the topic appears): that is an ERROR and a problem in the consumer's
/// health (not ready) until it exists. Runs on the runtime's blocking threads and holds the
/// source's state only while it looks (dropping the last reference drops the producer, which
/// must not happen on a runtime worker).
pub(crate) fn watch_topics(shared: &Arc<Shared>, runtime: &tokio::runtime::Handle) {
    let topics = dead_letter_topics(&shared.config);
    if topics.is_empty() {
        return;
    }
    let weak: Weak<Shared> = Arc::downgrade(shared);
    runtime.spawn(async move {
        let mut missing: BTreeMap<String, String> = BTreeMap::new();
        loop {
            let (weak, topics, before) = (weak.clone(), topics.clone(), missing.clone());
            let looked = tokio::task::spawn_blocking(move || {
                let shared = weak.upgrade()?;
                if shared.stopping() {
                    return None;
                }
                Some(report_topics(&shared, &topics, &before))
            })
            .await;
            let Ok(Some((now_missing, done))) = looked else {
                return;
            };
            missing = now_missing;
            if done {
                return;
            }
            tokio::time::sleep(TOPIC_RECHECK).await;
        }
    });
}

/// Looks every dead-letter topic up, logs what changed since `before` (the missing ones, with
/// their problem line), and reports the missing ones to the consumer's health. Returns the
/// missing ones and whether every topic was found. One that could not be looked up keeps what
/// was said of it before.
fn report_topics(
    shared: &Shared,
    topics: &BTreeMap<String, Vec<String>>,
    before: &BTreeMap<String, String>,
) -> (BTreeMap<String, String>, bool) {
    let mut missing = BTreeMap::new();
    let mut all_found = true;
    for (dlq, sources) in topics {
        match look_up(&shared.producer, dlq) {
            Lookup::Exists => {
                if before.contains_key(dlq) {
                    tracing::info!(dead_letter_topic = %dlq, "the dead-letter topic exists now");
                }
            }
            Lookup::Missing => {
                all_found = false;
                let line = format!(
                    "dead-letter topic {dlq:?} (for records of {}) does not exist, says the broker: the first record that must be dead-lettered would hold its partition until it does; create it, or choose another with KafkaConfig::dead_letter_topic",
                    sources.join(", ")
                );
                if !before.contains_key(dlq) {
                    tracing::error!(dead_letter_topic = %dlq, "{line}");
                }
                missing.insert(dlq.clone(), line);
            }
            Lookup::Unknown(why) => {
                all_found = false;
                tracing::debug!(dead_letter_topic = %dlq, %why, "the dead-letter topic could not be looked up; trying again");
                if let Some(line) = before.get(dlq) {
                    missing.insert(dlq.clone(), line.clone());
                }
            }
        }
    }
    shared.set_problems(problem::DEAD_LETTER_TOPICS, missing.values().cloned().collect());
    (missing, all_found)
}
