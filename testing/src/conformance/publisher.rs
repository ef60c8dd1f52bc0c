//! The outbox [`Publisher`] suite: what every publisher must do for the relay.
//!
//! | case | the contract it checks |
//! |---|---|
//! | [`publish_then_read_back`] | `Ok` means the message is on the broker, with its payload, key, headers and its ID in [`ID_HEADER`] |
//! | [`unconfirmed_publish_is_an_error`] | a message the broker does not take (unroutable, unknown destination) is an `Err`, never `Ok` |
//! | [`one_key_keeps_its_order`] | messages of one key, each published after the previous one's `Ok`, arrive in that order |
//! | [`republishing_keeps_the_id`] | publishing the same row again (the relay's retry) sends the same ID, so the consumer's inbox can drop the copy |
//!
//! [`ID_HEADER`]: txinbox::outbox::ID_HEADER

use std::time::Duration;

use txinbox::outbox::{OutboxMessage, Publisher, ID_HEADER};
use txinbox::{async_trait, message::Headers};

use super::{skipped, within};

/// What the implementation under test provides: its publisher, fresh destinations, and a way
/// to read back what reached them.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The publisher under test.
    type Publisher: Publisher;

    /// The publisher.
    fn publisher(&self) -> &Self::Publisher;

    /// A fresh destination (Kafka topic, RabbitMQ queue name) that exists and is empty, named
    /// after `label`.
    async fn destination(&self, label: &str) -> String;

    /// What reached `destination`, in the broker's order (Kafka: one partition's offsets;
    /// RabbitMQ: the queue's), waiting up to `within` for `expected` messages.
    async fn read(&self, destination: &str, expected: usize, within: Duration) -> Vec<Published>;

    /// A destination the broker refuses or cannot route to, for
    /// [`unconfirmed_publish_is_an_error`]. `None` (the default): that case is skipped, with a
    /// printed line.
    async fn unroutable(&self) -> Option<String> {
        None
    }

    /// The longest wait for a publish or a read. Default 30 s.
    fn patience(&self) -> Duration {
        Duration::from_secs(30)
    }

    /// Removes the destinations the case created. Called when a case passed.
    async fn cleanup(self)
    where
        Self: Sized,
    {
    }
}

/// A message as read back from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The payload.
    pub payload: Vec<u8>,
    /// The key as the broker carries it (Kafka record key; RabbitMQ header
    /// `txinbox_amqp::headers::KEY`).
    pub key: Option<Vec<u8>>,
    /// The headers, including [`ID_HEADER`].
    pub headers: Headers,
}

fn message(destination: &str, id: &str, key: Option<&str>, payload: &str) -> OutboxMessage {
    let mut m = OutboxMessage::new(id, destination, payload.to_owned()).with_headers(
        Headers::new()
            .with("conformance", "yes")
            .with("raw", &b"\xff\x00"[..]),
    );
    if let Some(key) = key {
        m = m.with_key(key.to_owned());
    }
    m
}

async fn publish<H: Harness>(h: &H, m: &OutboxMessage) {
    within(h.patience(), "Publisher::publish", h.publisher().publish(m))
        .await
        .unwrap_or_else(|e| panic!("publishing {} to {} failed: {e}", m.message_id(), m.destination()));
}

fn unique(label: &str) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{label}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// `Ok` means the message is on the broker: payload, key, the row's headers and its ID in
/// [`ID_HEADER`] are read back.
pub async fn publish_then_read_back<H: Harness>(h: H) {
    let dest = h.destination("publish_then_read_back").await;
    let id = unique("id");
    let m = message(&dest, &id, Some("customer-7"), "payload-1");
    publish(&h, &m).await;
    let got = h.read(&dest, 1, h.patience()).await;
    assert_eq!(
        got.len(),
        1,
        "exactly the published message reached {dest}: {got:?}"
    );
    let got = &got[0];
    assert_eq!(got.payload, b"payload-1", "payload");
    assert_eq!(got.key.as_deref(), Some(&b"customer-7"[..]), "key");
    assert_eq!(
        got.headers.get_str(ID_HEADER),
        Some(id.as_str()),
        "the ID travels in {ID_HEADER}"
    );
    assert_eq!(got.headers.get_str("conformance"), Some("yes"), "a UTF-8 header");
    assert_eq!(got.headers.get("raw"), Some(&b"\xff\x00"[..]), "a binary header");
    h.cleanup().await;
}

/// A message the broker does not take is an error: the relay must publish it again.
pub async fn unconfirmed_publish_is_an_error<H: Harness>(h: H) {
    let Some(dest) = h.unroutable().await else {
        skipped(
            "unconfirmed_publish_is_an_error",
            "the harness has no unroutable destination (Harness::unroutable)",
        );
        h.cleanup().await;
        return;
    };
    let m = message(&dest, &unique("id"), None, "nowhere");
    let result = within(h.patience(), "Publisher::publish", h.publisher().publish(&m)).await;
    assert!(
        result.is_err(),
        "publishing to {dest:?}, which the broker cannot take, returned Ok: the relay would mark the row published and lose it"
    );
    h.cleanup().await;
}

/// Messages of one key, each published after the previous `Ok` (as the relay does), arrive in
/// publish order.
pub async fn one_key_keeps_its_order<H: Harness>(h: H) {
    let dest = h.destination("one_key_keeps_its_order").await;
    let payloads: Vec<String> = (0..8).map(|i| format!("in-order-{i}")).collect();
    for p in &payloads {
        publish(&h, &message(&dest, &unique("id"), Some("one-key"), p)).await;
    }
    let got: Vec<String> = h
        .read(&dest, payloads.len(), h.patience())
        .await
        .into_iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    assert_eq!(got, payloads, "one key's messages arrive in publish order");
    h.cleanup().await;
}

/// Publishing the same message twice (a relay retry after an unknown outcome) sends the same
/// ID both times.
pub async fn republishing_keeps_the_id<H: Harness>(h: H) {
    let dest = h.destination("republishing_keeps_the_id").await;
    let id = unique("id");
    let m = message(&dest, &id, Some("k"), "twice");
    publish(&h, &m).await;
    publish(&h, &m).await;
    let got = h.read(&dest, 2, h.patience()).await;
    let ids: Vec<Option<&str>> = got.iter().map(|m| m.headers.get_str(ID_HEADER)).collect();
    assert_eq!(ids, [Some(id.as_str()); 2], "both copies carry the row's ID");
    h.cleanup().await;
}

/// Runs every case, each with a fresh harness from `make(case name)`. Prefer
/// [`publisher_conformance!`](crate::publisher_conformance), which makes one test per case.
pub async fn run_all<H, F, Fut>(make: F)
where
    H: Harness,
    F: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = H>,
{
    publish_then_read_back(make("publish_then_read_back").await).await;
    unconfirmed_publish_is_an_error(make("unconfirmed_publish_is_an_error").await).await;
    one_key_keeps_its_order(make("one_key_keeps_its_order").await).await;
    republishing_keeps_the_id(make("republishing_keeps_the_id").await).await;
}

/// One `#[tokio::test]` per case of the [publisher suite](crate::conformance::publisher), each
/// given a fresh harness from `$make(case name)`.
///
/// ```ignore
/// async fn harness(case: &'static str) -> MyPublisherHarness { MyPublisherHarness::new(case).await }
/// txinbox_testing::publisher_conformance!(harness);
/// ```
#[macro_export]
macro_rules! publisher_conformance {
    ($make:expr) => {
        $crate::publisher_conformance!(@cases $make;
            publish_then_read_back,
            unconfirmed_publish_is_an_error,
            one_key_keeps_its_order,
            republishing_keeps_the_id,
        );
    };
    (@cases $make:expr; $($case:ident,)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let harness = ($make)(stringify!($case)).await;
                $crate::conformance::publisher::$case(harness).await;
            }
        )*
    };
}
