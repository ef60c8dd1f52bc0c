//! [`Acks`]: the acknowledgements of one consuming channel, coalesced. Settlements mark their
//! delivery tag in an [`AckTracker`]; one flusher task per channel ([`flush`]) sends what it
//! plans, `basic.ack(multiple = true)` for the settled prefix, and tells each settlement when
//! the frame that covers it went out (or why not).
//!
//! **What bounds the delay.** The flusher sends as soon as it is woken: acks coalesce while the
//! previous frame is being handed to the connection, so a lone settlement is not delayed, and a
//! batch settled together goes out in one frame. A settled tag behind one that is not settled
//! waits at most [`COALESCE_WINDOW`], then is acked alone; behind a delivery dropped unsettled it
//! does not wait. Each frame waits at most the source's `publish_timeout`.
//!
//! **Shutdown and loss.** [`end`](Acks::end) with [`Ending::Drain`] (the source closing) sends
//! every settled ack before the channel closes. [`Ending::Lost`] (the channel or connection
//! went away) sends nothing more: what was settled and not yet sent fails its `settle`, stays
//! unacknowledged and is redelivered; the inbox turns the redelivery into a duplicate.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::Channel;
use tokio::sync::{oneshot, Notify};

use crate::tracker::AckTracker;

/// How long a settled ack waits behind a delivery that is not settled yet (one processed by a
/// transaction that has not committed) before it is sent alone: about one batch transaction.
pub(crate) const COALESCE_WINDOW: Duration = Duration::from_millis(20);

/// What a settlement learns about its ack: sent, or why not (the settle error's words).
pub(crate) type Sent = Result<(), NotSent>;

/// Why an ack was not sent.
#[derive(Debug, Clone)]
pub(crate) enum NotSent {
    /// The channel was lost (or the source closed) before the ack went out.
    Lost,
    /// lapin refused or failed to send it.
    Error(String),
    /// Not handed to the connection within `publish_timeout`.
    Timeout,
}

/// How the flusher ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The source is closing: send every settled ack, then stop.
    Drain,
    /// The channel is gone: send nothing more.
    Lost,
}

struct State {
    tracker: AckTracker<oneshot::Sender<Sent>>,
    ending: Option<Ending>,
}

/// The acknowledgements of one consuming channel (one [`Generation`](crate::shared::Generation)).
pub(crate) struct Acks {
    state: Mutex<State>,
    wake: Notify,
}

impl std::fmt::Debug for Acks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acks").finish_non_exhaustive()
    }
}

impl Acks {
    pub(crate) fn new() -> Self {
        Acks {
            state: Mutex::new(State {
                tracker: AckTracker::new(COALESCE_WINDOW),
                ending: None,
            }),
            wake: Notify::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a delivery of this channel. `false` if its tag is not above the last one (never
    /// seen from RabbitMQ): then it must not be acked through here.
    pub(crate) fn receive(&self, tag: u64) -> bool {
        self.state().tracker.receive(tag)
    }

    /// Settles `tag` as an ack and waits until the frame that covers it was handed to the
    /// connection.
    pub(crate) async fn ack(&self, tag: u64) -> Sent {
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.state();
            if state.ending.is_some() {
                return Err(NotSent::Lost);
            }
            if state.tracker.settle(tag, Instant::now(), tx).is_err() {
                return Err(NotSent::Error(format!(
                    "delivery tag {tag} is not outstanding on this channel (already settled?)"
                )));
            }
        }
        self.wake.notify_one();
        rx.await.unwrap_or(Err(NotSent::Lost))
    }

    /// The delivery of `tag` was dropped unsettled: it stays unacknowledged.
    pub(crate) fn abandon(&self, tag: u64) {
        if self.state().tracker.abandon(tag) {
            self.wake.notify_one();
        }
    }

    /// Sends `basic.nack(tag, requeue)` on `channel` (which must be this one), then lets acks
    /// pass `tag`. The nack is handed to the channel before any multiple ack that covers the tag.
    pub(crate) async fn nack_requeue(&self, channel: &Channel, tag: u64, timeout: Duration) -> bool {
        let nack = channel.basic_nack(
            tag,
            BasicNackOptions {
                multiple: false,
                requeue: true,
            },
        );
        let sent = matches!(tokio::time::timeout(timeout, nack).await, Ok(Ok(())));
        if sent {
            self.state().tracker.release(tag);
            self.wake.notify_one();
        }
        sent
    }

    /// Ends the flusher: [`Ending::Drain`] sends what is settled first; [`Ending::Lost`] fails
    /// every waiting settlement now.
    pub(crate) fn end(&self, ending: Ending) {
        let mut state = self.state();
        if state.ending.is_none() {
            state.ending = Some(ending);
        }
        if ending == Ending::Lost {
            // Dropping the waiters' senders fails their settlements with `Lost`.
            state.tracker = AckTracker::new(COALESCE_WINDOW);
        }
        drop(state);
        self.wake.notify_one();
    }
}

/// The flusher of one channel: sends what the tracker plans until [`Acks::end`].
pub(crate) async fn flush(acks: Arc<Acks>, channel: Channel, publish_timeout: Duration) {
    loop {
        let (planned, ending, next_due) = {
            let mut state = acks.state();
            let now = Instant::now();
            let ending = state.ending;
            let planned = match ending {
                Some(Ending::Lost) => return,
                Some(Ending::Drain) => state.tracker.due(now, true),
                None => state.tracker.due(now, false),
            };
            (planned, ending, state.tracker.next_due(now))
        };
        let busy = !planned.is_empty();
        // One deadline for the whole plan: a settlement waits at most `publish_timeout` for its
        // frame, however many frames go before it (a connection that cannot write, e.g. under a
        // resource alarm, would otherwise cost one timeout per frame).
        let deadline = tokio::time::Instant::now() + publish_timeout;
        for ack in planned {
            let send = channel.basic_ack(
                ack.tag,
                BasicAckOptions {
                    multiple: ack.multiple,
                },
            );
            let sent = match tokio::time::timeout_at(deadline, send).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(NotSent::Error(e.to_string())),
                Err(_) => Err(NotSent::Timeout),
            };
            for waiter in ack.waiters {
                let _ = waiter.send(sent.clone());
            }
        }
        if ending == Some(Ending::Drain) {
            return;
        }
        if busy {
            continue;
        }
        match next_due {
            Some(at) => {
                tokio::select! {
                    _ = acks.wake.notified() => {}
                    _ = tokio::time::sleep_until(at.into()) => {}
                }
            }
            None => acks.wake.notified().await,
        }
    }
}
