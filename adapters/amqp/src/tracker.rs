//! Which delivery tags of one channel may be acknowledged now, and in how few `basic.ack`
//! frames: the acknowledgement side of what the Kafka adapter does with offsets
//! (`adapters/kafka/src/tracker.rs`), pure and synchronous so a model can check it (the
//! tests below).
//!
//! The broker keeps, per channel, the set of delivery tags it sent and that were neither acked
//! nor nacked (*outstanding*). `basic.ack(tag, multiple = true)` settles every outstanding tag
//! `≤ tag`, and the tag itself must be outstanding (else RabbitMQ closes the channel with
//! `PRECONDITION_FAILED - unknown delivery tag`). So:
//!
//! - The tracker mirrors the outstanding set: a tag enters on [`receive`](AckTracker::receive)
//!   and leaves when an ack covering it is planned ([`due`](AckTracker::due)) or when its nack
//!   was sent ([`release`](AckTracker::release)).
//! - A multiple ack is planned for the highest tag of the **settled prefix**: the outstanding
//!   tags from the lowest one up, as long as each is settled as an ack. A tag not settled (still
//!   processing, being copied to the retry or dead-letter queue, waiting for its requeue nack,
//!   or dropped unsettled) is a hole no multiple ack passes.
//! - A settled tag behind a hole waits at most the coalescing window for the hole to fill, then
//!   is acked alone (`multiple = false`). Behind a tag dropped unsettled, which will never fill,
//!   it does not wait.
//!
//! The caller sends what [`due`](AckTracker::due) plans, in order, on the channel the tags came
//! from, and nothing else that covers them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// State of one outstanding delivery tag.
#[derive(Debug)]
enum Slot<W> {
    /// Received, not settled: in the hand-over channel, in the runtime, or being copied.
    Pending,
    /// Settled as an ack at `at`; `waiter` learns when its ack was sent.
    Settled { at: Instant, waiter: W },
    /// Dropped without being settled: stays outstanding until the channel closes (the broker then
    /// redelivers it). A hole that never fills.
    Abandoned,
}

/// One `basic.ack` to send, and whose settlement it carries.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Ack<W> {
    pub(crate) tag: u64,
    /// `true`: every outstanding tag `≤ tag` (all of them settled, in `waiters`).
    pub(crate) multiple: bool,
    /// The waiters of the tags this ack covers.
    pub(crate) waiters: Vec<W>,
}

/// The outstanding delivery tags of one channel. `W` is what a settled tag's owner waits on
/// (a oneshot sender in the adapter, the tag itself in the model test).
#[derive(Debug)]
pub(crate) struct AckTracker<W> {
    outstanding: BTreeMap<u64, Slot<W>>,
    last_received: u64,
    window: Duration,
    /// No tag behind a hole is due before this (a lower bound; `None`: none waits).
    next_due: Option<Instant>,
    /// The abandoned tags still outstanding (usually none): nothing settled behind one waits.
    abandoned: BTreeSet<u64>,
    /// A tag behind an abandoned one was settled, or one was abandoned, since the last look
    /// behind the holes: one may be due now.
    rescan: bool,
}

impl<W> AckTracker<W> {
    /// A tracker whose settled tags wait at most `window` behind a hole.
    pub(crate) fn new(window: Duration) -> Self {
        AckTracker {
            outstanding: BTreeMap::new(),
            last_received: 0,
            window,
            next_due: None,
            abandoned: BTreeSet::new(),
            rescan: false,
        }
    }

    /// Records a delivered tag. The broker numbers a channel's deliveries 1, 2, 3, …; a tag not
    /// above the last one is refused (`false`) and must not be settled through this tracker.
    /// The broker still counts a refused tag outstanding, so it stays a hole that never fills
    /// (as if dropped): no multiple ack passes it, and the broker redelivers it when the
    /// channel closes.
    pub(crate) fn receive(&mut self, tag: u64) -> bool {
        if tag <= self.last_received {
            if tag != 0 && !self.outstanding.contains_key(&tag) {
                self.outstanding.insert(tag, Slot::Abandoned);
                self.abandoned.insert(tag);
                self.rescan = true;
            }
            return false;
        }
        self.last_received = tag;
        self.outstanding.insert(tag, Slot::Pending);
        true
    }

    /// Records that `tag` is settled as an ack at `now`. `Err(waiter)` if `tag` is not pending
    /// here (never received, already settled, released or abandoned): nothing is planned for it.
    pub(crate) fn settle(&mut self, tag: u64, now: Instant, waiter: W) -> Result<(), W> {
        match self.outstanding.get_mut(&tag) {
            Some(slot @ Slot::Pending) => {
                *slot = Slot::Settled { at: now, waiter };
                let due = now + self.window;
                self.next_due = Some(self.next_due.map_or(due, |d| d.min(due)));
                if self.abandoned.first().is_some_and(|first| *first < tag) {
                    self.rescan = true;
                }
                Ok(())
            }
            _ => Err(waiter),
        }
    }

    /// Records that `tag` was dropped unsettled: it stays outstanding, and settled tags behind
    /// it no longer wait for it. No effect (`false`) unless `tag` is pending.
    pub(crate) fn abandon(&mut self, tag: u64) -> bool {
        if let Some(slot @ Slot::Pending) = self.outstanding.get_mut(&tag) {
            *slot = Slot::Abandoned;
            self.abandoned.insert(tag);
            self.rescan = true;
            return true;
        }
        false
    }

    /// Records that a `basic.nack` (or `basic.reject`) for `tag` was sent: the broker no longer
    /// counts it outstanding, so acks may pass it. Call only after the nack was handed to the
    /// channel, so that it goes out before any ack planned afterwards. No effect if `tag` was
    /// settled as an ack (its ack is planned or sent) or is unknown.
    pub(crate) fn release(&mut self, tag: u64) {
        if matches!(self.outstanding.get(&tag), Some(Slot::Pending | Slot::Abandoned)) {
            self.outstanding.remove(&tag);
            self.abandoned.remove(&tag);
        }
    }

    /// Whether any settled tag waits to be acked.
    #[cfg(test)]
    pub(crate) fn owes(&self) -> bool {
        self.outstanding
            .values()
            .any(|s| matches!(s, Slot::Settled { .. }))
    }

    /// When the next settled tag behind a hole is due (a lower bound), if any waits; `now`
    /// if one may be due already.
    pub(crate) fn next_due(&self, now: Instant) -> Option<Instant> {
        if self.rescan {
            return Some(now);
        }
        self.next_due
    }

    /// The acks to send now, in this order: one (multiple when it covers more than one tag) for
    /// the settled prefix, then one single ack per settled tag behind a hole that waited the
    /// window, or is behind an abandoned tag, or every settled tag if `force` (shutdown). The
    /// tags planned leave the outstanding set.
    pub(crate) fn due(&mut self, now: Instant, force: bool) -> Vec<Ack<W>> {
        let mut acks = Vec::new();
        // The settled prefix.
        let mut prefix = Vec::new();
        let mut top = None;
        while let Some(entry) = self.outstanding.first_entry() {
            if !matches!(entry.get(), Slot::Settled { .. }) {
                break;
            }
            let (tag, slot) = entry.remove_entry();
            if let Slot::Settled { waiter, .. } = slot {
                prefix.push(waiter);
            }
            top = Some(tag);
        }
        if let Some(tag) = top {
            acks.push(Ack {
                tag,
                multiple: prefix.len() > 1,
                waiters: prefix,
            });
        }
        // Behind the first hole: only when one may be due.
        if !force && !self.rescan && self.next_due.is_none_or(|due| now < due) {
            return acks;
        }
        self.rescan = false;
        let mut next_due: Option<Instant> = None;
        let mut behind_abandoned = false;
        let mut send = Vec::new();
        for (tag, slot) in &self.outstanding {
            match slot {
                Slot::Pending => {}
                Slot::Abandoned => behind_abandoned = true,
                Slot::Settled { at, .. } => {
                    let due = *at + self.window;
                    if force || behind_abandoned || due <= now {
                        send.push(*tag);
                    } else {
                        next_due = Some(next_due.map_or(due, |d| d.min(due)));
                    }
                }
            }
        }
        self.next_due = next_due;
        for tag in send {
            if let Some(Slot::Settled { waiter, .. }) = self.outstanding.remove(&tag) {
                acks.push(Ack {
                    tag,
                    multiple: false,
                    waiters: vec![waiter],
                });
            }
        }
        acks
    }
}

#[cfg(test)]
mod tests {
    //! A model of the broker's outstanding set checks every plan of the tracker over many random
    //! sequences of receive / settle / nack / drop / time passing / flush, in arbitrary order.

    use super::*;

    const WINDOW: Duration = Duration::from_millis(20);

    /// The broker's side of one channel, and what the application did with each tag.
    #[derive(Default)]
    struct Model {
        /// Delivered, neither acked nor nacked on the broker.
        unacked: BTreeSet<u64>,
        /// Received by the application and not yet settled, nacked or dropped.
        pending: Vec<u64>,
        /// Settled as an ack, with when.
        settled: BTreeMap<u64, Instant>,
        /// Dropped unsettled.
        abandoned: BTreeSet<u64>,
        next_tag: u64,
        acks_sent: usize,
        tags_acked: usize,
    }

    impl Model {
        /// Sends `acks` to the broker model, checking each against what the application settled.
        fn send(&mut self, acks: Vec<Ack<u64>>, seed: u64, step: usize) {
            for ack in acks {
                assert!(
                    self.unacked.contains(&ack.tag),
                    "seed {seed} step {step}: ack of tag {} that is not outstanding (the broker closes the channel: unknown delivery tag)",
                    ack.tag
                );
                let covered: BTreeSet<u64> = if ack.multiple {
                    self.unacked.range(..=ack.tag).copied().collect()
                } else {
                    BTreeSet::from([ack.tag])
                };
                for tag in &covered {
                    assert!(
                        self.settled.contains_key(tag),
                        "seed {seed} step {step}: ack {ack:?} covers tag {tag}, which is not settled"
                    );
                }
                let waiters: BTreeSet<u64> = ack.waiters.iter().copied().collect();
                assert_eq!(
                    waiters, covered,
                    "seed {seed} step {step}: the ack's waiters are exactly the tags it covers"
                );
                assert_eq!(waiters.len(), ack.waiters.len(), "each waiter once");
                if !ack.multiple {
                    assert_eq!(covered.len(), 1);
                }
                for tag in &covered {
                    self.unacked.remove(tag);
                }
                self.acks_sent += 1;
                self.tags_acked += covered.len();
            }
        }

        /// Settled tags still unacked after a plan at `now`, and whether that is allowed.
        fn check_bound(&self, now: Instant, force: bool, seed: u64, step: usize) {
            for (tag, at) in &self.settled {
                if !self.unacked.contains(tag) {
                    continue;
                }
                assert!(
                    !force,
                    "seed {seed} step {step}: settled tag {tag} still unacked after a forced flush"
                );
                assert!(
                    now < *at + WINDOW,
                    "seed {seed} step {step}: settled tag {tag} waited past the window"
                );
                let first_hole = self.unacked.iter().find(|t| !self.settled.contains_key(t));
                let hole = first_hole.expect("a settled tag left unacked is behind a hole");
                assert!(
                    hole < tag,
                    "seed {seed} step {step}: tag {tag} was in the settled prefix"
                );
                assert!(
                    !self.abandoned.range(..tag).any(|a| self.unacked.contains(a)),
                    "seed {seed} step {step}: tag {tag} waited behind a dropped tag"
                );
            }
        }
    }

    /// One random sequence of `steps`; with `drops`, some deliveries are dropped unsettled.
    /// Returns the acks sent and the tags they covered.
    fn run(seed: u64, steps: usize, drops: bool) -> (usize, usize) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut tracker = AckTracker::<u64>::new(WINDOW);
        let mut model = Model {
            next_tag: 1,
            ..Model::default()
        };
        let start = Instant::now();
        let mut now = start;
        for step in 0..steps {
            match rng.u32(0..100) {
                // Deliveries arrive in bursts, up to a prefetch of 64.
                0..=29 if model.pending.len() < 64 => {
                    for _ in 0..rng.usize(1..8) {
                        let tag = model.next_tag;
                        model.next_tag += 1;
                        assert!(tracker.receive(tag));
                        model.unacked.insert(tag);
                        model.pending.push(tag);
                    }
                }
                // Settled as an ack, in any order: mostly among the oldest, as transactions that
                // took deliveries in order commit; sometimes any.
                30..=64 if !model.pending.is_empty() => {
                    let n = model.pending.len();
                    let i = if rng.bool() {
                        rng.usize(..n.min(8))
                    } else {
                        rng.usize(..n)
                    };
                    let tag = model.pending.remove(i);
                    assert_eq!(tracker.settle(tag, now, tag), Ok(()));
                    model.settled.insert(tag, now);
                }
                // Requeued: the nack goes out first, then the tracker is told.
                65..=69 if !model.pending.is_empty() => {
                    let tag = model.pending.remove(rng.usize(..model.pending.len()));
                    assert!(
                        model.unacked.remove(&tag),
                        "seed {seed} step {step}: nack of tag {tag}, already acked"
                    );
                    tracker.release(tag);
                }
                // Dropped unsettled (rare: a stopped lane, shutdown).
                70..=71 if drops && !model.pending.is_empty() => {
                    let tag = model.pending.remove(rng.usize(..model.pending.len()));
                    tracker.abandon(tag);
                    model.abandoned.insert(tag);
                }
                // A duplicate settle or a tag from elsewhere is refused.
                72 => {
                    let tag = rng.u64(0..model.next_tag + 3);
                    if !model.pending.contains(&tag) {
                        assert_eq!(tracker.settle(tag, now, tag), Err(tag));
                    }
                }
                // Time passes.
                73..=84 => now += Duration::from_micros(rng.u64(0..30_000)),
                // The flusher runs.
                85..=97 => {
                    let acks = tracker.due(now, false);
                    model.send(acks, seed, step);
                    model.check_bound(now, false, seed, step);
                }
                // Shutdown's flush.
                _ => {
                    let acks = tracker.due(now, true);
                    model.send(acks, seed, step);
                    model.check_bound(now, true, seed, step);
                    assert!(!tracker.owes());
                }
            }
            // The flusher sleeps until `next_due`: never past a settled tag's deadline (or, if
            // that passed, not at all).
            let due = tracker.next_due(now);
            for (tag, at) in &model.settled {
                if model.unacked.contains(tag) {
                    assert!(
                        due.is_some_and(|due| due <= (*at + WINDOW).max(now)),
                        "seed {seed} step {step}: tag {tag} would wait past its deadline ({due:?})"
                    );
                }
            }
        }
        let acks = tracker.due(now, true);
        model.send(acks, seed, steps);
        model.check_bound(now, true, seed, steps);
        // Everything settled as an ack was acked (check_bound); what was not settled is still
        // outstanding, to be redelivered when the channel closes.
        for tag in model.abandoned.iter().chain(&model.pending) {
            assert!(
                model.unacked.contains(tag),
                "seed {seed}: unsettled tag {tag} is not outstanding"
            );
        }
        (model.acks_sent, model.tags_acked)
    }

    #[test]
    fn out_of_order_settlement_never_acks_an_unsettled_tag_and_leaves_nothing_settled_unacked() {
        for seed in 0..1000 {
            run(seed, 400, seed % 2 == 0);
        }
    }

    /// What it is for: 8 transactions of 50 deliveries each, taken in order, committing in any
    /// order within the window, cost one frame each at most, not 50.
    #[test]
    fn batches_committing_out_of_order_cost_a_frame_each_at_most() {
        let mut rng = fastrand::Rng::with_seed(29);
        let t0 = Instant::now();
        let mut tracker = AckTracker::<u64>::new(WINDOW);
        let (mut frames, mut tags) = (0, 0);
        for round in 0..20u64 {
            let first = round * 400 + 1;
            for tag in first..first + 400 {
                assert!(tracker.receive(tag));
            }
            let mut batches: Vec<u64> = (0..8).collect();
            rng.shuffle(&mut batches);
            for b in batches {
                for tag in first + b * 50..first + (b + 1) * 50 {
                    tracker.settle(tag, t0, tag).unwrap();
                }
                let acks = tracker.due(t0, false);
                frames += acks.len();
                tags += acks.iter().map(|a| a.waiters.len()).sum::<usize>();
            }
        }
        assert_eq!(
            tags,
            20 * 400,
            "all acked once the last batch of each round committed"
        );
        assert!(frames <= 20 * 8, "{frames} frames for {tags} tags");
    }

    #[test]
    fn a_settled_prefix_is_one_multiple_ack_and_a_tag_behind_a_hole_waits_the_window() {
        let t0 = Instant::now();
        let mut tracker = AckTracker::<u64>::new(WINDOW);
        for tag in 1..=5 {
            assert!(tracker.receive(tag));
        }
        assert!(!tracker.receive(5), "tags only grow");
        for tag in [2, 1, 4] {
            tracker.settle(tag, t0, tag).unwrap();
        }
        assert_eq!(
            tracker.due(t0, false),
            vec![Ack {
                tag: 2,
                multiple: true,
                waiters: vec![1, 2]
            }],
            "1 and 2 in one frame; 4 waits for 3"
        );
        assert_eq!(tracker.due(t0 + WINDOW / 2, false), vec![]);
        assert_eq!(
            tracker.due(t0 + WINDOW, false),
            vec![Ack {
                tag: 4,
                multiple: false,
                waiters: vec![4]
            }],
            "alone once the window passed"
        );
        // 3 is requeued (nack sent), 5 settled: 5 is the prefix now.
        tracker.release(3);
        tracker.settle(5, t0, 5).unwrap();
        assert_eq!(
            tracker.due(t0, false),
            vec![Ack {
                tag: 5,
                multiple: false,
                waiters: vec![5]
            }]
        );
    }

    #[test]
    fn nothing_waits_behind_a_dropped_delivery() {
        let t0 = Instant::now();
        let mut tracker = AckTracker::<u64>::new(WINDOW);
        for tag in 1..=3 {
            tracker.receive(tag);
        }
        tracker.abandon(1);
        tracker.settle(3, t0, 3).unwrap();
        tracker.settle(2, t0, 2).unwrap();
        let acks = tracker.due(t0, false);
        assert_eq!(
            acks.iter().map(|a| (a.tag, a.multiple)).collect::<Vec<_>>(),
            [(2, false), (3, false)]
        );
        tracker.release(1);
        assert!(!tracker.owes());
    }

    /// A tag out of order (a lapin or broker bug) is refused, yet the broker counts it
    /// outstanding: no multiple ack may pass it.
    #[test]
    fn a_tag_out_of_order_is_a_hole_no_multiple_ack_passes() {
        let t0 = Instant::now();
        let mut tracker = AckTracker::<u64>::new(WINDOW);
        assert!(tracker.receive(1));
        assert!(tracker.receive(3));
        assert!(
            !tracker.receive(2),
            "refused: it cannot be settled through the tracker"
        );
        assert!(tracker.settle(2, t0, 2).is_err());
        tracker.settle(1, t0, 1).unwrap();
        tracker.settle(3, t0, 3).unwrap();
        let acks = tracker.due(t0 + WINDOW, true);
        assert_eq!(
            acks.iter().map(|a| (a.tag, a.multiple)).collect::<Vec<_>>(),
            [(1, false), (3, false)],
            "ack(3, multiple) would cover tag 2, still in its handler"
        );
    }
}
