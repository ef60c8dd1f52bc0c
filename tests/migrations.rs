//! A migration that has been released is never edited: sqlx refuses to start on a database
//! whose applied migration's checksum differs ("migration was previously applied but has been
//! modified"), so every consumer on that database would stop. Change the schema with a new
//! migration, and add its checksum here.

/// `(version, first 16 hex digits of sqlx's checksum)` of every migration, in order.
const POSTGRES: &[(i64, &str)] = &[
    (20261121000000, "a9de9db80f8e6a3b"),
    (20261121000100, "9b400fdd59402ef8"),
    (20261121020000, "6fd973bd7bdf4048"),
    (20261121030000, "e54c924bd664ff20"),
    (20261124000000, "c953432f06948d70"),
    (20261125000000, "92c2b9792be05c9e"),
];
const SQLITE: &[(i64, &str)] = &[
    (20261121000000, "67c78f010ba0f3a8"),
    (20261121000100, "1d17d196dfac7231"),
    (20261124000000, "96e4497d5abdd0c1"),
    (20261125000000, "b70d12be2d327cee"),
    (20261125000100, "6b85adf7d032b619"),
    (20261126000000, "59b18ba9777d88ba"),
];

fn listed(m: &sqlx::migrate::Migrator) -> Vec<(i64, String)> {
    m.iter()
        .map(|m| {
            let hex: String = m.checksum.iter().take(8).map(|b| format!("{b:02x}")).collect();
            (m.version, hex)
        })
        .collect()
}

fn check(name: &str, actual: Vec<(i64, String)>, frozen: &[(i64, &str)]) {
    let frozen: Vec<(i64, String)> = frozen.iter().map(|(v, c)| (*v, c.to_string())).collect();
    for (i, (version, checksum)) in frozen.iter().enumerate() {
        let now = actual.get(i);
        assert_eq!(
            now.map(|(v, _)| v),
            Some(version),
            "{name} migration {version} is gone or renumbered: released migrations stay"
        );
        assert_eq!(
            now.map(|(_, c)| c),
            Some(checksum),
            "{name} migration {version} was edited after release: put it back and add a new migration"
        );
    }
    assert_eq!(
        actual.len(),
        frozen.len(),
        "{name}: a new migration? add it to tests/migrations.rs: {:?}",
        &actual[frozen.len().min(actual.len())..]
    );
}

#[test]
fn released_postgres_migrations_are_never_edited() {
    check("PostgreSQL", listed(&txinbox::postgres::migrator()), POSTGRES);
}

#[test]
fn released_sqlite_migrations_are_never_edited() {
    check("SQLite", listed(&txinbox::sqlite::migrator()), SQLITE);
}
