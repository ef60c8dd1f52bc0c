//! What the CLI asks a Kafka cluster: partitions, watermarks, group offsets and members,
//! offsets for a time, reading a range, committing group offsets, producing requeued records.
//!
//! All calls are blocking librdkafka calls with a deadline; callers run them off the async
//! runtime's worker (`block_in_place`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use txinbox_kafka::rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use txinbox_kafka::rdkafka::error::KafkaError;
use txinbox_kafka::rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use txinbox_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use txinbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use txinbox_kafka::ConnectionContext;

use crate::error::CliError;

/// A producer for requeued records.
pub type Producer = FutureProducer<ConnectionContext>;

/// librdkafka properties from one `-X` / `--kafka-property` value or `KAFKA_PROPERTIES`
/// (`txinbox_kafka::parse_properties`); the error never shows the text.
pub fn parse_properties(text: &str) -> Result<Vec<(String, String)>, String> {
    txinbox_kafka::parse_properties(text)
}

/// How long one broker request may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// A connection to the cluster at `brokers`, not a member of any group.
pub struct Kafka {
    brokers: String,
    /// `-X` properties (security settings), given to every client the CLI creates.
    properties: Vec<(String, String)>,
    client: BaseConsumer<ConnectionContext>,
}

/// What the broker says about one partition: [`Kafka::view`].
#[derive(Debug, Clone, Copy)]
pub struct BrokerPartition {
    pub partition: i32,
    /// The earliest offset the broker still holds.
    pub low: i64,
    /// The offset the next record will get.
    pub high: i64,
    /// The group's committed offset (`None`: nothing committed, or no group asked).
    pub group_offset: Option<i64>,
}

/// One record read from a partition, copied out of librdkafka.
pub struct Record {
    pub offset: i64,
    pub timestamp: Option<i64>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Kafka {
    /// Connects with the librdkafka `properties` (`-X`) and checks that the cluster answers.
    pub fn connect(brokers: &str, properties: &[(String, String)]) -> Result<Kafka, CliError> {
        let client = consumer(
            brokers,
            properties,
            &format!("txinbox-cli-{}", std::process::id()),
        )
        .map_err(|e| {
            CliError::BadArgs(format!(
                "Kafka client configuration for --brokers {} and -X: {}",
                shown(brokers),
                shown_error(&e)
            ))
        })?;
        client
            .fetch_metadata(None, Duration::from_secs(5))
            .map_err(|e| unreachable(brokers, e, &client))?;
        Ok(Kafka {
            brokers: brokers.into(),
            properties: properties.to_vec(),
            client,
        })
    }

    /// A client of `group` with the CLI's settings and the `-X` properties.
    fn consumer(&self, group: &str) -> Result<BaseConsumer<ConnectionContext>, KafkaError> {
        consumer(&self.brokers, &self.properties, group)
    }

    /// The partitions of `topic`, sorted.
    pub fn partitions(&self, topic: &str) -> Result<Vec<i32>, CliError> {
        let md = self
            .client
            .fetch_metadata(Some(topic), TIMEOUT)
            .map_err(|e| unreachable(&self.brokers, e, &self.client))?;
        let t = md
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .filter(|t| t.error().is_none() && !t.partitions().is_empty())
            .ok_or_else(|| {
                CliError::failed(format!(
                    "topic {topic} does not exist on {}",
                    shown(&self.brokers)
                ))
            })?;
        let mut ps: Vec<i32> = t.partitions().iter().map(|p| p.id()).collect();
        ps.sort_unstable();
        Ok(ps)
    }

    /// What the broker says about `partitions` of `topic` (all of them when empty; one the
    /// topic does not have is a bad argument): watermarks and, when `group` is given, its
    /// committed offsets. The one place the commands list partitions.
    pub fn view(
        &self,
        topic: &str,
        group: Option<&str>,
        partitions: &[i32],
    ) -> Result<Vec<BrokerPartition>, CliError> {
        let all = self.partitions(topic)?;
        let selected = if partitions.is_empty() {
            all
        } else {
            if let Some(p) = partitions.iter().find(|p| !all.contains(p)) {
                return Err(CliError::BadArgs(format!(
                    "topic {topic} has no partition {p} (it has {})",
                    all.len()
                )));
            }
            let mut selected = partitions.to_vec();
            selected.sort_unstable();
            selected.dedup();
            selected
        };
        let committed = match group {
            Some(g) => self.committed(g, topic, &selected)?,
            None => HashMap::new(),
        };
        selected
            .into_iter()
            .map(|p| {
                let (low, high) = self.watermarks(topic, p)?;
                Ok(BrokerPartition {
                    partition: p,
                    low,
                    high,
                    group_offset: committed.get(&p).copied().flatten(),
                })
            })
            .collect()
    }

    /// (low, high) watermarks of one partition.
    pub fn watermarks(&self, topic: &str, partition: i32) -> Result<(i64, i64), CliError> {
        self.client
            .fetch_watermarks(topic, partition, TIMEOUT)
            .map_err(|e| CliError::failed(format!("watermarks of {topic}/{partition}: {e}")))
    }

    /// The committed offsets of `group` for `partitions` of `topic` (`None`: nothing committed).
    pub fn committed(
        &self,
        group: &str,
        topic: &str,
        partitions: &[i32],
    ) -> Result<HashMap<i32, Option<i64>>, CliError> {
        let c = self
            .consumer(group)
            .map_err(|e| CliError::failed(format!("Kafka client for group {group}: {}", shown_error(&e))))?;
        let mut tpl = TopicPartitionList::new();
        for p in partitions {
            tpl.add_partition(topic, *p);
        }
        let got = c.committed_offsets(tpl, TIMEOUT).map_err(|e| {
            CliError::failed(with_problem(
                format!("committed offsets of group {group}: {e}"),
                &c,
            ))
        })?;
        Ok(got
            .elements_for_topic(topic)
            .iter()
            .map(|e| {
                let o = match e.offset() {
                    Offset::Offset(o) => Some(o),
                    _ => None,
                };
                (e.partition(), o)
            })
            .collect())
    }

    /// The first offset of each partition whose record timestamp is at or after `ms`
    /// (`None`: no such record yet, i.e. the end).
    pub fn offsets_for_time(
        &self,
        topic: &str,
        partitions: &[i32],
        ms: i64,
    ) -> Result<HashMap<i32, Option<i64>>, CliError> {
        let mut tpl = TopicPartitionList::new();
        for p in partitions {
            tpl.add_partition_offset(topic, *p, Offset::Offset(ms))
                .map_err(|e| CliError::failed(e.to_string()))?;
        }
        let got = self
            .client
            .offsets_for_times(tpl, TIMEOUT)
            .map_err(|e| CliError::failed(format!("offsets for time {ms} in {topic}: {e}")))?;
        Ok(got
            .elements_for_topic(topic)
            .iter()
            .map(|e| {
                let o = match e.offset() {
                    Offset::Offset(o) if o >= 0 => Some(o),
                    _ => None,
                };
                (e.partition(), o)
            })
            .collect())
    }

    /// The member IDs of `group` (empty when the group has no active member or does not exist).
    ///
    /// A group that lists no member but is not `Empty` or `Dead` (a rebalance in progress: its
    /// members are re-joining) counts as active, with its state in place of a member ID; and
    /// an empty answer is asked again once, so a momentary gap in the broker's view does not
    /// pass for "no consumer is running".
    pub fn group_members(&self, group: &str) -> Result<Vec<String>, CliError> {
        let ask = || -> Result<Vec<String>, CliError> {
            let list = self
                .client
                .fetch_group_list(Some(group), TIMEOUT)
                .map_err(|e| CliError::failed(format!("describing consumer group {group}: {e}")))?;
            let mut members = Vec::new();
            for g in list.groups().iter().filter(|g| g.name() == group) {
                members.extend(
                    g.members()
                        .iter()
                        .map(|m| format!("{} ({})", m.id(), m.client_host())),
                );
                let state = g.state();
                if g.members().is_empty() && !matches!(state, "" | "Empty" | "Dead") {
                    members.push(format!("(members re-joining: group state {state})"));
                }
            }
            Ok(members)
        };
        let members = ask()?;
        if !members.is_empty() {
            return Ok(members);
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        ask()
    }

    /// Commits `offsets` (partition → next offset) for `group`, which must have no active
    /// member.
    pub fn commit(&self, group: &str, topic: &str, offsets: &[(i32, i64)]) -> Result<(), String> {
        let c = self.consumer(group).map_err(|e| shown_error(&e))?;
        let mut tpl = TopicPartitionList::new();
        for (p, o) in offsets {
            tpl.add_partition_offset(topic, *p, Offset::Offset(*o))
                .map_err(|e| e.to_string())?;
        }
        c.commit(&tpl, CommitMode::Sync)
            .map_err(|e| with_problem(e.to_string(), &c))
    }

    /// Reads the records of `topic`/`partition` with offsets in `[from, to)`, calling `each`
    /// with every one until it returns `false`. Returns the next offset not read: `to` when the
    /// whole range was read (offsets without a record, such as transaction markers and
    /// compacted records, count as read), less when `each` stopped it or nothing arrived for
    /// 10 s.
    pub fn read_range(
        &self,
        topic: &str,
        partition: i32,
        from: i64,
        to: i64,
        mut each: impl FnMut(Record) -> bool,
    ) -> Result<i64, CliError> {
        if from >= to {
            return Ok(from);
        }
        let reader = self
            .consumer(&format!("txinbox-cli-reader-{}", std::process::id()))
            .map_err(|e| CliError::failed(shown_error(&e)))?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, partition, Offset::Offset(from))
            .map_err(|e| CliError::failed(e.to_string()))?;
        reader
            .assign(&tpl)
            .map_err(|e| CliError::failed(format!("reading {topic}/{partition}: {e}")))?;
        let mut next = from;
        let mut last_progress = Instant::now();
        while next < to && last_progress.elapsed() < TIMEOUT {
            match reader.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    last_progress = Instant::now();
                    if m.offset() < next {
                        continue;
                    }
                    if m.offset() >= to {
                        next = to;
                        break;
                    }
                    next = m.offset() + 1;
                    let go_on = each(Record {
                        offset: m.offset(),
                        timestamp: m.timestamp().to_millis(),
                        key: m.key().map(<[u8]>::to_vec),
                        payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                        headers: m
                            .headers()
                            .map(|hs| {
                                hs.iter()
                                    .map(|h| {
                                        (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default())
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                    });
                    if !go_on {
                        return Ok(next);
                    }
                }
                Some(Err(e)) => return Err(CliError::failed(format!("reading {topic}/{partition}: {e}"))),
                None => {}
            }
        }
        if next < to {
            // Nothing arrived: the consumer's position moves past offsets without a record.
            if let Ok(position) = reader.position() {
                if let Some(Offset::Offset(o)) = position.find_partition(topic, partition).map(|e| e.offset())
                {
                    next = next.max(o.min(to));
                }
            }
        }
        Ok(next)
    }

    /// A producer that waits for every record to be fully acknowledged.
    pub fn producer(&self) -> Result<Producer, CliError> {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        c.set("enable.idempotence", "true")
            .set("message.timeout.ms", "30000");
        let context = ConnectionContext::new(&mut c);
        c.create_with_context(context)
            .map_err(|e| CliError::failed(format!("Kafka producer: {}", shown_error(&e))))
    }
}

/// Produces one record to `topic`/`partition` and waits for its delivery report.
pub async fn produce(
    producer: &Producer,
    topic: &str,
    partition: Option<i32>,
    payload: &[u8],
    headers: &[(String, Vec<u8>)],
) -> Result<(i32, i64), String> {
    let mut h = OwnedHeaders::new_with_capacity(headers.len());
    for (key, value) in headers {
        h = h.insert(Header {
            key: key.as_str(),
            value: Some(value.as_slice()),
        });
    }
    let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).payload(payload).headers(h);
    if let Some(p) = partition {
        record = record.partition(p);
    }
    producer
        .send(record, TIMEOUT)
        .await
        .map(|d| (d.partition, d.offset))
        .map_err(|(e, _)| e.to_string())
}

/// A client of `group` on `brokers`: the CLI's settings, the `-X` `properties`, then the
/// settings the CLI owns (it never commits by itself).
fn consumer(
    brokers: &str,
    properties: &[(String, String)],
    group: &str,
) -> Result<BaseConsumer<ConnectionContext>, KafkaError> {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("socket.timeout.ms", "10000");
    for (k, v) in properties {
        c.set(k, v);
    }
    c.set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    let context = ConnectionContext::new(&mut c);
    c.create_with_context(context)
}

fn unreachable(brokers: &str, e: KafkaError, client: &BaseConsumer<ConnectionContext>) -> CliError {
    CliError::Unreachable {
        service: format!("Kafka brokers at {}", shown(brokers)),
        detail: match problem(client) {
            // A refused TLS handshake or SASL login: what to change, in librdkafka's words.
            Some(problem) => format!("{e}: {problem}"),
            None => format!("{e} (check --brokers / KAFKA_BROKERS and that the brokers run)"),
        },
    }
}

/// `text`, followed by the client's connection problem (TLS, SASL) if it has one.
fn with_problem(text: String, client: &BaseConsumer<ConnectionContext>) -> String {
    match problem(client) {
        Some(problem) => format!("{text}: {problem}"),
        None => text,
    }
}

/// The client's connection problem (TLS, SASL), if it has one. librdkafka's log lines and
/// errors reach the context only when the client is polled, which nothing does while a
/// request blocks: this polls (up to 1 s) until one is read.
fn problem(client: &BaseConsumer<ConnectionContext>) -> Option<String> {
    for _ in 0..10 {
        if let Some(p) = client.context().problem() {
            return Some(p);
        }
        // Not assigned anything: polling only serves the queued events.
        let _ = client.poll(Duration::from_millis(100));
    }
    client.context().problem()
}

/// A client-creation error without the property's value (rdkafka's own text quotes it, and a
/// `-X` value may be a password under a mistyped name).
fn shown_error(e: &KafkaError) -> String {
    match e {
        KafkaError::ClientConfig(_, description, key, _) => {
            format!("{description} (property {key}; its value is not shown)")
        }
        other => other.to_string(),
    }
}

/// `brokers` as the CLI may print it: every entry of the list through [`txinbox::redact::url`]
/// (SASL credentials pasted as `user:password@host` or `scheme://user:password@host`).
pub fn shown(brokers: &str) -> String {
    brokers
        .split(',')
        .map(txinbox::redact::url)
        .collect::<Vec<_>>()
        .join(",")
}
