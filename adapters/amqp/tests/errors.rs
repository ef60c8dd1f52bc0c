//! `AmqpError` goes into `txinbox::Error` with `?`, keeping itself and lapin's error in the
//! cause chain; a broker that is not there is transient, an invalid configuration is not.

use std::time::Duration;

use txinbox::source::SourceError;
use txinbox_amqp::{AmqpConfig, AmqpError, AmqpSource};

fn chain<'a>(e: &'a (dyn std::error::Error + 'static)) -> Vec<&'a (dyn std::error::Error + 'static)> {
    let mut out = vec![e];
    let mut at = e;
    while let Some(next) = at.source() {
        out.push(next);
        at = next;
    }
    out
}

async fn connect(config: AmqpConfig) -> Result<(), txinbox::Error> {
    AmqpSource::connect(config).await?;
    Ok(())
}

#[tokio::test]
async fn question_mark_keeps_the_amqp_error_and_lapins_cause() {
    // Nothing listens on port 1: refused, which a later attempt may get past.
    let config = AmqpConfig::new("amqp://guest:guest@127.0.0.1:1/%2f", "errors")
        .connect_timeout(Duration::from_secs(5));
    let e = connect(config).await.unwrap_err();
    let links = chain(&e);
    let texts: Vec<String> = links.iter().map(|l| l.to_string()).collect();
    let txinbox::Error::Source(source) = &e else {
        panic!("{e:?}")
    };
    assert!(source.is_transient(), "{texts:#?}");
    assert!(links[1].is::<SourceError>(), "{texts:#?}");
    let amqp = links[2]
        .downcast_ref::<AmqpError>()
        .unwrap_or_else(|| panic!("{texts:#?}"));
    assert!(amqp.is_transient() && !amqp.is_fatal(), "{amqp:?}");
    assert!(
        links[3].is::<lapin::Error>(),
        "lapin's error after it: {texts:#?}"
    );

    let e = connect(AmqpConfig::new("amqp://127.0.0.1:1/%2f", ""))
        .await
        .unwrap_err();
    let links = chain(&e);
    assert!(
        matches!(links[2].downcast_ref::<AmqpError>(), Some(AmqpError::Config(_))),
        "{e:?}"
    );
}
