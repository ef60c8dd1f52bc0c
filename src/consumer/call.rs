//! How the handler is called: a panic becomes a transient error, and each call's duration is
//! recorded.

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use futures::FutureExt;

use super::Shared;
use crate::handler::HandlerError;

/// Runs a handler call: a panic becomes a transient error (its transaction is rolled back by
/// the caller), and the call's duration is recorded as one `handler_duration` sample.
pub(super) async fn run_handler<St, H>(
    shared: &Shared<St, H>,
    call: impl std::future::Future<Output = Result<(), HandlerError>>,
) -> Result<(), HandlerError> {
    let started = Instant::now();
    let result = AssertUnwindSafe(call).catch_unwind().await;
    shared
        .metrics
        .handler_duration
        .record(started.elapsed().as_secs_f64());
    result.unwrap_or_else(|panic| {
        Err(HandlerError::transient(format!(
            "handler panicked: {}",
            panic_message(&*panic)
        )))
    })
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

#[cfg(test)]
mod tests {
    #[test]
    fn panic_messages_are_extracted() {
        let p = std::panic::catch_unwind(|| panic!("boom {}", 1)).unwrap_err();
        assert_eq!(super::panic_message(&*p), "boom 1");
    }
}
