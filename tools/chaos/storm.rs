//! The rebalance storm: three ledgers in one consumer group on a topic with six partitions,
//! SIGKILLed, stopped with SIGTERM and restarted at random while a producer keeps writing;
//! then every member drains and the run is checked like the crash matrix (nothing lost, nothing
//! doubled, nothing left unacknowledged).
//!
//! Each kill or stop makes the group rebalance (a killed member once its session times out), and
//! each restart again: the partitions move between members over and over while records arrive,
//! with offsets stored in the database and in the group. The figures (kills, stops, restarts,
//! the assignments and revocations the members logged, group stalls caused by the broker) are
//! printed under the summary.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::task::JoinHandle;

use crate::args::{Args, Phase};
use crate::events::Outgoing;
use crate::process::{describe, tail, Ledger};
use crate::report::Report;
use crate::run::{finish, prepare, Chaos, Setup, GRACE, POLL};
use crate::side::Side;

/// Members of the group.
const MEMBERS: usize = 3;
/// Partitions of the storm's topic: two per member.
const PARTITIONS: i32 = 6;
/// Per cent of the disruptions that are SIGKILLs; the rest are graceful stops (SIGTERM).
const KILL_PERCENT: u32 = 70;
/// Time between two disruptions, in milliseconds.
const BETWEEN: std::ops::Range<u64> = 1_000..3_500;
/// Time before a stopped member is started again, in milliseconds.
const RESTART_AFTER: std::ops::Range<u64> = 0..2_500;
/// How long a member runs before it may be stopped with SIGTERM. A SIGTERM in the first moments
/// after exec, before the ledger has installed its handler, ends the process by the signal's
/// default action (seen once: 0.1 s after a restart, an empty log), which says nothing about a
/// graceful stop; SIGKILLs still come at any moment.
const UP_BEFORE_SIGTERM: Duration = Duration::from_secs(2);
/// How long the members may take to drain once the churn is over.
const DRAIN_CAP: Duration = Duration::from_secs(90);
/// While draining, no event finished and no database position moved for this long, with all
/// members up: the group has stalled; the members' group-protocol logs say why.
const STALL: Duration = Duration::from_secs(15);
/// How often a stall the broker caused is recovered from (by moving the members to a new
/// group) before the storm gives up.
const MAX_RECOVERIES: u32 = 3;

/// Runs the storm on a fresh topic and database.
pub async fn run(args: &Args, ledger: &Path, seed: u64) -> anyhow::Result<Report> {
    let setup = Setup {
        source: "kafka",
        phase: Phase::Storm,
        ledger,
        seed,
        partitions: PARTITIONS,
        database_url: &args.postgres.database_url,
        events: args.storm_events,
    };
    let (mut chaos, plan) = prepare(args, setup).await?;
    // The group protocol in the members' logs: what a stalled group is waiting for.
    chaos.launcher.arg("--kafka-property=debug=cgrp".into());
    chaos.launcher.log_filter("info,librdkafka=debug");
    let messages: Vec<Outgoing> = plan.first_wave.iter().chain(&plan.second_wave).cloned().collect();
    let mut storm = Storm {
        members: (0..MEMBERS).map(|_| Member::default()).collect(),
        stopping: Vec::new(),
        kills: 0,
        stops: 0,
        restarts: 0,
        started: Instant::now(),
        stalled: false,
        broker_stalls: Vec::new(),
    };
    let outcome = storm.churn(&mut chaos, &messages, args).await;
    let outcome = match outcome {
        Ok(()) => storm.drain(&mut chaos).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(()) => {
            if let Err(e) = chaos.check(&plan).await {
                chaos.report.failures.push(format!("checking failed: {e:#}"));
            }
        }
        Err(e) => chaos.report.failures.push(format!("{e:#}")),
    }
    storm.stop_all(&mut chaos).await;
    let (assigned, revoked) = count_rebalances(chaos.launcher.logs());
    let r = &chaos.report;
    let stalled = if storm.stalled {
        "the group STALLED (the events it never consumed count as lost); "
    } else {
        ""
    };
    let broker_stalls = match storm.broker_stalls.len() {
        0 => String::new(),
        n => format!(
            "; {n} group stall(s) caused by the broker (tansu kept a departed member as the group's leader), each recovered by moving the members to a new group"
        ),
    };
    let figures = format!(
        "{stalled}{} events ({} messages) on {PARTITIONS} partitions, {MEMBERS} members: {} SIGKILLs, {} SIGTERMs, {} restarts, {assigned} assignments and {revoked} revocations logged by the members{broker_stalls}; {:.0} s; lost {}, doubled {}, unacked {}",
        plan.expected.events.len() + plan.expected.malformed.len(),
        plan.expected.messages,
        storm.kills,
        storm.stops,
        storm.restarts,
        storm.started.elapsed().as_secs_f64(),
        r.lost,
        r.doubled,
        r.unacked,
    );
    println!("   storm: {figures}");
    chaos.report.figures.push(figures);
    Ok(finish(chaos, args).await)
}

/// One place in the group.
#[derive(Default)]
struct Member {
    ledger: Option<Ledger>,
    /// When its ledger was started (`None` before the first start).
    started: Option<Instant>,
    /// When to start it again once it is down.
    restart_at: Option<Instant>,
}

/// A graceful stop in progress: the ledger and its exit status (`None`: killed after the grace).
type Stopping = JoinHandle<anyhow::Result<(Ledger, Option<std::process::ExitStatus>)>>;

struct Storm {
    members: Vec<Member>,
    /// Graceful stops in progress: the member, when it was asked, and the outcome.
    stopping: Vec<(usize, Instant, Stopping)>,
    kills: u32,
    stops: u32,
    restarts: u32,
    started: Instant,
    /// The drain found the group stalled for good.
    stalled: bool,
    /// Stalls caused by the broker (a departed member kept as the group's leader), each
    /// recovered from by moving the members to a new group.
    broker_stalls: Vec<String>,
}

impl Storm {
    /// Starts the members, then kills, stops and restarts them at random for
    /// `--storm-seconds` while publishing `messages` at an even pace.
    async fn churn(&mut self, chaos: &mut Chaos, messages: &[Outgoing], args: &Args) -> anyhow::Result<()> {
        let churn = Duration::from_secs(args.storm_seconds);
        // A tenth up front, so the first members have something to do while they join.
        let mut sent = messages.len() / 10;
        chaos.publish(&messages[..sent]).await?;
        for i in 0..MEMBERS {
            self.members[i].ledger = Some(chaos.start(&format!("storm-member{i}"), None)?);
            self.members[i].started = Some(Instant::now());
        }
        let begun = Instant::now();
        // The first disruption once the members have had time to join and consume.
        let mut next = Instant::now() + Duration::from_millis(chaos.rng.u64(2_000..4_000));
        let mut progress = (0, Instant::now());
        let mut looked = Instant::now();
        while begun.elapsed() < churn {
            tokio::time::sleep(POLL).await;
            // A group tansu has wedged consumes nothing for the rest of the churn: leave it.
            if looked.elapsed() > Duration::from_secs(1) {
                looked = Instant::now();
                let moved = Self::moved(chaos).await;
                if moved != progress.0 {
                    progress = (moved, Instant::now());
                }
                if progress.1.elapsed() > STALL && (self.broker_stalls.len() as u32) < MAX_RECOVERIES {
                    if let Some(why) = self.stale_leader(chaos) {
                        self.leave_wedged_group(chaos, why).await?;
                        progress.1 = Instant::now();
                    }
                }
            }
            let due = (sent as f64
                + (messages.len() - sent) as f64 * begun.elapsed().as_secs_f64() / churn.as_secs_f64())
                as usize;
            let due = due.min(messages.len());
            if due > sent {
                chaos.publish(&messages[sent..due]).await?;
                sent = due;
            }
            self.watch(chaos).await?;
            if Instant::now() >= next {
                self.disrupt(chaos).await?;
                next = Instant::now() + Duration::from_millis(chaos.rng.u64(BETWEEN));
            }
        }
        chaos.publish(&messages[sent..]).await?;
        println!("   published {} messages during the storm", messages.len());
        Ok(())
    }

    /// Restarts members whose time has come, collects finished graceful stops, and records a
    /// member that ended by itself as a failure (it is restarted like the others).
    async fn watch(&mut self, chaos: &mut Chaos) -> anyhow::Result<()> {
        let now = Instant::now();
        let mut i = 0;
        while i < self.stopping.len() {
            if !self.stopping[i].2.is_finished() {
                i += 1;
                continue;
            }
            let (member, since, handle) = self.stopping.swap_remove(i);
            let (ledger, status) = handle.await??;
            let outcome = match status {
                Some(s) if s.success() => "stopped, exit 0".to_string(),
                Some(s) => {
                    chaos.report.failures.push(format!(
                        "storm: SIGTERM ended member {member} with {}; log {}:\n{}",
                        describe(s),
                        ledger.log().display(),
                        tail(ledger.log(), 15)
                    ));
                    format!("FAILED: SIGTERM → {}", describe(s))
                }
                None => {
                    chaos.report.failures.push(format!(
                        "storm: member {member} did not stop within {GRACE:?} of SIGTERM; log {}",
                        ledger.log().display()
                    ));
                    "FAILED: no exit after SIGTERM".into()
                }
            };
            chaos.line(&format!("SIGTERM member {member}"), &outcome, since);
            self.members[member].restart_at = Some(now + Duration::from_millis(chaos.rng.u64(RESTART_AFTER)));
        }
        for (i, member) in self.members.iter_mut().enumerate() {
            if let Some(ledger) = &mut member.ledger {
                if let Some(status) = ledger.exited()? {
                    chaos.report.failures.push(format!(
                        "storm: member {i} ended by itself with {}; log {}:\n{}",
                        describe(status),
                        ledger.log().display(),
                        tail(ledger.log(), 15)
                    ));
                    chaos.line(
                        &format!("member {i} ended by itself"),
                        &format!("FAILED: {}", describe(status)),
                        now,
                    );
                    member.ledger = None;
                    member.restart_at = Some(now);
                }
            }
            if member.ledger.is_none() && member.restart_at.is_some_and(|t| t <= now) {
                member.ledger = Some(chaos.start(&format!("storm-member{i}"), None)?);
                member.started = Some(Instant::now());
                member.restart_at = None;
                self.restarts += 1;
            }
        }
        Ok(())
    }

    /// SIGKILLs or SIGTERMs one running member, chosen at random.
    async fn disrupt(&mut self, chaos: &mut Chaos) -> anyhow::Result<()> {
        let kill = chaos.rng.u32(0..100) < KILL_PERCENT;
        let running: Vec<usize> = (0..MEMBERS)
            .filter(|&i| {
                let m = &self.members[i];
                m.ledger.is_some() && (kill || m.started.is_some_and(|t| t.elapsed() >= UP_BEFORE_SIGTERM))
            })
            .collect();
        if running.is_empty() {
            return Ok(());
        }
        let i = running[chaos.rng.usize(..running.len())];
        let mut ledger = self.members[i].ledger.take().expect("a running member");
        let since = Instant::now();
        if kill {
            chaos
                .kill(&mut ledger, since, &format!("SIGKILL member {i}"))
                .await?;
            self.kills += 1;
            self.members[i].restart_at =
                Some(Instant::now() + Duration::from_millis(chaos.rng.u64(RESTART_AFTER)));
        } else {
            // Stopping gracefully drains and commits, which takes a moment: the storm goes on
            // meanwhile, and the member is started again once it has exited.
            self.stops += 1;
            let handle = tokio::spawn(async move {
                let status = ledger.terminate(GRACE).await?;
                Ok((ledger, status))
            });
            self.stopping.push((i, since, handle));
        }
        Ok(())
    }

    /// Brings every member up and waits until every event is finished and every partition's
    /// database position and group offset are at its end. A group that stops consuming is
    /// diagnosed from the members' group-protocol logs: when the broker keeps a departed member
    /// as the group's leader (tansu does, for good), the members move to a new group (at most
    /// [`MAX_RECOVERIES`] times in a storm); any other stall fails the run once the drain's
    /// time is up.
    async fn drain(&mut self, chaos: &mut Chaos) -> anyhow::Result<()> {
        let since = Instant::now();
        self.all_up(chaos).await?;
        let (mut assigned_before, _) = count_rebalances(chaos.launcher.logs());
        let mut progress = (0, Instant::now());
        let mut deadline = Instant::now() + DRAIN_CAP;
        let mut drained_checks = 0;
        let outcome = loop {
            tokio::time::sleep(POLL * 2).await;
            self.watch(chaos).await?;
            let drained =
                chaos.all_finished().await && chaos.side.consumed(&chaos.db.pool).await.unwrap_or(false);
            drained_checks = if drained { drained_checks + 1 } else { 0 };
            if drained_checks >= 3 {
                break "drained".to_string();
            }
            let Side::Kafka(kafka) = &chaos.side else {
                unreachable!("the storm runs on Kafka")
            };
            let positions = kafka.database_positions(&chaos.db.pool).await.unwrap_or_default();
            let moved = chaos.db.finished().await + positions.values().sum::<i64>() as u64;
            if moved != progress.0 {
                progress = (moved, Instant::now());
            }
            let stale_leader = if progress.1.elapsed() > STALL {
                self.stale_leader(chaos)
            } else {
                None
            };
            if let Some(why) = &stale_leader {
                if (self.broker_stalls.len() as u32) < MAX_RECOVERIES {
                    self.leave_wedged_group(chaos, why.clone()).await?;
                    (assigned_before, _) = count_rebalances(chaos.launcher.logs());
                    progress = (progress.0, Instant::now());
                    deadline = Instant::now() + DRAIN_CAP;
                    continue;
                }
            }
            if Instant::now() > deadline || stale_leader.is_some() {
                let finished = chaos.db.finished().await;
                let (assigned, _) = count_rebalances(chaos.launcher.logs());
                let behind: Vec<String> = kafka
                    .ends()
                    .iter()
                    .enumerate()
                    .filter_map(|(p, end)| {
                        let at = positions.get(&(p as i32)).copied().unwrap_or(0);
                        (at < *end).then(|| format!("{p}: {at} of {end}"))
                    })
                    .collect();
                let diagnosis = match &stale_leader {
                    Some(why) => format!("again after {MAX_RECOVERIES} moves to a new group: {why}"),
                    None => format!(
                        "the members logged {} partition assignments since the drain began; no departed leader in their group-protocol logs, so the members themselves may be stuck",
                        assigned - assigned_before
                    ),
                };
                self.stalled = progress.1.elapsed() > STALL;
                chaos.report.failures.push(format!(
                    "storm: not drained: {finished} of {} events finished{}; partitions behind (database position of end): {}; {diagnosis}; logs {}",
                    chaos.published,
                    if self.stalled {
                        format!(", nothing moved for {:.0} s (the group STALLED)", progress.1.elapsed().as_secs_f64())
                    } else {
                        String::new()
                    },
                    behind.join(", "),
                    chaos.launcher.logs().display()
                ));
                break if self.stalled { "STALLED" } else { "NOT drained" }.to_string();
            }
        };
        chaos.line("all members until drained", &outcome, since);
        Ok(())
    }

    /// tansu never forgets a departed leader, even once every member has left and joined
    /// again: the group is wedged for good. The members move to a new group, where they start
    /// every partition at its database position, as after any rebalance (the database, not the
    /// group, says what is done).
    async fn leave_wedged_group(&mut self, chaos: &mut Chaos, why: String) -> anyhow::Result<()> {
        let t = Instant::now();
        println!("   storm: the group stalled: {why}");
        self.broker_stalls.push(why);
        self.all_up(chaos).await?;
        self.stop_all(chaos).await;
        let Side::Kafka(kafka) = &mut chaos.side else {
            unreachable!("the storm runs on Kafka")
        };
        let group = kafka.move_group(&format!("after-stall{}", self.broker_stalls.len()));
        // On purpose, as an operator would (`txinbox positions rebind`): a consumer name is
        // tied to one group, and a source refuses to read through another.
        let topic = kafka.topic().to_owned();
        txinbox::ops::positions::rebind(
            &chaos.db.pool,
            &chaos.consumer_name(),
            txinbox::ops::positions::KAFKA,
            &topic,
            &group,
        )
        .await
        .context("recording the new group (txinbox.subscriptions)")?;
        chaos.launcher.replace_arg("--group=", format!("--group={group}"));
        self.all_up(chaos).await?;
        chaos.line(
            "group wedged by the broker",
            &format!("members moved to group {group}"),
            t,
        );
        Ok(())
    }

    /// Events finished plus the sum of the database positions: moves whenever the group
    /// consumes anything.
    async fn moved(chaos: &Chaos) -> u64 {
        let Side::Kafka(kafka) = &chaos.side else {
            unreachable!("the storm runs on Kafka")
        };
        let positions = kafka.database_positions(&chaos.db.pool).await.unwrap_or_default();
        chaos.db.finished().await + positions.values().sum::<i64>() as u64
    }

    /// Starts every member that is down (after any graceful stop in progress has ended).
    async fn all_up(&mut self, chaos: &mut Chaos) -> anyhow::Result<()> {
        while !self.stopping.is_empty() || self.members.iter().any(|m| m.ledger.is_none()) {
            for m in &mut self.members {
                if m.ledger.is_none() {
                    m.restart_at = Some(Instant::now());
                }
            }
            self.watch(chaos).await?;
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    /// When the latest JoinGroup responses of the running members (two at least) all name a
    /// leader that is none of them, the broker is waiting for a member that has left: nobody
    /// computes the assignment and the group never completes a rebalance (tansu 0.6 keeps a
    /// leader that stopped during a rebalance, past its session timeout; Apache Kafka elects
    /// another). Says which member that was.
    fn stale_leader(&self, chaos: &Chaos) -> Option<String> {
        let mut leaders = std::collections::BTreeSet::new();
        let mut live = std::collections::BTreeSet::new();
        let mut generation = String::new();
        let mut answered = 0;
        // The running members that have had a JoinGroup answer naming a leader (an error answer
        // names none; a member started a moment ago has had none yet): at least two must.
        for ledger in self.members.iter().filter_map(|m| m.ledger.as_ref()) {
            let text = std::fs::read_to_string(ledger.log()).unwrap_or_default();
            let Some(line) = text
                .lines()
                .rev()
                .find(|l| l.contains("JoinGroup response: GenerationId") && !l.contains("LeaderId ,"))
            else {
                continue;
            };
            leaders.insert(field(line, "LeaderId ")?);
            live.insert(field(line, "my MemberId ")?);
            generation = field(line, "GenerationId ")?;
            answered += 1;
        }
        if answered < 2 {
            return None;
        }
        let leader = match leaders.into_iter().collect::<Vec<_>>().as_slice() {
            [one] if !one.is_empty() && !live.contains(one) => one.clone(),
            _ => return None,
        };
        let mut holder = "a member this run did not start".to_string();
        for entry in std::fs::read_dir(chaos.launcher.logs())
            .into_iter()
            .flatten()
            .flatten()
        {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            if text.contains(&format!("my MemberId {leader},")) {
                let how = if text.contains("SIGTERM: stopping gracefully") {
                    "stopped with SIGTERM"
                } else {
                    "SIGKILLed"
                };
                holder = format!("{} ({how})", entry.file_name().to_string_lossy());
            }
        }
        Some(format!(
            "the running members' JoinGroup responses (generation {generation}) name {leader} the group's leader, a member that is gone: {holder}; with no live leader nobody assigns the partitions (a tansu group-coordinator bug: Apache Kafka elects a new leader)"
        ))
    }

    /// Stops every member with SIGTERM; each must exit 0.
    async fn stop_all(&mut self, chaos: &mut Chaos) {
        let since = Instant::now();
        let mut handles = Vec::new();
        for (i, m) in self.members.iter_mut().enumerate() {
            if let Some(mut ledger) = m.ledger.take() {
                handles.push((
                    i,
                    tokio::spawn(async move {
                        let status = ledger.terminate(GRACE).await;
                        (ledger, status)
                    }),
                ));
            }
        }
        for (i, _, handle) in self.stopping.drain(..) {
            handle.abort();
            chaos
                .report
                .failures
                .push(format!("storm: member {i} was still stopping at the end"));
        }
        let mut outcomes = Vec::new();
        for (i, handle) in handles {
            let Ok((ledger, status)) = handle.await else {
                continue;
            };
            match status {
                Ok(Some(s)) if s.success() => outcomes.push(format!("{i}: exit 0")),
                Ok(other) => {
                    let what = other.map_or("no exit".to_string(), describe);
                    chaos.report.failures.push(format!(
                        "storm: SIGTERM at the end ended member {i} with {what}; log {}",
                        ledger.log().display()
                    ));
                    outcomes.push(format!("{i}: FAILED {what}"));
                }
                Err(e) => chaos
                    .report
                    .failures
                    .push(format!("storm: stopping member {i}: {e:#}")),
            }
        }
        chaos.line("SIGTERM every member", &outcomes.join(", "), since);
    }
}

/// The text after `key` in a librdkafka log line, up to the next comma.
fn field(line: &str, key: &str) -> Option<String> {
    let rest = &line[line.find(key)? + key.len()..];
    Some(rest.split(',').next().unwrap_or("").trim().to_owned())
}

/// Assignments and revocations the members logged (the Kafka source logs one line for each).
fn count_rebalances(logs: &Path) -> (usize, usize) {
    let mut assigned = 0;
    let mut revoked = 0;
    for entry in std::fs::read_dir(logs).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        assigned += text.matches("partitions assigned").count();
        revoked += text.matches("partitions revoked").count();
    }
    (assigned, revoked)
}
