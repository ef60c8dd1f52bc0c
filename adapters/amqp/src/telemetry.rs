//! Metric names of the AMQP adapter. Everything goes through the `metrics` facade; nothing is
//! installed. Every metric carries a `queue` label (the work queue).
//!
//! | metric | kind | meaning |
//! |---|---|---|
//! | `txinbox_amqp_reconnects_total` | counter | a lost connection, channel or consumer was rebuilt |
//! | `txinbox_amqp_connected` | gauge | 1 while a consumer is registered, else 0 |
//! | `txinbox_amqp_queue_depth` | gauge | messages ready in the work queue as the broker reports them (passive `queue.declare` every 5 s on a channel of its own; excludes delivered-unacked ones) |
//! | `txinbox_amqp_ack_not_sent_total` | counter | an ack after commit was not sent; label `cause`: `stale_channel` (the channel was gone before the frame was sent), `error` (lapin refused the frame, e.g. as the channel closed), `timeout` (`publish_timeout`). The message is redelivered and deduplicated |
//! | `txinbox_amqp_publish_failures_total` | counter | a retry, dead-letter or fresh copy was not confirmed; labels `kind` (`retry`, `dead_letter`, `fresh_copy`) and `cause` (`unroutable`, `nack`, `error`, `timeout`) |
//! | `txinbox_amqp_published_total` | counter | retry, dead-letter or fresh copies confirmed by the broker; label `kind`. A `fresh_copy` replaces a delivery of a quorum queue near its delivery limit ([`AmqpConfig::delivery_limit`](crate::AmqpConfig::delivery_limit)) |
//! | `txinbox_amqp_requeued_total` | counter | originals given back with `basic.nack(requeue)` after a failed copy, or instead of a retry copy that would not fit in a frame |
//! | `txinbox_amqp_dead_letters_reduced_total` | counter | dead-letter copies that leave part of the original out to fit what the broker takes; label `form`: `headers_omitted` (frame_max), `payload_omitted` (max_message_size), `payload_and_headers_omitted`, `none` (no copy fits: acked on the strength of the database's dead letter) |
//! | `txinbox_amqp_stale_dropped_total` | counter | deliveries of a lost channel dropped before reaching the runtime (the broker redelivers them) |

/// Counter: connection/channel/consumer rebuilt.
pub const RECONNECTS: &str = "txinbox_amqp_reconnects_total";
/// Gauge: 1 while consuming.
pub const CONNECTED: &str = "txinbox_amqp_connected";
/// Gauge: messages ready in the work queue (broker's count).
pub const QUEUE_DEPTH: &str = "txinbox_amqp_queue_depth";
/// Counter: acks not sent, by `cause`.
pub const ACK_NOT_SENT: &str = "txinbox_amqp_ack_not_sent_total";
/// Counter: unconfirmed retry/dead-letter copies, by `kind` and `cause`.
pub const PUBLISH_FAILURES: &str = "txinbox_amqp_publish_failures_total";
/// Counter: confirmed retry/dead-letter copies, by `kind`.
pub const PUBLISHED: &str = "txinbox_amqp_published_total";
/// Counter: originals requeued after a failed copy.
pub const REQUEUED: &str = "txinbox_amqp_requeued_total";
/// Counter: dead-letter copies cut to fit, by `form`.
pub const DEAD_LETTERS_REDUCED: &str = "txinbox_amqp_dead_letters_reduced_total";
/// Counter: deliveries of a lost channel dropped before the runtime saw them.
pub const STALE_DROPPED: &str = "txinbox_amqp_stale_dropped_total";

pub(crate) fn describe() {
    use metrics::{describe_counter, describe_gauge};
    describe_counter!(
        RECONNECTS,
        "AMQP connection, channel or consumer rebuilt after a loss"
    );
    describe_gauge!(CONNECTED, "1 while the AMQP consumer is registered");
    describe_gauge!(
        QUEUE_DEPTH,
        "Messages ready in the work queue, as the broker reports them"
    );
    describe_counter!(
        ACK_NOT_SENT,
        "Acks after commit that were not sent (the message is redelivered and deduplicated)"
    );
    describe_counter!(
        PUBLISH_FAILURES,
        "Retry or dead-letter copies not confirmed by the broker"
    );
    describe_counter!(PUBLISHED, "Retry or dead-letter copies confirmed by the broker");
    describe_counter!(
        REQUEUED,
        "Originals requeued after a retry or dead-letter copy failed"
    );
    describe_counter!(
        DEAD_LETTERS_REDUCED,
        "Dead-letter copies that leave the original headers or payload out to fit what the broker takes"
    );
    describe_counter!(
        STALE_DROPPED,
        "Deliveries of a lost channel dropped before processing (redelivered by the broker)"
    );
}
