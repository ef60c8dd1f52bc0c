//! The `payments_api` example as a process, over real sockets: the contract of issue 16 (first
//! call, replay, mismatch, missing key, not a payment, balances per tenant) on the embedded
//! store and on PostgreSQL, one outbox message per payment on both, the embedded store's
//! payment events published to RabbitMQ (`--publish-amqp`), and a graceful stop on SIGTERM.
//!
//! Uses the example binary `cargo test` builds beside this test (`target/<profile>/examples/`);
//! skipped with a message if it is not there. PostgreSQL at `DATABASE_URL` and RabbitMQ at
//! `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn binary() -> Option<PathBuf> {
    // target/<profile>/deps/payments_api-<hash> → target/<profile>/examples/payments_api
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join("payments_api");
    path.exists().then_some(path)
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(args: &[&str], database_url: Option<&str>) -> Option<Server> {
        let Some(bin) = binary() else {
            eprintln!("skipped: the payments_api example binary is not built next to this test");
            return None;
        };
        let addr = free_port();
        let mut cmd = Command::new(bin);
        cmd.arg("--listen").arg(addr.to_string()).args(args);
        cmd.env_remove("DATABASE_URL").env("RUST_LOG", "warn");
        if let Some(url) = database_url {
            cmd.env("DATABASE_URL", url);
        }
        let child = cmd.stdout(Stdio::null()).spawn().unwrap();
        let started = Instant::now();
        while TcpStream::connect(addr).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "payments_api did not listen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Server { child, addr })
    }

    /// One HTTP/1.1 request; `(status, headers lowercased, body)`.
    fn call(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String, String) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_lowercase(), body.to_owned())
    }

    fn stop(mut self) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "graceful stop on SIGTERM: {status}");
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "payments_api did not stop"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn contract(s: &Server) {
    let auth = ("Authorization", "Bearer acme");
    let json = ("Content-Type", "application/json");
    let pay = |key: Option<&str>, body: &str| {
        let mut h = vec![auth, json];
        if let Some(k) = key {
            h.push(("Idempotency-Key", k));
        }
        s.call("POST", "/payments", &h, body)
    };
    let (st, head, first) = pay(Some("k1"), r#"{"account":"a1","amount_cents":500}"#);
    assert_eq!(st, 201, "{first}");
    assert!(!head.contains("idempotent-replayed"));
    let v: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(
        (
            v["account"].as_str(),
            v["amount_cents"].as_i64(),
            v["balance_cents"].as_i64()
        ),
        (Some("a1"), Some(500), Some(500))
    );
    assert!(v["payment_id"].as_str().is_some_and(|id| !id.is_empty()));
    // Retry, quoted form of the same key: replayed, same body.
    let (st, head, again) = pay(Some("\"k1\""), r#"{"account":"a1","amount_cents":500}"#);
    assert_eq!((st, again.as_str()), (201, first.as_str()));
    assert!(head.contains("idempotent-replayed: true"));
    // Same key, other body.
    let (st, head, body) = pay(Some("k1"), r#"{"account":"a1","amount_cents":700}"#);
    assert_eq!(st, 422);
    assert!(head.contains("application/problem+json") && body.contains("idempotency-key-reused"));
    // No key.
    assert_eq!(pay(None, r#"{"account":"a1","amount_cents":700}"#).0, 400);
    // Not a payment.
    assert_eq!(pay(Some("k2"), r#"{"amount":1}"#).0, 400);
    // A second payment adds up.
    let (st, _, body) = pay(Some("k3"), r#"{"account":"a1","amount_cents":250}"#);
    assert_eq!(st, 201);
    assert!(body.contains(r#""balance_cents":750"#), "{body}");
    // Balances, per tenant.
    let (st, _, body) = s.call("GET", "/accounts/a1", &[auth], "");
    assert_eq!(st, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["balance_cents"],
        750
    );
    let (_, _, body) = s.call("GET", "/accounts/a1", &[("Authorization", "Bearer other")], "");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["balance_cents"],
        0
    );
    // The same key under another tenant is another payment.
    let (st, head, _) = s.call(
        "POST",
        "/payments",
        &[("Authorization", "Bearer other"), json, ("Idempotency-Key", "k1")],
        r#"{"account":"a1","amount_cents":500}"#,
    );
    assert_eq!(st, 201);
    assert!(!head.contains("idempotent-replayed"));
}

fn fresh_sqlite_path(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("txinbox_http_{name}_{}.db", std::process::id()));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    path
}

/// `(message_id, status)` of every row of the embedded store's outbox.
fn sqlite_outbox(path: &std::path::Path) -> Vec<(String, String)> {
    use txinbox::sqlx;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
            .await
            .unwrap();
        let rows = sqlx::query_as("SELECT message_id, status FROM txinbox_outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
        pool.close().await;
        rows
    })
}

#[test]
fn payments_api_on_the_embedded_store() {
    let path = fresh_sqlite_path("payments");
    let Some(server) = Server::start(&["--sqlite-path", path.to_str().unwrap()], None) else {
        return;
    };
    contract(&server);
    server.stop();
    // One outbox message per payment (3), none for the replay, the 422 or the 400s; no relay
    // was asked for, so they wait.
    let outbox = sqlite_outbox(&path);
    assert_eq!(outbox.len(), 3, "{outbox:?}");
    assert!(outbox.iter().all(|(_, status)| status == "pending"), "{outbox:?}");
}

/// HTTP → SQLite outbox → RabbitMQ: each payment's event reaches the queue once, with its
/// outbox ID as `message_id`, and is marked published.
#[test]
fn payments_api_publishes_the_embedded_stores_events_to_rabbitmq() {
    use txinbox_amqp::lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeleteOptions};
    use txinbox_amqp::lapin::{Connection, ConnectionProperties};
    let amqp = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let queue = format!("txinbox_http_payments_{}", std::process::id());
    let path = fresh_sqlite_path("payments_amqp");
    let Some(server) = Server::start(
        &[
            "--sqlite-path",
            path.to_str().unwrap(),
            "--publish-amqp",
            &amqp,
            "--topic",
            &queue,
        ],
        None,
    ) else {
        return;
    };
    contract(&server);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let events = rt.block_on(async {
        let conn = Connection::connect(&amqp, ConnectionProperties::default())
            .await
            .expect("RabbitMQ at AMQP_URL");
        let channel = conn.create_channel().await.unwrap();
        let mut events: Vec<(String, serde_json::Value)> = Vec::new();
        // The relay polls SQLite every second: allow it many rounds, then, once the third event
        // is in, two seconds more to see that nothing else comes.
        let mut deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let Some(m) = channel
                .basic_get(queue.as_str().into(), BasicGetOptions::default())
                .await
                .unwrap()
            else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let id = m
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            events.push((id, serde_json::from_slice(&m.data).unwrap()));
            m.ack(BasicAckOptions::default()).await.unwrap();
            if events.len() == 3 {
                deadline = Instant::now() + Duration::from_secs(2);
            }
        }
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        events
    });
    server.stop();
    assert_eq!(events.len(), 3, "one event per payment: {events:?}");
    let outbox = sqlite_outbox(&path);
    let mut published: Vec<&str> = outbox.iter().map(|(id, _)| id.as_str()).collect();
    let mut received: Vec<&str> = events.iter().map(|(id, _)| id.as_str()).collect();
    published.sort();
    received.sort();
    assert_eq!(
        received, published,
        "each event carries its outbox ID as message_id"
    );
    assert!(
        outbox.iter().all(|(_, status)| status == "published"),
        "{outbox:?}"
    );
    let mut amounts: Vec<i64> = events
        .iter()
        .map(|(_, e)| e["amount_cents"].as_i64().unwrap())
        .collect();
    amounts.sort();
    assert_eq!(amounts, [250, 500, 500]);
}

#[test]
fn payments_api_on_postgres() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Not migrated: the server under test migrates it.
    let url = rt.block_on(async {
        let db = txinbox_testing::database::TestDatabase::builder("txinbox_http_payments")
            .migrate(false)
            .create()
            .await;
        db.pool().close().await;
        db.url().to_owned()
    });
    let Some(server) = Server::start(&[], Some(&url)) else {
        return;
    };
    contract(&server);
    server.stop();
    // One outbox message per payment (3), none for the replay, the 422 or the 400s.
    let outbox: i64 = rt.block_on(async {
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::query_scalar("SELECT count(*) FROM txinbox.outbox")
            .fetch_one(&pool)
            .await
            .unwrap()
    });
    assert_eq!(outbox, 3);
}
