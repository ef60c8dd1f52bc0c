//! [`RetryPolicy`]: how often and how late a transiently failing message is tried again;
//! [`Backoff`]: the exponential delay behind it and behind every other wait-and-retry in
//! txinbox and its adapters (an unavailable database, a lock conflict, a reconnect).

use std::time::Duration;

/// Exponential backoff with full jitter and a cap on attempts.
///
/// Attempt `n` (1-based) that fails transiently is retried after a random delay in
/// `[0, min(max_delay, initial_delay * 2^(n-1))]`, unless `n == max_attempts`, in which case the
/// message is dead-lettered with reason `attempts_exhausted`. A handler's own
/// [`retry_after`](crate::HandlerError::retry_after) is honoured as a lower bound, up to
/// `max_delay`.
///
/// Defaults: 10 attempts, 200 ms initial delay, 60 s maximum delay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial_delay: Duration,
    max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 10,
            initial_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// Total attempts, the first included, before a message is dead-lettered. At least 1.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Upper bound of the first retry's delay.
    pub fn initial_delay(mut self, d: Duration) -> Self {
        self.initial_delay = d;
        self
    }

    /// Upper bound of any retry's delay.
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.max_delay = d;
        self
    }

    /// Whether attempt number `attempt` (1-based) was the last one allowed.
    pub fn exhausted(&self, attempt: u32) -> bool {
        attempt >= self.max_attempts
    }

    /// Delay before the attempt after `attempt`, given the handler's requested minimum. A
    /// requested delay is honoured up to `max_delay`, never beyond: a handler asking for a day
    /// (or `Duration::MAX`) must not hold a Kafka partition, or a message, that long.
    pub fn delay(&self, attempt: u32, requested: Option<Duration>) -> Duration {
        let jittered = Backoff::new(self.initial_delay, self.max_delay).full_jitter(attempt);
        requested.map_or(jittered, |r| r.min(self.max_delay).max(jittered))
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.max_attempts == 0 {
            return Err("RetryPolicy::max_attempts must be at least 1 (the first attempt counts)".into());
        }
        if self.initial_delay > self.max_delay {
            return Err(format!(
                "RetryPolicy::initial_delay ({:?}) is above max_delay ({:?})",
                self.initial_delay, self.max_delay
            ));
        }
        Ok(())
    }
}

/// Exponential backoff: `initial` before the first retry, doubling with each further one, never
/// above `max`. Each user keeps its own numbers and picks its jitter.
///
/// ```
/// use std::time::Duration;
/// use txinbox::retry::Backoff;
///
/// let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
/// assert_eq!(backoff.ceiling(3), Duration::from_millis(400));
/// assert!(backoff.half_jitter(3) >= Duration::from_millis(200));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
}

impl Backoff {
    /// `initial` doubling to `max`.
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max }
    }

    /// The delay before retry `attempt` (1-based; 0 counts as 1), without jitter:
    /// `min(max, initial * 2^(attempt-1))`, never overflowing.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1).min(30);
        self.initial.saturating_mul(1u32 << shift).min(self.max)
    }

    /// A random delay in `[ceiling / 2, ceiling]`: grows like the ceiling, while waiters that
    /// failed together drift apart.
    pub fn half_jitter(&self, attempt: u32) -> Duration {
        self.ceiling(attempt).mul_f64(0.5 + fastrand::f64() / 2.0)
    }

    /// A random delay in `[0, ceiling]` ("full jitter"): spreads retries the most.
    pub fn full_jitter(&self, attempt: u32) -> Duration {
        self.ceiling(attempt).mul_f64(fastrand::f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_initial_to_max_and_jitters_below_the_ceiling() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let ceilings: Vec<u128> = (0..=6).map(|n| b.ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, [100, 100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1), "no overflow");
        let huge = Backoff::new(Duration::from_secs(u64::MAX / 2), Duration::MAX);
        assert_eq!(huge.ceiling(40), Duration::MAX, "saturates");
        for _ in 0..200 {
            let half = b.half_jitter(3);
            assert!((Duration::from_millis(200)..=Duration::from_millis(400)).contains(&half));
            assert!(b.full_jitter(3) <= Duration::from_millis(400));
        }
    }

    #[test]
    fn delays_are_jittered_below_the_ceiling() {
        let p = RetryPolicy::default()
            .initial_delay(Duration::from_millis(100))
            .max_delay(Duration::from_secs(1));
        let delays: Vec<_> = (0..200).map(|_| p.delay(3, None)).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(400)));
        assert!(
            delays.iter().any(|d| *d != delays[0]),
            "jitter must vary the delay"
        );
        assert!(p.delay(1, Some(Duration::from_millis(700))) >= Duration::from_millis(700));
    }

    #[test]
    fn a_requested_delay_is_honoured_up_to_max_delay() {
        let p = RetryPolicy::default().max_delay(Duration::from_secs(1));
        for requested in [Duration::from_secs(5), Duration::from_secs(86_400), Duration::MAX] {
            assert_eq!(
                p.delay(1, Some(requested)),
                Duration::from_secs(1),
                "{requested:?}"
            );
        }
    }

    #[test]
    fn exhaustion_and_validation() {
        let p = RetryPolicy::default().max_attempts(3);
        assert!(!p.exhausted(2));
        assert!(p.exhausted(3));
        assert!(RetryPolicy::default().max_attempts(0).validate().is_err());
        assert!(RetryPolicy::default()
            .initial_delay(Duration::from_secs(9))
            .max_delay(Duration::from_secs(1))
            .validate()
            .is_err());
    }
}
