//! The [`MessageSource`]/[`Delivery`](txinbox::Delivery) suite: what every broker adapter must do, whatever the
//! broker.
//!
//! | case | the contract it checks |
//! |---|---|
//! | [`ack_is_final`] | payload and headers arrive as published; an acked delivery is not delivered again, not even by a source opened later |
//! | [`retry_redelivers_later`] | `Settlement::Retry { after }` delivers the message again, not before `after` (sources with [`RetryMode::Redeliver`](txinbox::source::RetryMode::Redeliver)) |
//! | [`dead_letter_moves_it_aside`] | `Settlement::DeadLetter` ends the delivery (not delivered again) and the message reaches the dead-letter target |
//! | [`dropped_delivery_is_redelivered`] | a delivery dropped unsettled comes back: from the open source if [`Features::redelivers_while_open`], else from the next one opened after `close` |
//! | [`close_returns_with_a_delivery_in_flight`] | `close` returns while a delivery is still held; that delivery, never settled, comes back |
//! | [`receive_survives_cancellation`] | `receive` futures dropped after each poll lose nothing and duplicate nothing |
//! | [`settle_survives_cancellation`] | a `settle` future dropped after one poll may or may not settle, but never loses the message |
//! | [`lanes_keep_publish_order`] | deliveries of one key in one [`Lane::Ordered`](txinbox::source::Lane) arrive in publish order |
//!
//! Each case takes a fresh [`Harness`] (a new topic or queue) and panics, with a message
//! saying what went wrong, when the implementation breaks the contract. The suite's own unit
//! tests run every case against a deliberately broken wrapper of the in-memory broker and
//! check that it fails.

mod cases;
mod memory;
mod support;
#[cfg(test)]
mod tests;

use std::time::Duration;

use txinbox::{async_trait, message::Headers, Message, MessageSource};

pub use cases::{
    ack_is_final, close_returns_with_a_delivery_in_flight, dead_letter_moves_it_aside,
    dropped_delivery_is_redelivered, lanes_keep_publish_order, receive_survives_cancellation,
    retry_redelivers_later, settle_survives_cancellation,
};
pub use memory::MemoryHarness;

/// What the implementation under test provides: one fresh, isolated stream (a topic, a queue
/// with a unique name) for one case, a way to publish into it, and a way to open sources on it.
///
/// Every source [`open`](Harness::open)ed by one harness belongs to the same subscription (the
/// same consumer group, the same queue): a source opened after another was closed continues
/// where that one left off.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The source under test.
    type Source: MessageSource;

    /// What the source can do; the cases adapt or skip accordingly.
    fn features(&self) -> Features {
        Features::default()
    }

    /// Publishes one message into the stream and returns once the broker has it (confirmed),
    /// so a source opened afterwards receives it. `message.key`, when set, is the broker's
    /// ordering key (Kafka record key, the memory broker's lane).
    async fn publish(&self, message: TestMessage);

    /// Opens a new source on the stream: a new member of the same subscription.
    async fn open(&self) -> Self::Source;

    /// Reads back the messages dead-lettered from this stream so far, waiting up to `within`
    /// for at least `expected` of them. `None` (the default) means the harness cannot read
    /// them: the dead-letter checks are skipped, with a printed line.
    async fn dead_letters(&self, expected: usize, within: Duration) -> Option<Vec<Message>> {
        let _ = (expected, within);
        None
    }

    /// Removes what the stream left behind (topics, queues). Called when a case passed.
    async fn cleanup(self)
    where
        Self: Sized,
    {
    }
}

/// What a source under test can do, and how long the suite waits for it.
///
/// ```
/// use std::time::Duration;
/// use txinbox_testing::conformance::source::Features;
///
/// let features = Features::default()
///     .redelivers_while_open(false)
///     .patience(Duration::from_secs(60));
/// ```
#[derive(Debug, Clone)]
pub struct Features {
    redelivers_while_open: bool,
    patience: Duration,
    quiet: Duration,
}

impl Default for Features {
    /// A source that redelivers a dropped delivery while it is still open, 30 s of patience
    /// and 500 ms of quiet.
    fn default() -> Self {
        Features {
            redelivers_while_open: true,
            patience: Duration::from_secs(30),
            quiet: Duration::from_millis(500),
        }
    }
}

impl Features {
    /// Whether a delivery dropped unsettled comes back from the source that is still open (the
    /// memory broker requeues it at once). `false`: only from a source opened after `close`
    /// (Kafka: the offset is not stored; RabbitMQ: requeued when the channel closes). The
    /// contract allows both; the suite then checks the redelivery after a reopen.
    pub fn redelivers_while_open(mut self, yes: bool) -> Self {
        self.redelivers_while_open = yes;
        self
    }

    /// The longest wait for something that must happen (a delivery, `close`, a reopened source
    /// joining its group). Default 30 s.
    pub fn patience(mut self, limit: Duration) -> Self {
        self.patience = limit;
        self
    }

    /// How long nothing must arrive, after a marker message, to conclude that nothing more
    /// will. Default 500 ms.
    pub fn quiet(mut self, period: Duration) -> Self {
        self.quiet = period;
        self
    }

    /// See [`redelivers_while_open`](Self::redelivers_while_open).
    pub fn redelivers_dropped_while_open(&self) -> bool {
        self.redelivers_while_open
    }

    /// See [`patience`](Self::patience).
    pub fn patience_limit(&self) -> Duration {
        self.patience
    }

    /// See [`quiet`](Self::quiet).
    pub fn quiet_period(&self) -> Duration {
        self.quiet
    }
}

/// A message the suite publishes through [`Harness::publish`]. Payloads are unique within a
/// case: the suite recognises messages by payload.
#[derive(Debug, Clone)]
pub struct TestMessage {
    /// A message ID, unique within the case: publish it where the broker carries one (AMQP
    /// `message_id`, a header), or ignore it.
    pub id: String,
    /// The ordering key, if any (Kafka record key, memory broker lane).
    pub key: Option<String>,
    /// The payload.
    pub payload: String,
    /// Headers to publish with the message; the suite checks they arrive.
    pub headers: Headers,
}

impl TestMessage {
    /// A message with this ID and payload, no key, no headers.
    pub fn new(id: impl Into<String>, payload: impl Into<String>) -> Self {
        TestMessage {
            id: id.into(),
            key: None,
            payload: payload.into(),
            headers: Headers::new(),
        }
    }

    /// Sets the ordering key.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the headers.
    pub fn with_headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }
}

/// Runs every case, one after the other, each with a fresh harness from `make(case name)`.
/// Prefer [`source_conformance!`](crate::source_conformance), which makes one test per case.
pub async fn run_all<H, F, Fut>(make: F)
where
    H: Harness,
    F: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = H>,
{
    ack_is_final(make("ack_is_final").await).await;
    retry_redelivers_later(make("retry_redelivers_later").await).await;
    dead_letter_moves_it_aside(make("dead_letter_moves_it_aside").await).await;
    dropped_delivery_is_redelivered(make("dropped_delivery_is_redelivered").await).await;
    close_returns_with_a_delivery_in_flight(make("close_returns_with_a_delivery_in_flight").await).await;
    receive_survives_cancellation(make("receive_survives_cancellation").await).await;
    settle_survives_cancellation(make("settle_survives_cancellation").await).await;
    lanes_keep_publish_order(make("lanes_keep_publish_order").await).await;
}

/// One `#[tokio::test]` per case of the [source suite](crate::conformance::source), each named
/// after its case and given a fresh harness from `$make(case name)`, an `async fn(&'static
/// str) -> impl Harness` (or a closure returning a future).
///
/// ```ignore
/// async fn harness(case: &'static str) -> MyHarness { MyHarness::create(case).await }
/// txinbox_testing::source_conformance!(harness);
/// ```
#[macro_export]
macro_rules! source_conformance {
    ($make:expr) => {
        $crate::source_conformance!(@cases $make;
            ack_is_final,
            retry_redelivers_later,
            dead_letter_moves_it_aside,
            dropped_delivery_is_redelivered,
            close_returns_with_a_delivery_in_flight,
            receive_survives_cancellation,
            settle_survives_cancellation,
            lanes_keep_publish_order,
        );
    };
    (@cases $make:expr; $($case:ident,)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let harness = ($make)(stringify!($case)).await;
                $crate::conformance::source::$case(harness).await;
            }
        )*
    };
}
