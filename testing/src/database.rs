//! Scratch PostgreSQL databases for tests.
