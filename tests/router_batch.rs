//! A `Router` keeps its routes' batch handlers: a micro-batch is split into runs of messages
//! for one handler, a run of several goes to that handler's `handle_batch`, and the effects are
//! those of every message handled once, in lane order. On SQLite, with the in-memory broker.
#![cfg(all(feature = "sqlite", feature = "memory"))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sqlx::Sqlite;
use txinbox::handler::{BatchContext, BatchHandler, BatchMessage};
use txinbox::memory::MemoryBroker;
use txinbox::message::Headers;
use txinbox::{Consumer, Context, Handler, HandlerError, Message, Router, SqliteInbox};

/// Appends `(message ID, how)` to `effects`; counts its `handle_batch` calls and the messages
/// they carried.
#[derive(Clone, Default)]
struct Recording {
    batches: Arc<AtomicUsize>,
    batched: Arc<AtomicUsize>,
    bulk: bool,
}

async fn effect(db: &mut sqlx::SqliteConnection, id: &str, how: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (message_id, how) VALUES (?1, ?2)")
        .bind(id)
        .bind(how)
        .execute(db)
        .await?;
    Ok(())
}

#[txinbox::async_trait]
impl Handler<Sqlite> for Recording {
    async fn handle(&self, cx: &mut Context<'_, Sqlite>, _: &Message) -> Result<(), HandlerError> {
        let id = cx.message_id().as_str().to_owned();
        effect(cx.db(), &id, "one").await?;
        Ok(())
    }

    fn batch(&self) -> Option<&dyn BatchHandler<Sqlite>> {
        self.bulk.then_some(self as &dyn BatchHandler<Sqlite>)
    }
}

#[txinbox::async_trait]
impl BatchHandler<Sqlite> for Recording {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, Sqlite>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        self.batched.fetch_add(batch.len(), Ordering::SeqCst);
        for m in batch {
            effect(cx.db(), m.id().as_str(), "batch").await?;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_hands_runs_of_a_batched_route_to_its_batch_handler() {
    let path = std::env::temp_dir().join(format!("txinbox-router-batch-{}.db", std::process::id()));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let inbox = SqliteInbox::open(&path, 4).await.unwrap();
    txinbox::sqlite::migrate(inbox.pool()).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE effects (seq INTEGER PRIMARY KEY, message_id TEXT NOT NULL, how TEXT NOT NULL)",
    )
    .execute(inbox.pool())
    .await
    .unwrap();

    let bulk = Recording {
        bulk: true,
        ..Recording::default()
    };
    let router = Router::<Sqlite>::new()
        .on_type("placed", bulk.clone())
        .on_type("cancelled", Recording::default());
    let broker = MemoryBroker::new("orders");
    let types = [
        "placed",
        "placed",
        "placed",
        "cancelled",
        "placed",
        "placed",
        "cancelled",
    ];
    for (i, t) in types.iter().enumerate() {
        let headers = Headers::new().with("type", *t);
        broker.publish_with(
            Some("lane"),
            Some(format!("m-{i}")),
            headers,
            Bytes::from_static(b"{}"),
        );
    }
    broker.close();
    Consumer::builder("router-batch")
        .source(broker.source())
        .inbox(inbox.clone())
        .handler(router)
        .concurrency(1)
        // Every message is queued before the first transaction starts: one batch of seven.
        .batch_linger(Duration::from_millis(500))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();

    let effects: Vec<(String, String)> = sqlx::query_as("SELECT message_id, how FROM effects ORDER BY seq")
        .fetch_all(inbox.pool())
        .await
        .unwrap();
    let ids: Vec<&str> = effects.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        ["m-0", "m-1", "m-2", "m-3", "m-4", "m-5", "m-6"],
        "each message once, in lane order"
    );
    assert!(
        bulk.batches.load(Ordering::SeqCst) >= 1,
        "the batched route's handle_batch was used: {effects:?}"
    );
    let by_batch = effects.iter().filter(|(_, how)| how == "batch").count();
    assert_eq!(by_batch, bulk.batched.load(Ordering::SeqCst));
    assert_eq!(
        effects
            .iter()
            .filter(|(id, how)| how == "batch" && ["m-3", "m-6"].contains(&id.as_str()))
            .count(),
        0,
        "the plain route's messages went through its handle: {effects:?}"
    );
    assert_eq!((broker.stats().acked, broker.dead_letters().len()), (7, 0));
}
