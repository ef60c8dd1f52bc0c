//! Per-partition offset bookkeeping: which received offsets are settled, the highest contiguous
//! settled offset, and how many messages are buffered or in flight (for pause/resume).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

/// State of one received offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Received; in the hand-over channel or in the runtime.
    Pending,
    /// Settled: its transaction committed (or it was a duplicate, or its dead letter is
    /// confirmed).
    Done,
    /// Dropped without being settled: never done in this assignment.
    Abandoned,
}

/// Facts about one assignment of a partition that deliveries need after the partition's
/// tracker is gone (revoked).
#[derive(Debug)]
pub(crate) struct Generation {
    pub(crate) epoch: u64,
    /// The lowest offset dropped unsettled in this assignment, `i64::MAX` if none.
    abandoned_below: AtomicI64,
}

impl Generation {
    pub(crate) fn new(epoch: u64) -> Arc<Self> {
        Arc::new(Generation {
            epoch,
            abandoned_below: AtomicI64::new(i64::MAX),
        })
    }

    /// Whether an offset below `offset` was dropped unsettled in this assignment.
    pub(crate) fn has_hole_below(&self, offset: i64) -> bool {
        self.abandoned_below.load(Ordering::SeqCst) < offset
    }

    pub(crate) fn abandon(&self, offset: i64) {
        self.abandoned_below.fetch_min(offset, Ordering::SeqCst);
    }
}

/// One assigned partition.
#[derive(Debug)]
pub(crate) struct Partition {
    pub(crate) generation: Arc<Generation>,
    pub(crate) topic: Arc<str>,
    pub(crate) lane: Arc<str>,
    /// Set when a revocation started: nothing more is handed out.
    pub(crate) revoking: bool,
    /// Received offsets not yet folded into `done_next`, in receive (= offset) order.
    window: VecDeque<(i64, Slot)>,
    /// Highest received offset.
    last_received: Option<i64>,
    /// Highest contiguous settled offset + 1 (the position to store), if any progress.
    done_next: Option<i64>,
    /// The last position given to `store_offsets`.
    stored_next: Option<i64>,
    /// The last settled prefix stored as the database position by the source itself (key
    /// and unordered ordering: [`take_quiet_flush`](Self::take_quiet_flush)), or the database
    /// position the assignment started at.
    flushed_next: Option<i64>,
    /// When a record was last received or settled.
    last_activity: std::time::Instant,
    /// The furthest prefix handed to a transaction to store ([`prefix_to_store`](Self::prefix_to_store)).
    handed_next: Option<i64>,
    /// In the hand-over channel, not yet handed to the runtime.
    pub(crate) buffered: usize,
    /// Handed to the runtime and not yet settled or dropped.
    pub(crate) in_flight: usize,
    pub(crate) paused: bool,
    /// Held (assigned, paused, nothing handed out), and why. `Some(..)` while blocked.
    pub(crate) blocked: Option<Hold>,
}

/// Why a partition is held: assigned, paused, nothing of it handed out, until a position
/// written to the database releases it (see `assignment` and `retention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// The database has no position and the group has passed records of it
    /// ([`MissingPosition::Refuse`](crate::MissingPosition::Refuse)): the group's committed
    /// offset, `None` while it could not be read.
    MissingPosition { group_offset: Option<i64> },
    /// The database position is below the broker's low watermark: retention deleted records
    /// the consumer never processed ([`RetentionGap::Refuse`](crate::RetentionGap::Refuse)).
    /// `low` is `None` while the watermark could not be read (held until it can).
    BehindRetention { position: i64, low: Option<i64> },
}

impl Hold {
    /// One line for the health report: the partition, the cause and the way out.
    pub(crate) fn explain(&self, topic: &str, partition: i32, group: &str) -> String {
        match *self {
            Hold::MissingPosition { group_offset } => format!(
                "partition {topic}/{partition} held: the database has no position for it and consumer group {group:?} has committed offset {} (on_missing_position = refuse); write one with `txinbox positions set --to-earliest` or `txinbox positions adopt`",
                group_offset.map_or_else(|| "unknown (it could not be read yet)".to_owned(), |o| o.to_string())
            ),
            Hold::BehindRetention { position, low: Some(low) } => format!(
                "partition {topic}/{partition} held: its database position {position} is behind the broker's low watermark {low}: retention deleted {} records it never processed (on_retention_gap = refuse); accept the gap with `txinbox positions set --to-earliest`",
                low - position
            ),
            Hold::BehindRetention { position, low: None } => format!(
                "partition {topic}/{partition} held: its database position {position} could not be checked against the broker's low watermark yet (retrying)"
            ),
        }
    }
}

impl Partition {
    pub(crate) fn new(epoch: u64, topic: Arc<str>, partition: i32) -> Self {
        Partition {
            generation: Generation::new(epoch),
            lane: format!("{topic}/{partition}").into(),
            topic,
            revoking: false,
            window: VecDeque::new(),
            last_received: None,
            done_next: None,
            stored_next: None,
            flushed_next: None,
            last_activity: std::time::Instant::now(),
            handed_next: None,
            buffered: 0,
            in_flight: 0,
            paused: false,
            blocked: None,
        }
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.generation.epoch
    }

    /// Records a received offset. `false`: not newer than the last one (a replayed fetch);
    /// the message must be ignored.
    pub(crate) fn receive(&mut self, offset: i64) -> bool {
        if let Some(last) = self.last_received.filter(|last| offset <= *last) {
            // A re-fetch of what this assignment already received is harmless; anything else
            // (the log truncated and rewritten below what was read) deserves a look.
            tracing::warn!(
                topic = %self.topic,
                lane = %self.lane,
                offset,
                last,
                "ignoring an offset at or below one already received"
            );
            return false;
        }
        self.last_received = Some(offset);
        self.last_activity = std::time::Instant::now();
        self.window.push_back((offset, Slot::Pending));
        self.buffered += 1;
        true
    }

    /// A buffered message was handed to the runtime.
    pub(crate) fn hand_out(&mut self) {
        self.buffered = self.buffered.saturating_sub(1);
        self.in_flight += 1;
    }

    /// A buffered message was discarded without being handed out (revocation).
    pub(crate) fn discard_buffered(&mut self) {
        self.buffered = self.buffered.saturating_sub(1);
    }

    fn slot(&mut self, offset: i64) -> Option<&mut Slot> {
        let i = self.window.binary_search_by_key(&offset, |(o, _)| *o).ok()?;
        Some(&mut self.window[i].1)
    }

    /// Marks `offset` settled and advances the contiguous position.
    pub(crate) fn settle(&mut self, offset: i64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.last_activity = std::time::Instant::now();
        if let Some(slot @ Slot::Pending) = self.slot(offset) {
            *slot = Slot::Done;
        }
        while let Some((o, Slot::Done)) = self.window.front().copied() {
            self.window.pop_front();
            self.done_next = Some(o + 1);
        }
    }

    /// Marks `offset` dropped unsettled: the contiguous position never passes it in this
    /// assignment.
    pub(crate) fn abandon(&mut self, offset: i64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(slot @ Slot::Pending) = self.slot(offset) {
            *slot = Slot::Abandoned;
        }
        self.generation.abandon(offset);
    }

    /// Received and not settled: buffered plus in flight.
    pub(crate) fn unsettled(&self) -> usize {
        self.buffered + self.in_flight
    }

    /// Pause/resume with hysteresis: `Some(true)` to pause (at `high` messages tracked),
    /// `Some(false)` to resume (once down to `high / 2`), `None` to leave it as it is.
    ///
    /// Tracked: received and not yet behind the contiguous settled prefix, so unsettled ones
    /// and, under key or unordered ordering, those settled past a record still held (an
    /// in-place retry, a slow handler). Counting only the unsettled would let a held record
    /// keep the prefix (the stored position and offset) while the rest of the partition ran on
    /// and the window grew without bound; this way it runs on for `high` records at most.
    pub(crate) fn flow(&mut self, high: usize) -> Option<bool> {
        let unsettled = self.window.len().max(self.unsettled());
        if !self.paused && unsettled >= high {
            self.paused = true;
            Some(true)
        } else if self.paused && unsettled <= high / 2 {
            self.paused = false;
            Some(false)
        } else {
            None
        }
    }

    /// The assignment starts at `next`, a position below which every offset is done (the
    /// database position): it is the position to store until a later offset settles.
    pub(crate) fn start_at(&mut self, next: i64) {
        self.done_next = Some(next);
        self.flushed_next = Some(next);
    }

    /// A flush of `next` ([`take_quiet_flush`](Self::take_quiet_flush)) failed: the next quiet
    /// spell tries again.
    pub(crate) fn flush_failed(&mut self, next: i64) {
        if self.flushed_next == Some(next) {
            self.flushed_next = None;
        }
    }

    /// The settled prefix to store as the database position, once the partition has been
    /// quiet (nothing received unsettled, nothing received or settled) for `quiet`, if it moved
    /// past the last one flushed. Under key and unordered ordering each transaction stores a
    /// prefix that may trail what settled by its commit; this brings an idle partition's
    /// position to exactly where it is, at most once per quiet spell.
    pub(crate) fn take_quiet_flush(&mut self, quiet: std::time::Duration) -> Option<i64> {
        if self.unsettled() > 0 || self.last_activity.elapsed() < quiet {
            return None;
        }
        let next = self.done_next?;
        if self.flushed_next.is_some_and(|f| f >= next) {
            return None;
        }
        self.flushed_next = Some(next);
        Some(next)
    }

    /// The position to store, if it moved since the last call.
    pub(crate) fn take_store(&mut self) -> Option<i64> {
        let next = self.done_next?;
        if self.stored_next.is_some_and(|s| s >= next) {
            return None;
        }
        self.stored_next = Some(next);
        Some(next)
    }

    /// Where this member stands in the partition: the contiguous settled position (what the
    /// database holds), else the first offset received and not settled.
    pub(crate) fn position(&self) -> Option<i64> {
        self.done_next.or_else(|| self.window.front().map(|(o, _)| *o))
    }

    /// The highest contiguous settled offset + 1, if any.
    pub(crate) fn done_next(&self) -> Option<i64> {
        self.done_next
    }

    /// The position a transaction settling `offset` stores ([`prefix_with`](Self::prefix_with)),
    /// or `None` when a transaction was already handed that far or further: it stores as much
    /// (or, if it rolls back, the position trails, which costs only duplicates after a restart;
    /// the quiet flush catches up). Under key ordering most transactions of a partition would
    /// otherwise write the same value again, each on the partition's one position row, where
    /// their commits queue.
    pub(crate) fn prefix_to_store(&mut self, offset: i64) -> Option<i64> {
        let next = self.prefix_with(offset)?;
        if self.handed_next.is_some_and(|h| h >= next) {
            return None;
        }
        self.handed_next = Some(next);
        Some(next)
    }

    /// The contiguous settled prefix (as [`done_next`](Self::done_next)) if `offset`, a
    /// received offset not yet settled, were settled too: the position a transaction that
    /// settles `offset` may store. `None` while nothing before the prefix's end is known
    /// (no start position and the first received offset unsettled, `offset` aside).
    pub(crate) fn prefix_with(&self, offset: i64) -> Option<i64> {
        let mut next = self.done_next;
        // `window` starts at the first offset not yet folded into `done_next`: walk while each
        // is done or is `offset`.
        for &(o, slot) in &self.window {
            if slot == Slot::Done || o == offset {
                next = Some(o + 1);
            } else {
                break;
            }
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_position_waits_for_the_lowest_unsettled_offset() {
        let mut p = Partition::new(1, "t".into(), 0);
        for o in [5, 6, 8, 9] {
            assert!(p.receive(o));
            p.hand_out();
        }
        assert!(!p.receive(6), "an older offset is ignored");
        p.settle(6);
        assert_eq!(p.take_store(), None, "5 is not settled yet");
        p.settle(5);
        assert_eq!(p.take_store(), Some(7), "5 and 6 settled: next is 7");
        assert_eq!(p.take_store(), None, "unchanged");
        p.settle(9);
        p.settle(8);
        assert_eq!(
            p.take_store(),
            Some(10),
            "gaps in offsets (compaction, markers) are fine"
        );
        assert_eq!(p.unsettled(), 0);
    }

    #[test]
    fn a_database_start_position_is_stored_before_anything_settles() {
        let mut p = Partition::new(1, "t".into(), 0);
        p.start_at(40);
        assert_eq!(p.take_store(), Some(40), "stored although nothing new settled");
        assert_eq!(p.take_store(), None);
        assert!(p.receive(40));
        p.hand_out();
        p.settle(40);
        assert_eq!(p.take_store(), Some(41));
    }

    #[test]
    fn pause_at_the_high_mark_resume_at_half() {
        let mut p = Partition::new(1, "t".into(), 0);
        for o in 0..9 {
            p.receive(o);
            assert_eq!(p.flow(10), None);
        }
        p.receive(9);
        assert_eq!(p.flow(10), Some(true), "10 unsettled: pause");
        assert_eq!(p.flow(10), None, "stays paused");
        for o in 0..4 {
            p.hand_out();
            p.settle(o);
            assert_eq!(p.flow(10), None, "6..9 unsettled: still paused");
        }
        p.hand_out();
        p.settle(4);
        assert_eq!(p.flow(10), Some(false), "5 unsettled: resume");
        assert_eq!(p.flow(10), None);
    }

    /// Settlement out of order against the contiguous prefix (`Ordering::Key`, `Unordered`): a
    /// model of what each offset is, random receives (with gaps), settlements, abandonments and
    /// transactions computing the position they store. Checked at every step: a position
    /// offered with an offset never passes an offset that is neither settled nor that one; the
    /// stored position never passes an unsettled offset and never moves back; and once everything
    /// before a point is settled, the position reaches it (nothing settled is left behind).
    #[test]
    fn out_of_order_settlement_never_stores_past_an_unsettled_offset_and_reaches_every_settled_prefix() {
        #[derive(Clone, Copy, PartialEq, Debug)]
        enum Model {
            InFlight,
            Done,
            Dropped,
        }
        for seed in 0..500u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut p = Partition::new(1, "t".into(), 0);
            let start = rng.i64(0..50);
            if rng.bool() {
                p.start_at(start);
            }
            let mut model: Vec<(i64, Model)> = Vec::new();
            let mut next_offset = start;
            let mut stored: Option<i64> = None;
            let mut handed_max: Option<i64> = None;
            for step in 0..300 {
                let ctx = || format!("seed {seed} step {step}");
                match rng.u8(0..10) {
                    0..=3 => {
                        next_offset += 1 + rng.i64(0..3) * i64::from(rng.u8(0..4) == 0); // gaps: compaction, markers
                        assert!(p.receive(next_offset), "{}", ctx());
                        p.hand_out();
                        model.push((next_offset, Model::InFlight));
                    }
                    4..=7 => {
                        let open: Vec<usize> = (0..model.len())
                            .filter(|&i| model[i].1 == Model::InFlight)
                            .collect();
                        if open.is_empty() {
                            continue;
                        }
                        let i = open[rng.usize(..open.len())];
                        let offset = model[i].0;
                        // The transaction stores the prefix counting itself (if no other was handed
                        // as far), then commits, then settles.
                        let could = p.prefix_with(offset);
                        let handed = p.prefix_to_store(offset);
                        let expected = could.filter(|c| handed_max.is_none_or(|h| h < *c));
                        assert_eq!(
                            handed,
                            expected,
                            "{}: handed {handed:?}, furthest before {handed_max:?}, prefix {could:?}",
                            ctx()
                        );
                        if let Some(next) = handed {
                            handed_max = Some(next);
                        }
                        if let Some(next) = handed.or(p.prefix_with(offset)) {
                            for &(o, m) in &model {
                                if o < next {
                                    assert!(
                                        m == Model::Done || o == offset,
                                        "{}: position {next} offered with {offset} passes {o}, which is {m:?}",
                                        ctx()
                                    );
                                }
                            }
                        }
                        p.settle(offset);
                        model[i].1 = Model::Done;
                    }
                    8 => {
                        let open: Vec<usize> = (0..model.len())
                            .filter(|&i| model[i].1 == Model::InFlight)
                            .collect();
                        if open.is_empty() || rng.u8(0..4) != 0 {
                            continue;
                        }
                        let i = open[rng.usize(..open.len())];
                        p.abandon(model[i].0);
                        model[i].1 = Model::Dropped;
                    }
                    _ => {
                        if let Some(next) = p.take_store() {
                            assert!(
                                stored.is_none_or(|s| s < next),
                                "{}: stored position moved back",
                                ctx()
                            );
                            stored = Some(next);
                        }
                    }
                }
                // Safety: nothing unsettled below the contiguous prefix.
                if let Some(done) = p.done_next() {
                    for &(o, m) in &model {
                        assert!(
                            o >= done || m == Model::Done,
                            "{}: prefix {done} passes {o} ({m:?})",
                            ctx()
                        );
                    }
                }
                // Liveness: the prefix reaches the end of every run of settled offsets from the start.
                let settled_run = model.iter().take_while(|(_, m)| *m == Model::Done).last();
                if let Some(&(last, _)) = settled_run {
                    assert!(
                        p.done_next().is_some_and(|d| d > last),
                        "{}: {last} settled with everything before it, prefix {:?}",
                        ctx(),
                        p.done_next()
                    );
                }
            }
        }
    }

    #[test]
    fn a_held_record_pauses_the_partition_once_high_records_settled_past_it() {
        let mut p = Partition::new(1, "t".into(), 0);
        for o in 0..10 {
            p.receive(o);
            p.hand_out();
        }
        // Offset 0 is held (retrying in place); the other keys' records settle.
        for o in 1..10 {
            p.settle(o);
        }
        assert_eq!(p.unsettled(), 1);
        assert_eq!(p.flow(10), Some(true), "10 tracked behind the held record: pause");
        p.settle(0);
        assert_eq!(p.flow(10), Some(false), "the prefix passed them all: resume");
    }

    #[test]
    fn a_quiet_partition_flushes_its_settled_prefix_once() {
        let quiet = std::time::Duration::ZERO;
        let mut p = Partition::new(1, "t".into(), 0);
        p.start_at(10);
        assert_eq!(
            p.take_quiet_flush(quiet),
            None,
            "the start position is the database's already"
        );
        for o in 10..13 {
            p.receive(o);
            p.hand_out();
        }
        p.settle(11);
        p.settle(10);
        assert_eq!(p.take_quiet_flush(quiet), None, "12 is still in flight");
        p.settle(12);
        assert_eq!(
            p.take_quiet_flush(std::time::Duration::from_secs(60)),
            None,
            "not quiet for long enough"
        );
        assert_eq!(p.take_quiet_flush(quiet), Some(13));
        assert_eq!(p.take_quiet_flush(quiet), None, "once");
        p.flush_failed(13);
        assert_eq!(p.take_quiet_flush(quiet), Some(13), "again after a failed write");
    }

    #[test]
    fn an_abandoned_offset_blocks_the_position_and_marks_a_hole() {
        let mut p = Partition::new(1, "t".into(), 0);
        for o in 0..4 {
            p.receive(o);
            p.hand_out();
        }
        p.settle(0);
        p.abandon(1);
        p.settle(2);
        p.settle(3);
        assert_eq!(p.done_next(), Some(1));
        assert!(!p.generation.has_hole_below(1));
        assert!(p.generation.has_hole_below(2));
        assert_eq!(p.in_flight, 0);
    }
}
