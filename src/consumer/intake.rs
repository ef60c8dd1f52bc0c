//! How deliveries come in: the intake loop, the in-flight slot each delivery holds until its
//! task ends, and the per-lane gauges of what is unsettled.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::backoff::store_backoff;
use super::scheduler::LaneKey;
use super::Shared;
use crate::error::Error;
use crate::health;
use crate::source::{Lane, MessageSource};
use crate::telemetry;

/// How long intake waits for the store's preflight before it receives anyway.
const PREFLIGHT_WAIT: Duration = Duration::from_secs(2);

/// Receives, once the store's preflight has answered, while there is room and the database is
/// healthy; returns the source at the end.
pub(super) async fn intake<Src: MessageSource, St, H>(
    mut source: Src,
    shared: Arc<Shared<St, H>>,
    max_in_flight: usize,
    tx: mpsc::UnboundedSender<InFlight<Src::Delivery>>,
    preflight_done: tokio::sync::oneshot::Receiver<()>,
) -> Src {
    let slots = Arc::new(Semaphore::new(max_in_flight));
    let gauge = shared.metrics.in_flight.clone();
    let mut errors = 0u32;
    // NOTE: one shutdown waiter for the whole loop, and no waiter at all where there is room and
    // the database is healthy: registering and dropping waiters per message was a few per cent
    // of the consumer's CPU under load.
    let shutdown = shared.shutdown.cancelled();
    tokio::pin!(shutdown);
    // Nothing is received before the store's preflight has answered (see `run_until`; its end,
    // whatever the outcome, drops the sender), or PREFLIGHT_WAIT has passed: a database that
    // does not answer is then found by the first transaction, as before there was a check.
    tokio::select! {
        _ = tokio::time::timeout(PREFLIGHT_WAIT, preflight_done) => {}
        _ = &mut shutdown => return source,
    }
    loop {
        let permit = match slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => tokio::select! {
                p = slots.clone().acquire_owned() => p.expect("semaphore is never closed"),
                _ = &mut shutdown => break,
            },
        };
        if !*shared.healthy.borrow() {
            shared.wait_healthy().await;
        }
        // NOTE: `receive` is cancellation safe by contract; dropping it on shutdown loses nothing.
        let received = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            r = source.receive() => r,
        };
        match received {
            Ok(Some(delivery)) => {
                errors = 0;
                gauge.increment(1.0);
                let lane = match crate::source::Delivery::reported_lane(&delivery) {
                    Lane::Unordered => None,
                    Lane::Ordered(key) => Some(key),
                };
                let received = Instant::now();
                shared.health.received(&lane, received);
                let slot = Slot {
                    _permit: permit,
                    gauge: gauge.clone(),
                    health: shared.health.clone(),
                    lane,
                    received,
                };
                if tx
                    .send(InFlight {
                        delivery,
                        _slot: slot,
                    })
                    .is_err()
                {
                    break;
                }
            }
            Ok(None) => {
                tracing::info!(consumer = %shared.name, "source finished");
                break;
            }
            Err(e) if e.is_transient() => {
                errors += 1;
                let delay = store_backoff(errors);
                tracing::warn!(consumer = %shared.name, error = %e, ?delay, "receive failed; retrying");
                if !shared.sleep(delay).await {
                    break;
                }
            }
            Err(e) => {
                shared.fail(Error::Source(e));
                break;
            }
        }
    }
    source
}

/// A received delivery and the in-flight slot it occupies until its task ends.
pub(super) struct InFlight<D> {
    pub(super) delivery: D,
    pub(super) _slot: Slot,
}

pub(super) struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: metrics::Gauge,
    health: Arc<health::State>,
    lane: LaneKey,
    received: Instant,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
        self.health.settled(&self.lane, self.received);
    }
}

/// How often the per-lane gauges ([`telemetry::LANE_OLDEST_UNSETTLED_AGE`]) are refreshed.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// Sets [`telemetry::LANE_OLDEST_UNSETTLED_AGE`] per lane every [`GAUGE_INTERVAL`] until
/// shutdown, and zero for lanes that had a value and are gone.
pub(super) async fn refresh_gauges(
    health: Arc<health::State>,
    consumer: Arc<str>,
    shutdown: CancellationToken,
) {
    let mut known: HashMap<LaneKey, metrics::Gauge> = HashMap::new();
    let mut tick = tokio::time::interval(GAUGE_INTERVAL);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => break,
        }
        let samples = health.sample();
        let mut seen = std::collections::HashSet::new();
        for sample in samples {
            let gauge = known.entry(sample.lane.clone()).or_insert_with(|| {
                let lane = sample.lane.as_deref().unwrap_or("").to_owned();
                metrics::gauge!(telemetry::LANE_OLDEST_UNSETTLED_AGE, "consumer" => consumer.to_string(), "lane" => lane)
            });
            gauge.set(sample.oldest_unsettled.as_secs_f64());
            seen.insert(sample.lane);
        }
        known.retain(|lane, gauge| {
            let keep = seen.contains(lane);
            if !keep {
                gauge.set(0.0);
            }
            keep
        });
    }
    for gauge in known.values() {
        gauge.set(0.0);
    }
}
