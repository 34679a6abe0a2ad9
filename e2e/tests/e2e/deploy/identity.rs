//! Each controller does its whole job with a token of its own ServiceAccount (TokenRequest
//! API), and the apiserver refuses a controller a verb it does not need.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use dbops_api::{Backup, BackupPhase, Database};
use dbops_e2e::controlplane::{client_from_kubeconfig, service_account_user};
use dbops_e2e::fixtures::{create_backup, manifest};
use dbops_e2e::harness::deploy::{
    CONTROLLERS, SYSTEM_NAMESPACE, TENANT_BINDING, TENANT_ROLE, can_i_as, deployed,
    start_controller, wait_leading,
};
use dbops_e2e::postgres::redact_passwords;
use dbops_e2e::wait::{Want, eventually, wait_for};
use dbops_e2e::{ControllerProcess, Kubectl, PgServer, paths};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::bed;

/// One test's world for the ServiceAccount runs: namespace, PostgreSQL, admin Secret (in
/// `dbops-system`, the controllers' namespace, deleted with the world), DatabaseServer,
/// the three controllers with their own tokens.
struct AsServiceAccounts {
    controllers: Vec<(&'static str, ControllerProcess)>,
    pg: PgServer,
    b: crate::Bed,
    logs: tempfile::TempDir,
    _store: tempfile::TempDir,
    /// The admin Secret's name in `dbops-system`.
    admin_secret: String,
}

impl Drop for AsServiceAccounts {
    fn drop(&mut self) {
        let _ = self.b.kubectl.run(
            &[
                "delete",
                "secret",
                &self.admin_secret,
                "-n",
                SYSTEM_NAMESPACE,
                "--wait=false",
                "--ignore-not-found",
            ],
            None,
        );
    }
}

impl AsServiceAccounts {
    fn log(&self, controller: &str) -> String {
        let path = self.logs.path().join(format!("{controller}.log"));
        let text = std::fs::read_to_string(path).unwrap_or_default();
        redact_passwords(&text.replace(self.pg.superuser_password(), "<superuser-password>"))
    }

    fn logs(&self) -> String {
        self.controllers
            .iter()
            .map(|(c, _)| format!("---- {c} log ----\n{}\n", self.log(c)))
            .collect()
    }
}

#[tokio::test]
async fn each_controller_does_its_job_with_a_token_of_its_own_service_account() {
    let b = bed("sa-token").await;
    deployed(b.cp).await;
    let ns = b.ns.name().to_string();
    let pg = PgServer::start("sa-token").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(b.client.clone(), &ns);
    // The admin Secret where the Deployments' controllers read it, named for this test
    // (dbops-system is shared); the DatabaseServer labelled as this test's, which the
    // controllers select.
    let admin_secret = format!("{ns}-pg-admin");
    dbops_e2e::fixtures::create_secret(
        &b.client,
        SYSTEM_NAMESPACE,
        &admin_secret,
        &[
            ("username", dbops_e2e::postgres::SUPERUSER),
            ("password", pg.superuser_password()),
        ],
    )
    .await
    .unwrap();
    let server = dbops_e2e::fixtures::server_name(&ns, "pg");
    dbops_e2e::fixtures::create_server(
        &b.client,
        &ns,
        &server,
        dbops_e2e::fixtures::server_spec(&pg, &admin_secret),
    )
    .await
    .unwrap();

    let logs = tempfile::tempdir().unwrap();
    let store = tempfile::tempdir().unwrap();
    let store_url = format!("file://{}", store.path().display());
    let pg_bin = paths::postgres_bin_dir().unwrap();
    let mut world = AsServiceAccounts {
        controllers: Vec::new(),
        pg,
        b,
        logs,
        _store: store,
        admin_secret,
    };
    for controller in CONTROLLERS {
        let account = format!("dbops-{controller}");
        let kubeconfig = world
            .b
            .cp
            .kubeconfig_for_service_account(SYSTEM_NAMESPACE, &account, Duration::from_secs(3600))
            .await
            .unwrap();
        // The flags and environment of the Deployment, scoped to this test's namespace.
        let mut args = vec![
            "--leader-elect".to_string(),
            format!("--watch-namespace={ns}"),
            "--resync-interval=5s".to_string(),
            "--backoff-base=1s".to_string(),
            "--backoff-max=5s".to_string(),
        ];
        match controller {
            "database-controller" => args.extend([
                format!("--backup-store={store_url}"),
                format!("--pg-restore={}", pg_bin.join("pg_restore").display()),
            ]),
            "backup-controller" => args.extend([
                format!("--backup-store={store_url}"),
                format!("--pg-dump={}", pg_bin.join("pg_dump").display()),
            ]),
            _ => args.extend([
                format!("--pg-dump={}", pg_bin.join("pg_dump").display()),
                format!("--pg-restore={}", pg_bin.join("pg_restore").display()),
            ]),
        }
        let pod = format!("{account}-sa-test");
        let mut env = vec![
            ("POD_NAMESPACE", SYSTEM_NAMESPACE),
            ("POD_NAME", pod.as_str()),
        ];
        if controller == "database-controller" {
            // As the Deployment sets it (from the pod's spec.serviceAccountName).
            env.push(("DBOPS_SERVICE_ACCOUNT", account.as_str()));
        }
        let c = start_controller(
            controller,
            controller,
            &kubeconfig,
            world.logs.path(),
            &args,
            &env,
        )
        .await
        .unwrap();
        world.controllers.push((controller, c));
    }
    // Each holds its Lease in dbops-system and has synced its watches: list and watch of
    // its kinds across the namespace, and get/create/patch of its Lease, are allowed.
    for (_, c) in &world.controllers {
        wait_leading(c, Duration::from_secs(60)).await;
    }

    // The database-controller provisions a Database; the backup-controller backs it up.
    let databases: Api<Database> = Api::namespaced(world.b.client.clone(), &ns);
    let db: Database = manifest("app", json!({"serverRef": {"name": server}})).unwrap();
    databases.create(&PostParams::default(), &db).await.unwrap();
    if let Err(e) = dbops_e2e::wait::database_condition(
        &world.b.client,
        &ns,
        "app",
        Want::provisioned(),
        Duration::from_secs(90),
    )
    .await
    {
        panic!("{e:#}\n{}", world.logs());
    }
    assert!(secrets.get_opt("app-connection").await.unwrap().is_some());

    let backups: Api<Backup> = Api::namespaced(world.b.client.clone(), &ns);
    create_backup(&world.b.client, &ns, "app-1", "app", json!({}))
        .await
        .unwrap();
    let completed = wait_for(
        "Backup app-1 to complete",
        Duration::from_secs(120),
        || async { Ok(backups.get("app-1").await?.status.and_then(|s| s.phase)) },
        |phase| *phase == Some(BackupPhase::Completed),
    )
    .await;
    if let Err(e) = completed {
        panic!("{e:#}\n{}", world.logs());
    }

    // What each ServiceAccount wrote, as the apiserver's audit log records it: its Lease,
    // and (for the two that acted) its objects; none of it refused.
    for (controller, _) in &world.controllers {
        let user = service_account_user(SYSTEM_NAMESPACE, &format!("dbops-{controller}"));
        let lease = world
            .b
            .cp
            .audit_writes(&user, Some(SYSTEM_NAMESPACE))
            .unwrap();
        assert!(
            lease.iter().any(|w| w.resource == "leases" && w.code < 300),
            "{user} never wrote its Lease: {lease:?}"
        );
        let writes = world.b.cp.audit_writes(&user, Some(&ns)).unwrap();
        let refused: Vec<_> = writes
            .iter()
            .chain(&lease)
            .filter(|w| w.code >= 400)
            .collect();
        // A 409 is a lost race the controllers expect (create of an existing object);
        // anything else refused is a missing permission or a bug.
        assert!(
            refused.iter().all(|w| w.code == 409),
            "{user} was refused: {refused:?}"
        );
        if *controller != "migration-controller" {
            assert!(!writes.is_empty(), "{user} wrote nothing in {ns}");
        }
        // Refused reads (a watch, a get) do not reach the audit log; they reach the log.
        let log = world.log(controller).to_lowercase();
        assert!(
            !log.contains("forbidden") && !log.contains("could not publish an event"),
            "{controller} was refused something:\n{}",
            world.log(controller)
        );
    }
    let wrote = |user: &str, resource: &str, verb: &str| {
        world
            .b
            .cp
            .audit_writes(user, Some(&ns))
            .unwrap()
            .iter()
            .any(|w| w.resource == resource && w.verb == verb && w.code < 300)
    };
    let database_user = service_account_user(SYSTEM_NAMESPACE, "dbops-database-controller");
    let backup_user = service_account_user(SYSTEM_NAMESPACE, "dbops-backup-controller");
    assert!(wrote(&database_user, "secrets", "create"));
    // Through the RoleBinding it made for the Database's namespace.
    assert!(wrote(&database_user, "rolebindings", "create"));
    assert!(wrote(&database_user, "events", "create"));
    assert!(wrote(&backup_user, "backups", "patch"));
    assert!(wrote(&backup_user, "events", "create"));
}

#[tokio::test]
async fn the_apiserver_refuses_a_controller_what_it_does_not_need() {
    let b = bed("sa-refused").await;
    deployed(b.cp).await;
    let ns = b.ns.name().to_string();

    // Objects to be refused on: a Secret and a Database.
    let secrets: Api<Secret> = Api::namespaced(b.client.clone(), &ns);
    let mut secret = Secret::default();
    secret.metadata.name = Some("precious".into());
    secret.string_data = Some(BTreeMap::from([("k".to_string(), "v".to_string())]));
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let databases: Api<Database> = Api::namespaced(b.client.clone(), &ns);
    let db: Database = manifest("orders", json!({"serverRef": {"name": "pg-main"}})).unwrap();
    databases.create(&PostParams::default(), &db).await.unwrap();

    let token = |account: &'static str| {
        let cp = b.cp;
        async move {
            cp.kubeconfig_for_service_account(SYSTEM_NAMESPACE, account, Duration::from_secs(3600))
                .await
                .unwrap()
        }
    };
    let backup_kubeconfig = token("dbops-backup-controller").await;
    let database_kubeconfig = token("dbops-database-controller").await;
    let migration_kubeconfig = token("dbops-migration-controller").await;
    let as_backup = Kubectl::new(&backup_kubeconfig);
    let as_database = Kubectl::new(&database_kubeconfig);
    let as_migration = Kubectl::new(&migration_kubeconfig);

    // What RBAC answers, per verb: (kubectl, verb, resource, namespace or all, allowed).
    let lease = "leases/dbops-database-controller";
    // (The test's namespace stands in for dbops-system in the other tests, so it was granted
    // the Secrets Roles: the tenant namespace here is `default`.)
    let cases: [(&Kubectl, &str, &str, Option<&str>, bool); 42] = [
        // The backup-controller reads the admin and CA Secrets in its own namespace, no
        // tenant's, and writes none.
        (&as_backup, "get", "secrets", Some(SYSTEM_NAMESPACE), true),
        (&as_backup, "watch", "secrets", Some(SYSTEM_NAMESPACE), true),
        (&as_backup, "get", "secrets", Some("default"), false),
        (&as_backup, "list", "secrets", None, false),
        (&as_backup, "delete", "secrets", Some(&ns), false),
        (&as_backup, "create", "secrets", Some(&ns), false),
        // DatabaseServers are the platform team's: read, never written.
        (&as_backup, "watch", "databaseservers.dbops.dev", None, true),
        (
            &as_backup,
            "patch",
            "databaseservers.dbops.dev",
            None,
            false,
        ),
        // It watches Databases everywhere, and never writes them.
        (&as_backup, "watch", "databases.dbops.dev", None, true),
        (&as_backup, "patch", "databases.dbops.dev", Some(&ns), false),
        (
            &as_backup,
            "delete",
            "databases.dbops.dev",
            Some(&ns),
            false,
        ),
        // Its own kind: scheduled Backups are created and pruned.
        (&as_backup, "delete", "backups.dbops.dev", Some(&ns), true),
        // Not another controller's Lease, and no Lease outside dbops-system.
        (&as_backup, "patch", lease, Some(SYSTEM_NAMESPACE), false),
        (
            &as_backup,
            "create",
            "leases.coordination.k8s.io",
            Some(&ns),
            false,
        ),
        // The database-controller reads the admin and CA Secrets in its own namespace,
        // where it also writes the poolers' Secrets, Deployments and Services (and this
        // test's namespace stands in for it), and no tenant's Secret: it writes connection
        // Secrets only where a Database needs them, through a RoleBinding it makes there
        // (none in `default`: no Database is served there), and never deletes one.
        (&as_database, "get", "secrets", Some(SYSTEM_NAMESPACE), true),
        (
            &as_database,
            "create",
            "secrets",
            Some(SYSTEM_NAMESPACE),
            true,
        ),
        (
            &as_database,
            "create",
            "deployments.apps",
            Some(SYSTEM_NAMESPACE),
            true,
        ),
        (&as_database, "get", "secrets", Some("default"), false),
        (&as_database, "list", "secrets", None, false),
        (&as_database, "create", "secrets", Some("default"), false),
        (&as_database, "delete", "secrets", Some("default"), false),
        (
            &as_database,
            "create",
            "deployments.apps",
            Some("default"),
            false,
        ),
        // Those RoleBindings: it may bind the one ClusterRole holding the Secret verbs,
        // and delete only RoleBindings of that name; no other role, no escalation.
        (
            &as_database,
            "create",
            "rolebindings.rbac.authorization.k8s.io",
            Some(&ns),
            true,
        ),
        (&as_database, "delete", TENANT_BINDING, Some(&ns), true),
        (
            &as_database,
            "delete",
            "rolebindings.rbac.authorization.k8s.io/other",
            Some(&ns),
            false,
        ),
        (
            &as_database,
            "update",
            "rolebindings.rbac.authorization.k8s.io/other",
            Some(&ns),
            false,
        ),
        (&as_database, "bind", TENANT_ROLE, None, true),
        (
            &as_database,
            "bind",
            "clusterroles.rbac.authorization.k8s.io/cluster-admin",
            None,
            false,
        ),
        (
            &as_database,
            "escalate",
            "clusterroles.rbac.authorization.k8s.io",
            None,
            false,
        ),
        (
            &as_database,
            "create",
            "clusterrolebindings.rbac.authorization.k8s.io",
            None,
            false,
        ),
        // It keeps the DatabaseServers' status and finalizer, and never deletes one.
        (
            &as_database,
            "delete",
            "databaseservers.dbops.dev",
            None,
            false,
        ),
        // It deletes a Database that expired (spec.expireAfter), and no other kind.
        (
            &as_database,
            "delete",
            "databases.dbops.dev",
            Some(&ns),
            true,
        ),
        (
            &as_database,
            "delete",
            "backups.dbops.dev",
            Some(&ns),
            false,
        ),
        (&as_database, "patch", lease, Some(SYSTEM_NAMESPACE), true),
        // Nothing outside what it serves.
        (&as_database, "list", "pods", None, false),
        // The migration-controller reads the admin and CA Secrets in its own namespace
        // only: no tenant's Secret, and no list across namespaces.
        (
            &as_migration,
            "get",
            "secrets",
            Some(SYSTEM_NAMESPACE),
            true,
        ),
        (&as_migration, "get", "secrets", Some("default"), false),
        (&as_migration, "list", "secrets", None, false),
        // A cutover through a pooler: its Pods in the controllers' namespace, listed and
        // annotated; no Pod elsewhere, and none deleted.
        (&as_migration, "list", "pods", Some(SYSTEM_NAMESPACE), true),
        (&as_migration, "patch", "pods", Some(SYSTEM_NAMESPACE), true),
        (&as_migration, "list", "pods", Some("default"), false),
        (
            &as_migration,
            "delete",
            "pods",
            Some(SYSTEM_NAMESPACE),
            false,
        ),
    ];
    for (kubectl, verb, resource, namespace, allowed) in cases {
        let answer = kubectl.can_i(verb, resource, namespace).unwrap();
        assert_eq!(
            answer,
            allowed,
            "can-i {verb} {resource} in {namespace:?} with {}",
            if std::ptr::eq(kubectl, &as_backup) {
                "the backup-controller's token"
            } else if std::ptr::eq(kubectl, &as_migration) {
                "the migration-controller's token"
            } else {
                "the database-controller's token"
            }
        );
    }

    // No controller may read a Secret in a namespace where no Database is served (the
    // test's namespace stands in for dbops-system: it was granted the Secrets Roles).
    for controller in CONTROLLERS {
        let user = service_account_user(SYSTEM_NAMESPACE, &format!("dbops-{controller}"));
        for namespace in ["default", "kube-system"] {
            assert!(
                !can_i_as(&b.kubectl, &user, "get", "secrets", namespace),
                "{user} may read the Secrets of namespace {namespace}"
            );
        }
    }

    // And real requests with the backup-controller's token: 403, nothing changed.
    let client = client_from_kubeconfig(&backup_kubeconfig).await.unwrap();
    let forbidden = |result: Result<(), kube::Error>, what: &str| match result {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("{what} with the backup-controller's token: expected 403, got {other:?}"),
    };
    let their_secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    forbidden(
        their_secrets
            .delete("precious", &DeleteParams::default())
            .await
            .map(|_| ()),
        "deleting a Secret",
    );
    let their_databases: Api<Database> = Api::namespaced(client.clone(), &ns);
    forbidden(
        their_databases
            .patch(
                "orders",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"connectionLimit": 1}})),
            )
            .await
            .map(|_| ()),
        "patching a Database",
    );
    // Neither the backup- nor the migration-controller can read a tenant's Secret (one in
    // `default`, a namespace no Role of theirs reaches).
    let tenant_secrets: Api<Secret> = Api::namespaced(b.client.clone(), "default");
    let mut tenant_secret = secret.clone();
    tenant_secret.metadata.name = Some(format!("precious-{ns}"));
    tenant_secrets
        .create(&PostParams::default(), &tenant_secret)
        .await
        .unwrap();
    for (kubeconfig, who) in [
        (&backup_kubeconfig, "backup-controller"),
        (&migration_kubeconfig, "migration-controller"),
    ] {
        let client = client_from_kubeconfig(kubeconfig).await.unwrap();
        match Api::<Secret>::namespaced(client, "default")
            .get(&format!("precious-{ns}"))
            .await
        {
            Err(kube::Error::Api(status)) if status.code == 403 => {}
            other => panic!(
                "reading a tenant's Secret with the {who}'s token: expected 403, got {:?}",
                other.map(|s| s.metadata.name)
            ),
        }
    }
    tenant_secrets
        .delete(&format!("precious-{ns}"), &DeleteParams::default())
        .await
        .unwrap();
    // What it may do still works with the same client: the refusal is RBAC, not a bad token.
    assert!(their_databases.get("orders").await.is_ok());
    assert!(secrets.get_opt("precious").await.unwrap().is_some());
    let db = databases.get("orders").await.unwrap();
    assert_ne!(db.spec.connection_limit, 1);

    // The audit log shows the refused write under the ServiceAccount's name.
    let user = service_account_user(SYSTEM_NAMESPACE, "dbops-backup-controller");
    let started = Instant::now();
    let refused = eventually(
        "the refused writes in the audit log",
        Duration::from_secs(10),
        || async { b.cp.audit_writes(&user, Some(&ns)) },
        |writes| writes.iter().filter(|w| w.code == 403).count() >= 2,
    )
    .await;
    assert!(
        refused
            .iter()
            .any(|w| w.verb == "delete" && w.resource == "secrets" && w.code == 403),
        "{refused:?} (after {:?})",
        started.elapsed()
    );
}
