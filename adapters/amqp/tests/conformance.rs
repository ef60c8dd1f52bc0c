//! The conformance suites (`txinbox_testing::conformance`) against the RabbitMQ adapter:
//! `AmqpSource`/`AmqpDelivery` through the source suite, `AmqpPublisher` through the publisher
//! suite, each on classic queues (module `classic`), on quorum queues (`quorum`) and over TLS
//! with verified certificates (`tls`: quorum queues on the TLS-only node).
//!
//! **Needs RabbitMQ** at `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`) and the
//! TLS-only node at `AMQPS_URL` (default `amqps://guest:guest@127.0.0.1:5671/%2f`, trusting
//! `$TXINBOX_TLS_DIR/ca.pem`); `scripts/test` starts both. Each case uses queues of its own,
//! deleted when it passes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use txinbox::{async_trait, message::Headers, message::Origin, Message};
use txinbox_amqp::headers;
use txinbox_amqp::{AmqpConfig, AmqpPublisher, AmqpSource, AmqpTls, QueueType};
use txinbox_testing::conformance::{publisher, source};

#[path = "support/tls.rs"]
mod tls;

/// Where a case runs: which node, with which TLS settings, on which queue type.
#[derive(Clone)]
struct Broker {
    url: String,
    tls: AmqpTls,
    queue_type: QueueType,
}

impl Broker {
    fn classic() -> Broker {
        Broker {
            url: std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
            tls: AmqpTls::new(),
            queue_type: QueueType::Classic,
        }
    }

    fn quorum() -> Broker {
        Broker {
            queue_type: QueueType::Quorum,
            ..Broker::classic()
        }
    }

    fn tls() -> Broker {
        Broker {
            url: tls::amqps_url(),
            tls: AmqpTls::new().ca_file(tls::file("ca.pem")),
            queue_type: QueueType::Quorum,
        }
    }

    /// A source configuration for `queue` on this broker.
    fn config(&self, queue: &str) -> AmqpConfig {
        AmqpConfig::new(&self.url, queue)
            .tls(self.tls.clone())
            .queue_type(self.queue_type)
    }
}

/// `txinbox-conformance-<pid>-<n>-<what>`.
fn unique(what: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "txinbox-conformance-{}-{}-{what}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A connection with one confirming channel.
async fn connect(broker: &Broker, name: &str) -> (Connection, Channel) {
    let conn = broker
        .tls
        .connect(
            &broker.url,
            ConnectionProperties::default().with_connection_name(name.into()),
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "connect to {} (is RabbitMQ running? scripts/test starts it): {e}",
                broker.url
            )
        });
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    (conn, channel)
}

async fn declare(channel: &Channel, queue: &str, args: FieldTable) {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap_or_else(|e| panic!("declare queue {queue}: {e}"));
}

async fn delete(channel: &Channel, queues: &[String]) {
    for q in queues {
        let _ = channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

fn to_headers(table: Option<&FieldTable>) -> Headers {
    let mut headers = Headers::new();
    for (k, v) in table.map(|t| t.inner().iter()).into_iter().flatten() {
        match v {
            AMQPValue::LongString(s) => headers.insert(k.to_string(), s.as_bytes().to_vec()),
            AMQPValue::ByteArray(b) => headers.insert(k.to_string(), b.as_slice().to_vec()),
            _ => {}
        }
    }
    headers
}

/// Takes what `queue` holds (`basic.get`, auto-ack) until `n` messages or `within`.
async fn take(channel: &Channel, queue: &str, n: usize, within: Duration) -> Vec<Message> {
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < n && started.elapsed() < within {
        match channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            Some(m) => {
                let props = &m.delivery.properties;
                let mut message =
                    Message::new(m.delivery.data.clone(), Origin::new("rabbitmq", queue.to_owned()))
                        .with_headers(to_headers(props.headers().as_ref()));
                if let Some(id) = props.message_id() {
                    message = message.with_native_id(id.to_string());
                }
                out.push(message);
            }
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Source

struct SourceHarness {
    broker: Broker,
    queue: String,
    conn: Connection,
    channel: Channel,
    /// Dead letters taken from `<queue>.dlq` so far.
    dead: tokio::sync::Mutex<Vec<Message>>,
}

async fn source_harness(broker: Broker, case: &'static str) -> SourceHarness {
    let queue = unique(case);
    let (conn, channel) = connect(&broker, &format!("{queue}-publisher")).await;
    // Declared up front, as the source declares them, so publishing before it opens is kept.
    for (name, args) in broker.config(&queue).topology() {
        declare(&channel, &name, args).await;
    }
    SourceHarness {
        broker,
        queue,
        conn,
        channel,
        dead: tokio::sync::Mutex::new(Vec::new()),
    }
}

#[async_trait]
impl source::Harness for SourceHarness {
    type Source = AmqpSource;

    fn features(&self) -> source::Features {
        // A dropped delivery sends nothing; the broker requeues it when the channel closes.
        source::Features::default()
            .redelivers_while_open(false)
            .patience(Duration::from_secs(30))
            .quiet(Duration::from_millis(500))
    }

    async fn publish(&self, message: source::TestMessage) {
        let mut headers = FieldTable::default();
        if let Some(key) = &message.key {
            // The key travels as the outbox publisher sends it; the source makes it the lane.
            headers.insert(
                headers::KEY.into(),
                AMQPValue::LongString(LongString::from(key.as_str())),
            );
        }
        for (name, value) in message.headers.iter() {
            headers.insert(
                name.into(),
                AMQPValue::LongString(LongString::from(value.to_vec())),
            );
        }
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(message.id.as_str().into())
            .with_headers(headers);
        let confirm = self
            .channel
            .basic_publish(
                ShortString::default(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                message.payload.as_bytes(),
                props,
            )
            .await
            .expect("publish a test message");
        assert!(
            confirm.await.expect("publisher confirm").is_ack(),
            "broker confirmed the test message"
        );
    }

    async fn open(&self) -> AmqpSource {
        let config = self
            .broker
            .config(&self.queue)
            .prefetch(16)
            .lane_header(headers::KEY)
            .connection_name(format!("{}-consumer", self.queue))
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
            .publish_timeout(Duration::from_secs(5));
        AmqpSource::connect(config).await.expect("AMQP source")
    }

    async fn dead_letters(&self, expected: usize, within: Duration) -> Option<Vec<Message>> {
        let mut dead = self.dead.lock().await;
        let missing = expected.saturating_sub(dead.len());
        let more = take(&self.channel, &format!("{}.dlq", self.queue), missing, within).await;
        dead.extend(more);
        Some(dead.clone())
    }

    async fn cleanup(self) {
        let q = &self.queue;
        delete(
            &self.channel,
            &[q.clone(), format!("{q}.retry"), format!("{q}.dlq")],
        )
        .await;
        let _ = self.conn.close(200, "done".into()).await;
    }
}

mod classic {
    txinbox_testing::source_conformance!(|case| super::source_harness(super::Broker::classic(), case));
}

mod quorum {
    txinbox_testing::source_conformance!(|case| super::source_harness(super::Broker::quorum(), case));
}

mod tls_quorum {
    txinbox_testing::source_conformance!(|case| super::source_harness(super::Broker::tls(), case));
}

// ---------------------------------------------------------------------------------------------
// Publisher

mod publishing {
    use super::*;

    pub struct PublisherHarness {
        publisher: AmqpPublisher,
        conn: Connection,
        channel: Channel,
        queues: Mutex<Vec<String>>,
    }

    pub async fn publisher_harness(broker: Broker, case: &'static str) -> PublisherHarness {
        let publisher = AmqpPublisher::connect_with_tls(&broker.url, broker.tls.clone())
            .await
            .expect("AMQP publisher")
            .publish_timeout(Duration::from_secs(5));
        let (conn, channel) = connect(&broker, &unique(&format!("{case}-reader"))).await;
        PublisherHarness {
            publisher,
            conn,
            channel,
            queues: Mutex::new(Vec::new()),
        }
    }

    #[async_trait]
    impl publisher::Harness for PublisherHarness {
        type Publisher = AmqpPublisher;

        fn publisher(&self) -> &AmqpPublisher {
            &self.publisher
        }

        async fn destination(&self, label: &str) -> String {
            let queue = unique(label);
            declare(&self.channel, &queue, FieldTable::default()).await;
            self.queues.lock().unwrap().push(queue.clone());
            queue
        }

        async fn read(
            &self,
            destination: &str,
            expected: usize,
            within: Duration,
        ) -> Vec<publisher::Published> {
            take(&self.channel, destination, expected, within)
                .await
                .into_iter()
                .map(|m| publisher::Published {
                    payload: m.payload().to_vec(),
                    key: m.headers().get(headers::KEY).map(<[u8]>::to_vec),
                    headers: m.headers().clone(),
                })
                .collect()
        }

        async fn unroutable(&self) -> Option<String> {
            // No queue of this name: the default exchange returns the mandatory message.
            Some(unique("no-such-queue"))
        }

        async fn cleanup(self) {
            let queues = std::mem::take(&mut *self.queues.lock().unwrap());
            delete(&self.channel, &queues).await;
            let _ = self.conn.close(200, "done".into()).await;
        }
    }

    mod plain {
        txinbox_testing::publisher_conformance!(|case| super::publisher_harness(
            super::Broker::classic(),
            case
        ));
    }

    mod tls {
        txinbox_testing::publisher_conformance!(|case| super::publisher_harness(super::Broker::tls(), case));
    }
}
