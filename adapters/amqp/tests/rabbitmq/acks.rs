//! Coalesced acks on a real broker: whatever order deliveries are settled in, a
//! `basic.ack(multiple)` never covers one that was not settled.

use std::collections::BTreeSet;
use std::time::Duration;

use txinbox::source::Settlement;
use txinbox::{Delivery, MessageSource};
use txinbox_amqp::{AmqpDelivery, AmqpSource};

use super::*;

async fn next(source: &mut AmqpSource, within: Duration) -> Option<AmqpDelivery> {
    tokio::time::timeout(within, source.receive())
        .await
        .ok()
        .map(|r| r.expect("receive").expect("source open"))
}

fn id_of(d: &AmqpDelivery) -> String {
    d.message()
        .native_id()
        .expect("published with a message_id")
        .to_owned()
}

/// Settles `deliveries` as acks in a shuffled order, in groups settled together (as a batch's
/// settlements are), the groups one after another, so that runs of them coalesce and others
/// wait behind a hole.
async fn settle_shuffled(mut deliveries: Vec<AmqpDelivery>, rng: &mut fastrand::Rng) {
    rng.shuffle(&mut deliveries);
    while !deliveries.is_empty() {
        let k = rng.usize(1..=12).min(deliveries.len());
        let group: Vec<_> = deliveries.drain(..k).collect();
        let results = futures::future::join_all(group.into_iter().map(|d| d.settle(Settlement::Ack))).await;
        for r in results {
            r.expect("a settled ack is sent");
        }
    }
}

/// 80 deliveries: the first 40 settled out of order (coalesced into multiple acks), then of the
/// other 40 some dropped unsettled, some held until the source closed, the rest settled out of
/// order. Consumed again, exactly the unsettled ones come back: no multiple ack covered a
/// dropped or held delivery, and every settled one was acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_settlement_acks_exactly_the_settled_deliveries() {
    let _suite = shared().await;
    let queue = TestQueue::new("acks").await;
    const N: usize = 80;
    let messages: Vec<_> = (0..N)
        .map(|i| (Some(format!("ack-{i:02}")), "{}".to_owned()))
        .collect();
    queue.publish_all(&messages).await;

    let mut source = AmqpSource::connect(queue.config(N as u16)).await.unwrap();
    let mut deliveries = Vec::new();
    while deliveries.len() < N {
        let d = next(&mut source, Duration::from_secs(10))
            .await
            .expect("every published message is delivered");
        deliveries.push(Some(d));
    }
    let mut rng = fastrand::Rng::with_seed(29);
    let first: Vec<AmqpDelivery> = deliveries[..40].iter_mut().map(|d| d.take().unwrap()).collect();
    settle_shuffled(first, &mut rng).await;

    // Holes: single, in a run, and at the end.
    let dropped = [41usize, 47, 52, 53, 66];
    let held_back = [60usize, 61, 79];
    let unsettled: BTreeSet<String> = dropped
        .iter()
        .chain(&held_back)
        .map(|&i| id_of(deliveries[i].as_ref().unwrap()))
        .collect();
    for &i in &dropped {
        drop(deliveries[i].take());
    }
    let held: Vec<AmqpDelivery> = held_back.iter().map(|&i| deliveries[i].take().unwrap()).collect();
    settle_shuffled(deliveries.into_iter().flatten().collect(), &mut rng).await;
    source.close().await.expect("closed");
    drop(held);

    let mut again = AmqpSource::connect(queue.config(N as u16)).await.unwrap();
    let mut back = Vec::new();
    while let Some(d) = next(&mut again, Duration::from_secs(3)).await {
        back.push(id_of(&d));
        d.settle(Settlement::Ack).await.expect("acked");
    }
    again.close().await.expect("closed");
    back.sort();
    let back_set: BTreeSet<String> = back.iter().cloned().collect();
    assert_eq!(back.len(), back_set.len(), "each once: {back:?}");
    assert_eq!(
        back_set, unsettled,
        "exactly the deliveries never settled come back (missing ones were acked by a multiple ack that covered them; extra ones were settled and not acked)"
    );
    assert_eq!(queue.ready().await, 0);
    queue.delete().await;
}
