//! [`AmqpDelivery`]: one message and how it is settled on RabbitMQ.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::BasicProperties;
use txinbox::{
    async_trait, dead_letter::DeadLetter, message::Origin, source::Lane, source::SettleError,
    source::Settlement, Delivery, Message,
};

use crate::acks::NotSent;
use crate::confirm::{confirmed, Unconfirmed};
use crate::fit::{self, Form};
use crate::headers::{self, int_header, to_headers};
use crate::shared::{Generation, Shared};
use crate::telemetry;

/// One message received from RabbitMQ.
///
/// Settling:
///
/// | settlement | on the broker |
/// |---|---|
/// | `Ack` | `basic.ack` on the delivery's own channel, coalesced with its neighbours': `multiple` for a run of settled deliveries, never past one that is not settled (see below) |
/// | `Retry { after }` | a copy (same properties and headers, `x-txinbox-retry` + 1, `expiration` = `after` in ms, persistent) is published to the retry queue with a publisher confirm, then the original is acked; when the copy expires the retry queue dead-letters it back to the work queue. A copy whose headers would not fit in a frame: the original is requeued (`basic.nack`) after `after` instead |
/// | `DeadLetter` | a copy with `x-txinbox-reason`, `x-txinbox-error`, `x-txinbox-original-queue` (persistent, no expiration) is published to the dead-letter queue with a publisher confirm, then the original is acked. Made to fit: without the original headers if they would not fit in a frame beside these, without the payload if the broker refuses its size (see [`headers::HEADERS`]) |
///
/// Copies are published on a channel of their own, so a publish the broker refuses with a
/// channel error costs neither the consumer nor the other deliveries' acks. If the channel the
/// delivery came from was lost, nothing is sent and `settle` fails: the broker redelivers the
/// message and the inbox deduplicates it. If a copy is not confirmed (unroutable, nacked,
/// refused, timed out), the original is not acked and `settle` fails; while its channel lives,
/// the original is requeued after a delay so it neither hot-loops nor sits unacknowledged.
/// Copies never carry the original `user_id` (RabbitMQ would refuse a `user_id` other than the
/// publishing connection's user) nor `cluster_id`.
///
/// Acks are coalesced per channel: `settle` marks the delivery tag settled and returns once the
/// `basic.ack` that covers it was handed to the connection. A run of settled tags from the
/// lowest unacknowledged one up goes out as one `basic.ack(multiple = true)`; a settled tag
/// behind one that is not settled yet waits at most 20 ms, then is acked alone. A delivery
/// dropped unsettled, or one being copied or requeued, is never covered by a multiple ack: it
/// stays unacknowledged and is redelivered when its channel closes.
pub struct AmqpDelivery {
    message: Message,
    lane: Lane,
    properties: BasicProperties,
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
        // lapin numbers a channel's deliveries in order; a tag out of order would be a lapin or
        // broker bug. Such a delivery is never acked (its settlements fail), no multiple ack
        // covers it (the tracker keeps it as a hole), and the broker redelivers it.
        if !generation.acks.receive(d.delivery_tag) {
            tracing::error!(
                queue = %shared.queue,
                delivery_tag = d.delivery_tag,
                "a delivery tag not above the channel's last one; it will not be acknowledged"
            );
        }
        AmqpDelivery {
            message,
            lane,
            properties: d.properties,
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

    /// Settles the delivery as an ack and waits until the `basic.ack` that covers it (coalesced
    /// with its neighbours', see [`crate::acks`]) was handed to the connection.
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
        match self.generation.acks.ack(self.delivery_tag).await {
            Ok(()) => Ok(()),
            Err(NotSent::Lost) => {
                not_sent("stale_channel");
                Err(self.stale(
                    "basic.ack",
                    "the channel was lost (or the source closed) before the ack went out",
                ))
            }
            Err(NotSent::Error(e)) => {
                not_sent("error");
                Err(SettleError::new(format!(
                    "basic.ack failed: {e}; the broker redelivers the message and the inbox deduplicates it"
                )))
            }
            Err(NotSent::Timeout) => {
                not_sent("timeout");
                Err(self.stale("basic.ack", "timed out (publish_timeout)"))
            }
        }
    }

    /// Publishes a copy of the message (`payload` or an empty body) to `queue` through the
    /// default exchange, mandatory, on the generation's channel for copies, and waits for the
    /// broker's confirm. A failure is counted and left to the caller to word.
    async fn publish_copy(
        &self,
        queue: &ShortString,
        properties: BasicProperties,
        payload: &[u8],
        kind: &'static str,
    ) -> Result<(), Unconfirmed> {
        let publish = async {
            let mut slot = self.generation.copies.lock().await;
            let channel = self.generation.copy_channel(&mut slot).await?;
            let confirm = channel
                .basic_publish(
                    ShortString::default(),
                    queue.clone(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    payload,
                    properties,
                )
                .await?;
            confirm.await
        };
        let outcome = confirmed(self.shared.publish_timeout, publish).await;
        match &outcome {
            Ok(()) => self.shared.counter(telemetry::PUBLISHED, &[("kind", kind)]),
            Err(unconfirmed) => self.shared.counter(
                telemetry::PUBLISH_FAILURES,
                &[("kind", kind), ("cause", unconfirmed.cause())],
            ),
        }
        .increment(1);
        outcome
    }

    /// The settle error for a copy to `queue` that was not confirmed.
    fn not_confirmed(&self, kind: &str, queue: &ShortString, unconfirmed: &Unconfirmed) -> SettleError {
        let detail = unconfirmed
            .detail(|code, text| format!("returned by the broker: {code} {text}; does the queue exist?"));
        SettleError::new(format!(
            "{kind} copy to queue {queue} not confirmed ({detail}); the original was not acknowledged"
        ))
    }

    /// Gives the original back to the queue after `delay`, unless its channel is gone by then
    /// (then the broker has requeued it already). Until then its tag stays unacknowledged: no
    /// coalesced ack passes it before the nack went out.
    fn requeue_later(&self, delay: Duration) {
        let tag = self.delivery_tag;
        let generation = self.generation.clone();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if !generation.alive() {
                return;
            }
            let nacked = generation
                .acks
                .nack_requeue(&generation.channel, tag, shared.publish_timeout)
                .await;
            if nacked {
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
        let millis = after.as_millis().min(u128::from(u32::MAX)).to_string();
        let Some(properties) = fit::retry(&self.properties, count, &millis, self.generation.frame_max) else {
            // Its headers leave no room for the counter and the expiration: given back to the
            // queue after the delay instead, unchanged (the attempt is counted in the database).
            tracing::warn!(
                queue = %self.shared.queue,
                frame_max = self.generation.frame_max,
                ?after,
                "the retry copy's headers would not fit in a frame; the original is requeued after the delay instead"
            );
            self.requeue_later(after);
            return Ok(());
        };
        let queue = &self.shared.retry_queue;
        match self
            .publish_copy(queue, properties, self.message.payload(), "retry")
            .await
        {
            Ok(()) => self.ack().await,
            Err(unconfirmed) => {
                self.requeue_later(after.max(self.shared.requeue_delay));
                Err(self.not_confirmed("retry", queue, &unconfirmed))
            }
        }
    }

    /// Whether this is a quorum queue's delivery whose next give-back could be the broker's last
    /// before it drops the message or dead-letters it past txinbox: its `x-delivery-count` + 1
    /// reaches the delivery limit ([`AmqpConfig::delivery_limit`](crate::AmqpConfig::delivery_limit)).
    pub(crate) fn near_delivery_limit(&self) -> bool {
        let count = int_header(self.properties.headers().as_ref(), headers::DELIVERY_COUNT).unwrap_or(0);
        count >= 1 && count.saturating_add(1) >= i64::from(self.shared.delivery_limit)
    }

    /// Publishes a fresh copy of the message to the work queue (same payload, properties and
    /// headers, without the broker's counters: its delivery count starts over), confirmed, then
    /// acks the original. `Err(self)` if the copy was not confirmed: the delivery is still
    /// unsettled, to be processed as it is. Once the copy is confirmed the original is only a
    /// duplicate: a failed ack costs nothing (the inbox deduplicates whichever comes second).
    pub(crate) async fn replace_with_fresh_copy(self) -> Result<(), AmqpDelivery> {
        let count = int_header(self.properties.headers().as_ref(), headers::DELIVERY_COUNT).unwrap_or(0);
        let table = self.properties.headers().clone().unwrap_or_default();
        let properties = fit::copy_properties(&self.properties, table, self.properties.expiration().clone());
        let queue = ShortString::from(self.shared.queue.as_ref());
        match self
            .publish_copy(&queue, properties, self.message.payload(), "fresh_copy")
            .await
        {
            Ok(()) => {
                tracing::warn!(
                    queue = %self.shared.queue,
                    message_id = ?self.message.native_id(),
                    delivery_count = count,
                    delivery_limit = self.shared.delivery_limit,
                    "a message given back this often (consumers that died or lost their connection with it) is republished as a fresh copy, so the quorum queue's delivery limit cannot drop it"
                );
                let _ = self.ack().await;
                Ok(())
            }
            Err(unconfirmed) => {
                tracing::error!(
                    queue = %self.shared.queue,
                    message_id = ?self.message.native_id(),
                    delivery_count = count,
                    error = %unconfirmed,
                    "a fresh copy of a message near the quorum queue's delivery limit was not confirmed; processing the delivery as it is"
                );
                Err(self)
            }
        }
    }

    /// Publishes the dead-letter copy, made to fit (see [`fit`]), then acks the original.
    async fn dead_letter(&self, dl: DeadLetter) -> Result<(), SettleError> {
        if !self.generation.alive() {
            self.shared
                .counter(telemetry::ACK_NOT_SENT, &[("cause", "stale_channel")])
                .increment(1);
            return Err(self.stale("dead-letter copy", "the channel was lost"));
        }
        let queue = &self.shared.dead_letter_queue;
        let why = fit::Why {
            reason: dl.reason.as_str(),
            error: &dl.error,
            queue: &self.shared.queue,
        };
        let payload = self.message.payload();
        let mut payload_refused = false;
        loop {
            let frame_max = self.generation.frame_max;
            let Some(copy) = fit::dead_letter(&self.properties, payload, &why, frame_max, payload_refused)
            else {
                tracing::error!(
                    queue = %self.shared.queue,
                    dead_letter_queue = %queue,
                    frame_max,
                    "no dead-letter copy fits in a frame; the database's dead letter is its record and the original is acknowledged without a copy"
                );
                self.shared
                    .counter(telemetry::DEAD_LETTERS_REDUCED, &[("form", "none")])
                    .increment(1);
                return self.ack().await;
            };
            if copy.form != Form::Whole {
                tracing::warn!(
                    queue = %self.shared.queue,
                    dead_letter_queue = %queue,
                    form = copy.form.name(),
                    frame_max,
                    "the dead-letter copy leaves part of the original out to fit what the broker takes; the database's dead letter keeps it"
                );
            }
            let body: &[u8] = if copy.form.keeps_payload() { payload } else { &[] };
            match self
                .publish_copy(queue, copy.properties, body, "dead_letter")
                .await
            {
                Ok(()) => {
                    if copy.form != Form::Whole {
                        self.shared
                            .counter(telemetry::DEAD_LETTERS_REDUCED, &[("form", copy.form.name())])
                            .increment(1);
                    }
                    return self.ack().await;
                }
                Err(unconfirmed) if !payload_refused && fit::is_size_refusal(&unconfirmed) => {
                    tracing::warn!(
                        queue = %self.shared.queue,
                        dead_letter_queue = %queue,
                        error = %unconfirmed,
                        "the broker refused the dead-letter copy's size (max_message_size); sending it without the payload"
                    );
                    payload_refused = true;
                }
                Err(unconfirmed) => {
                    self.requeue_later(self.shared.requeue_delay);
                    return Err(self.not_confirmed("dead_letter", queue, &unconfirmed));
                }
            }
        }
    }
}

/// Dropped unsettled (or after a settlement that did not ack it): its tag stays unacknowledged,
/// and acks of later deliveries stop waiting for it (they go out alone, never covering it).
impl Drop for AmqpDelivery {
    fn drop(&mut self) {
        self.generation.acks.abandon(self.delivery_tag);
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

    fn position_to_store(&self) -> Option<txinbox::position::Position> {
        None // a queue has no positions
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
