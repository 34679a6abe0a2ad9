//! No tenant can take a name dbops derives for another tenant (issue 34): two tenant
//! namespaces on one server, each served by a database-controller of its own (as two
//! teams of one installation are), the controllers' namespace holding the admin Secret.
//!
//! Tenant B names its Databases after every role tenant A will need later: the owner's
//! two rotation logins (`sq9452_1`, `sq9452_2`, the names of PostgreSQL's roles before
//! this change), a DatabaseUser's group (`sq9452_dash`) and its first login
//! (`sq9452_dash_1`). B's Databases are made first, so each of those roles exists before
//! A needs it. Then A rotates its owner's password twice and adds the DatabaseUser
//! `dash`: every step becomes Ready (before the change, the first rotation stopped with
//! `NameConflict`), and each login reaches its own tenant's database only.

use std::time::Duration;

use dbops_api::{Database, DatabaseUser};
use dbops_e2e::fixtures::{self, Connection, manifest, merge_patch};
use dbops_e2e::harness::redact::redact;
use dbops_e2e::wait::{Want, database_condition, describe_database, wait_for};
use dbops_e2e::{PgServer, TestNamespace};
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::{bed, start_tenant_database_controller};

const ADMIN_SECRET: &str = "pg-admin";
const READY: Duration = Duration::from_secs(90);

/// The names tenant B gives its Databases (and so their owner roles): every role tenant A's
/// Database `sq9452` and its DatabaseUser `dash` were given before issue 34.
const SQUATTED: [&str; 4] = ["sq9452_1", "sq9452_2", "sq9452_dash", "sq9452_dash_1"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_tenant_can_take_a_role_name_another_needs() {
    let b = bed("names-ctl").await;
    let ctl = b.ns.name().to_string();
    let pg = PgServer::start("names").await.unwrap();
    fixtures::create_admin_secret(&b.client, &ctl, ADMIN_SECRET, &pg)
        .await
        .unwrap();
    let server = fixtures::server_name(&ctl, ADMIN_SECRET);
    let logs = dbops_e2e::harness::bed::test_dir("names", "logs");
    let mut tenants = Vec::new();
    let mut controllers = Vec::new();
    for (i, prefix) in ["names-a", "names-b"].into_iter().enumerate() {
        let ns = TestNamespace::create(&b.client, &b.kubectl, prefix)
            .await
            .unwrap();
        let dir = logs.path().join(format!("tenant-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        controllers
            .push(start_tenant_database_controller(&b, ns.name(), &ctl, "3s", &[], &dir).await);
        tenants.push(ns);
    }
    let (a, bee) = (tenants[0].name().to_string(), tenants[1].name().to_string());
    let log = |i: usize| redact(&controllers[i].process.log_tail(6000), [("superuser", &pg)]);
    let ready = |ns: String, name: String, i: usize| {
        let client = b.client.clone();
        let log = log(i);
        async move {
            if let Err(e) =
                database_condition(&client, &ns, &name, Want::provisioned(), READY).await
            {
                panic!("{e:#}\n---- controller log ----\n{log}");
            }
        }
    };

    // Tenant B first: a Database named after each role A will need.
    for name in SQUATTED {
        fixtures::create_database(
            &b.client,
            &bee,
            &name.replace('_', "-"),
            ADMIN_SECRET,
            json!({"serverRef": {"name": server}, "databaseName": name, "deletionPolicy": "Delete"}),
        )
        .await
        .unwrap();
    }
    for name in SQUATTED {
        ready(bee.clone(), name.replace('_', "-"), 1).await;
        assert!(pg.role_exists(name).await.unwrap(), "B's owner {name}");
    }

    // Tenant A: its Database, two rotations, a DatabaseUser.
    fixtures::create_database(
        &b.client,
        &a,
        "sq9452",
        ADMIN_SECRET,
        json!({"serverRef": {"name": server}, "deletionPolicy": "Delete"}),
    )
    .await
    .unwrap();
    ready(a.clone(), "sq9452".into(), 0).await;
    let databases: Api<Database> = Api::namespaced(b.client.clone(), &a);
    for (round, login) in [(1, "sq9452-1"), (2, "sq9452-2")] {
        let rotate = json!({"metadata": {"annotations": {"dbops.dev/rotate": format!("{round}")}}});
        merge_patch(&databases, "sq9452", rotate).await.unwrap();
        let rotated = wait_for(
            &format!("A's rotation {round} to the login {login}"),
            READY,
            || async {
                Connection::of_database(&b.client, &a, "sq9452")
                    .await
                    .map(|c| c.user)
            },
            |user| user == login,
        )
        .await;
        if let Err(e) = rotated {
            let d = describe_database(&databases, "sq9452").await;
            panic!("{e:#}\n{d}\n---- controller log ----\n{}", log(0));
        }
        ready(a.clone(), "sq9452".into(), 0).await;
        let own = Connection::of_database(&b.client, &a, "sq9452")
            .await
            .unwrap();
        let who: String = own
            .connect()
            .await
            .unwrap()
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(who, "sq9452", "A's login {login} acts as its owner");
    }

    let users: Api<DatabaseUser> = Api::namespaced(b.client.clone(), &a);
    let user: DatabaseUser = manifest("dash", json!({"databaseRef": {"name": "sq9452"}})).unwrap();
    users.create(&PostParams::default(), &user).await.unwrap();
    let log0 = log(0);
    let ready_user = wait_for(
        "A's DatabaseUser dash Ready",
        READY,
        || async { Ok(users.get("dash").await?) },
        |u: &DatabaseUser| {
            u.status.as_ref().is_some_and(|s| {
                Want::new("Ready", "True", Some("UserReady")).matches(&s.conditions)
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n---- controller log ----\n{log0}"));
    let status = ready_user.status.unwrap();
    assert_eq!(status.group_role.as_deref(), Some("sq9452.dash"));
    assert_eq!(status.role.as_deref(), Some("sq9452.dash-1"));

    // Each tenant's logins reach their own database, not the other's.
    let dash = Connection::read(&Api::namespaced(b.client.clone(), &a), "dash-connection")
        .await
        .unwrap();
    dash.connect().await.expect("A's DatabaseUser connects");
    for name in SQUATTED {
        let k8s_name = name.replace('_', "-");
        let theirs = Connection::of_database(&b.client, &bee, &k8s_name)
            .await
            .unwrap();
        assert_eq!(theirs.user, name, "B's owner logs in as itself");
        theirs.connect().await.expect("B's owner connects");
        let mut into_a = theirs.clone();
        into_a.dbname = "sq9452".into();
        assert!(
            into_a.connect().await.is_err(),
            "B's {name} must not reach A's database"
        );
        let mut into_b = dash.clone();
        into_b.dbname = name.to_string();
        assert!(
            into_b.connect().await.is_err(),
            "A's DatabaseUser must not reach B's database {name}"
        );
    }
}
