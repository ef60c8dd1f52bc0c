//! The runtime: [`Consumer`] pulls deliveries, runs each through the inbox pipeline and
//! settles it; [`ConsumerBuilder`] configures it, with the `DEFAULT_*` values below.
//!
//! Scheduling: one intake task calls [`MessageSource::receive`] while fewer than
//! `max_in_flight` deliveries are unsettled and the database is healthy. The scheduler queues
//! deliveries per [`Lane::Ordered`] lane and runs one task per lane at a time, so a lane is
//! processed in receive order while different lanes run concurrently. [`Lane::Unordered`]
//! deliveries share one queue served by up to `concurrency` tasks. At most `concurrency`
//! transactions are open at once (a semaphore).
//!
//! Micro-batching: a task takes what is already queued for its lane, up to `batch_size`
//! deliveries, and processes them in one transaction (`Shared::process_batch`). With a
//! `batch_linger`, a lane with fewer queued waits up to that long for more before it starts.
//! Under load a lane's queue fills while its previous transaction commits, so batches form by
//! themselves; an idle consumer sends a lone message at once.
//!
//! One file per question: `builder` (configuration and its checks), `shared` (the state
//! every task shares), `intake` (receiving, in-flight slots, lane gauges), `scheduler`
//! (lanes, linger, which task runs next), `batch` (a micro-batch in one transaction),
//! `single` (one message in one transaction), `settle` (telling the broker, dead letters),
//! `backoff` (waiting out the database), `call` (running the handler).

pub(crate) mod backoff;
mod batch;
mod builder;
mod call;
mod intake;
mod retention;
mod scheduler;
mod settle;
mod shared;
mod single;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

pub use builder::ConsumerBuilder;
pub use builder::{
    DEFAULT_BATCH_LINGER, DEFAULT_BATCH_MAX_DURATION, DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY,
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_MESSAGE_BYTES,
};
use intake::{intake, refresh_gauges};
pub use retention::Retention;
use scheduler::{Linger, Scheduler};
use shared::Shared;

use crate::error::Error;
use crate::handler::Handler;
use crate::health::{self, Health};
use crate::source::{Lane, MessageSource, SourceError};
use crate::store::InboxStore;

/// A consumer: one source, one inbox store, one handler.
///
/// Built with [`Consumer::builder`], started with [`Consumer::run`] or
/// [`Consumer::run_until`].
pub struct Consumer<Src, St, H> {
    source: Src,
    shared: Arc<Shared<St, H>>,
    max_in_flight: usize,
    /// The inbox's retention, when configured: runs beside the consumer, stops with it.
    janitor: Option<crate::janitor::Janitor>,
}

impl<Src, St, H> std::fmt::Debug for Consumer<Src, St, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("name", &self.shared.name)
            .field("system", &self.shared.system)
            .field("id_strategy", &self.shared.id_strategy)
            .field("concurrency", &self.shared.concurrency_limit)
            .field("max_in_flight", &self.max_in_flight)
            .field("retention", &self.janitor.as_ref().map(|j| j.schedule()))
            .finish_non_exhaustive()
    }
}

/// Marks the consumer stopped for [`Health`] when `run_until` ends or its future is dropped.
struct StoppedOnDrop(Arc<health::State>);

impl Drop for StoppedOnDrop {
    fn drop(&mut self) {
        self.0.set_running(false);
    }
}

impl<Src, St, H> Consumer<Src, St, H> {
    /// A handle reporting this consumer's health (database reachable, intake paused, broker
    /// connected, lanes assigned, progress and stalls per lane); see [`crate::health`].
    ///
    /// Take it before [`run`](Self::run), which consumes the consumer. It is cheap to clone and
    /// stays valid after the consumer stops (then reporting it stopped).
    pub fn health(&self) -> Health {
        Health::new(self.shared.health.clone())
    }
}

impl<Src, St, H> Consumer<Src, St, H>
where
    Src: MessageSource,
    St: InboxStore,
    H: Handler<St::Db>,
{
    /// Runs until the source is finished ([`MessageSource::receive`] returns `Ok(None)`) or a
    /// fatal error; see [`run_until`](Self::run_until).
    pub async fn run(self) -> Result<(), Error> {
        self.run_until(std::future::pending::<()>()).await
    }

    /// Runs until `shutdown` completes, the source is finished, or a fatal error.
    ///
    /// Shutdown is graceful: intake stops, every received delivery is processed and settled
    /// (deliveries waiting for an in-place retry are left unsettled and will be redelivered),
    /// then the source is closed. Transactions are never cancelled midway.
    ///
    /// If the future returned here is dropped instead, in-progress message tasks are aborted:
    /// their transactions roll back and their deliveries stay unsettled, to be redelivered. With
    /// sqlx 0.9.0 an abort that lands while `BEGIN` is in flight can return a connection to the
    /// pool inside a transaction (sqlx #4393); keep `idle_in_transaction_session_timeout` set
    /// ([`PostgresInbox::connect_options`](crate::PostgresInbox::connect_options)) and shut down
    /// through `shutdown` rather than by dropping.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
        let Consumer {
            source,
            shared,
            max_in_flight,
            janitor,
        } = self;
        // Retention runs beside the consumer, on its own connections, and stops with it (below);
        // dropped with this future, it is aborted.
        let janitor = janitor.map(|j| Arc::new(j).spawn());
        shared.health.set_running(true);
        let _stopped = StoppedOnDrop(shared.health.clone());
        let gauges = tokio::spawn(refresh_gauges(
            shared.health.clone(),
            shared.name.clone(),
            shared.shutdown.clone(),
        ));
        let _gauges = AbortOnDrop(gauges);
        let preflight = shared.clone();
        // Intake starts once the check has answered (or after a short wait, see `intake`): a
        // server the store cannot work with must stop the consumer before any message's
        // transaction fails on it and counts an attempt.
        let (checked, preflight_done) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            // Dropped when this task ends, whatever the outcome: intake goes on then.
            let _checked = checked;
            // Best effort: a database that is down now is found by the first transaction,
            // which fails closed.
            match preflight.store.preflight().await {
                Ok(warnings) => {
                    for warning in warnings {
                        tracing::warn!(consumer = %preflight.name, %warning, "inbox database setting puts the guarantee at risk");
                    }
                }
                // A server the store cannot work with (too old): stop before every message
                // fails its transaction one attempt after another.
                Err(e) if !e.is_transient() => preflight.fail(Error::Store(e)),
                Err(e) => {
                    tracing::debug!(consumer = %preflight.name, error = %e, "checking the inbox database's settings failed")
                }
            }
        });
        let (tx, mut rx) = mpsc::unbounded_channel();
        let intake = tokio::spawn(intake(source, shared.clone(), max_in_flight, tx, preflight_done));
        // If this future is dropped (the caller's "crash"), stop intake too.
        let _stop_intake = shared.shutdown.clone().drop_guard();

        let mut tasks = JoinSet::new();
        let mut sched = Scheduler {
            lanes: HashMap::new(),
            task_lanes: HashMap::new(),
            stopped_lanes: HashMap::new(),
            lingering: FuturesUnordered::new(),
            generation: 0,
        };
        let mut intake_open = true;
        tokio::pin!(shutdown);
        let mut signalled = false;

        while intake_open || !tasks.is_empty() || !sched.lingering.is_empty() {
            tokio::select! {
                _ = &mut shutdown, if !signalled => {
                    signalled = true;
                    tracing::info!(consumer = %shared.name, "shutdown requested: stopping intake and draining");
                    shared.shutdown.cancel();
                }
                item = rx.recv(), if intake_open => match item {
                    Some(item) => {
                        let key = match crate::source::Delivery::lane(&item.delivery) {
                            Lane::Unordered => None,
                            Lane::Ordered(key) => Some(key),
                        };
                        if key.as_ref().is_some_and(|k| sched.stays_stopped(k, &item.delivery)) {
                            drop(item); // unsettled: redelivered after the delivery it must follow
                        } else {
                            sched.lanes.entry(key.clone()).or_default().queue.push_back(item);
                            sched.pump(&key, &mut tasks, &shared);
                        }
                    }
                    None => intake_open = false,
                },
                Some((key, generation)) = sched.lingering.next(), if !sched.lingering.is_empty() => {
                    if let Some(lane) = sched.lanes.get_mut(&key) {
                        if lane.linger == Linger::Waiting(generation) {
                            lane.linger = Linger::Expired;
                            sched.pump(&key, &mut tasks, &shared);
                        }
                    }
                }
                Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    let (id, end) = match done {
                        Ok((id, end)) => (id, end),
                        Err(e) => {
                            // A bug in txinbox or an adapter, not in the handler (handler panics
                            // are caught). The delivery was dropped unsettled and will be
                            // redelivered; stop rather than run its lane out of order.
                            let error = SourceError::fatal(format!("message task failed: {e}"));
                            shared.fail(Error::Source(error));
                            (e.id(), scheduler::LaneEnd::Stopped(scheduler::Stop::for_good()))
                        }
                    };
                    if let Some(key) = sched.task_lanes.remove(&id) {
                        let lane = sched.lanes.get_mut(&key).expect("a running lane has a queue");
                        lane.running -= 1;
                        match &key {
                            Some(ordered) => match end {
                                scheduler::LaneEnd::Done => sched.pump(&key, &mut tasks, &shared),
                                scheduler::LaneEnd::Stopped(stop) => {
                                    // Queued behind the stop: dropped unsettled, unless the lane
                                    // was started over meanwhile (then it goes on from there).
                                    let queue = &mut lane.queue;
                                    match queue.iter().position(|i| stop.starts_over(&i.delivery)) {
                                        Some(k) => {
                                            queue.drain(..k);
                                            sched.pump(&key, &mut tasks, &shared);
                                        }
                                        None => {
                                            sched.lanes.remove(&key);
                                            sched.stopped_lanes.insert(ordered.clone(), stop);
                                        }
                                    }
                                }
                            },
                            _ => sched.pump(&key, &mut tasks, &shared),
                        }
                    }
                }
            }
        }

        if let Some(janitor) = janitor {
            janitor.stop().await;
        }
        let source = intake
            .await
            .map_err(|e| Error::Source(SourceError::fatal(format!("intake task failed: {e}"))))?;
        if let Err(e) = source.close().await {
            tracing::warn!(consumer = %shared.name, error = %e, "closing the source failed");
        }
        let fatal = shared.fatal.lock().unwrap().take();
        match fatal {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
