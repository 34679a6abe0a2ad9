//! The harness's PostgreSQL servers: two side by side surviving a restart, the DDL log and
//! the catalog helpers, an SQL error saying what the server said.

use std::time::Duration;

use dbops_e2e::PgServer;
use dbops_e2e::wait::eventually;

#[tokio::test]
async fn two_servers_run_side_by_side_and_survive_a_restart() {
    dbops_e2e::init_test_logging();
    let (source, target) = tokio::join!(PgServer::start("source"), PgServer::start("target"));
    let (source, mut target) = (source.unwrap(), target.unwrap());
    assert_ne!(source.port(), target.port());

    let s = source.connect_as_superuser().await.unwrap();
    s.batch_execute("CREATE TABLE marks (n int); INSERT INTO marks VALUES (1), (2)")
        .await
        .unwrap();
    let row = s
        .query_one("SELECT count(*) FROM marks", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 2);

    // A wrong password is refused: TCP connections use scram-sha-256.
    let wrong = target
        .connect("postgres", "not-the-password", "postgres")
        .await;
    assert!(wrong.is_err(), "a wrong password must be refused");

    let t = target.connect_as_superuser().await.unwrap();
    t.batch_execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)")
        .await
        .unwrap();
    drop(t);
    target.stop().unwrap();
    assert!(
        target.connect_as_superuser().await.is_err(),
        "a stopped server refuses connections"
    );
    target.start_again().await.unwrap();
    let t = target.connect_as_superuser().await.unwrap();
    let row = t.query_one("SELECT n FROM kept", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 7, "data survives a restart");

    // The superuser is not the OS user: the server does not run as root.
    let user = s
        .query_one("SELECT current_setting('data_directory')", &[])
        .await
        .unwrap();
    let data_dir: String = user.get(0);
    let owner = std::process::Command::new("stat")
        .args(["-c", "%U", &data_dir])
        .output()
        .unwrap();
    assert_ne!(String::from_utf8_lossy(&owner.stdout).trim(), "root");
}

#[tokio::test]
async fn ddl_is_logged_and_the_catalog_helpers_see_it() {
    dbops_e2e::init_test_logging();
    let pg = PgServer::start("helpers").await.unwrap();
    let before = pg.ddl_statements().unwrap().len();
    assert!(!pg.database_exists("shop").await.unwrap());
    assert!(!pg.role_exists("shop_owner").await.unwrap());

    let su = pg.connect_as_superuser().await.unwrap();
    // One statement each: CREATE DATABASE refuses to run in a multi-statement batch.
    for sql in [
        "CREATE ROLE shop_owner LOGIN PASSWORD 'not-for-printing'",
        "CREATE ROLE shop_reader",
        "CREATE DATABASE shop OWNER shop_owner CONNECTION LIMIT 7",
        "COMMENT ON DATABASE shop IS 'dbops.dev/uid=1234'",
        "COMMENT ON ROLE shop_owner IS 'dbops.dev/uid=1234'",
    ] {
        su.batch_execute(sql).await.unwrap();
    }
    // Reads and data changes are not DDL.
    su.batch_execute("SELECT 1").await.unwrap();
    su.execute(
        "UPDATE pg_database SET datallowconn = true WHERE false",
        &[],
    )
    .await
    .unwrap();
    // The extended protocol is logged as `execute`.
    su.execute("ALTER DATABASE shop CONNECTION LIMIT 8", &[])
        .await
        .unwrap();

    let ddl = eventually(
        "the DDL in the server log",
        Duration::from_secs(10),
        || async { pg.ddl_statements() },
        |ddl| ddl.len() >= before + 6,
    )
    .await;
    let new = &ddl[before..];
    assert!(
        new.iter().all(|l| !l.contains("not-for-printing")),
        "passwords are redacted: {new:#?}"
    );
    assert!(new[0].contains("CREATE ROLE shop_owner LOGIN PASSWORD '<redacted>'"));
    assert!(
        new.iter()
            .any(|l| l.contains("ALTER DATABASE shop CONNECTION LIMIT 8"))
    );
    assert!(
        !new.iter()
            .any(|l| l.contains("INSERT") || l.contains("SELECT 1")),
        "{new:#?}"
    );
    assert!(!pg.log_tail(100_000).contains("not-for-printing"));

    assert!(pg.database_exists("shop").await.unwrap());
    assert!(pg.role_exists("shop_owner").await.unwrap());
    assert_eq!(pg.count_roles_like("shop\\_%").await.unwrap(), 2);
    assert_eq!(pg.count_databases_like("shop%").await.unwrap(), 1);
    assert_eq!(
        pg.database_comment("shop").await.unwrap().as_deref(),
        Some("dbops.dev/uid=1234")
    );
    assert_eq!(
        pg.role_comment("shop_owner").await.unwrap().as_deref(),
        Some("dbops.dev/uid=1234")
    );
    assert_eq!(pg.role_comment("shop_reader").await.unwrap(), None);
    assert_eq!(
        pg.database_owner("shop").await.unwrap().as_deref(),
        Some("shop_owner")
    );
    assert_eq!(pg.connlimit("shop").await.unwrap(), Some(8));
    assert!(pg.database_oid("shop").await.unwrap().is_some());
    assert_eq!(pg.connlimit("nope").await.unwrap(), None);

    // A session stays open in the database: FORCE drops it anyway.
    let _session = pg
        .connect("shop_owner", "not-for-printing", "shop")
        .await
        .unwrap();
    pg.drop_database_force("shop").await.unwrap();
    assert!(!pg.database_exists("shop").await.unwrap());
    pg.drop_database_force("shop").await.unwrap();
}

/// A server's error reaches conditions and logs with its message: tokio-postgres shows it
/// as "db error" alone, and every SqlError condition read "<what>: db error" before.
#[tokio::test]
async fn a_sql_error_says_what_the_server_said() {
    use dbops_shared::postgres::PgError;
    let pg = PgServer::start("sqlerror").await.unwrap();
    let session = pg
        .superuser_session(dbops_api::TlsMode::Disable, "postgres")
        .await
        .unwrap();
    let e = session
        .batch_execute("GRANT SELECT ON TABLE no_such_table TO PUBLIC")
        .await
        .map_err(PgError::sql("granting"))
        .unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.starts_with("granting: ERROR: relation \"no_such_table\" does not exist")
            && shown.contains("SQLSTATE 42P01"),
        "{shown}"
    );
    assert_eq!(e.reason(), "SqlError");
}
