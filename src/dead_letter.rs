//! Dead letters: what the runtime gives a source to dead-letter ([`DeadLetter`]) and the
//! machine-readable reason ([`DeadLetterReason`]) recorded in the database and sent in the
//! broker's dead-letter headers.

use std::fmt;

/// Why and how a message was dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Machine-readable reason.
    pub reason: DeadLetterReason,
    /// Human-readable error, truncated.
    pub error: String,
}

/// Machine-readable dead-letter reasons. [`as_str`](DeadLetterReason::as_str) is what goes into
/// the database and the broker's dead-letter headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The handler returned a permanent error.
    Permanent,
    /// The handler failed transiently more often than the retry policy allows.
    AttemptsExhausted,
    /// The payload could not be decoded.
    Undecodable,
    /// The same message ID arrived with a different payload fingerprint.
    Conflict,
    /// No message ID could be derived under the configured strategy.
    MissingId,
    /// The derived message ID cannot be stored (too long, or contains NUL).
    InvalidId,
    /// Payload plus headers exceed the configured size limit.
    TooLarge,
    /// No [`Router`](crate::Router) route matched the message.
    NoHandler,
}

impl DeadLetterReason {
    /// The reason named by [`as_str`](Self::as_str), if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        [
            DeadLetterReason::Permanent,
            DeadLetterReason::AttemptsExhausted,
            DeadLetterReason::Undecodable,
            DeadLetterReason::Conflict,
            DeadLetterReason::MissingId,
            DeadLetterReason::InvalidId,
            DeadLetterReason::TooLarge,
            DeadLetterReason::NoHandler,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }

    /// The reason as stored and sent: `permanent_error`, `attempts_exhausted`, `undecodable`,
    /// `conflict`, `missing_id`, `invalid_id`, `too_large`, `no_handler`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::Permanent => "permanent_error",
            DeadLetterReason::AttemptsExhausted => "attempts_exhausted",
            DeadLetterReason::Undecodable => "undecodable",
            DeadLetterReason::Conflict => "conflict",
            DeadLetterReason::MissingId => "missing_id",
            DeadLetterReason::InvalidId => "invalid_id",
            DeadLetterReason::TooLarge => "too_large",
            DeadLetterReason::NoHandler => "no_handler",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::DeadLetterReason;

    #[test]
    fn every_reason_parses_back_from_its_stored_name() {
        for reason in [
            DeadLetterReason::Permanent,
            DeadLetterReason::AttemptsExhausted,
            DeadLetterReason::Undecodable,
            DeadLetterReason::Conflict,
            DeadLetterReason::MissingId,
            DeadLetterReason::InvalidId,
            DeadLetterReason::TooLarge,
            DeadLetterReason::NoHandler,
        ] {
            assert_eq!(DeadLetterReason::parse(reason.as_str()), Some(reason));
        }
        assert_eq!(DeadLetterReason::parse("permanent"), None);
    }
}
