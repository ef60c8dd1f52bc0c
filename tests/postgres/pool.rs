//! The pool `PostgresInbox::connect` builds. sqlx pings a pooled connection (a lone Sync
//! message, one round trip) each time it hands it out, unless told otherwise, and again each
//! time it comes back: two round trips a transaction beside its statements. The inbox's pool
//! skips the first for a connection that was in use a moment ago, and still pings one that sat
//! idle, so a connection the server ended while it was idle is never handed out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use txinbox::store::InboxStore;
use txinbox::PostgresInbox;
use txinbox_testing::database::TestDatabase;

/// A TCP proxy in front of PostgreSQL that counts the Sync messages clients send.
struct SyncCounter {
    port: u16,
    syncs: Arc<AtomicU64>,
}

impl SyncCounter {
    async fn start(server: &PgConnectOptions) -> SyncCounter {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let port = listener.local_addr().expect("the proxy's address").port();
        let syncs = Arc::new(AtomicU64::new(0));
        let target = format!("{}:{}", server.get_host(), server.get_port());
        let counted = syncs.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(&target).await.expect("connect to PostgreSQL");
                tokio::spawn(forward(client, server, counted.clone()));
            }
        });
        SyncCounter { port, syncs }
    }

    fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::SeqCst)
    }
}

/// Copies both ways, parsing the client's side into messages: an untyped startup message, then
/// a type byte and a length each. (The proxied sessions have TLS off.)
async fn forward(client: TcpStream, server: TcpStream, syncs: Arc<AtomicU64>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
    });
    let mut pending = Vec::new();
    let mut started = false;
    let mut buf = [0u8; 8192];
    loop {
        let n = match client_read.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        loop {
            let (header, typed) = if started { (5, 1) } else { (4, 0) };
            if pending.len() < header {
                break;
            }
            let len = u32::from_be_bytes(pending[typed..typed + 4].try_into().unwrap()) as usize;
            if pending.len() < typed + len {
                break;
            }
            if started && pending[0] == b'S' {
                syncs.fetch_add(1, Ordering::SeqCst);
            }
            pending.drain(..typed + len);
            started = true;
        }
        if server_write.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn begin_and_commit(inbox: &PostgresInbox) {
    let tx = inbox.begin().await.expect("BEGIN");
    inbox.commit(tx).await.expect("COMMIT");
}

#[tokio::test]
async fn a_connection_in_use_a_moment_ago_is_handed_out_without_a_ping() {
    let db = TestDatabase::new("txinbox_pool").await;
    let options: PgConnectOptions = db.url().parse().expect("the scratch database's URL");
    let proxy = SyncCounter::start(&options).await;
    let proxied = options
        .host("127.0.0.1")
        .port(proxy.port)
        .ssl_mode(PgSslMode::Disable);
    // One connection, so each transaction waits for the last one's release to finish.
    let inbox = PostgresInbox::connect_with(proxied, 1)
        .await
        .expect("connect through the proxy");
    begin_and_commit(&inbox).await;
    // Its release's ping, before counting.
    tokio::time::sleep(Duration::from_millis(200)).await;

    const TRANSACTIONS: u64 = 40;
    let before = proxy.syncs();
    for _ in 0..TRANSACTIONS {
        begin_and_commit(&inbox).await;
    }
    // The last release's ping.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let syncs = proxy.syncs() - before;
    // BEGIN and COMMIT go as simple queries, without a Sync: what is counted is pings.
    assert_eq!(
        syncs, TRANSACTIONS,
        "pings for {TRANSACTIONS} back-to-back transactions on one connection: one each, when \
         it goes back to the pool (sqlx's own), none when it is handed out again"
    );
    db.drop_database().await;
}

#[tokio::test]
async fn a_connection_the_server_ended_while_it_sat_idle_is_not_handed_out() {
    let db = TestDatabase::new("txinbox_pool").await;
    let options: PgConnectOptions = db.url().parse().expect("the scratch database's URL");
    let inbox = PostgresInbox::connect_with(options, 2).await.expect("connect");
    begin_and_commit(&inbox).await;
    assert!(
        db.terminate_sessions().await >= 1,
        "the pool's idle connection was ended"
    );
    tokio::time::sleep(txinbox::store::PING_AFTER_IDLE + Duration::from_millis(200)).await;
    // The idle connection is pinged, found dead and replaced: the transaction runs.
    begin_and_commit(&inbox).await;
    db.drop_database().await;
}
