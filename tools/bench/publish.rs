//! Publishers, one per source kind, and the loop that loads a source: a window of unsettled
//! messages, at saturation or at a fixed rate.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use txinbox::memory::MemoryBroker;

use crate::measure::{now_micros, Probe};

/// Payloads are `"<publish time in µs> <sequence number>"`.
pub(crate) fn payload(seq: u64) -> String {
    format!("{} {seq}", now_micros())
}

pub(crate) enum Publisher {
    Memory(MemoryBroker),
    Kafka {
        producer: rdkafka::producer::FutureProducer,
        topic: String,
        partitions: i32,
        /// Record keys `seq % keys`; `None`: every record its own key.
        keys: Option<u64>,
    },
    Amqp {
        channel: lapin::Channel,
        queue: String,
    },
}

impl Publisher {
    pub(crate) async fn publish(&self, seq: u64) -> anyhow::Result<()> {
        let body = payload(seq);
        match self {
            Publisher::Memory(broker) => broker.publish(format!("m-{seq}"), body),
            Publisher::Kafka {
                producer,
                topic,
                partitions,
                keys,
            } => {
                // Distinct keys, or `keys` of them; either way a key stays on one partition.
                let key = keys.map_or(seq, |k| seq % k).to_string();
                let mut record = rdkafka::producer::FutureRecord::to(topic)
                    .key(&key)
                    .payload(&body)
                    .partition((seq % *partitions as u64) as i32);
                loop {
                    match producer.send_result(record) {
                        Ok(_delivery) => break, // the delivery report is not awaited; flushed at the end
                        Err((
                            rdkafka::error::KafkaError::MessageProduction(
                                rdkafka::types::RDKafkaErrorCode::QueueFull,
                            ),
                            r,
                        )) => {
                            record = r;
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        Err((e, _)) => bail!("producing to Kafka failed: {e}"),
                    }
                }
            }
            Publisher::Amqp { channel, queue } => {
                let props = lapin::BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(format!("m-{seq}").into());
                channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        lapin::options::BasicPublishOptions::default(),
                        body.as_bytes(),
                        props,
                    )
                    .await
                    .context("publishing to RabbitMQ")?;
            }
        }
        Ok(())
    }

    pub(crate) async fn finish(&self) {
        if let Publisher::Kafka { producer, .. } = self {
            use rdkafka::producer::Producer as _;
            let _ = producer.flush(Duration::from_secs(30));
        }
    }
}

/// How a row's publisher loads its source.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Load {
    /// Messages measured (after the warm-up one).
    pub(crate) n: u64,
    /// At most this many published and not yet settled.
    pub(crate) window: u64,
    /// Messages per second; `None`: as fast as the window allows (saturation).
    pub(crate) rate: Option<f64>,
}

impl Load {
    pub(crate) fn saturated(n: u64, window: u64) -> Load {
        Load {
            n,
            window,
            rate: None,
        }
    }

    /// What a row's note says about its load.
    pub(crate) fn describe(&self) -> String {
        match self.rate {
            None => format!("window {}", self.window),
            Some(rate) => format!("paced at {rate:.0} msg/s, window {}", self.window),
        }
    }
}

/// Publishes a warm-up message and waits until it is settled (a Kafka consumer first joins its
/// group, which takes seconds), starts the clock, then publishes `load.n` more, keeping at most
/// `load.window` published and not yet settled, and no faster than `load.rate`. The probe's
/// target must be `load.n + 1`.
pub(crate) async fn publish_loop(publisher: Publisher, load: Load, probe: Arc<Probe>) -> anyhow::Result<()> {
    publisher.publish(0).await?;
    publisher.finish().await;
    while probe.settled() < 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    probe.start();
    let start = tokio::time::Instant::now();
    for seq in 1..=load.n {
        if let Some(rate) = load.rate {
            // Each message at its own time: the timer's millisecond resolution sends them in
            // bursts of up to rate / 1000, never ahead of the schedule.
            let due = start + Duration::from_secs_f64((seq - 1) as f64 / rate);
            if due > tokio::time::Instant::now() {
                tokio::time::sleep_until(due).await;
            }
        }
        while seq.saturating_sub(probe.settled()) >= load.window {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        publisher.publish(seq).await?;
    }
    publisher.finish().await;
    Ok(())
}
