//! Operations on an inbox: status, positions, retention and dead letters, on PostgreSQL and on
//! the embedded SQLite store.
//!
//! These are the queries behind the `txinbox` command-line tool (package `txinbox-cli`), as a
//! small public API so they can be tested and used from code. Everything here works on a plain
//! [`PgPool`](sqlx::PgPool) whose database has been [migrated](crate::postgres::migrate), and what takes
//! a [`Db`] also on a [`SqlitePool`](sqlx::SqlitePool) migrated with [`sqlite::migrate`](crate::sqlite::migrate);
//! nothing here talks to a broker.
//!
//! | module | what |
//! |---|---|
//! | [`status`] | per-consumer counters and stored positions |
//! | [`retention`] | purging terminal inbox rows in batches, and the retention horizon |
//! | [`replay`] | classifying messages against the inbox, moving stored positions |
//! | [`positions`] | the recorded group, stored positions against the broker's, adopting and setting them |
//! | [`dead_letters`] | listing, showing, requeueing and discarding dead letters |
//!
//! Times are [`Timestamp`]s (milliseconds since the Unix epoch, UTC), so this module needs no
//! date-time crate.

pub mod dead_letters;
pub mod positions;
pub mod replay;
pub mod retention;
pub mod status;

use std::fmt;
use std::str::FromStr;

/// The database the operations run on: PostgreSQL (schema `txinbox`, `timestamptz` times) or
/// the embedded SQLite store (tables `txinbox_…`, INTEGER epoch-millisecond times). Both hold
/// the same tables with the same columns, so one query text serves both wherever the
/// dialects agree; [`Db::table`] and a few crate-private helpers (times as epoch
/// milliseconds, the clock) spell what differs. Built from a `&PgPool` or a `&SqlitePool` with `.into()`.
#[derive(Debug, Clone, Copy)]
pub enum Db<'a> {
    /// PostgreSQL, [migrated](crate::postgres::migrate).
    Postgres(&'a sqlx::PgPool),
    /// SQLite, [migrated](crate::sqlite::migrate).
    #[cfg(feature = "sqlite")]
    Sqlite(&'a sqlx::SqlitePool),
}

impl<'a> From<&'a sqlx::PgPool> for Db<'a> {
    fn from(pool: &'a sqlx::PgPool) -> Self {
        Db::Postgres(pool)
    }
}

#[cfg(feature = "sqlite")]
impl<'a> From<&'a sqlx::SqlitePool> for Db<'a> {
    fn from(pool: &'a sqlx::SqlitePool) -> Self {
        Db::Sqlite(pool)
    }
}

/// An owned [`Db`]: a clone of the pool, for work that outlives a borrow (the consumer's
/// retention task). Cheap to clone, like the pools.
#[derive(Debug, Clone)]
pub enum DbPool {
    /// PostgreSQL, [migrated](crate::postgres::migrate).
    Postgres(sqlx::PgPool),
    /// SQLite, [migrated](crate::sqlite::migrate).
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
}

impl DbPool {
    /// The borrowed [`Db`] the operations take.
    pub fn db(&self) -> Db<'_> {
        match self {
            DbPool::Postgres(pool) => Db::Postgres(pool),
            #[cfg(feature = "sqlite")]
            DbPool::Sqlite(pool) => Db::Sqlite(pool),
        }
    }
}

impl Db<'_> {
    /// The full name of txinbox table `name` (`inbox` → `txinbox.inbox` or `txinbox_inbox`).
    pub fn table(self, name: &str) -> String {
        match self {
            Db::Postgres(_) => format!("txinbox.{name}"),
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => format!("txinbox_{name}"),
        }
    }

    /// A time expression (a column, an aggregate of one) as epoch milliseconds.
    pub(crate) fn ms(self, e: &str) -> String {
        match self {
            Db::Postgres(_) => format!("CAST(extract(epoch FROM {e}) * 1000 AS bigint)"),
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => e.to_owned(),
        }
    }

    /// A time from the epoch milliseconds in parameter `p` (bound as `i64`), comparable with
    /// the time columns.
    pub(crate) fn at_ms(self, p: &str) -> String {
        match self {
            Db::Postgres(_) => format!("to_timestamp(CAST({p} AS float8) / 1000)"),
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => p.to_owned(),
        }
    }

    /// The database's clock, as the time columns store it.
    pub(crate) fn now(self) -> &'static str {
        match self {
            Db::Postgres(_) => "now()",
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        }
    }

    /// The database's clock in epoch milliseconds.
    pub(crate) fn now_ms(self) -> String {
        self.ms(self.now())
    }

    /// Whether this is the embedded SQLite store.
    pub fn is_sqlite(self) -> bool {
        !matches!(self, Db::Postgres(_))
    }
}

/// Runs `$body` with `$pool` bound to the pool of `$db`, compiled once per backend: one query
/// text and one chain of binds serve both databases.
macro_rules! on_db {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db {
            $crate::ops::Db::Postgres($pool) => $body,
            #[cfg(feature = "sqlite")]
            $crate::ops::Db::Sqlite($pool) => $body,
        }
    };
}
pub(crate) use on_db;

/// A point in time: milliseconds since the Unix epoch, UTC. Displays as RFC 3339
/// (`2026-11-21T07:08:24.123Z`); parses from RFC 3339 (with `Z` or an offset) or from a number
/// of epoch milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// Milliseconds since the Unix epoch.
    pub fn unix_ms(self) -> i64 {
        self.0
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let days = self.0.div_euclid(86_400_000);
        let ms_of_day = self.0.rem_euclid(86_400_000);
        let (y, m, d) = civil_from_days(days);
        let (h, rest) = (ms_of_day / 3_600_000, ms_of_day % 3_600_000);
        let (min, rest) = (rest / 60_000, rest % 60_000);
        let (s, ms) = (rest / 1000, rest % 1000);
        write!(f, "{y:04}-{m:02}-{d:02}T{h:02}:{min:02}:{s:02}.{ms:03}Z")
    }
}

impl FromStr for Timestamp {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "`{text}` is not a time: use RFC 3339 (2026-11-21T07:00:00Z, 2026-11-21T09:00:00+02:00) or epoch milliseconds"
            )
        };
        if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
            return text.parse().map(Timestamp).map_err(|_| bad());
        }
        let b = text.as_bytes();
        if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
            return Err(bad());
        }
        let num = |r: std::ops::Range<usize>| -> Result<i64, String> {
            let s = text.get(r).ok_or_else(bad)?;
            if s.bytes().all(|c| c.is_ascii_digit()) {
                s.parse().map_err(|_| bad())
            } else {
                Err(bad())
            }
        };
        let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        if b[13] != b':' || b[16] != b':' {
            return Err(bad());
        }
        let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
            return Err(bad());
        }
        let mut i = 19;
        let mut ms = 0;
        if b[i] == b'.' {
            let start = i + 1;
            i = start;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == start {
                return Err(bad());
            }
            let frac = &text[start..i.min(start + 3)];
            ms = frac.parse::<i64>().map_err(|_| bad())? * 10i64.pow(3 - frac.len() as u32);
        }
        let offset_min = match &text[i..] {
            "Z" | "z" => 0,
            tz if tz.len() == 6
                && (tz.starts_with('+') || tz.starts_with('-'))
                && tz.as_bytes()[3] == b':' =>
            {
                let sign = if tz.starts_with('-') { -1 } else { 1 };
                sign * (num(i + 1..i + 3)? * 60 + num(i + 4..i + 6)?)
            }
            _ => return Err(bad()),
        };
        let days = days_from_civil(y, mo, d);
        let secs = days * 86_400 + h * 3600 + mi * 60 + s - offset_min * 60;
        Ok(Timestamp(secs * 1000 + ms))
    }
}

// Howard Hinnant's civil-date algorithms (proleptic Gregorian calendar).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (
        if m <= 2 {
            yoe + era * 400 + 1
        } else {
            yoe + era * 400
        },
        m,
        d,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_and_honour_offsets() {
        let t: Timestamp = "2026-11-21T07:08:24.123Z".parse().unwrap();
        assert_eq!(t.to_string(), "2026-11-21T07:08:24.123Z");
        assert_eq!(t, Timestamp(1_795_244_904_123));
        let shifted: Timestamp = "2026-11-21T09:08:24.123+02:00".parse().unwrap();
        assert_eq!(shifted, t);
        assert_eq!(
            "0".parse::<Timestamp>().unwrap().to_string(),
            "1970-01-01T00:00:00.000Z"
        );
        assert_eq!(Timestamp(-1).to_string(), "1969-12-31T23:59:59.999Z");
        assert_eq!(
            "2000-02-29T00:00:00Z".parse::<Timestamp>().unwrap().0,
            951_782_400_000
        );
        for bad in [
            "",
            "yesterday",
            "2026-13-01T00:00:00Z",
            "2026-11-21T07:08:24",
            "2026-11-21T07:08:24.Z",
            "2026-11-21T07:08:24+0\u{e9}00",
        ] {
            assert!(bad.parse::<Timestamp>().is_err(), "{bad} must not parse");
        }
    }
}
