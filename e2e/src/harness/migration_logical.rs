#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! The Logical mode's tests on top of [`crate::harness::migration`]: a source started with
//! `wal_level=logical`, a Database `app` with tables, a writer that follows its connection
//! Secret to the target, what a Migration might leave behind (slots, publications,
//! subscriptions, roles), and the checks of the writer's commits and of the source after a
//! rollback.

use std::time::Duration;

use dbops_api::Migration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

use crate::harness::migration::{Conn, Setup};
use crate::live_writer::{LiveWriter, Options};
use crate::postgres::PgServer;

/// The source's settings for logical replication.
pub const LOGICAL: &[(&str, &str)] = &[
    ("wal_level", "logical"),
    ("max_replication_slots", "10"),
    ("max_wal_senders", "10"),
];

pub async fn logical_setup(prefix: &str) -> Setup {
    Setup::with_source_settings(prefix, LOGICAL).await
}

/// A Database `app` on the source with `writes` (the writer's) and `items` (a serial key,
/// 10,000 rows): its sequence must arrive with the data.
pub async fn app_with_tables(s: &Setup) -> Conn {
    s.create_database("app").await;
    let c = s.connection("app").await;
    s.source
        .connect(&c.user, &c.password, "app")
        .await
        .unwrap()
        .batch_execute(
            "CREATE TABLE writes (n bigint PRIMARY KEY, at timestamptz DEFAULT now()); \
             CREATE TABLE items (id serial PRIMARY KEY, v text); \
             INSERT INTO items (v) SELECT md5(i::text) FROM generate_series(1, 10000) i",
        )
        .await
        .unwrap();
    c
}

/// What a Migration of this test bed might leave behind, by server: replication slots,
/// publications (in `app`), subscriptions and roles named `dbops_mig_*`.
pub async fn leftovers(s: &Setup) -> Vec<String> {
    let mut found = Vec::new();
    for (side, pg) in [("source", &s.source), ("target", &s.target)] {
        for (what, name) in pg.replication_leftovers().await.unwrap() {
            found.push(format!("{side} {what} {name}"));
        }
        if pg.database_exists("app").await.unwrap() {
            for name in pg.publications("app").await.unwrap() {
                found.push(format!("{side} publication {name}"));
            }
        }
    }
    found
}

/// A writer that behaves like an application: [`LiveWriter::through_secret`] inserting 1,
/// 2, 3, ... into `writes` (one autocommit statement each) through the Database's
/// connection Secret, read again after a failure, so it follows the switch to the target;
/// 2 ms after each insert, 20 ms after a failed connect. It records when each commit
/// succeeded.
pub struct Writer(LiveWriter);

impl Writer {
    pub fn start(secrets: Api<Secret>, name: String) -> Self {
        let options = Options::new("writes")
            .pause(Duration::from_millis(2))
            .retry(Duration::from_millis(20));
        Self(LiveWriter::through_secret(secrets, &name, options))
    }

    pub fn committed(&self) -> usize {
        self.0.commits()
    }

    /// Waits until at least `at_least` inserts have committed, for at most `limit`.
    pub async fn wait_commits(&self, at_least: usize, limit: Duration) {
        self.0.wait_commits(at_least, limit).await.unwrap();
    }

    /// The numbers committed so far, from the `from`-th commit on.
    pub fn numbers_from(&self, from: usize) -> Vec<i64> {
        self.0.numbers_from(from)
    }

    /// After the switch: waits (60 s at most) for 50 more commits, which can only land on
    /// the target through the rewritten Secret, then stops; the commits, the longest gap
    /// between two of them and the commit before that gap.
    pub async fn finish_on_target(self) -> (Vec<i64>, Duration, i64) {
        self.wait_commits(self.committed() + 50, Duration::from_secs(60))
            .await;
        let log = self.0.finish().await;
        let (gap, after) = log.longest_gap();
        (log.numbers(), gap, after)
    }
}

/// Migration `name`, stopped right after its slot was created: the slot is on the source
/// and nothing of the subscription is recorded in its status (`at` says when).
pub async fn assert_slot_without_subscription(s: &Setup, name: &str, at: &str) {
    let m = s.migrations().get(name).await.unwrap();
    let slot = replication_name(&m);
    assert!(
        leftovers(s).await.contains(&format!("source slot {slot}")),
        "the slot exists {at}"
    );
    assert_eq!(
        m.status
            .as_ref()
            .and_then(|st| st.replication.as_ref())
            .and_then(|r| r.subscription_oid),
        None,
        "nothing of the subscription is recorded {at}"
    );
}

/// The Database's connection Secrets, for the writer.
pub fn secrets(s: &Setup) -> Api<Secret> {
    Api::namespaced(s.b.client.clone(), s.ns())
}

/// The name of the Migration's slot, publication, subscription and role (the
/// controller's `replication::name`: `dbops_mig_` and its UID).
pub fn replication_name(m: &Migration) -> String {
    let uid = m.metadata.uid.as_deref().unwrap();
    format!("dbops_mig_{}", uid.replace('-', "_").to_lowercase())
}

/// `items` arrived whole on the target, and its sequence with it: the next id follows the
/// source's.
pub async fn assert_items_copied(target: &PgServer) {
    let items = Setup::superuser_scalar_i64(target, "app", "SELECT count(*) FROM items").await;
    assert_eq!(items, 10_000);
    let next =
        Setup::superuser_scalar_i64(target, "app", "SELECT nextval('items_id_seq')::bigint").await;
    assert_eq!(next, 10_001, "the sequence value was copied");
}

/// The source as before the Migration: the owner writes there, and the database's
/// connection limit and settings are as they were (-1; none set).
pub async fn assert_source_writable(s: &Setup, c: &Conn, n: i64, after: &str) {
    let owner = s
        .source
        .connect(&c.user, &c.password, "app")
        .await
        .unwrap_or_else(|e| panic!("after {after}: the owner cannot log in on the source: {e}"));
    owner
        .execute("INSERT INTO writes (n) VALUES ($1)", &[&n])
        .await
        .unwrap_or_else(|e| panic!("after {after}: the source is not writable: {e}"));
    assert_eq!(
        s.source.connlimit("app").await.unwrap(),
        Some(-1),
        "after {after}"
    );
    let settings = Setup::superuser_scalar_i64(
        &s.source,
        "postgres",
        "SELECT count(*) FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase WHERE d.datname = 'app'",
    )
    .await;
    assert_eq!(settings, 0, "after {after}: the freeze's setting was reset");
}
