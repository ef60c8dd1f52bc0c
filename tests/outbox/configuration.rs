//! A relay configuration that cannot work is refused with a reason.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use txinbox::outbox::{Relay, RelayConfig};
use txinbox::RetryPolicy;
use txinbox_testing::database::server_url as admin_url;

use crate::support::*;

#[test]
fn bad_relay_configuration_is_refused_with_a_reason() {
    let err = |c: RelayConfig| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let pool = PgPoolOptions::new().connect_lazy(&admin_url()).unwrap();
            Relay::new(pool, Recorder::default(), c).unwrap_err().to_string()
        })
    };
    assert!(err(RelayConfig::default().batch_size(0)).contains("batch_size"));
    assert!(err(RelayConfig::default().poll_interval(Duration::ZERO)).contains("poll_interval"));
    assert!(
        err(RelayConfig::default().retry_policy(RetryPolicy::default().max_attempts(0)))
            .contains("max_attempts")
    );
}
