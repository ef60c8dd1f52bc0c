//! What the cases share: publishing recognisable messages, receiving with a deadline, and
//! finding out what a source delivers again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use txinbox::{message::Headers, source::Settlement, Delivery, MessageSource};

use super::{Features, Harness, TestMessage};
use crate::conformance::within;

/// The harness of one case, with the case's name and features.
pub(super) struct Case<H: Harness> {
    pub(super) harness: H,
    pub(super) name: &'static str,
    pub(super) features: Features,
    next: AtomicUsize,
}

pub(super) type DeliveryOf<H> = <<H as Harness>::Source as MessageSource>::Delivery;

impl<H: Harness> Case<H> {
    pub(super) fn new(harness: H, name: &'static str) -> Self {
        let features = harness.features();
        Case {
            harness,
            name,
            features,
            next: AtomicUsize::new(0),
        }
    }

    /// Publishes a message whose payload is `<case>/<label>`, with a header the suite checks,
    /// and returns the payload.
    pub(super) async fn publish(&self, label: &str, key: Option<&str>) -> String {
        let n = self.next.fetch_add(1, Ordering::SeqCst);
        let payload = format!("{}/{label}", self.name);
        let mut message = TestMessage::new(format!("{}-{n}-{}", self.name, std::process::id()), &payload)
            .with_headers(Headers::new().with("conformance-label", label.to_owned()));
        if let Some(key) = key {
            message = message.with_key(key);
        }
        within(
            self.features.patience,
            "Harness::publish",
            self.harness.publish(message),
        )
        .await;
        payload
    }

    pub(super) async fn open(&self) -> H::Source {
        within(self.features.patience, "Harness::open", self.harness.open()).await
    }

    /// Closes `source`; it must return `Ok` within the patience.
    pub(super) async fn close(&self, source: H::Source) {
        within(self.features.patience, "MessageSource::close", source.close())
            .await
            .unwrap_or_else(|e| panic!("MessageSource::close failed: {e}"));
    }

    /// The next delivery, or `None` if nothing arrives within `limit`. Panics if the source
    /// ends or fails.
    pub(super) async fn receive_within(
        &self,
        source: &mut H::Source,
        limit: Duration,
    ) -> Option<DeliveryOf<H>> {
        match tokio::time::timeout(limit, source.receive()).await {
            Err(_) => None,
            Ok(Ok(Some(d))) => Some(d),
            Ok(Ok(None)) => panic!("MessageSource::receive returned Ok(None) (finished) on an open stream"),
            Ok(Err(e)) => panic!("MessageSource::receive failed: {e}"),
        }
    }

    /// The next delivery; panics naming `what` if none arrives within the patience.
    pub(super) async fn expect(&self, source: &mut H::Source, what: &str) -> DeliveryOf<H> {
        match self.receive_within(source, self.features.patience).await {
            Some(d) => d,
            None => panic!(
                "{}: expected {what}, but nothing was delivered within {:?}",
                self.name, self.features.patience
            ),
        }
    }

    /// Publishes a marker, then receives and acks everything up to it and for a quiet period
    /// after it: what the source still delivers. Returns the payloads other than the marker's,
    /// in the order received.
    pub(super) async fn leftovers(&self, source: &mut H::Source, marker: &str) -> Vec<String> {
        let marker = self.publish(marker, None).await;
        let mut seen = Vec::new();
        loop {
            let d = self
                .expect(source, &format!("the marker message {marker:?}"))
                .await;
            let payload = payload(&d);
            ack(d).await;
            if payload == marker {
                break;
            }
            seen.push(payload);
        }
        while let Some(d) = self.receive_within(source, self.features.quiet).await {
            let p = payload(&d);
            ack(d).await;
            seen.push(p);
        }
        seen
    }
}

pub(super) fn payload(d: &impl Delivery) -> String {
    String::from_utf8_lossy(d.message().payload()).into_owned()
}

/// Acks; the settlement must succeed.
pub(super) async fn ack(d: impl Delivery) {
    settle(d, Settlement::Ack).await;
}

/// Settles; the settlement must succeed.
pub(super) async fn settle(d: impl Delivery, s: Settlement) {
    let what = format!("{s:?} of {:?}", payload(&d));
    d.settle(s).await.unwrap_or_else(|e| panic!("{what} failed: {e}"));
}

/// Polls `f` once with a waker that does nothing.
pub(super) fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::pin::Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}
