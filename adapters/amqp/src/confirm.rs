//! Waiting for a publisher confirm, once for every publish that needs one (the retry and
//! dead-letter copies of [`AmqpDelivery`](crate::AmqpDelivery), the outbox rows of
//! [`AmqpPublisher`](crate::AmqpPublisher), the `txinbox` CLI's requeue): [`confirmed`] is `Ok`
//! only for a positive confirm of a routed message; anything else is an [`Unconfirmed`] saying
//! why.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use lapin::types::{ReplyCode, ShortString};
use lapin::Confirmation;

/// Why a publish was not confirmed as routed. `Display` words each case; a caller that knows
/// the destination words [`Returned`](Unconfirmed::Returned) itself (what to check).
#[derive(Debug)]
pub enum Unconfirmed {
    /// Confirmed, but returned by the broker as unroutable (`mandatory`).
    Returned {
        /// The broker's reply code (312 `NO_ROUTE`).
        reply_code: ReplyCode,
        /// The broker's reply text.
        reply_text: ShortString,
    },
    /// Negatively confirmed by the broker.
    Nack,
    /// The channel is not in confirm mode.
    NotRequested,
    /// The publish or the wait for its confirm failed (channel or connection lost, …).
    Failed(lapin::Error),
    /// No confirm within the given time.
    TimedOut(Duration),
}

impl Unconfirmed {
    /// The `cause` label of [`PUBLISH_FAILURES`](crate::telemetry::PUBLISH_FAILURES).
    pub(crate) fn cause(&self) -> &'static str {
        match self {
            Unconfirmed::Returned { .. } => "unroutable",
            Unconfirmed::Nack => "nack",
            Unconfirmed::NotRequested | Unconfirmed::Failed(_) => "error",
            Unconfirmed::TimedOut(_) => "timeout",
        }
    }

    /// What went wrong, for an error message. A returned message is described by `returned`
    /// from its reply code and text: each caller says what to check for its destination.
    pub(crate) fn detail(&self, returned: impl FnOnce(ReplyCode, &ShortString) -> String) -> String {
        match self {
            Unconfirmed::Returned {
                reply_code,
                reply_text,
            } => returned(*reply_code, reply_text),
            Unconfirmed::TimedOut(_) => format!("{self} (publish_timeout)"),
            _ => self.to_string(),
        }
    }
}

impl fmt::Display for Unconfirmed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unconfirmed::Returned {
                reply_code,
                reply_text,
            } => write!(f, "returned by the broker ({reply_code} {reply_text})"),
            Unconfirmed::Nack => f.write_str("negatively confirmed by the broker"),
            Unconfirmed::NotRequested => f.write_str("publisher confirms are off"),
            Unconfirmed::Failed(e) => write!(f, "{e}"),
            Unconfirmed::TimedOut(limit) => write!(f, "no confirm within {limit:?}"),
        }
    }
}

impl std::error::Error for Unconfirmed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Unconfirmed::Failed(e) => Some(e),
            _ => None,
        }
    }
}

/// Waits at most `timeout` for `publish` (a `basic.publish` on a channel in confirm mode, with
/// `mandatory` set so an unroutable message comes back, and then its
/// [`PublisherConfirm`](lapin::PublisherConfirm)). `Ok` only for a positive confirm without a
/// returned message.
pub async fn confirmed(
    timeout: Duration,
    publish: impl Future<Output = lapin::Result<Confirmation>>,
) -> Result<(), Unconfirmed> {
    match tokio::time::timeout(timeout, publish).await {
        Ok(Ok(Confirmation::Ack(None))) => Ok(()),
        Ok(Ok(Confirmation::Ack(Some(returned)))) => Err(Unconfirmed::Returned {
            reply_code: returned.reply_code,
            reply_text: returned.reply_text,
        }),
        Ok(Ok(Confirmation::Nack(_))) => Err(Unconfirmed::Nack),
        Ok(Ok(Confirmation::NotRequested)) => Err(Unconfirmed::NotRequested),
        Ok(Err(e)) => Err(Unconfirmed::Failed(e)),
        Err(_) => Err(Unconfirmed::TimedOut(timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::message::{BasicReturnMessage, Delivery};

    const LIMIT: Duration = Duration::from_millis(20);

    fn returned(reply_code: ReplyCode, reply_text: &str) -> BasicReturnMessage {
        BasicReturnMessage {
            delivery: Delivery::mock(1, "".into(), "q".into(), false, b"p".to_vec()),
            reply_code,
            reply_text: reply_text.into(),
        }
    }

    /// The outcome of a publish that resolves at once to `answer`: (`cause` label, detail).
    async fn outcome(answer: lapin::Result<Confirmation>) -> Option<(&'static str, String)> {
        let unconfirmed = confirmed(LIMIT, async { answer }).await.err()?;
        let detail = unconfirmed.detail(|code, text| format!("returned: {code} {text}"));
        Some((unconfirmed.cause(), detail))
    }

    #[tokio::test]
    async fn only_a_positive_confirm_of_a_routed_message_is_confirmed() {
        assert_eq!(outcome(Ok(Confirmation::Ack(None))).await, None);
        assert_eq!(
            outcome(Ok(Confirmation::Ack(Some(returned(312, "NO_ROUTE"))))).await,
            Some(("unroutable", "returned: 312 NO_ROUTE".to_string())),
            "the caller words a returned message"
        );
        let nack = Some(("nack", "negatively confirmed by the broker".to_string()));
        assert_eq!(outcome(Ok(Confirmation::Nack(None))).await, nack);
        assert_eq!(
            outcome(Ok(Confirmation::Nack(Some(returned(312, "NO_ROUTE"))))).await,
            nack,
            "a nack is a nack, returned or not"
        );
        assert_eq!(
            outcome(Ok(Confirmation::NotRequested)).await,
            Some(("error", "publisher confirms are off".to_string()))
        );
        let error = lapin::Error::from(lapin::ErrorKind::ChannelsLimitReached);
        let text = error.to_string();
        assert_eq!(outcome(Err(error)).await, Some(("error", text)));
    }

    #[tokio::test]
    async fn no_confirm_in_time_is_a_timeout() {
        let never = std::future::pending::<lapin::Result<Confirmation>>();
        let unconfirmed = confirmed(LIMIT, never).await.expect_err("no confirm");
        assert_eq!(unconfirmed.cause(), "timeout");
        assert_eq!(
            unconfirmed.detail(|_, _| unreachable!()),
            "no confirm within 20ms (publish_timeout)"
        );
    }
}
