//! [`AmqpDelivery`]: one message and how it is settled on RabbitMQ.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Acker, BasicProperties};
use txinbox::{
    async_trait, dead_letter::DeadLetter, message::Origin, source::Lane, source::SettleError,
    source::Settlement, Delivery, Message,
};

use crate::confirm::confirmed;
use crate::headers::{self, int_header, to_headers};
use crate::shared::{Generation, Shared};
use crate::telemetry;

/// Longest `x-txinbox-error` value, in bytes.
const MAX_ERROR_HEADER: usize = 4096;

/// One message received from RabbitMQ.
///
/// Settling:
///
/// | settlement | on the broker |
/// |---|---|
/// | `Ack` | `basic.ack` (single) on the delivery's own channel |
/// | `Retry { after }` | a copy (same properties and headers, `x-txinbox-retry` + 1, `expiration` = `after` in ms, persistent) is published to the retry queue with a publisher confirm, then the original is acked; when the copy expires the retry queue dead-letters it back to the work queue |
/// | `DeadLetter` | a copy with `x-txinbox-reason`, `x-txinbox-error`, `x-txinbox-original-queue` (persistent, no expiration) is published to the dead-letter queue with a publisher confirm, then the original is acked |
///
/// If the channel the delivery came from was lost, nothing is sent and `settle` fails: the
/// broker redelivers the message and the inbox deduplicates it. If a copy is not confirmed
/// (unroutable, nacked, timed out), the original is not acked and `settle` fails; while its
/// channel lives, the original is requeued after a delay so it neither hot-loops nor sits
/// unacknowledged. Copies never carry the original `user_id` (RabbitMQ would refuse a
/// `user_id` other than the publishing connection's user) nor `cluster_id`.
pub struct AmqpDelivery {
    message: Message,
    lane: Lane,
    properties: BasicProperties,
    acker: Acker,
    delivery_tag: u64,
    generation: Arc<Generation>,
    shared: Arc<Shared>,
}

impl fmt::Debug for AmqpDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpDelivery")
            .field("queue", &self.shared.queue)
            .field("message_id", &self.message.native_id())
            .field("delivery_tag", &self.delivery_tag)
            .field("generation", &self.generation.id)
            .field("lane", &self.lane)
            .finish_non_exhaustive()
    }
}

impl AmqpDelivery {
    pub(crate) fn new(d: lapin::message::Delivery, generation: Arc<Generation>, shared: Arc<Shared>) -> Self {
        let headers = to_headers(d.properties.headers().as_ref());
        let lane = lane_of(&headers, shared.lane_header.as_deref());
        let mut message = Message::new(Bytes::from(d.data), Origin::new("rabbitmq", shared.queue.clone()))
            .with_headers(headers)
            .with_redelivered(d.redelivered);
        if let Some(id) = d.properties.message_id() {
            message = message.with_native_id(id.as_str());
        }
        AmqpDelivery {
            message,
            lane,
            properties: d.properties,
            acker: d.acker,
            delivery_tag: d.delivery_tag,
            generation,
            shared,
        }
    }

    pub(crate) fn generation_alive(&self) -> bool {
        self.generation.alive()
    }

    /// The AMQP properties as received (`correlation_id`, `reply_to`, …). Handlers see only the
    /// broker-neutral [`Message`]; this is for code that wraps the source.
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// The connection generation this delivery came from (1 for the first connection).
    pub fn generation(&self) -> u64 {
        self.generation.id
    }

    fn stale(&self, what: &str, cause: &'static str) -> SettleError {
        SettleError::new(format!(
            "{what} not sent: {cause} (channel generation {} of queue {}); the broker redelivers the message and the inbox deduplicates it",
            self.generation.id, self.shared.queue
        ))
    }

    async fn ack(&self) -> Result<(), SettleError> {
        let not_sent = |cause: &'static str| {
            self.shared
                .counter(telemetry::ACK_NOT_SENT, &[("cause", cause)])
                .increment(1);
        };
        if !self.generation.alive() {
            not_sent("stale_channel");
            return Err(self.stale("basic.ack", "the channel was lost"));
        }
        let sent = tokio::time::timeout(
            self.shared.publish_timeout,
            self.acker.ack(BasicAckOptions { multiple: false }),
        )
        .await;
        match sent {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => {
                not_sent("not_sent");
                Err(self.stale(
                    "basic.ack",
                    "lapin sent nothing (the channel is closed or the delivery was already settled)",
                ))
            }
            Ok(Err(e)) => {
                not_sent("error");
                Err(SettleError::new(format!(
                    "basic.ack failed: {e}; the broker redelivers the message and the inbox deduplicates it"
                )))
            }
            Err(_) => {
                not_sent("timeout");
                Err(self.stale("basic.ack", "timed out (publish_timeout)"))
            }
        }
    }

    /// Publishes a copy of the message to `queue` through the default exchange, mandatory,
    /// and waits for the broker's confirm.
    async fn publish_copy(
        &self,
        queue: &ShortString,
        properties: BasicProperties,
        kind: &'static str,
    ) -> Result<(), SettleError> {
        let fail = |cause: &'static str, detail: String| {
            self.shared
                .counter(telemetry::PUBLISH_FAILURES, &[("kind", kind), ("cause", cause)])
                .increment(1);
            SettleError::new(format!(
                "{kind} copy to queue {queue} not confirmed ({detail}); the original was not acknowledged"
            ))
        };
        let channel = &self.generation.channel;
        let publish = async {
            let _one_at_a_time = self.generation.publish_lock.lock().await;
            let confirm = channel
                .basic_publish(
                    ShortString::default(),
                    queue.clone(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    self.message.payload(),
                    properties,
                )
                .await?;
            confirm.await
        };
        match confirmed(self.shared.publish_timeout, publish).await {
            Ok(()) => {
                self.shared
                    .counter(telemetry::PUBLISHED, &[("kind", kind)])
                    .increment(1);
                Ok(())
            }
            Err(unconfirmed) => Err(fail(
                unconfirmed.cause(),
                unconfirmed.detail(|code, text| {
                    format!("returned by the broker: {code} {text}; does the queue exist?")
                }),
            )),
        }
    }

    /// Gives the original back to the queue after `delay`, unless its channel is gone by then
    /// (then the broker has requeued it already).
    fn requeue_later(&self, delay: Duration) {
        let acker = self.acker.clone();
        let generation = self.generation.clone();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if !generation.alive() {
                return;
            }
            let nack = acker.nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            });
            if let Ok(Ok(true)) = tokio::time::timeout(shared.publish_timeout, nack).await {
                shared.counter(telemetry::REQUEUED, &[]).increment(1);
            }
        });
    }

    async fn retry(&self, after: Duration) -> Result<(), SettleError> {
        if !self.generation.alive() {
            self.shared
                .counter(telemetry::ACK_NOT_SENT, &[("cause", "stale_channel")])
                .increment(1);
            return Err(self.stale("retry copy", "the channel was lost"));
        }
        let original = self.properties.headers().as_ref();
        let count = int_header(original, headers::RETRY)
            .unwrap_or(0)
            .saturating_add(1);
        let mut headers = original.cloned().unwrap_or_default();
        headers.insert(headers::RETRY.into(), AMQPValue::LongLongInt(count));
        let millis = after.as_millis().min(u128::from(u32::MAX));
        let properties = copy_properties(&self.properties, headers, Some(millis.to_string().into()));
        match self
            .publish_copy(&self.shared.retry_queue, properties, "retry")
            .await
        {
            Ok(()) => self.ack().await,
            Err(e) => {
                self.requeue_later(after.max(self.shared.requeue_delay));
                Err(e)
            }
        }
    }

    async fn dead_letter(&self, dl: DeadLetter) -> Result<(), SettleError> {
        if !self.generation.alive() {
            self.shared
                .counter(telemetry::ACK_NOT_SENT, &[("cause", "stale_channel")])
                .increment(1);
            return Err(self.stale("dead-letter copy", "the channel was lost"));
        }
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(
            headers::REASON.into(),
            AMQPValue::LongString(dl.reason.as_str().into()),
        );
        headers.insert(
            headers::ERROR.into(),
            AMQPValue::LongString(LongString::from(truncate(&dl.error, MAX_ERROR_HEADER))),
        );
        headers.insert(
            headers::ORIGINAL_QUEUE.into(),
            AMQPValue::LongString(self.shared.queue.as_bytes().to_vec().into()),
        );
        let properties = copy_properties(&self.properties, headers, None);
        match self
            .publish_copy(&self.shared.dead_letter_queue, properties, "dead_letter")
            .await
        {
            Ok(()) => self.ack().await,
            Err(e) => {
                self.requeue_later(self.shared.requeue_delay);
                Err(e)
            }
        }
    }
}

#[async_trait]
impl Delivery for AmqpDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    fn lane(&self) -> Lane {
        self.lane.clone()
    }

    async fn settle(self, settlement: Settlement) -> Result<(), SettleError> {
        match settlement {
            Settlement::Ack => self.ack().await,
            Settlement::Retry { after } => self.retry(after).await,
            Settlement::DeadLetter(dl) => self.dead_letter(dl).await,
        }
    }
}

/// `Ordered(value)` when the lane header is configured and present, else `Unordered`.
fn lane_of(headers: &txinbox::message::Headers, lane_header: Option<&str>) -> Lane {
    match lane_header.and_then(|name| headers.get(name)) {
        Some(v) => Lane::Ordered(String::from_utf8_lossy(v).into()),
        None => Lane::Unordered,
    }
}

/// The properties of a copy: everything of the original except `expiration` (replaced),
/// `user_id` and `cluster_id`; headers replaced; always persistent.
fn copy_properties(
    p: &BasicProperties,
    headers: FieldTable,
    expiration: Option<ShortString>,
) -> BasicProperties {
    let mut c = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    if let Some(v) = p.content_type() {
        c = c.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        c = c.with_content_encoding(v.clone());
    }
    if let Some(v) = p.priority() {
        c = c.with_priority(*v);
    }
    if let Some(v) = p.correlation_id() {
        c = c.with_correlation_id(v.clone());
    }
    if let Some(v) = p.reply_to() {
        c = c.with_reply_to(v.clone());
    }
    if let Some(v) = expiration {
        c = c.with_expiration(v);
    }
    if let Some(v) = p.message_id() {
        c = c.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        c = c.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        c = c.with_type(v.clone());
    }
    if let Some(v) = p.app_id() {
        c = c.with_app_id(v.clone());
    }
    c
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_keep_identity_but_not_user_or_expiration() {
        let mut h = FieldTable::default();
        h.insert("a".into(), AMQPValue::LongString("1".into()));
        let p = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_user_id("someone-else".into())
            .with_cluster_id("c".into())
            .with_expiration("60000".into())
            .with_correlation_id("corr".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(1)
            .with_headers(h.clone());
        let c = copy_properties(&p, h.clone(), Some("250".into()));
        assert_eq!(c.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(c.correlation_id().as_ref().map(|s| s.as_str()), Some("corr"));
        assert_eq!(
            c.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(c.expiration().as_ref().map(|s| s.as_str()), Some("250"));
        assert_eq!(c.user_id(), &None);
        assert_eq!(c.cluster_id(), &None);
        assert_eq!(c.delivery_mode(), &Some(2), "copies are persistent");
        assert_eq!(c.headers().as_ref(), Some(&h));
        let dl = copy_properties(&p, h, None);
        assert_eq!(dl.expiration(), &None, "dead letters never expire");
    }

    #[test]
    fn lanes_come_from_the_configured_header_only() {
        let h = txinbox::message::Headers::new().with("account", "acct-7");
        assert_eq!(
            lane_of(&h, None),
            Lane::Unordered,
            "competing consumers by default"
        );
        assert_eq!(lane_of(&h, Some("account")), Lane::Ordered("acct-7".into()));
        assert_eq!(lane_of(&h, Some("other")), Lane::Unordered, "no header, no lane");
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        assert_eq!(truncate("ééé", 3), "é");
    }
}
