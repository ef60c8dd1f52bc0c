//! The runtime against a real PostgreSQL: races, failures, crashes, outages, ordering,
//! migrations and metrics, one file per concern. Needs `DATABASE_URL` (a role that may create
//! databases); `scripts/test` provides it.

mod batch_model;
mod batching;
mod configuration;
mod contention;
mod crashes;
mod dead_letters;
mod dedup;
mod health;
mod limits;
mod metrics;
mod migrations;
mod ordering;
mod pool;
mod positions;
mod retention;
mod retries;
mod router;
mod shutdown;
mod spans;
mod store_health;
mod support;
mod tls;
mod unavailable;
mod upgrade;
