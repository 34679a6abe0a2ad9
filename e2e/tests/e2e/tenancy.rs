//! Tenancy: a tenant namespace separate from the controllers' own (where the admin Secret
//! lives), as in a real installation. Deleting a tenant namespace never hangs on dbops
//! and each deletion policy is honoured; a tenant that may create Databases cannot read
//! the admin credentials.
//!
//! The controllers run with their own ServiceAccount tokens (the RBAC of `deploy/`),
//! `--watch-namespace=<tenant>`, `--controller-namespace=<controllers' namespace>` and a
//! `--server-selector` of their own.

use std::time::{Duration, Instant};

use dbops_api::Database;
use dbops_e2e::fixtures;
use dbops_e2e::harness::redact::redact;
use dbops_e2e::wait::{Want, database_condition, database_has, eventually, wait_for};
use dbops_e2e::{PgServer, TestNamespace};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

use crate::{bed, start_tenant_database_controller};

const ADMIN_SECRET: &str = "pg-admin";
const READY: Duration = Duration::from_secs(60);

/// A PostgreSQL server of the test's own, its admin Secret in the controllers' namespace
/// `ctl`, and the name of the DatabaseServer the fixtures give it.
async fn admin_server(b: &crate::Bed, ctl: &str, name: &str) -> (PgServer, String) {
    let pg = PgServer::start(name).await.unwrap();
    fixtures::create_admin_secret(&b.client, ctl, ADMIN_SECRET, &pg)
        .await
        .unwrap();
    (pg, fixtures::server_name(ctl, ADMIN_SECRET))
}
/// What the issue allows for a namespace with Databases of every policy to be gone.
const NAMESPACE_GONE: Duration = Duration::from_secs(120);

/// A namespace holding Databases of every policy is gone within two minutes: Delete
/// dropped its database, Retain kept its own, and Snapshot (whose final Backup cannot be
/// made in a terminating namespace) kept its database and said so on the DatabaseServer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tenant_namespace_never_hangs_and_keeps_what_each_policy_says() {
    // The controllers' namespace (admin Secret, DatabaseServer) and the tenant's.
    let b = bed("ns-ctl").await;
    let ctl = b.ns.name().to_string();
    let tenant = TestNamespace::create(&b.client, &b.kubectl, "ns-tenant")
        .await
        .unwrap();
    let tenant_name = tenant.name().to_string();
    let (pg, server) = admin_server(&b, &ctl, "ns-delete").await;

    let logs = tempfile::Builder::new()
        .prefix("dbops-ns-delete-logs-")
        .tempdir()
        .unwrap();
    let controller =
        start_tenant_database_controller(&b, &tenant_name, &ctl, "3s", &[], logs.path()).await;
    let log = || redact(&controller.process.log_tail(6000), [("superuser", &pg)]);

    let policies = [
        ("kept", "Retain"),
        ("dropped", "Delete"),
        ("snapped", "Snapshot"),
    ];
    for (name, policy) in policies {
        fixtures::create_database(
            &b.client,
            &tenant_name,
            name,
            ADMIN_SECRET,
            json!({"serverRef": {"name": server}, "deletionPolicy": policy}),
        )
        .await
        .unwrap();
    }
    for (name, _) in policies {
        let want = Want::provisioned();
        if let Err(e) = database_condition(&b.client, &tenant_name, name, want, READY).await {
            panic!("{e:#}\n---- controller log ----\n{}", log());
        }
        assert!(pg.database_exists(name).await.unwrap());
    }

    // The namespace goes, with everything in it.
    let namespaces: Api<Namespace> = Api::all(b.client.clone());
    let uid = namespaces
        .get(&tenant_name)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap_or_default();
    let started = Instant::now();
    namespaces
        .delete(&tenant_name, &DeleteParams::default())
        .await
        .unwrap();
    let gone =
        dbops_e2e::wait::deleted(namespaces.clone(), &tenant_name, &uid, NAMESPACE_GONE).await;
    let took = started.elapsed();
    if let Err(e) = gone {
        let left = b
            .kubectl
            .run(&["get", "dbops", "-n", &tenant_name, "-o", "yaml"], None)
            .map(|o| o.stdout)
            .unwrap_or_default();
        panic!(
            "{e:#}\n---- what is left ----\n{left}\n---- controller log ----\n{}",
            log()
        );
    }
    eprintln!("namespace {tenant_name} with 3 Databases gone in {took:?}");

    // Delete dropped; Retain kept; Snapshot kept (no final Backup could be made).
    assert!(
        !pg.database_exists("dropped").await.unwrap(),
        "Delete drops"
    );
    assert!(pg.database_exists("kept").await.unwrap(), "Retain keeps");
    assert!(
        pg.database_exists("snapped").await.unwrap(),
        "Snapshot without its final Backup keeps the database"
    );
    // ... and the platform team hears of it on the DatabaseServer (cluster-scoped: its
    // Events are in `default`).
    let found = wait_for(
        "a KeptWithoutFinalSnapshot Event on the DatabaseServer",
        Duration::from_secs(30),
        || async { fixtures::events_about(&b.client, "default", "DatabaseServer", &server).await },
        |events: &Vec<k8s_openapi::api::core::v1::Event>| {
            events.iter().any(|e| {
                e.reason.as_deref() == Some("KeptWithoutFinalSnapshot")
                    && e.message.as_deref().is_some_and(|m| m.contains("snapped"))
            })
        },
    )
    .await;
    if let Err(e) = found {
        panic!("{e:#}\n---- controller log ----\n{}", log());
    }
    drop(controller);
    drop(tenant);
}

/// A tenant ServiceAccount that may create Databases in its namespace reads no admin
/// credential: not the admin Secret in the controllers' namespace, not the DatabaseServers
/// (which name it), while it can use its own namespace as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_that_may_create_databases_cannot_read_admin_credentials() {
    let b = bed("tenant-rbac").await;
    let ctl = b.ns.name().to_string();
    let tenant = TestNamespace::create(&b.client, &b.kubectl, "tenant-team")
        .await
        .unwrap();
    let tenant_name = tenant.name().to_string();
    let (_pg, _) = admin_server(&b, &ctl, "tenant-rbac").await;

    // What a platform team gives an application team: Databases, Backups and Migrations,
    // and the Secrets, of its own namespace.
    let manifest = format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata: {{name: app-team, namespace: {tenant_name}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: dbops-user, namespace: {tenant_name}}}
rules:
  - apiGroups: [dbops.dev]
    resources: [databases, backups, migrations]
    verbs: [get, list, watch, create, update, patch, delete]
  - apiGroups: [""]
    resources: [secrets]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: dbops-user, namespace: {tenant_name}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: dbops-user}}
subjects: [{{kind: ServiceAccount, name: app-team, namespace: {tenant_name}}}]
"#
    );
    let applied = b
        .kubectl
        .run(&["apply", "-f", "-"], Some(&manifest))
        .unwrap();
    assert!(applied.success, "{}", applied.stderr);

    let who = format!("system:serviceaccount:{tenant_name}:app-team");
    let can = |verb: &str, resource: &str, namespace: Option<&str>| {
        let mut args = vec!["auth", "can-i", verb, resource, "--as", who.as_str()];
        match namespace {
            Some(ns) => args.extend(["-n", ns]),
            None => args.push("--all-namespaces"),
        }
        let out = b.kubectl.run(&args, None).unwrap();
        out.stdout.trim() == "yes"
    };
    let admin_secret = format!("secrets/{ADMIN_SECRET}");
    let cases = [
        // Its own work.
        (
            "create",
            "databases.dbops.dev",
            Some(tenant_name.as_str()),
            true,
        ),
        ("get", "secrets", Some(tenant_name.as_str()), true),
        // The admin credentials: neither the Secret nor the servers that name it.
        ("get", admin_secret.as_str(), Some(ctl.as_str()), false),
        ("list", "secrets", Some(ctl.as_str()), false),
        ("list", "secrets", None, false),
        ("get", "databaseservers.dbops.dev", None, false),
        ("create", "databaseservers.dbops.dev", None, false),
    ];
    for (verb, resource, namespace, allowed) in cases {
        assert_eq!(
            can(verb, resource, namespace),
            allowed,
            "can-i {verb} {resource} in {namespace:?} as {who}"
        );
    }
    drop(tenant);
}

/// The RoleBinding the database-controller writes in a tenant namespace
/// (`database-controller/src/tenant_secrets.rs`).
const TENANT_SECRETS: &str = "dbops-database-controller-tenant-secrets";

/// Issue 22, seen on a real node: a Database's reconcile waited inside itself (for its
/// namespace's connection Secrets), the Database was deleted and created again with the
/// same name meanwhile, and when the wait ended the reconcile went on for the object it
/// held: it created the role and database marked as the deleted Database's (left to
/// nobody), wrote that object's status over the new one's, and the new Database was stuck
/// in NameConflict. A reconcile must confirm, after such a wait and before it changes
/// anything on the server, that the object it acts for is still the live one.
///
/// The wait is the real one, and it ends when the test says: the controller runs with
/// `--service-account` naming a ServiceAccount other than its token's, in a tenant
/// namespace where its token holds nothing, so the RoleBinding it writes there grants the
/// process nothing yet (as one the apiserver's authorizer has not taken in) and the
/// reconcile waits for the grant; the test grants the token the Secrets there with a
/// RoleBinding of its own once the Database has been deleted and created again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_replaced_while_its_reconcile_waits_is_provisioned_for_the_new_one_only() {
    const NAME: &str = "orders";
    let b = bed("replaced-ctl").await;
    let ctl = b.ns.name().to_string();
    let tenant = TestNamespace::create_tenant(&b.client, &b.kubectl, "replaced-tenant")
        .await
        .unwrap();
    let tenant_name = tenant.name().to_string();
    let (pg, server) = admin_server(&b, &ctl, "replaced").await;

    let logs = crate::test_dir("replaced", "logs");
    // Not the token's ServiceAccount: the RoleBinding grants the process nothing.
    let stand_in = [format!("--service-account={ctl}/stand-in")];
    let controller =
        start_tenant_database_controller(&b, &tenant_name, &ctl, "3s", &stand_in, logs.path())
            .await;
    let log = || redact(&controller.process.log_tail(12000), [("superuser", &pg)]);

    let spec = json!({"serverRef": {"name": server}});
    let dbs: Api<Database> = Api::namespaced(b.client.clone(), &tenant_name);
    let first =
        fixtures::create_database(&b.client, &tenant_name, NAME, ADMIN_SECRET, spec.clone())
            .await
            .unwrap();
    let first_uid = first.metadata.uid.clone().unwrap();

    // The controller wrote the namespace's RoleBinding and waits for what it grants.
    let bindings: Api<RoleBinding> = Api::namespaced(b.client.clone(), &tenant_name);
    eventually(
        "the database-controller's RoleBinding in the tenant namespace",
        Duration::from_secs(30),
        || async { Ok(bindings.get_opt(TENANT_SECRETS).await?.is_some()) },
        |found| *found,
    )
    .await;
    // Held before anything was done: nothing on the server, no status.
    assert!(!pg.role_exists(NAME).await.unwrap(), "{}", log());
    assert!(!pg.database_exists(NAME).await.unwrap(), "{}", log());
    let held = dbs.get(NAME).await.unwrap();
    assert!(held.status.is_none(), "{:?}\n{}", held.status, log());

    // Deleted (Retain: no finalizer, gone at once) and created again, same name and spec.
    dbs.delete(NAME, &DeleteParams::default()).await.unwrap();
    dbops_e2e::wait::deleted(dbs.clone(), NAME, &first_uid, Duration::from_secs(30))
        .await
        .unwrap();
    let second = fixtures::create_database(&b.client, &tenant_name, NAME, ADMIN_SECRET, spec)
        .await
        .unwrap();
    let second_uid = second.metadata.uid.clone().unwrap();

    // The wait ends: the token may now read the namespace's Secrets.
    let grant: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "e2e-grant", "namespace": tenant_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": TENANT_SECRETS},
        "subjects": [{"kind": "ServiceAccount", "name": "dbops-database-controller", "namespace": "dbops-system"}],
    }))
    .unwrap();
    bindings
        .create(&PostParams::default(), &grant)
        .await
        .unwrap();

    // The new Database ends Ready, provisioned for itself. NameConflict or SecretConflict
    // would be the deleted one's leftovers in its way: no need to wait longer for those.
    let settled = wait_for(
        "the new Database Ready, or refused",
        READY,
        || async { Ok(dbs.get(NAME).await?) },
        |db: &Database| {
            let ready = db.status.as_ref().and_then(|s| {
                dbops_shared::conditions::get(&s.conditions, dbops_api::condition::READY)
            });
            ready.is_some_and(|c| {
                c.status == "True"
                    || ["NameConflict", "SecretConflict"].contains(&c.reason.as_str())
            })
        },
    )
    .await;
    let db = match settled {
        Ok(db) => db,
        Err(e) => panic!("{e:#}\n---- controller log ----\n{}", log()),
    };
    assert_eq!(db.metadata.uid.as_deref(), Some(second_uid.as_str()));
    assert!(
        database_has(&db, Want::provisioned()),
        "the new Database is not Ready: {:?}\n---- controller log ----\n{}",
        db.status,
        log()
    );

    // On the server: the role and database are the new Database's; nothing is marked as
    // the deleted one's.
    let role_mark = pg.role_comment(NAME).await.unwrap().unwrap_or_default();
    let database_mark = pg.database_comment(NAME).await.unwrap().unwrap_or_default();
    assert!(
        role_mark.contains(&second_uid),
        "role {NAME}: {role_mark:?}"
    );
    assert!(
        database_mark.contains(&second_uid),
        "database {NAME}: {database_mark:?}"
    );
    let admin = pg.connect_as_superuser().await.unwrap();
    let marked_old: i64 = admin
        .query_one(
            "SELECT (SELECT count(*) FROM pg_roles WHERE shobj_description(oid, 'pg_authid') LIKE '%' || $1 || '%') \
             + (SELECT count(*) FROM pg_database WHERE shobj_description(oid, 'pg_database') LIKE '%' || $1 || '%')",
            &[&first_uid],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        marked_old, 0,
        "roles and databases marked as the deleted Database's"
    );
    // Its status speaks of its own database, and its Secret is its own.
    let oid = pg.database_oid(NAME).await.unwrap().unwrap();
    let provider_id = db.status.as_ref().and_then(|s| s.provider_id.clone());
    assert!(
        provider_id
            .as_deref()
            .is_some_and(|p| p.ends_with(&format!("/{oid}"))),
        "providerID {provider_id:?}, database oid {oid}"
    );
    let secret = Api::<Secret>::namespaced(b.client.clone(), &tenant_name)
        .get(&format!("{NAME}-connection"))
        .await
        .unwrap();
    let owners: Vec<String> = secret
        .metadata
        .owner_references
        .unwrap_or_default()
        .into_iter()
        .map(|o| o.uid)
        .collect();
    assert_eq!(owners, std::slice::from_ref(&second_uid));
    // No Event says the deleted Database was provisioned.
    let events = fixtures::events_about(&b.client, &tenant_name, "Database", NAME)
        .await
        .unwrap();
    let about_old: Vec<(Option<String>, Option<String>)> = events
        .iter()
        .filter(|e| e.involved_object.uid.as_deref() == Some(first_uid.as_str()))
        .map(|e| (e.reason.clone(), e.message.clone()))
        .collect();
    assert!(
        !about_old
            .iter()
            .any(|(reason, _)| reason.as_deref() == Some("Provisioned")),
        "Events about the deleted Database: {about_old:?}"
    );
    drop(controller);
    drop(tenant);
}
