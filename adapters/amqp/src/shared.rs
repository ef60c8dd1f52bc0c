//! What the source's supervisor and its deliveries share: the queue's names, settings and
//! metric labels ([`Shared`]), the connection generation a delivery belongs to ([`Generation`])
//! and the connection health ([`AmqpMonitor`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use lapin::types::ShortString;
use lapin::{Channel, Connection};

use crate::acks::Acks;

/// State shared by the source, its supervisor and every delivery.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) queue: Arc<str>,
    pub(crate) retry_queue: ShortString,
    pub(crate) dead_letter_queue: ShortString,
    pub(crate) lane_header: Option<String>,
    pub(crate) publish_timeout: Duration,
    pub(crate) requeue_delay: Duration,
    pub(crate) monitor: AmqpMonitor,
    /// Where the connection state is reported, once the consumer attached it.
    pub(crate) health: std::sync::OnceLock<txinbox::health::SourceHealth>,
    /// Queues copies go to that the broker says do not exist (with `declare_topology(false)`),
    /// one problem line each; reported to the health once it is attached.
    pub(crate) missing_queues: std::sync::Mutex<Vec<String>>,
    /// [`AmqpConfig::delivery_limit_or_default`](crate::AmqpConfig::delivery_limit_or_default).
    pub(crate) delivery_limit: u32,
}

/// The kind of problem the source reports for missing copy queues
/// ([`SourceHealth::set_problems`](txinbox::health::SourceHealth::set_problems)).
const MISSING_QUEUES: &str = "amqp-missing-queues";

impl Shared {
    /// The problem lines of missing copy queues now.
    pub(crate) fn missing_queues(&self) -> Vec<String> {
        self.missing_queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records the missing copy queues and reports them to the health, if attached.
    pub(crate) fn set_missing_queues(&self, lines: Vec<String>) {
        *self.missing_queues.lock().unwrap_or_else(|e| e.into_inner()) = lines;
        self.report_missing_queues();
    }

    /// Reports the missing copy queues to the health, if attached.
    pub(crate) fn report_missing_queues(&self) {
        if let Some(health) = self.health.get() {
            health.set_problems(MISSING_QUEUES, self.missing_queues());
        }
    }

    pub(crate) fn counter(
        &self,
        name: &'static str,
        labels: &[(&'static str, &'static str)],
    ) -> metrics::Counter {
        let mut all = vec![metrics::Label::new("queue", self.queue.to_string())];
        all.extend(labels.iter().map(|(k, v)| metrics::Label::new(*k, *v)));
        metrics::counter!(name, all)
    }
}

/// One connection + channel + consumer. Deliveries carry their generation; once it is marked
/// dead nothing is sent on its channel any more.
#[derive(Debug)]
pub(crate) struct Generation {
    pub(crate) id: u64,
    pub(crate) channel: Channel,
    pub(crate) alive: AtomicBool,
    /// The connection's negotiated `frame_max` (0: no limit): what a copy's properties must fit in.
    pub(crate) frame_max: u32,
    /// The connection, for opening [`copies`](Self::copies).
    pub(crate) connection: Weak<Connection>,
    /// The channel retry and dead-letter copies are published on, in confirm mode, opened when
    /// first needed and again after it closed. Not the consuming channel: a publish the broker
    /// refuses with a channel error (`ACCESS_REFUSED`, `max_message_size`) closes only this
    /// one, and the consumer, its deliveries and their acks carry on.
    ///
    /// Held from a copy's publish to its confirm. lapin pairs a `basic.return` with whichever
    /// confirm completes next, not with its own publish, so with several copies in flight an
    /// unroutable copy could be taken as confirmed and its original acked: one at a time.
    pub(crate) copies: tokio::sync::Mutex<Option<Channel>>,
    /// The channel's acknowledgements, coalesced; sent by the flusher task
    /// ([`acks::flush`](crate::acks::flush)) started with the generation.
    pub(crate) acks: Arc<Acks>,
}

impl Generation {
    pub(crate) fn new(id: u64, connection: &Arc<Connection>, channel: Channel) -> Generation {
        Generation {
            id,
            channel,
            alive: AtomicBool::new(true),
            frame_max: connection.configuration().frame_max(),
            connection: Arc::downgrade(connection),
            copies: tokio::sync::Mutex::new(None),
            acks: Arc::new(Acks::new()),
        }
    }

    pub(crate) fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst) && self.channel.status().connected()
    }

    /// The channel for copies, opened (in confirm mode) if there is none or it closed.
    pub(crate) async fn copy_channel(&self, slot: &mut Option<Channel>) -> Result<Channel, lapin::Error> {
        if let Some(channel) = slot.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        *slot = None;
        let connection = self.connection.upgrade().ok_or_else(|| {
            lapin::Error::from(lapin::ErrorKind::InvalidConnectionState(
                lapin::ConnectionState::Closed,
            ))
        })?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await?;
        *slot = Some(channel.clone());
        Ok(channel)
    }
}

/// Connection health of one [`AmqpSource`], for readiness checks and tests. Cheap to clone.
///
/// [`AmqpSource`]: crate::AmqpSource
#[derive(Debug, Clone, Default)]
pub struct AmqpMonitor {
    pub(crate) inner: Arc<MonitorState>,
}

#[derive(Debug, Default)]
pub(crate) struct MonitorState {
    pub(crate) connected: AtomicBool,
    pub(crate) generation: AtomicU64,
    pub(crate) reconnects: AtomicU64,
}

impl AmqpMonitor {
    /// Whether a consumer is registered on a live channel right now.
    pub fn is_connected(&self) -> bool {
        self.inner.connected.load(Ordering::SeqCst)
    }

    /// The current connection generation: 1 for the first connection, +1 per reconnect.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::SeqCst)
    }

    /// How many times the connection, channel or consumer was rebuilt.
    pub fn reconnects(&self) -> u64 {
        self.inner.reconnects.load(Ordering::SeqCst)
    }
}
