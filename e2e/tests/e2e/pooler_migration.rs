//! A Migration of a Database on a pooled server (issue 36, ★): a real PgBouncer (Debian's
//! package) runs the configuration dbops keeps in the pooler's Secret, as the pooler's one
//! Pod (its files written again and reloaded when the Secret changes, as the kubelet and
//! the image's entrypoint do, and a Pod object whose status says Ready at its address); a writer connected through it and
//! a writer connected directly insert while the Database moves in Logical and in Dump
//! mode. The pooled writer fails no insert and loses no committed row; its longest wait
//! is printed beside the direct writer's failures and gap.

use std::time::{Duration, Instant};

use dbops_api::{MigrationPhase, MigrationStep};
use dbops_e2e::harness::database::value;
use dbops_e2e::harness::migration::{
    READY, SOURCE_ADMIN, Setup, assert_every_commit_in, writes_on,
};
use dbops_e2e::harness::object::InBed;
use dbops_e2e::live_writer::{LiveWriter, Options};
use dbops_e2e::pgbouncer::PgBouncer;
use dbops_e2e::wait::eventually;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

/// The pooler's admin login.
const ADMIN: &str = dbops_shared::pooler::ADMIN_USER;

/// The pooled Database `app` of a [`Setup`], with the source's pooler run by the harness
/// from its Secret as its one Pod.
struct Pooled {
    app: dbops_e2e::harness::migration::Conn,
    bouncer: std::sync::Arc<PgBouncer>,
    /// Rewrites the pooler's files and reloads it when its Secret changes.
    kubelet: tokio::task::JoinHandle<()>,
    /// The pooler's Secret (and Pod) name.
    name: String,
    secrets: Api<Secret>,
    /// The pooler's certificate, which clients and the console verify.
    ca: Vec<u8>,
}

impl Pooled {
    /// Whether the pooler routes app to `port`, and whether it holds it paused.
    async fn route_of_app(&self) -> Option<(String, bool)> {
        let pw = value(
            &self.secrets.get(&self.name).await.unwrap(),
            "admin-password",
        );
        let console = self.bouncer.admin_tls(&pw, &self.ca).await.unwrap();
        let rows = console.simple_query("SHOW DATABASES").await.unwrap();
        rows.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) if r.get("name") == Some("app") => Some((
                r.get("port").unwrap_or_default().to_string(),
                r.get("paused") == Some("1"),
            )),
            _ => None,
        })
    }
}

/// `s`'s source pooled (one replica), `app` on it with its tables, and the pooler run.
async fn pooled_app(s: &mut Setup, prefix: &str) -> Pooled {
    let source = s.server(SOURCE_ADMIN);
    let servers: Api<dbops_api::DatabaseServer> = Api::all(s.b.client.clone());
    servers
        .patch(
            &source,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"pooler": {"replicas": 1}}})),
        )
        .await
        .unwrap();
    let app = dbops_e2e::harness::migration_logical::app_with_tables(s).await;
    s.source
        .connect(&app.user, &app.password, "app")
        .await
        .unwrap()
        .batch_execute(
            "CREATE TABLE direct_writes (n bigint PRIMARY KEY, at timestamptz DEFAULT now())",
        )
        .await
        .unwrap();

    // The pooler's Secret routes app and lets its owner in.
    let name = dbops_shared::pooler::object_name(&source);
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    let pooler = eventually(
        "the pooler's Secret to route app",
        READY,
        || async { Ok(secrets.get_opt(&name).await?) },
        |secret| {
            secret.as_ref().is_some_and(|p| {
                value(p, "pgbouncer.ini").contains("\napp = ")
                    && value(p, "userlist.txt").contains(&format!("\"{}\"", app.user))
            })
        },
    )
    .await
    .unwrap();
    let files = ["pgbouncer.ini", "userlist.txt", "tls.crt", "tls.key"]
        .into_iter()
        .map(|k| (k.to_string(), value(&pooler, k)))
        .collect();
    let dir = dbops_e2e::harness::bed::test_dir(prefix, "pgbouncer");
    let bouncer = std::sync::Arc::new(
        PgBouncer::start_from_rendered(dir.path(), &files, ADMIN)
            .await
            .unwrap(),
    );
    let kubelet = bouncer.follow_secret(secrets.clone(), &name);
    bouncer
        .publish_pod(&s.b.client, s.ns(), &name, &pooler)
        .await
        .unwrap();
    let ca = value(&pooler, "tls.crt").into_bytes();
    Pooled {
        app,
        bouncer,
        kubelet,
        name,
        secrets,
        ca,
    }
}

/// The pooled Database `app` of `s` (its tables made), the source's pooler run by the
/// harness from its Secret, and the writer through it; then the Migration in `mode`,
/// with a direct writer beside.
async fn pooled_migration(s: &mut Setup, prefix: &str, mode: &str) {
    s.start_migration_controller(&[]);
    let p = pooled_app(s, prefix).await;
    let (app, bouncer, secrets) = (&p.app, p.bouncer.clone(), p.secrets.clone());
    let ca = p.ca.clone();

    // The pooled writer: one session through the pooler, never reconnecting on its own
    // account (a failed insert is counted, then it connects again).
    let connect = {
        let (bouncer, user, password, ca) = (
            bouncer.clone(),
            app.user.clone(),
            app.password.clone(),
            ca.clone(),
        );
        move || {
            let (bouncer, user, password, ca) =
                (bouncer.clone(), user.clone(), password.clone(), ca.clone());
            async move { bouncer.connect_tls(&user, &password, "app", &ca).await }
        }
    };
    // The simple protocol: Debian 12's PgBouncer (1.18) does not carry a prepared
    // statement over to another server connection in transaction mode, and a cutover
    // between a statement's Parse and its Bind fails it ("prepared statement does not
    // exist"); the pooler's image (PgBouncer 1.24) does, and the deployed test's writer
    // prepares its statements.
    let pooled = LiveWriter::start(
        connect,
        Options::new("writes")
            .pause(Duration::from_millis(5))
            .simple_protocol(),
    );
    let direct = LiveWriter::through_secret(
        secrets.clone(),
        "app-connection",
        Options::new("direct_writes").pause(Duration::from_millis(5)),
    );
    pooled
        .wait_commits(50, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", bouncer.log_tail(4000)));
    direct
        .wait_commits(50, Duration::from_secs(60))
        .await
        .unwrap();

    let started = Instant::now();
    let done = s
        .migrate(
            "app-move",
            "app",
            json!({"mode": mode}),
            MigrationPhase::Succeeded,
        )
        .await;
    let took = started.elapsed();
    // Writes go on through the pooler, now to the target.
    let before = pooled.commits();
    pooled
        .wait_commits(before + 50, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", bouncer.log_tail(4000)));
    let pooled = pooled.finish().await;
    let direct = direct.finish().await;
    p.kubelet.abort();

    let (pooled_gap, _) = pooled.longest_gap();
    let (direct_gap, _) = direct.longest_gap();
    println!(
        "{mode} migration through the pooler in {:.1}s: pooled writer {} commits, {} failed, longest wait {:.3}s; direct writer {} commits, {} failed, longest gap {:.3}s",
        took.as_secs_f64(),
        pooled.numbers().len(),
        pooled.failures(),
        pooled_gap.as_secs_f64(),
        direct.numbers().len(),
        direct.failures(),
        direct_gap.as_secs_f64(),
    );
    let status = done.status.clone().unwrap();
    let record = status.pooler.clone().expect("status.pooler");
    assert!(record.held, "{record:?}");
    assert!(record.resumed_at.is_some(), "{record:?}");
    assert_eq!(record.instances, 1, "{record:?}");
    let switch = status
        .steps
        .iter()
        .find(|st| st.name == MigrationStep::SwitchTraffic)
        .and_then(|st| st.message.clone())
        .unwrap_or_default();
    assert!(switch.contains("routes app to DatabaseServer"), "{switch}");

    assert_eq!(
        pooled.failures(),
        0,
        "no failed query through the pooler: first {:?}, last {:?}\n{}",
        pooled.first_failure,
        pooled.last_failure,
        bouncer.log_tail(4000)
    );
    assert_every_commit_in(&pooled.numbers(), &writes_on(&s.target).await);

    // The pooler routes app to the target, not paused.
    assert_eq!(
        p.route_of_app().await,
        Some((s.target.port().to_string(), false)),
        "the pooler routes app to the target, not paused"
    );
}

#[tokio::test]
async fn a_logical_migration_through_the_pooler_fails_no_pooled_query() {
    dbops_e2e::init_test_logging();
    let mut s = dbops_e2e::harness::migration_logical::logical_setup("pooled-logical").await;
    pooled_migration(&mut s, "pooled-logical", "Logical").await;
}

#[tokio::test]
async fn a_dump_migration_through_the_pooler_fails_no_pooled_query() {
    dbops_e2e::init_test_logging();
    let mut s = Setup::new("pooled-dump").await;
    pooled_migration(&mut s, "pooled-dump", "Dump").await;
}

/// A Database deleted after SwitchTraffic patched it, before it is Ready on the target
/// (the database-controller is stopped meanwhile): the source's pooler held it since the
/// freeze, and no route will ever follow it to the target, so SwitchTraffic lets it go
/// (`RESUME` where the pooler routes it) rather than leave its clients to wait out
/// `query_wait_timeout`. Fails without 3ec5518: the pooler keeps app paused.
#[tokio::test]
async fn a_database_deleted_after_the_switch_is_let_go_by_the_pooler() {
    dbops_e2e::init_test_logging();
    let mut s = Setup::new("pooled-deleted").await;
    let p = pooled_app(&mut s, "pooled-deleted").await;
    assert_eq!(
        p.route_of_app().await,
        Some((s.source.port().to_string(), false)),
        "before the Migration the pooler routes app to the source, not paused"
    );

    // Up to the point of no return: the freeze held app in the pooler.
    s.create_migration("app-move", "app", json!({"mode": "Dump"}))
        .await;
    s.run_until_exit_at("SwitchTraffic:started");
    assert_eq!(
        p.route_of_app().await,
        Some((s.source.port().to_string(), true)),
        "the freeze paused app in the pooler"
    );

    // No database-controller: the switched Database will not become Ready on the target.
    dbops_e2e::controllers::end(
        s.database_controller.take(),
        "TERM",
        Duration::from_secs(20),
    );
    s.start_migration_controller(&[]);
    let target = s.server(dbops_e2e::harness::migration::TARGET_ADMIN);
    let databases = s.databases();
    eventually(
        "app switched to the target",
        READY,
        || async { Ok(databases.get("app").await?) },
        |db| db.spec.server_ref.name == target,
    )
    .await;
    databases.delete("app", &Default::default()).await.unwrap();

    let m = s
        .wait_migration("app-move", "the pooler to let app go", READY, |m| {
            m.status
                .as_ref()
                .and_then(|st| st.pooler.as_ref())
                .is_some_and(|r| r.resumed_at.is_some())
        })
        .await;
    let record = m.status.and_then(|st| st.pooler).unwrap();
    assert!(record.held, "{record:?}");
    assert!(
        record
            .message
            .as_deref()
            .is_some_and(|m| m.contains("resumed app")),
        "{record:?}"
    );
    assert_eq!(
        p.route_of_app().await.map(|(_, paused)| paused),
        Some(false),
        "the pooler holds app no more"
    );
    p.kubelet.abort();
}
