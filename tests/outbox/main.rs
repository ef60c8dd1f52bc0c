//! The outbox and its relay against a real PostgreSQL, with an in-process publisher standing in
//! for the broker (it records what it was given, in order, and fails on request). Broker
//! publishers are tested in the adapters. Needs `DATABASE_URL`.

mod configuration;
mod failures;
mod health;
mod ids;
mod metrics;
mod notifications;
mod ordering;
mod retention;
#[cfg(feature = "sqlite")]
mod sqlite;
mod support;
mod unavailable;
