//! What the controller never takes over (a database, role or Secret that is not its own)
//! and bad admin input, reported without leaking the admin password.

use std::collections::BTreeMap;
use std::time::Duration;

use dbops_e2e::harness::database::{
    ADMIN_SECRET, READY, RESYNC, SecretView, Setup, login, not_ready,
};
use dbops_e2e::wait::holds_for;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, PostParams};
use rand::distr::{Alphanumeric, SampleString};
use serde_json::json;

/// 7. A database or role that exists without our mark is never adopted or touched.
#[tokio::test]
async fn an_existing_database_or_role_is_a_name_conflict_and_untouched() {
    let s = Setup::new("db-conflict").await;
    let su = s.pg.connect_as_superuser().await.unwrap();
    let hand_password = Alphanumeric.sample_string(&mut rand::rng(), 20);
    for sql in [
        "CREATE DATABASE taken".to_string(),
        "COMMENT ON DATABASE taken IS 'made by hand'".to_string(),
        format!(
            "CREATE ROLE hand_role LOGIN PASSWORD {}",
            dbops_e2e::postgres::quote_literal(&hand_password)
        ),
    ] {
        su.batch_execute(&sql).await.unwrap();
    }
    let taken_oid = s.pg.database_oid("taken").await.unwrap();

    s.create("taken", json!({"deletionPolicy": "Delete"})).await;
    s.create(
        "fresh",
        json!({"owner": "hand_role", "deletionPolicy": "Delete"}),
    )
    .await;
    let taken = s.wait("taken", not_ready("NameConflict"), READY).await;
    let fresh = s.wait("fresh", not_ready("NameConflict"), READY).await;

    // Watch for a few resyncs: nothing changes in PostgreSQL.
    holds_for(
        "database taken, role hand_role and no database fresh, all as made by hand",
        RESYNC * 2 + Duration::from_secs(1),
        || async {
            Ok((
                s.pg.database_oid("taken").await?,
                s.pg.database_comment("taken").await?,
                s.pg.database_owner("taken").await?,
                s.pg.role_comment("hand_role").await?,
                s.pg.database_exists("fresh").await?,
                s.pg.role_exists("taken").await?,
            ))
        },
        |state| {
            *state
                == (
                    taken_oid,
                    Some("made by hand".to_string()),
                    Some("postgres".to_string()),
                    None,
                    false,
                    false,
                )
        },
    )
    .await
    .unwrap();
    assert!(
        login(s.pg.port(), "hand_role", &hand_password, "postgres")
            .await
            .unwrap(),
        "the password of the hand-made role was changed"
    );
    assert!(
        s.secrets()
            .get_opt("taken-connection")
            .await
            .unwrap()
            .is_none(),
        "no connection Secret for a conflicting database"
    );

    for name in ["taken", "fresh"] {
        let events = s.events_for(name).await;
        assert!(
            events
                .iter()
                .any(|e| e.reason.as_deref() == Some("NameConflict")),
            "no NameConflict Event about Database {name}: {:?}",
            events
                .iter()
                .map(|e| (&e.type_, &e.reason))
                .collect::<Vec<_>>()
        );
    }

    // Deleting with policy Delete drops nothing that is not ours.
    s.delete("taken").await;
    s.delete("fresh").await;
    s.wait_gone(&taken, READY).await;
    s.wait_gone(&fresh, READY).await;
    assert_eq!(
        s.pg.database_oid("taken").await.unwrap(),
        taken_oid,
        "database taken was dropped"
    );
    assert_eq!(
        s.pg.database_comment("taken").await.unwrap().as_deref(),
        Some("made by hand")
    );
    assert!(
        s.pg.role_exists("hand_role").await.unwrap(),
        "role hand_role was dropped"
    );
    assert!(
        login(s.pg.port(), "hand_role", &hand_password, "postgres")
            .await
            .unwrap()
    );
}

/// 10. Bad admin input is reported precisely and never leaks the admin password.
#[tokio::test]
async fn bad_admin_input_is_reported_without_leaking_the_password() {
    let s = Setup::new("db-admin").await;
    let wrong = format!("wrong-{}", Alphanumeric.sample_string(&mut rand::rng(), 16));
    s.create_admin_secret("nopw-admin", Some("postgres"), None)
        .await;
    s.create_admin_secret("wrong-admin", Some("postgres"), Some(&wrong))
        .await;
    let closed_port = dbops_e2e::process::free_port().unwrap();
    // A DatabaseServer per admin Secret (late-admin's does not exist yet), and one on a
    // closed port with the good admin Secret.
    for admin in ["late-admin", "nopw-admin", "wrong-admin"] {
        s.create_server(admin, json!({})).await;
    }
    s.create_server(
        "closed-port",
        json!({"port": closed_port, "adminSecretRef": {"name": ADMIN_SECRET}}),
    )
    .await;
    // CA Secrets: missing, without ca.crt, not a certificate.
    dbops_e2e::fixtures::create_secret(&s.b.client, s.ns(), "empty-ca", &[("other", "x")])
        .await
        .unwrap();
    dbops_e2e::fixtures::create_ca_secret(
        &s.b.client,
        s.ns(),
        "junk-ca",
        "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n",
    )
    .await
    .unwrap();
    for (server, ca) in [
        ("no-ca", "missing-ca"),
        ("empty-ca", "empty-ca"),
        ("junk-ca", "junk-ca"),
    ] {
        s.create_server(
            server,
            json!({"adminSecretRef": {"name": ADMIN_SECRET},
                   "tls": {"mode": "verify-full", "caSecretRef": {"name": ca}}}),
        )
        .await;
    }
    let on = |admin: &str| json!({"serverRef": {"name": s.server(admin)}});

    // (Database, the admin Secret of its server, why it is not Ready.)
    let refused = [
        ("no-ca", "no-ca", "CASecretNotFound"),
        ("empty-ca", "empty-ca", "CASecretInvalid"),
        ("junk-ca", "junk-ca", "CASecretInvalid"),
        ("nosecret", "late-admin", "AdminSecretNotFound"),
        ("nopassword", "nopw-admin", "AdminSecretInvalid"),
        ("wrongpassword", "wrong-admin", "AuthenticationFailed"),
        ("closedport", "closed-port", "ServerUnreachable"),
    ];
    for (name, admin, _) in refused {
        s.create(name, on(admin)).await;
    }

    for (name, _, reason) in refused {
        s.wait(name, not_ready(reason), READY).await;
    }
    for name in ["nosecret", "no-ca", "empty-ca", "junk-ca"] {
        let dbname = name.replace('-', "_");
        assert!(!s.pg.database_exists(&dbname).await.unwrap(), "{dbname}");
    }
    // The DatabaseServers say the same about themselves.
    for (admin, reason) in [
        ("no-ca", "CASecretNotFound"),
        ("empty-ca", "CASecretInvalid"),
        ("junk-ca", "CASecretInvalid"),
        ("late-admin", "AdminSecretNotFound"),
        ("nopw-admin", "AdminSecretInvalid"),
        ("wrong-admin", "AuthenticationFailed"),
        ("closed-port", "ServerUnreachable"),
    ] {
        s.wait_server(&s.server(admin), not_ready(reason)).await;
    }

    // The missing Secret appears: the Database proceeds without any change to it.
    let started = std::time::Instant::now();
    let password = s.pg.superuser_password().to_string();
    s.create_admin_secret("late-admin", Some("postgres"), Some(&password))
        .await;
    s.wait_ready("nosecret").await;
    tracing::info!(elapsed = ?started.elapsed(), "nosecret Ready after its admin Secret appeared");

    // Nothing shows either password: status (the Databases' and the DatabaseServers'),
    // Events, the controller's log.
    let dbs =
        s.b.kubectl
            .run(&["get", "databases", "-n", s.ns(), "-o", "yaml"], None)
            .unwrap();
    let selector = s.b.ns.server_selector();
    let servers =
        s.b.kubectl
            .run(
                &["get", "databaseservers", "-l", &selector, "-o", "yaml"],
                None,
            )
            .unwrap();
    assert!(
        servers.success && servers.stdout.contains("AuthenticationFailed"),
        "kubectl get databaseservers failed"
    );
    assert!(
        dbs.success && dbs.stdout.contains("AuthenticationFailed"),
        "kubectl get databases failed"
    );
    let events =
        s.b.kubectl
            .run(&["get", "events", "-n", s.ns(), "-o", "yaml"], None)
            .unwrap();
    assert!(
        events.success && events.stdout.contains("Database"),
        "no Events about Databases"
    );
    let log = s.controller_log_raw();
    for (what, text) in [
        ("kubectl get databases -o yaml", &dbs.stdout),
        ("kubectl get databaseservers -o yaml", &servers.stdout),
        ("kubectl get events -o yaml", &events.stdout),
        ("the controller's log", &log),
    ] {
        for (which, secret) in [
            ("admin password", &password),
            ("wrong admin password", &wrong),
        ] {
            let line = text.lines().position(|l| l.contains(secret.as_str()));
            assert!(
                line.is_none(),
                "the {which} appears in {what}, line {}",
                line.unwrap_or(0) + 1
            );
        }
    }
}

/// Issue 10, item 2: a Secret `<name>-connection` that dbops did not create is never taken
/// over. The Database reports `Ready=False/SecretConflict`, the Secret keeps its data and
/// gains no owner (so deleting the Database cannot garbage-collect it), and nothing is
/// created on the server; once the Secret is gone, a new Database of that name provisions.
#[tokio::test]
async fn an_existing_secret_is_never_taken_over() {
    let s = Setup::new("db-secret-conflict").await;
    let mut theirs = Secret::default();
    theirs.metadata.name = Some("billing-connection".into());
    theirs.string_data = Some(BTreeMap::from([(
        "password".to_string(),
        "not-dbops".to_string(),
    )]));
    let theirs = s
        .secrets()
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();

    let db = s
        .create("billing", json!({"deletionPolicy": "Delete"}))
        .await;
    let refused = s.wait("billing", not_ready("SecretConflict"), READY).await;
    let message = refused
        .status
        .as_ref()
        .and_then(|st| {
            st.conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| c.message.clone())
        })
        .unwrap_or_default();
    assert!(message.contains("billing-connection"), "{message}");
    let untouched = |found: &Secret| {
        found.metadata.resource_version == theirs.metadata.resource_version
            && found.metadata.owner_references.is_none()
    };
    holds_for(
        "Secret billing-connection keeps its data and gains no owner",
        RESYNC * 2 + Duration::from_secs(1),
        || async {
            Ok(s.secrets()
                .get("billing-connection")
                .await
                .map(SecretView)?)
        },
        |found| untouched(&found.0),
    )
    .await
    .unwrap();
    assert!(!s.pg.role_exists("billing").await.unwrap(), "role created");
    assert!(
        !s.pg.database_exists("billing").await.unwrap(),
        "database created"
    );
    assert!(
        s.events_for("billing")
            .await
            .iter()
            .any(|e| e.reason.as_deref() == Some("SecretConflict")
                && e.type_.as_deref() == Some("Warning")),
        "no Warning Event SecretConflict"
    );

    // Deleting the Database leaves the Secret alone (no owner reference to collect it).
    s.delete("billing").await;
    s.wait_gone(&db, READY).await;
    holds_for(
        "Secret billing-connection survives the Database's deletion",
        Duration::from_secs(5),
        || async {
            Ok(s.secrets()
                .get_opt("billing-connection")
                .await?
                .map(SecretView))
        },
        |found| found.as_ref().is_some_and(|f| untouched(&f.0)),
    )
    .await
    .unwrap();

    // Without the foreign Secret, the same name provisions and the Secret is its own.
    s.secrets()
        .delete("billing-connection", &DeleteParams::default())
        .await
        .unwrap();
    let db = s
        .create("billing", json!({"deletionPolicy": "Delete"}))
        .await;
    s.wait_ready("billing").await;
    let own = s.connection_secret("billing").await;
    assert!(
        own.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| Some(&o.uid) == db.metadata.uid.as_ref() && o.controller == Some(true))
    );
}
