//! `amqps://` against the TLS-only RabbitMQ node (`AMQPS_URL`, default
//! `amqps://guest:guest@127.0.0.1:5671/%2f`; `scripts/test` starts it with the certificates of
//! `$TXINBOX_TLS_DIR`): logging in with the client certificate (SASL EXTERNAL), and each refusal
//! with the error a user sees. Consuming, retrying and dead-lettering over TLS are the
//! conformance suite's `tls_quorum` cases (tests/conformance.rs).

use std::process::Command;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::{BasicProperties, ConnectionProperties};
use txinbox::source::Settlement;
use txinbox::{Delivery, MessageSource};
use txinbox_amqp::{AmqpConfig, AmqpError, AmqpPublisher, AmqpSource, AmqpTls};

#[path = "support/tls.rs"]
mod tls;

fn unique(what: &str) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "txinbox-amqp-tls-{}-{}-{what}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// `amqps://127.0.0.1:5671/%2f?auth_mechanism=external`: no user, no password.
fn external_url() -> String {
    let base = tls::amqps_url();
    let (scheme, rest) = base.split_once("://").expect("AMQPS_URL has a scheme");
    let host_path = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let host_path = host_path.split_once('?').map_or(host_path, |(h, _)| h);
    format!("{scheme}://{host_path}?auth_mechanism=external")
}

fn trusted() -> AmqpTls {
    AmqpTls::new().ca_file(tls::file("ca.pem"))
}

fn with_client_certificate() -> AmqpTls {
    trusted().client_certificate(tls::file("client.pem"), tls::file("client.key"))
}

/// The connect error of a source for `url` with `tls`, as a user would print it.
async fn refused(url: &str, tls: AmqpTls) -> (String, bool) {
    let config = AmqpConfig::new(url, unique("refused"))
        .tls(tls)
        .connect_timeout(Duration::from_secs(5));
    match AmqpSource::connect(config).await {
        Ok(_) => panic!("connecting to {url} should have been refused"),
        Err(e) => {
            let fatal = e.is_fatal();
            eprintln!("{url}: {e}");
            (e.to_string(), fatal)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_logs_in_with_its_client_certificate_and_consumes_over_tls() {
    let queue = unique("external");
    let name = unique("external-consumer");
    let config = AmqpConfig::new(external_url(), &queue)
        .tls(with_client_certificate())
        .connection_name(&name);
    let mut source = AmqpSource::connect(config)
        .await
        .expect("EXTERNAL login with the client certificate");

    // The broker says who logged in on that connection: the certificate's CN.
    let out = Command::new("rabbitmqctl")
        .args([
            "-q",
            "-n",
            "txinbox-tls@localhost",
            "list_connections",
            "--no-table-headers",
            "user",
            "auth_mechanism",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl (scripts/test installs RabbitMQ)");
    let listed = String::from_utf8_lossy(&out.stdout);
    let line = listed
        .lines()
        .find(|l| l.contains(&name))
        .unwrap_or_else(|| panic!("no connection named {name} on the TLS node:\n{listed}"));
    assert!(
        line.starts_with("txinbox-client") && line.contains("EXTERNAL"),
        "the connection logs in as the certificate's CN with EXTERNAL: {line}"
    );

    // And it consumes: a message published over TLS by the outbox publisher arrives and is acked.
    let publisher = AmqpPublisher::connect_with_tls(tls::amqps_url(), trusted())
        .await
        .expect("publisher over TLS");
    let conn = trusted()
        .connect(&tls::amqps_url(), ConnectionProperties::default())
        .await
        .expect("connect over TLS");
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            b"{}",
            BasicProperties::default().with_message_id("m-1".into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    let delivery = tokio::time::timeout(Duration::from_secs(10), source.receive())
        .await
        .expect("a delivery within 10 s")
        .unwrap()
        .expect("a delivery");
    assert_eq!(delivery.message().native_id(), Some("m-1"));
    delivery.settle(Settlement::Ack).await.expect("ack over TLS");
    source.close().await.unwrap();
    drop(publisher);
    for q in [queue.clone(), format!("{queue}.retry"), format!("{queue}.dlq")] {
        let _ = channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test]
async fn external_login_without_a_client_certificate_is_refused() {
    let (error, fatal) = refused(&external_url(), trusted()).await;
    assert!(fatal, "retrying cannot help: {error}");
    assert!(
        error.contains("ACCESS_REFUSED") && error.contains("EXTERNAL logs in with the client certificate"),
        "{error}"
    );
}

#[tokio::test]
async fn a_broker_certificate_of_another_ca_is_refused_with_what_to_do() {
    for tls in [
        AmqpTls::new().ca_file(tls::file("other-ca.pem")),
        AmqpTls::new(), // the system's roots only
    ] {
        let (error, fatal) = refused(&tls::amqps_url(), tls.clone()).await;
        assert!(fatal, "retrying cannot help: {error}");
        assert!(
            error.contains("not signed by a CA this client trusts") && error.contains("--amqp-ca-file"),
            "{tls:?}: {error}"
        );
        assert!(!error.contains("guest:guest"), "no password in {error}");
    }
}

#[tokio::test]
async fn plaintext_amqp_to_the_tls_port_is_refused_with_what_to_do() {
    let url = tls::amqps_url().replacen("amqps://", "amqp://", 1);
    let started = std::time::Instant::now();
    let (error, _) = refused(&url, AmqpTls::new()).await;
    assert!(error.contains("use amqps://"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused at once, not after the connect timeout: {error}"
    );
}

#[tokio::test]
async fn amqps_to_a_plaintext_port_is_refused_with_what_to_do() {
    let plain = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let url = plain.replacen("amqp://", "amqps://", 1);
    let (error, fatal) = refused(&url, trusted()).await;
    assert!(fatal, "{error}");
    assert!(error.contains("did not answer with TLS"), "{error}");
}

#[tokio::test]
async fn a_client_certificate_on_a_plaintext_uri_is_refused_before_connecting() {
    let plain = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:s3cret@127.0.0.1:5672/%2f".into());
    let e = AmqpPublisher::connect_with_tls(&plain, with_client_certificate())
        .await
        .unwrap_err();
    assert!(matches!(e, AmqpError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("use amqps://"), "{e}");
}

/// A name of 127.0.0.1 in /etc/hosts other than `localhost` (the certificate lists only
/// `localhost` and `127.0.0.1`), if the machine has one.
fn another_name_for_loopback() -> Option<String> {
    let hosts = std::fs::read_to_string("/etc/hosts").ok()?;
    hosts
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default())
        .filter(|l| l.split_whitespace().next() == Some("127.0.0.1"))
        .flat_map(|l| {
            l.split_whitespace()
                .skip(1)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .find(|name| !name.starts_with("localhost"))
}

#[tokio::test]
async fn a_host_name_the_certificate_does_not_list_is_refused_with_what_to_do() {
    let Some(name) = another_name_for_loopback() else {
        eprintln!("skipped: no name for 127.0.0.1 in /etc/hosts besides localhost");
        return;
    };
    let url = tls::amqps_url().replacen("127.0.0.1", &name, 1);
    assert_ne!(url, tls::amqps_url(), "AMQPS_URL names 127.0.0.1");
    let (error, fatal) = refused(&url, trusted()).await;
    assert!(fatal, "{error}");
    assert!(
        error.contains(&format!("not valid for the host name {name:?}")),
        "{error}"
    );
}
