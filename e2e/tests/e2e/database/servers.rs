//! A DatabaseServer serves the namespaces it allows, within its quota, and outlives its
//! Databases.

use dbops_api::DatabaseServer;
use dbops_e2e::fixtures::merge_patch_spec;
use dbops_e2e::harness::database::{ADMIN_SECRET, READY, RESYNC, Setup, merge, not_ready};
use dbops_e2e::wait::{Want, eventually, holds_for};
use kube::api::{Api, DeleteParams};
use serde_json::json;

/// DatabaseServers: a Database naming a server that does not exist yet waits
/// (`ServerNotFound`) and provisions once it appears; a server serves only the namespaces
/// its `allowedNamespaces` selects (absent: none, `NamespaceNotAllowed`; changing it lets
/// the waiting Database in) and at most `limits.databasesPerNamespace` Databases per
/// namespace (`QuotaExceeded`); a refused Database touches nothing on the server. A server
/// in use keeps the finalizer `dbops.dev/server-in-use` until its last Database is gone.
#[tokio::test]
async fn a_server_serves_allowed_namespaces_within_its_quota_and_outlives_its_databases() {
    let s = Setup::new("db-server").await;
    let servers: Api<DatabaseServer> = Api::all(s.b.client.clone());
    let admin = json!({"adminSecretRef": {"name": ADMIN_SECRET}});
    let on = |server: &str| json!({"serverRef": {"name": s.server(server)}});
    let untouched = |name: &'static str| {
        let pg = &s.pg;
        async move {
            assert!(!pg.database_exists(name).await.unwrap(), "database {name}");
            assert!(!pg.role_exists(name).await.unwrap(), "role {name}");
        }
    };

    // The test's server: Ready, with what it runs and how it is reached.
    let main = s
        .wait_server(&s.server(ADMIN_SECRET), Want::new("Ready", "True", None))
        .await;
    let status = main.status.unwrap();
    assert!(
        status.server_version.is_some_and(|v| !v.is_empty()),
        "no serverVersion"
    );
    assert_eq!(
        status.tls.map(|t| t.mode),
        Some(dbops_api::TlsMode::Disable)
    );

    // A server that does not exist yet.
    s.create("early", on("later")).await;
    s.wait("early", not_ready("ServerNotFound"), READY).await;
    untouched("early").await;
    s.create_server("later", admin.clone()).await;
    let early = s.wait_ready("early").await;
    assert_eq!(
        early.status.and_then(|st| st.server).as_deref(),
        Some(s.server("later").as_str())
    );
    let later = s.server("later");
    eventually(
        "DatabaseServer later to count its Database",
        READY,
        || async {
            Ok(servers
                .get(&later)
                .await?
                .status
                .and_then(|st| st.databases))
        },
        |count| *count == Some(1),
    )
    .await;

    // Namespaces: none allowed, then another tenant's only, then every namespace.
    let mut closed = admin.clone();
    merge(&mut closed, json!({"allowedNamespaces": null}));
    s.create_server("closed", closed).await;
    let mut elsewhere = admin.clone();
    merge(
        &mut elsewhere,
        json!({"allowedNamespaces": {"matchLabels": {"dbops.dev/tenant": "elsewhere"}}}),
    );
    s.create_server("elsewhere", elsewhere).await;
    s.create("shut", on("closed")).await;
    s.create("foreign", on("elsewhere")).await;
    for name in ["shut", "foreign"] {
        s.wait(name, not_ready("NamespaceNotAllowed"), READY).await;
    }
    untouched("shut").await;
    untouched("foreign").await;
    merge_patch_spec(
        &servers,
        &s.server("closed"),
        json!({"allowedNamespaces": {}}),
    )
    .await
    .unwrap();
    s.wait_ready("shut").await;

    // A quota of one Database per namespace: the first is served, the second refused.
    let mut small = admin.clone();
    merge(&mut small, json!({"limits": {"databasesPerNamespace": 1}}));
    s.create_server("small", small).await;
    let first = s.create("first", on("small")).await;
    s.wait_ready("first").await;
    let second = s.create("second", on("small")).await;
    s.wait("second", not_ready("QuotaExceeded"), READY).await;
    untouched("second").await;

    // In use: the finalizer holds the server's deletion until its Databases are gone.
    let small = s.server("small");
    let in_use = |server: &DatabaseServer| {
        server
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == dbops_api::server::IN_USE_FINALIZER)
    };
    let held = eventually(
        "DatabaseServer small to carry dbops.dev/server-in-use",
        READY,
        || async { Ok(servers.get(&small).await.map(ServerView)?) },
        |server| in_use(&server.0),
    )
    .await;
    servers
        .delete(&small, &DeleteParams::default())
        .await
        .unwrap();
    // It says why: Ready=False/InUse, naming the Databases that hold it.
    let waiting = s.wait_server(&small, Want::not_ready("InUse")).await;
    let message = waiting
        .status
        .iter()
        .flat_map(|st| st.conditions.iter())
        .find(|c| c.type_ == "Ready")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains("first") && message.contains("second"),
        "the InUse message names the Databases on the server: {message}"
    );
    holds_for(
        "DatabaseServer small stays while Database first is on it",
        RESYNC * 2,
        || async { Ok(servers.get_opt(&small).await?.map(ServerView)) },
        |server| server.as_ref().is_some_and(|s| in_use(&s.0)),
    )
    .await
    .unwrap();
    s.delete("first").await;
    s.delete("second").await;
    s.wait_gone(&first, READY).await;
    s.wait_gone(&second, READY).await;
    let uid = held.0.metadata.uid.clone().unwrap();
    if let Err(e) = dbops_e2e::wait::deleted(servers.clone(), &small, &uid, READY).await {
        panic!(
            "{e:#}\n---- controller log tail ----\n{}",
            s.controller_log(6000)
        );
    }
}

/// A DatabaseServer shown by its deletion state, finalizers and status, for failure
/// messages.
struct ServerView(DatabaseServer);

impl std::fmt::Debug for ServerView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DatabaseServer {:?} deletionTimestamp {:?} finalizers {:?} status {:?}",
            self.0.metadata.name,
            self.0.metadata.deletion_timestamp,
            self.0.metadata.finalizers,
            self.0.status
        )
    }
}
