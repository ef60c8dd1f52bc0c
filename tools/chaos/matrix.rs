//! The crash matrix of one broker: each named crash point, random SIGKILLs, then a final run to
//! the end, stopped with SIGTERM.

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use txinbox::crash;

use crate::args::{Args, Phase};
use crate::brokers;
use crate::events::Plan;
use crate::process::{describe, died_of, tail, Ledger};
use crate::report::{PointResult, Report};
use crate::run::{finish, prepare, Chaos, Setup, GRACE, POLL};

/// A crash point counts as not reached once this many more messages than its `n` were applied
/// without an abort (a point on the batch path is hit once per batch of up to 100 messages,
/// and several lanes commit batches at once).
pub(crate) const NOT_REACHED_MARGIN: u64 = 1_000;
/// A crash-point run that finishes no event for this long (a restart after a kill included)
/// has nothing left to do: the point counts as not reached.
pub(crate) const STALL: Duration = Duration::from_secs(20);
/// Longest wait for one crash-point run.
pub(crate) const POINT_CAP: Duration = Duration::from_secs(60);
/// How long a rebalance takes at most once the second member started (a few session
/// timeouts).
pub(crate) const REBALANCE_CAP: Duration = Duration::from_secs(40);
/// Time left for the final run when random kills stop.
pub(crate) const FINAL_RESERVE: Duration = Duration::from_secs(20);
/// The final run may always take this long to drain, even past the budget.
pub(crate) const FINAL_MIN: Duration = Duration::from_secs(60);

/// One broker's crash matrix, random kills, final run and checks.
pub(crate) async fn run_source(
    args: &Args,
    source: &'static str,
    ledger: &Path,
    seed: u64,
    deadline: Instant,
) -> anyhow::Result<Report> {
    let setup = Setup {
        source,
        phase: Phase::Matrix,
        ledger,
        seed,
        partitions: brokers::PARTITIONS,
        database_url: &args.postgres.database_url,
        events: args.events,
    };
    let (mut chaos, plan) = prepare(args, setup).await?;
    chaos.run(args, &plan, deadline).await;
    Ok(finish(chaos, args).await)
}

impl Chaos {
    pub(crate) async fn run(&mut self, args: &Args, plan: &Plan, deadline: Instant) {
        if let Err(e) = self.matrix_and_kills(args, plan, deadline).await {
            self.report.failures.push(format!("{e:#}"));
            return;
        }
        if let Err(e) = self.check(plan).await {
            self.report.failures.push(format!("checking failed: {e:#}"));
        }
        let unreached: Vec<&str> = self
            .report
            .points
            .iter()
            .filter(|(_, r)| matches!(r, PointResult::NotReached { .. }))
            .map(|(p, _)| *p)
            .collect();
        let attempted = self
            .report
            .points
            .values()
            .filter(|r| !matches!(r, PointResult::NotApplicable))
            .count();
        for point in &unreached {
            if !args.allow_unreached.iter().any(|p| p == point) {
                let hint = if unreached.len() == attempted {
                    " (no point was reached: was the ledger built with --features crash-points?)"
                } else {
                    ""
                };
                self.report.failures.push(format!(
                    "crash point {point} was never reached{hint}; pass --allow-unreached {point} if this build has no such point"
                ));
            }
        }
    }

    pub(crate) async fn matrix_and_kills(
        &mut self,
        args: &Args,
        plan: &Plan,
        deadline: Instant,
    ) -> anyhow::Result<()> {
        let points = self.side.points();
        for point in crash::POINTS {
            self.report.points.insert(point, PointResult::NotApplicable);
        }
        // Each crash point gets a fresh share of the first wave, published just before its run:
        // the runtime batches, so one run can consume everything already published, and a
        // point must never find nothing left to process.
        // An even split: the first `extra` points get one more, so no point gets an empty share
        // while there are at least as many events as points.
        let (share, extra) = (
            plan.first_wave.len() / points.len(),
            plan.first_wave.len() % points.len(),
        );
        let mut rest = &plan.first_wave[..];
        for (i, point) in points.into_iter().enumerate() {
            let (chunk, after) = rest.split_at(share + usize::from(i < extra));
            rest = after;
            self.publish(chunk).await?;
            let fresh = chunk.iter().filter(|m| m.copy == 0).count() as u64;
            println!("   published {} messages for {point}", chunk.len());
            let result = if point == crash::REBALANCE {
                // The first revocation: the one the joining member causes.
                self.rebalance_run(1).await?
            } else {
                // The n-th hit: early enough that this share cannot run out before it. A point
                // on the batch path is hit once per batch (up to 100 messages), not per message.
                let most = (fresh / 100).clamp(1, 3) as u32;
                let nth = self.rng.u32(1..=most);
                self.point_run(point, nth).await?
            };
            let failed = match &result {
                PointResult::Failed(why) => Some(format!("crash point {point}: {why}")),
                _ => None,
            };
            self.report.points.insert(point, result);
            if let Some(why) = failed {
                anyhow::bail!(why);
            }
        }
        self.publish(&plan.second_wave).await?;
        println!("   published {} messages (second wave)", plan.second_wave.len());
        let mut kills = 0;
        while kills < args.random_kills && Instant::now() + FINAL_RESERVE < deadline {
            self.kill_run().await?;
            kills += 1;
        }
        self.final_run(deadline.max(Instant::now() + FINAL_MIN)).await
    }

    pub(crate) async fn point_run(&mut self, point: &'static str, nth: u32) -> anyhow::Result<PointResult> {
        let since = Instant::now();
        let before = self.db.finished().await;
        let mut what = format!("crash at {point}:{nth}");
        let mut ledger = self.start(&format!("crash-{point}"), Some(&format!("{point}:{nth}")))?;
        let mut idle_since: Option<Instant> = None;
        let mut progress = (0, Instant::now());
        let result = loop {
            tokio::time::sleep(POLL).await;
            let applied = self.db.finished().await.saturating_sub(before);
            if applied > progress.0 {
                progress = (applied, Instant::now());
            }
            if let Some(status) = ledger.exited()? {
                break self.ended(&ledger, status, nth, applied, point);
            }
            if self.all_finished().await {
                idle_since.get_or_insert_with(Instant::now);
            }
            let enough = applied >= u64::from(nth) + NOT_REACHED_MARGIN;
            let idle = idle_since.is_some_and(|t| t.elapsed() > Duration::from_secs(3));
            let stalled = progress.1.elapsed() > STALL;
            if enough || idle || stalled || ledger.age() > POINT_CAP {
                break match ledger.terminate(GRACE).await? {
                    // Reached while draining after SIGTERM: still a hit.
                    Some(status) if !status.success() => {
                        what.push_str(" +SIGTERM");
                        self.ended(&ledger, status, nth, applied, point)
                    }
                    Some(_) => PointResult::NotReached { applied },
                    None => PointResult::Failed(format!(
                        "did not stop within {GRACE:?} of SIGTERM; log {}",
                        ledger.log().display()
                    )),
                };
            }
        };
        self.line(&what, &result.to_string(), since);
        Ok(result)
    }

    /// Classifies the exit of a ledger armed with a crash point.
    pub(crate) fn ended(
        &mut self,
        ledger: &Ledger,
        status: std::process::ExitStatus,
        nth: u32,
        applied: u64,
        point: &str,
    ) -> PointResult {
        if died_of(status, Signal::SIGABRT) {
            self.report.aborts += 1;
            PointResult::Aborted { nth, applied }
        } else {
            PointResult::Failed(format!(
                "ended with {} instead of aborting at {point}; log {}:\n{}",
                describe(status),
                ledger.log().display(),
                tail(ledger.log(), 15)
            ))
        }
    }

    /// Kafka: a consuming member armed with `rebalance:<nth>` must abort while it gives up
    /// partitions to a second member that joins the group.
    pub(crate) async fn rebalance_run(&mut self, nth: u32) -> anyhow::Result<PointResult> {
        let since = Instant::now();
        let point = crash::REBALANCE;
        let before = self.db.finished().await;
        let mut victim = self.start("crash-rebalance", Some(&format!("{point}:{nth}")))?;
        let victim_run = self.launcher.started();
        // Let it take the partitions and consume a little first.
        let consuming = Instant::now();
        loop {
            tokio::time::sleep(POLL).await;
            let applied = self.db.finished().await.saturating_sub(before);
            if let Some(status) = victim.exited()? {
                let result = self.ended(&victim, status, nth, applied, point);
                self.line(
                    &format!("crash at {point}:{nth} (alone)"),
                    &result.to_string(),
                    since,
                );
                return Ok(result);
            }
            if applied >= 10 || self.all_finished().await || consuming.elapsed() > POINT_CAP {
                break;
            }
        }
        let mut joiner = self.start("rebalance-joiner", None)?;
        let joined = Instant::now();
        let result = loop {
            tokio::time::sleep(POLL).await;
            let applied = self.db.finished().await.saturating_sub(before);
            if let Some(status) = victim.exited()? {
                break self.ended(&victim, status, nth, applied, point);
            }
            if let Some(status) = joiner.exited()? {
                break PointResult::Failed(format!(
                    "the joining member ended with {}; log {}",
                    describe(status),
                    joiner.log().display()
                ));
            }
            if joined.elapsed() > REBALANCE_CAP {
                // Not during the join: stopping revokes too, but that is not the point here.
                victim.terminate(GRACE).await?;
                break PointResult::NotReached { applied };
            }
        };
        self.line_of(
            victim_run,
            &format!("crash at {point}:{nth} (2nd member)"),
            &result.to_string(),
            since,
        );
        // The joiner has just been handed every partition: kill it mid-stream too.
        let since = Instant::now();
        tokio::time::sleep(Duration::from_millis(self.rng.u64(500..2_500))).await;
        self.kill(&mut joiner, since, "SIGKILL the joiner").await?;
        Ok(result)
    }

    /// Starts a ledger and SIGKILLs it at a random moment once it consumes.
    pub(crate) async fn kill_run(&mut self) -> anyhow::Result<()> {
        let since = Instant::now();
        let before = self.db.finished().await;
        let mut ledger = self.start("sigkill", None)?;
        while ledger.age() < POINT_CAP {
            tokio::time::sleep(POLL).await;
            if ledger.exited()?.is_some() || self.db.finished().await > before || self.all_finished().await {
                break;
            }
        }
        let delay = Duration::from_millis(self.rng.u64(0..2_000));
        tokio::time::sleep(delay).await;
        let what = format!("SIGKILL after {} ms", delay.as_millis());
        self.kill(&mut ledger, since, &what).await
    }

    /// Runs a ledger until every event is finished and the broker is drained, then stops it
    /// with SIGTERM, which must end it with exit 0.
    pub(crate) async fn final_run(&mut self, deadline: Instant) -> anyhow::Result<()> {
        let since = Instant::now();
        let mut ledger = self.start("final", None)?;
        let mut drained_checks = 0;
        loop {
            tokio::time::sleep(POLL * 2).await;
            if let Some(status) = ledger.exited()? {
                anyhow::bail!(
                    "the final ledger ended by itself with {}; log {}:\n{}",
                    describe(status),
                    ledger.log().display(),
                    tail(ledger.log(), 15)
                );
            }
            let drained =
                self.all_finished().await && self.side.consumed(&self.db.pool).await.unwrap_or(false);
            drained_checks = if drained { drained_checks + 1 } else { 0 };
            if drained_checks >= 3 {
                break;
            }
            if Instant::now() > deadline {
                let finished = self.db.finished().await;
                self.report.failures.push(format!(
                    "not drained in time: {finished} of {} events finished (the unfinished ones are counted as lost below); log {}",
                    self.published,
                    ledger.log().display()
                ));
                break;
            }
        }
        let outcome = match ledger.terminate(GRACE).await? {
            Some(status) if status.success() => "drained, SIGTERM → exit 0".to_string(),
            Some(status) => {
                self.report.failures.push(format!(
                    "SIGTERM ended the final ledger with {}; log {}",
                    describe(status),
                    ledger.log().display()
                ));
                format!("FAILED: SIGTERM → {}", describe(status))
            }
            None => {
                self.report.failures.push(format!(
                    "the final ledger did not stop within {GRACE:?} of SIGTERM; log {}",
                    ledger.log().display()
                ));
                "FAILED: no exit after SIGTERM".into()
            }
        };
        self.line("final (until drained)", &outcome, since);
        Ok(())
    }
}
