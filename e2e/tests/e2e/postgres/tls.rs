//! TLS: the shared client names each TLS failure, Databases on TLS servers name each one,
//! and servers of the oldest and newest supported majors start and answer over TLS.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use dbops_e2e::postgres::scalar;
use dbops_e2e::process::stdout_text;
use dbops_e2e::tls::TestCa;
use dbops_e2e::{ControllerProcess, PgServer};
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

/// The test servers' certificates name 127.0.0.1 beside their DNS names.
const LOOPBACK: [IpAddr; 1] = [IpAddr::V4(Ipv4Addr::LOCALHOST)];

/// Provisioning on a busy 2-core machine.
const READY: Duration = Duration::from_secs(60);

/// A test CA, another CA that vouches for none of the servers, and three servers named
/// after `name`: TLS with a certificate of the CA for localhost (`secure`), TLS with one
/// of the CA made out to pg.example only (`renamed`), and no TLS (`plain`); in that order.
async fn tls_servers(name: &str) -> (TestCa, TestCa, PgServer, PgServer, PgServer) {
    let ca = TestCa::new(&format!("dbops-e2e-{name}-ca")).unwrap();
    let other_ca = TestCa::new(&format!("dbops-e2e-{name}-other-ca")).unwrap();
    let cert = ca.server_cert(&["localhost"], &LOOPBACK).unwrap();
    let other_name = ca.server_cert(&["pg.example"], &[]).unwrap();
    let (renamed_name, plain_name) = (format!("{name}-other-name"), format!("{name}-plain"));
    let (secure, renamed, plain) = tokio::join!(
        PgServer::start_with_tls(name, Some(&cert)),
        PgServer::start_with_tls(&renamed_name, Some(&other_name)),
        PgServer::start(&plain_name),
    );
    (
        ca,
        other_ca,
        secure.unwrap(),
        renamed.unwrap(),
        plain.unwrap(),
    )
}

/// TLS for the controllers' own sessions against real PostgreSQL servers speaking TLS
/// with certificates of a test CA, through the shared client: `disable` stays plain and
/// `require` encrypts (pg_stat_ssl says so); `require` to a server without TLS is
/// `ServerWithoutTLS`; `verify-full` with the system's roots or another CA does not trust
/// the test CA (`CertificateNotTrusted`); with the server's CA, the host name decides
/// (`HostnameMismatch` for a certificate made out to another name), which `verify-ca`
/// does not look at.
#[tokio::test]
async fn the_shared_client_speaks_tls_and_names_each_tls_failure() {
    use dbops_api::TlsMode;
    use dbops_shared::postgres::{CaBundle, Endpoint, Servers};
    let (ca, other_ca, secure, renamed, plain) = tls_servers("tls").await;
    let servers = Servers::new(2, 5, Duration::from_secs(30));
    let endpoint = |pg: &PgServer, host: &str, mode: TlsMode, ca: Option<&TestCa>| {
        let mut endpoint = Endpoint::new(host, pg.port(), mode);
        endpoint.tls.ca = ca.map(|ca| CaBundle::from_pem(ca.pem().as_bytes()).unwrap());
        endpoint
    };

    // Sessions that work, and whether they are encrypted.
    for (pg, host, mode, trusted, encrypted) in [
        (&secure, "127.0.0.1", TlsMode::Disable, None, false),
        (&secure, "127.0.0.1", TlsMode::Require, None, true),
        (&plain, "127.0.0.1", TlsMode::Disable, None, false),
        (&secure, "localhost", TlsMode::VerifyFull, Some(&ca), true),
        (&renamed, "localhost", TlsMode::VerifyCa, Some(&ca), true),
    ] {
        let session = servers
            .connect(
                &endpoint(pg, host, mode, trusted),
                &pg.superuser_credentials(),
                "postgres",
            )
            .await
            .unwrap_or_else(|e| panic!("{} to {host}: {e}", mode.as_str()));
        assert_eq!(
            is_encrypted(&session).await,
            encrypted,
            "{} to {host}",
            mode.as_str()
        );
    }

    // Sessions refused, each with its reason.
    for (pg, mode, trusted, reason) in [
        (&plain, TlsMode::Require, None, "ServerWithoutTLS"),
        (&secure, TlsMode::VerifyFull, None, "CertificateNotTrusted"),
        (
            &secure,
            TlsMode::VerifyFull,
            Some(&other_ca),
            "CertificateNotTrusted",
        ),
        (&renamed, TlsMode::VerifyFull, Some(&ca), "HostnameMismatch"),
    ] {
        let e = servers
            .connect(
                &endpoint(pg, "localhost", mode, trusted),
                &pg.superuser_credentials(),
                "postgres",
            )
            .await
            .err()
            .unwrap_or_else(|| panic!("{} to port {} connected", mode.as_str(), pg.port()));
        assert_eq!(e.reason(), reason, "{e}");
        if reason == "CertificateNotTrusted" {
            assert!(
                e.to_string().contains("does not chain to a trusted root"),
                "{e}"
            );
        }
    }
}

/// A DatabaseServer of [`databases_on_tls_servers_name_each_tls_failure`] and a Database
/// on it, both named `name`.
struct TlsCase<'a> {
    name: &'static str,
    pg: &'a PgServer,
    host: &'static str,
    mode: &'static str,
    /// The CA in the server's CA Secret, if it has one.
    ca: Option<&'a TestCa>,
    /// The Database's Ready reason (`Provisioned`: Ready).
    reason: &'static str,
}

/// The same TLS through the controllers: DatabaseServers on real PostgreSQL servers
/// speaking TLS with certificates of a test CA, that CA in a Secret (`ca.crt`) beside the
/// admin Secret in the controllers' namespace, and a Database on each, served by a
/// database-controller. `verify-full` with the right CA provisions, and the connection
/// Secret (`PGSSLMODE`, `ca.crt`) logs in with TLS verified; `verify-ca` accepts a
/// certificate made out to another name. A wrong CA is `CertificateNotTrusted`, that other
/// name under `verify-full` `HostnameMismatch`, and `require` to a server without TLS
/// `ServerWithoutTLS`: on the Database's Ready condition and on the DatabaseServer's.
#[tokio::test]
async fn databases_on_tls_servers_name_each_tls_failure() {
    use dbops_e2e::fixtures::{create_tls_server, server_condition, server_name};
    use dbops_e2e::wait::{Want, database_condition};
    use dbops_shared::postgres::tls::{Verify, connector, roots_from_pem};

    let b = crate::bed("pg-tls").await;
    let ns = b.ns.name().to_string();
    let (ca, other_ca, secure, renamed, plain) = tls_servers("tls-db").await;

    let case = |name, pg, host, mode, ca, reason| TlsCase {
        name,
        pg,
        host,
        mode,
        ca,
        reason,
    };
    let cases = [
        case(
            "verified",
            &secure,
            "localhost",
            "verify-full",
            Some(&ca),
            "Provisioned",
        ),
        case(
            "any-name",
            &renamed,
            "localhost",
            "verify-ca",
            Some(&ca),
            "Provisioned",
        ),
        case(
            "untrusted",
            &secure,
            "localhost",
            "verify-full",
            Some(&other_ca),
            "CertificateNotTrusted",
        ),
        case(
            "renamed",
            &renamed,
            "localhost",
            "verify-full",
            Some(&ca),
            "HostnameMismatch",
        ),
        case(
            "plaintext",
            &plain,
            "127.0.0.1",
            "require",
            None,
            "ServerWithoutTLS",
        ),
    ];
    for c in &cases {
        let ca_pem = c.ca.map(TestCa::pem);
        create_tls_server(&b.client, &ns, c.name, c.pg, c.host, c.mode, ca_pem)
            .await
            .unwrap();
        dbops_e2e::fixtures::create_database(&b.client, &ns, c.name, c.name, serde_json::json!({}))
            .await
            .unwrap();
    }

    let kubeconfig = crate::controller_kubeconfig(b.cp, "database-controller").await;
    let logs = crate::test_dir("pg-tls", "logs");
    let args = crate::watch_args(&ns, "3s");
    let controller =
        ControllerProcess::start("database-controller", &kubeconfig, logs.path(), &args).unwrap();
    let log = || {
        let mut text = controller.process.log_tail(6000);
        for pg in [&secure, &renamed, &plain] {
            text = text.replace(pg.superuser_password(), "<superuser-password>");
        }
        dbops_e2e::postgres::redact_passwords(&text)
    };

    for &TlsCase {
        name, mode, reason, ..
    } in &cases
    {
        let status = if reason == "Provisioned" {
            "True"
        } else {
            "False"
        };
        let want = Want::new("Ready", status, Some(reason));
        if let Err(e) = database_condition(&b.client, &ns, name, want, READY).await {
            panic!("{mode}: {e:#}\n---- controller log tail ----\n{}", log());
        }
        let server = server_name(&ns, name);
        // The server's own Ready condition: True, or False with the same reason.
        let want = Want::new("Ready", status, (status == "False").then_some(reason));
        match server_condition(&b.client, &server, want, READY).await {
            Ok(found) if status == "True" => {
                let tls = found.status.and_then(|st| st.tls);
                assert!(
                    tls.as_ref().is_some_and(|t| t.mode.as_str() == mode
                        && t.protocol.as_deref().is_some_and(|p| p.starts_with("TLS"))),
                    "DatabaseServer {server}: status.tls {tls:?}"
                );
            }
            Ok(_) => {}
            Err(e) => panic!("{mode}: {e:#}\n---- controller log tail ----\n{}", log()),
        }
    }

    // The connection Secret of the verified Database: verify-full, the CA, and a login
    // that checks the certificate and the host name with nothing but the Secret.
    let secret = Api::<Secret>::namespaced(b.client.clone(), &ns)
        .get("verified-connection")
        .await
        .unwrap();
    let data = secret.data.unwrap_or_default();
    let value = |key: &str| {
        data.get(key)
            .map(|v| String::from_utf8(v.0.clone()).unwrap())
            .unwrap_or_else(|| panic!("no key {key} in verified-connection"))
    };
    assert_eq!(value("PGSSLMODE"), "verify-full");
    assert_eq!(value("ca.crt"), ca.pem());
    let roots = roots_from_pem(value("ca.crt").as_bytes()).unwrap();
    let mut config = tokio_postgres::Config::new();
    config
        .host(value("PGHOST"))
        .port(value("PGPORT").parse().unwrap())
        .user(value("PGUSER"))
        .password(value("PGPASSWORD"))
        .dbname(value("PGDATABASE"))
        .ssl_mode(tokio_postgres::config::SslMode::Require);
    let (client, connection) = config
        .connect(connector(Verify::ChainAndHost, Some(roots)).unwrap())
        .await
        .unwrap_or_else(|e| panic!("the application's verify-full login: {e}"));
    tokio::spawn(connection);
    let ssl: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl, "the application's session is not encrypted");

    // And libpq's own client, as an application would run it: the Secret's PG* keys as
    // its environment and its ca.crt as a mounted file, nothing else.
    let mounted = tempfile::Builder::new()
        .prefix("dbops-secret-mount-")
        .tempdir()
        .unwrap();
    let ca_file = mounted.path().join("ca.crt");
    std::fs::write(&ca_file, value("ca.crt")).unwrap();
    let psql = dbops_e2e::paths::postgres_bin_dir().unwrap().join("psql");
    let mut command = std::process::Command::new(&psql);
    command.env_clear();
    for key in [
        "PGHOST",
        "PGPORT",
        "PGUSER",
        "PGPASSWORD",
        "PGDATABASE",
        "PGSSLMODE",
    ] {
        command.env(key, value(key));
    }
    let out = command
        .env("PGSSLROOTCERT", &ca_file)
        .args([
            "-X",
            "-A",
            "-t",
            "-c",
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        ])
        .output()
        .unwrap();
    let ssl = stdout_text(out, "psql with the Secret's keys and verify-full").unwrap();
    assert_eq!(ssl.trim(), "t");

    // Nothing was created where TLS failed.
    for (name, pg) in [
        ("untrusted", &secure),
        ("renamed", &renamed),
        ("plaintext", &plain),
    ] {
        assert!(!pg.database_exists(name).await.unwrap(), "database {name}");
    }
    drop(controller);
}

/// The harness starts servers of the oldest and newest majors it knows (Debian's, and the
/// packages `e2e/install` put into the cache from `e2e/postgres.versions`), the newest
/// with TLS; each answers with its own major and keeps a table. The newest major's pg_dump
/// dumps the oldest server and its pg_restore loads that into the newest: the way across
/// majors. No control plane.
#[tokio::test]
async fn servers_of_the_oldest_and_newest_supported_majors_start_and_answer() {
    use dbops_api::TlsMode;
    use dbops_e2e::postgres::{client_bin_dir, server_majors};
    dbops_e2e::init_test_logging();
    let majors = server_majors().unwrap();
    let (oldest, newest) = (majors[0], majors[majors.len() - 1]);
    assert!(
        oldest <= 13 && newest >= 18,
        "majors {majors:?}: 13 and 18 at least"
    );
    let ca = TestCa::new("dbops-e2e-majors-ca").unwrap();
    let cert = ca.server_cert(&["localhost"], &LOOPBACK).unwrap();
    let (old_name, new_name) = (format!("pg{oldest}"), format!("pg{newest}"));
    let (old, new) = tokio::join!(
        PgServer::start_major(&old_name, oldest),
        PgServer::start_major_with_tls(&new_name, newest, Some(&cert)),
    );
    let (old, new) = (old.unwrap(), new.unwrap());

    for (pg, major) in [(&old, oldest), (&new, newest)] {
        let client = pg.connect_as_superuser().await.unwrap();
        let num: String = scalar(&client, "SHOW server_version_num").await;
        assert_eq!(
            num.parse::<u32>().unwrap() / 10000,
            major,
            "server_version_num {num} of {}",
            pg.bin_dir().display()
        );
        client
            .batch_execute(&format!(
                "CREATE TABLE marks (n int, note text);
                 INSERT INTO marks VALUES (1, 'one'), ({major}, 'major')"
            ))
            .await
            .unwrap();
        let rows = client
            .query("SELECT n, note FROM marks ORDER BY n", &[])
            .await
            .unwrap();
        let read: Vec<(i32, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        assert_eq!(read, [(1, "one".into()), (major as i32, "major".into())]);
    }

    // TLS on the newest.
    let session = new
        .superuser_session(TlsMode::Require, "postgres")
        .await
        .unwrap();
    assert!(
        is_encrypted(&session).await,
        "PostgreSQL {newest} speaks TLS"
    );

    // The newest major's pg_dump and pg_restore, from the oldest server to the newest.
    let clients = client_bin_dir(newest).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("old.dump");
    let run = |program: &str, pg: &PgServer, args: &[&str]| {
        let out = std::process::Command::new(clients.join(program))
            .env("PGPASSWORD", pg.superuser_password())
            .args(pg.superuser_login_args())
            .args(args)
            .output()
            .unwrap();
        let what = format!("{program} {newest} against PostgreSQL {}", pg.port());
        stdout_text(out, &what).unwrap();
    };
    let dump_arg = dump.to_str().unwrap();
    run(
        "pg_dump",
        &old,
        &["-Fc", "-t", "marks", "-f", dump_arg, "postgres"],
    );
    let client = new.connect_as_superuser().await.unwrap();
    client.batch_execute("CREATE DATABASE moved").await.unwrap();
    run("pg_restore", &new, &["--no-owner", "-d", "moved", dump_arg]);
    let moved = new.connect_as_superuser_to("moved").await.unwrap();
    let rows = moved
        .query("SELECT n, note FROM marks ORDER BY n", &[])
        .await
        .unwrap();
    let read: Vec<(i32, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(read, [(1, "one".into()), (oldest as i32, "major".into())]);
}

/// Whether the session's own connection is encrypted (`pg_stat_ssl`).
async fn is_encrypted(session: &dbops_shared::postgres::Session) -> bool {
    session
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}
