//! The PostgreSQL harness: real servers from Debian's packages, several at once.

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

#[tokio::test]
async fn the_shared_client_connects_with_ssl_mode_prefer_to_a_server_without_tls() {
    use dbops_shared::postgres::{Credentials, Servers};
    let pg = PgServer::start("prefer").await.unwrap();
    let servers = Servers::new(2, 5, std::time::Duration::from_secs(30));
    let creds = Credentials {
        username: "postgres".into(),
        password: pg.superuser_password().into(),
    };
    for mode in ["prefer", "disable"] {
        let server: dbops_api::ServerSpec = serde_json::from_value(serde_json::json!({
            "host": "127.0.0.1", "port": pg.port(), "adminSecretRef": {"name": "x"}, "sslMode": mode
        }))
        .unwrap();
        let session = servers.connect(&server, &creds, "postgres").await.unwrap();
        let one: i32 = session.query_one("SELECT 1", &[]).await.unwrap().get(0);
        assert_eq!(one, 1, "sslMode {mode}");
    }
}

/// TLS for the controllers' own sessions against real PostgreSQL servers speaking TLS
/// with certificates of a test CA: `require` and `prefer` encrypt (pg_stat_ssl says so);
/// `require` to a server without TLS is `ServerWithoutTLS`; `verify-full` with the system's
/// roots does not trust the test CA (`CertificateNotTrusted`); with the CA trusted, the
/// host name decides (`HostnameMismatch` for a certificate made out to another name).
#[tokio::test]
async fn the_shared_client_speaks_tls_and_names_each_tls_failure() {
    use dbops_shared::postgres::tls::{self, TlsFailure, Verify};
    use dbops_shared::postgres::{Credentials, PgError, Servers};
    use std::net::{IpAddr, Ipv4Addr};
    let ca = dbops_e2e::tls::TestCa::new("dbops-e2e-postgres-ca").unwrap();
    let loopback = [IpAddr::V4(Ipv4Addr::LOCALHOST)];
    let cert = ca.server_cert(&["localhost"], &loopback).unwrap();
    let secure = PgServer::start_with_tls("tls", Some(&cert)).await.unwrap();
    let plain = PgServer::start("no-tls").await.unwrap();
    let servers = Servers::new(2, 5, std::time::Duration::from_secs(30));
    let spec = |pg: &PgServer, mode: &str| -> dbops_api::ServerSpec {
        serde_json::from_value(serde_json::json!({
            "host": "127.0.0.1", "port": pg.port(), "adminSecretRef": {"name": "x"}, "sslMode": mode
        }))
        .unwrap()
    };
    let creds = |pg: &PgServer| Credentials {
        username: "postgres".into(),
        password: pg.superuser_password().into(),
    };
    for mode in ["require", "prefer"] {
        let session = servers
            .connect(&spec(&secure, mode), &creds(&secure), "postgres")
            .await
            .unwrap_or_else(|e| panic!("sslMode {mode}: {e}"));
        let ssl: bool = session
            .query_one(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert!(ssl, "sslMode {mode} did not use TLS");
    }
    let reason = |e: PgError| e.reason();
    let e = servers
        .connect(&spec(&plain, "require"), &creds(&plain), "postgres")
        .await
        .unwrap_err();
    assert_eq!(reason(e), "ServerWithoutTLS");
    let e = servers
        .connect(&spec(&secure, "verify-full"), &creds(&secure), "postgres")
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("does not chain to a trusted root"),
        "{e}"
    );
    assert_eq!(reason(e), "CertificateNotTrusted");

    // The CA trusted: verify-full passes for the name on the certificate and fails for
    // another one (an address the certificate does not list).
    let roots = tls::roots_from_pem(ca.pem().as_bytes()).unwrap();
    let connect = |host: &'static str| {
        let mut config = tokio_postgres::Config::new();
        config
            .host(host)
            .port(secure.port())
            .user("postgres")
            .password(secure.superuser_password())
            .dbname("postgres")
            .ssl_mode(tokio_postgres::config::SslMode::Require);
        let connector = tls::connector(Verify::ChainAndHost, Some(roots.clone())).unwrap();
        async move {
            config.connect(connector).await.map(|(client, conn)| {
                tokio::spawn(conn);
                client
            })
        }
    };
    let client = connect("localhost")
        .await
        .expect("verify-full for localhost");
    let one: i32 = client.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
    let other = ca.server_cert(&["pg.example"], &[]).unwrap();
    let renamed = PgServer::start_with_tls("tls-other-name", Some(&other))
        .await
        .unwrap();
    let mut config = tokio_postgres::Config::new();
    config
        .host("localhost")
        .port(renamed.port())
        .user("postgres")
        .password(renamed.superuser_password())
        .dbname("postgres")
        .ssl_mode(tokio_postgres::config::SslMode::Require);
    let e = config
        .connect(tls::connector(Verify::ChainAndHost, Some(roots.clone())).unwrap())
        .await
        .err()
        .expect("a certificate for pg.example is not one for localhost");
    assert_eq!(
        TlsFailure::of(&e),
        Some(TlsFailure::HostnameMismatch),
        "{e}"
    );
}
