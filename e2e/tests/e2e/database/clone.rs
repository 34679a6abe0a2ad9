//! `spec.cloneFrom` (issue 38): a new Database filled with a copy of a live one of the
//! same namespace, under a writer (consistent at one instant, the writer unaffected),
//! with masked columns (no original value in the copy, joins on hashed keys still
//! matching), 20 clones at once queuing within the server's `limits.concurrentClones`,
//! and bad input refused naming the field.
//!
//! The database-controller copies with the pg_dump of the server's major and the psql
//! beside it (`--pg-dump`), as the suite's admin: a managed service's, not a superuser.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dbops_e2e::harness::database::{ADMIN_SECRET, Setup, not_ready, value};
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;

const COPY: Duration = Duration::from_secs(120);

async fn setup(prefix: &str) -> Setup {
    let bin = dbops_e2e::paths::postgres_bin_dir().unwrap();
    let pg_dump = format!("--pg-dump={}", bin.join("pg_dump").display());
    Setup::with_args(prefix, &[&pg_dump]).await
}

/// A session as Database `name`'s owner, from its connection Secret.
async fn as_owner(s: &Setup, name: &str) -> tokio_postgres::Client {
    let secret = s.connection_secret(name).await;
    let (user, password) = (value(&secret, "username"), value(&secret, "password"));
    s.pg.connect(
        &user,
        &password,
        &s.databases().get(name).await.unwrap().database_name(),
    )
    .await
    .unwrap()
}

async fn count(c: &tokio_postgres::Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

async fn column_list(c: &tokio_postgres::Client, sql: &str) -> Vec<i64> {
    c.query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

const SOURCE: &str = "
    CREATE TABLE customers (id bigint PRIMARY KEY, email text NOT NULL UNIQUE, name text, tier text);
    CREATE TABLE orders (id bigserial PRIMARY KEY,
                         customer_id bigint NOT NULL REFERENCES customers (id), note text);
    CREATE TABLE pair_a (n bigint PRIMARY KEY);
    CREATE TABLE pair_b (n bigint PRIMARY KEY);
    INSERT INTO customers SELECT g, 'user' || g || '@example.com', 'Name ' || g, 'gold'
      FROM generate_series(1, 5000) g;
    INSERT INTO orders (customer_id, note) SELECT 1 + (g * 7) % 5000, 'note ' || g
      FROM generate_series(1, 20000) g;";

/// A writer commits `n` into pair_a and pair_b in one transaction, over and over, from
/// before the clone is created until after it is Ready: the copy holds both halves of
/// every transaction or neither (one instant), and no write fails. Masked: the emails
/// hashed (no original one in the copy, still unique), ids hashed on both ends of the
/// foreign key (every order still joins its customer, each customer keeps its number of
/// orders), names nulled, notes fixed; the unmasked tier kept. The source keeps its data.
#[tokio::test]
async fn a_live_database_is_cloned_under_a_writer_at_one_instant_with_masked_columns() {
    let s = setup("db-clone").await;
    s.create_ready("orders", json!({})).await;
    let source = as_owner(&s, "orders").await;
    source.batch_execute(SOURCE).await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let (committed, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut writer_client = as_owner(&s, "orders").await;
    let writer = {
        let (stop, committed, failed) = (stop.clone(), committed.clone(), failed.clone());
        tokio::spawn(async move {
            let mut n: i64 = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let tx = writer_client.transaction().await;
                let done = match tx {
                    Ok(tx) => {
                        let a = tx.execute("INSERT INTO pair_a VALUES ($1)", &[&n]).await;
                        let b = tx.execute("INSERT INTO pair_b VALUES ($1)", &[&n]).await;
                        match (a, b) {
                            (Ok(_), Ok(_)) => tx.commit().await.is_ok(),
                            _ => false,
                        }
                    }
                    Err(_) => false,
                };
                let counter = if done { &committed } else { &failed };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mask = json!([
        {"table": "public.customers", "column": "email", "with": "hash"},
        {"table": "public.customers", "column": "id", "with": "hash"},
        {"table": "public.orders", "column": "customer_id", "with": "hash"},
        {"table": "public.customers", "column": "name", "with": "nullify"},
        {"table": "public.orders", "column": "note", "with": "fixed", "value": "redacted"},
    ]);
    while committed.load(Ordering::Relaxed) < 200 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.create(
        "preview",
        json!({"cloneFrom": {"databaseRef": {"name": "orders"}, "mask": mask}}),
    )
    .await;
    let preview = s
        .wait("preview", dbops_e2e::harness::database::ready(), COPY)
        .await;
    let before_stop = committed.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();

    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "the writer's failed transactions"
    );
    let copy = as_owner(&s, "preview").await;
    // One instant: both halves of every transaction, or neither.
    let (a, b) = (
        count(&copy, "SELECT count(*) FROM pair_a").await,
        count(&copy, "SELECT count(*) FROM pair_b").await,
    );
    let halves = count(
        &copy,
        "SELECT count(*) FROM pair_a FULL JOIN pair_b USING (n) WHERE pair_a.n IS NULL OR pair_b.n IS NULL",
    )
    .await;
    assert_eq!(
        (a, halves),
        (b, 0),
        "pair_a {a} rows, pair_b {b}, {halves} halves"
    );
    assert!(a >= 200 && a as u64 <= before_stop, "{a} of {before_stop}");

    // Masked.
    let emails: HashSet<String> = copy
        .query("SELECT email FROM customers", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(emails.len(), 5000, "hashed emails stay unique");
    let originals: HashSet<String> = source
        .query("SELECT email FROM customers", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        emails.is_disjoint(&originals),
        "an original email is in the copy"
    );
    assert_eq!(
        count(
            &copy,
            "SELECT count(*) FROM customers WHERE name IS NOT NULL"
        )
        .await,
        0
    );
    assert_eq!(
        count(&copy, "SELECT count(*) FROM customers WHERE tier = 'gold'").await,
        5000
    );
    assert_eq!(
        count(&copy, "SELECT count(*) FROM orders WHERE note = 'redacted'").await,
        20000
    );
    let ids_kept = count(
        &copy,
        "SELECT count(*) FROM customers WHERE id BETWEEN 1 AND 5000",
    )
    .await;
    assert!(ids_kept < 5000, "the ids were not hashed");
    // Joins on the hashed key still match, customer by customer.
    let joined = "SELECT count(*) FROM orders o JOIN customers c ON c.id = o.customer_id";
    assert_eq!(count(&copy, joined).await, 20000);
    let per_customer = "SELECT count(*) FROM orders GROUP BY customer_id ORDER BY 1";
    assert_eq!(
        column_list(&copy, per_customer).await,
        column_list(&source, per_customer).await
    );
    // The source as it was.
    assert_eq!(
        count(
            &source,
            "SELECT count(*) FROM customers WHERE email LIKE '%@example.com' AND name IS NOT NULL"
        )
        .await,
        5000
    );

    let status = preview.status.clone().unwrap();
    let clone = status.clone_status.clone().expect("status.clone");
    assert!(
        clone
            .source
            .as_deref()
            .unwrap_or_default()
            .contains("orders"),
        "{clone:?}"
    );
    assert!(
        clone.copied_at.is_some() && clone.completed_at.is_some(),
        "{clone:?}"
    );
    assert_eq!(clone.tables, clone.tables_total, "{clone:?}");
    assert_eq!(clone.tables_total, Some(4), "{clone:?}");
    assert_eq!(clone.masked_values, Some(5000 * 3 + 20000 * 2), "{clone:?}");
    assert!(clone.bytes.unwrap_or_default() > 300_000, "{clone:?}");
    let reasons: Vec<String> = s
        .events_for("preview")
        .await
        .into_iter()
        .filter_map(|e| e.reason)
        .collect();
    assert!(reasons.iter().any(|r| r == "Cloning"), "{reasons:?}");
    s.wait_ready("orders").await;
}

/// Refused by the API server, naming the field: no source or two, with `restoreFrom`, a
/// `fixed` without a value or a value without `fixed`, the Database itself as its source,
/// `cloneFrom` added after creation. Refused by the controller before anything is made on
/// the server (the copy's database never exists): a table or column the source lacks,
/// `nullify` on a NOT NULL column, `hash` on a type it does not keep, a source that does
/// not exist.
#[tokio::test]
async fn bad_clone_input_is_refused_naming_the_field() {
    let s = setup("db-clone-bad").await;
    s.create_ready("src", json!({})).await;
    as_owner(&s, "src")
        .await
        .batch_execute(
            "CREATE TABLE t (id int PRIMARY KEY, doc jsonb NOT NULL, note text, code varchar(8) UNIQUE)",
        )
        .await
        .unwrap();
    let refused = [
        (
            json!({"cloneFrom": {}}),
            "exactly one of databaseRef and backupRef",
        ),
        (
            json!({"cloneFrom": {"databaseRef": {"name": "src"}, "backupRef": {"name": "b"}}}),
            "exactly one of databaseRef and backupRef",
        ),
        (
            json!({"cloneFrom": {"databaseRef": {"name": "src"}}, "restoreFrom": {"backupRef": {"name": "b"}}}),
            "set cloneFrom or restoreFrom, not both",
        ),
        (
            json!({"cloneFrom": {"databaseRef": {"name": "src"}, "mask": [{"table": "public.t", "column": "note", "with": "fixed"}]}}),
            "value is given with `with: fixed`",
        ),
        (
            json!({"cloneFrom": {"databaseRef": {"name": "src"}, "mask": [{"table": "public.t", "column": "note", "with": "hash", "value": "x"}]}}),
            "value is given with `with: fixed`",
        ),
        (
            json!({"cloneFrom": {"databaseRef": {"name": "src"}, "mask": [{"table": "t", "column": "note", "with": "hash"}]}}),
            "table must be schema.table",
        ),
        (
            json!({"cloneFrom": {"databaseRef": {"name": "self"}}}),
            "cloneFrom.databaseRef names this Database itself",
        ),
    ];
    for (spec, message) in refused {
        let db = s.database("self", spec.clone());
        let e = s
            .databases()
            .create(&PostParams::default(), &db)
            .await
            .expect_err(&format!("{spec} was accepted"));
        assert!(e.to_string().contains(message), "{spec}: {e}");
    }
    let later = s.create_ready("later", json!({})).await;
    let e = s
        .databases()
        .patch(
            "later",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cloneFrom": {"databaseRef": {"name": "src"}}}})),
        )
        .await
        .expect_err("cloneFrom added later was accepted");
    assert!(
        e.to_string()
            .contains("cloneFrom can only be set when the Database is created"),
        "{e}"
    );
    drop(later);

    let bad = [
        (
            "notable",
            json!([{"table": "public.nope", "column": "x", "with": "nullify"}]),
            "MaskInvalid",
            "spec.cloneFrom.mask[0].table",
        ),
        (
            "nocolumn",
            json!([{"table": "public.t", "column": "nope", "with": "nullify"}]),
            "MaskInvalid",
            "spec.cloneFrom.mask[0].column",
        ),
        (
            "notnull",
            json!([{"table": "public.t", "column": "note", "with": "hash"}, {"table": "public.t", "column": "doc", "with": "nullify"}]),
            "MaskInvalid",
            "spec.cloneFrom.mask[1].with",
        ),
        (
            "nohash",
            json!([{"table": "public.t", "column": "doc", "with": "hash"}]),
            "MaskInvalid",
            "spec.cloneFrom.mask[0].with",
        ),
        (
            "badvalue",
            json!([{"table": "public.t", "column": "id", "with": "fixed", "value": "1"}]),
            "MaskInvalid",
            "unique key",
        ),
        (
            "shorthash",
            json!([{"table": "public.t", "column": "code", "with": "hash"}]),
            "MaskInvalid",
            "fewer than 16 hex characters",
        ),
    ];
    for (name, mask, _, _) in &bad {
        s.create(
            name,
            json!({"cloneFrom": {"databaseRef": {"name": "src"}, "mask": mask}}),
        )
        .await;
    }
    s.create(
        "nosource",
        json!({"cloneFrom": {"databaseRef": {"name": "missing"}}}),
    )
    .await;
    for (name, _, reason, field) in bad {
        let db = s.wait(name, not_ready(reason), COPY).await;
        let ready = dbops_e2e::wait::condition(&db, "Ready").unwrap();
        assert!(ready.message.contains(field), "{name}: {}", ready.message);
        assert!(
            !s.pg.database_exists(name).await.unwrap(),
            "{name}: its database was made"
        );
    }
    s.wait("nosource", not_ready("CloneSourceNotFound"), COPY)
        .await;
    assert!(!s.pg.database_exists("nosource").await.unwrap());
}

/// 20 clones of one source created at once on a server with `limits.concurrentClones: 2`:
/// never more than 2 copies load at once (psql's sessions on the server, sampled every
/// 50 ms), the others say `CloneQueued`, and all 20 end Ready with every row.
#[tokio::test]
async fn twenty_clones_at_once_queue_within_the_servers_bound() {
    let s = setup("db-clone-20").await;
    let server = s.server(ADMIN_SECRET);
    kube::Api::<dbops_api::DatabaseServer>::all(s.b.client.clone())
        .patch(
            &server,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"limits": {"concurrentClones": 2}}})),
        )
        .await
        .unwrap();
    s.create_ready("base", json!({})).await;
    as_owner(&s, "base")
        .await
        .batch_execute(
            "CREATE TABLE t (id int PRIMARY KEY, pad text);
             INSERT INTO t SELECT g, repeat('x', 500) FROM generate_series(1, 20000) g;",
        )
        .await
        .unwrap();
    let names: Vec<String> = (1..=20).map(|i| format!("pr{i}")).collect();
    let sampler = s.pg.connect_as_superuser().await.unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let sampling = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut most = 0i64;
            while !done.load(Ordering::Relaxed) {
                let loading: i64 = sampler
                    .query_one(
                        "SELECT count(DISTINCT datname) FROM pg_stat_activity \
                          WHERE application_name = 'dbops-database-controller-clone' \
                            AND datname LIKE 'pr%'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get(0);
                most = most.max(loading);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            most
        })
    };
    for name in &names {
        s.create(
            name,
            json!({"cloneFrom": {"databaseRef": {"name": "base"}}}),
        )
        .await;
    }
    for name in &names {
        s.wait(
            name,
            dbops_e2e::harness::database::ready(),
            Duration::from_secs(300),
        )
        .await;
    }
    done.store(true, Ordering::Relaxed);
    let most = sampling.await.unwrap();
    assert!((1..=2).contains(&most), "{most} copies loaded at once");
    let mut queued = 0;
    for name in &names {
        let reasons: Vec<String> = s
            .events_for(name)
            .await
            .into_iter()
            .filter_map(|e| e.reason)
            .collect();
        queued += usize::from(reasons.iter().any(|r| r == "CloneQueued"));
        assert_eq!(
            count(&as_owner(&s, name).await, "SELECT count(*) FROM t").await,
            20000
        );
    }
    assert!(queued >= 10, "only {queued} of 20 clones said CloneQueued");
}

/// The database-controller killed while a masked clone is loading (psql's session on the
/// new database): nothing of the copy is committed, the database keeps its pending mark;
/// after a restart it is made anew and copied once, every row there, every masked value
/// replaced, and the source's own rows untouched.
#[tokio::test]
async fn a_clone_interrupted_by_a_crash_completes_after_restart() {
    let mut s = setup("db-clone-crash").await;
    s.create_ready("big", json!({})).await;
    as_owner(&s, "big")
        .await
        .batch_execute(
            "CREATE TABLE t (id bigint PRIMARY KEY, email text, pad text);
             INSERT INTO t SELECT g, 'u' || g || '@example.com', repeat('x', 200)
               FROM generate_series(1, 400000) g;",
        )
        .await
        .unwrap();
    let mask = json!([{"table": "public.t", "column": "email", "with": "hash"}]);
    let first = s
        .create(
            "copy",
            json!({"cloneFrom": {"databaseRef": {"name": "big"}, "mask": mask}}),
        )
        .await;
    let loading = dbops_e2e::wait::eventually(
        "psql loading the clone",
        COPY,
        || s.pg.sessions_of("copy", "dbops-database-controller-clone"),
        |n| *n > 0,
    )
    .await;
    assert!(loading > 0);
    let oid_before = s.pg.database_oid("copy").await.unwrap();
    s.kill_controller();
    let uid = first.metadata.uid.clone().unwrap();
    assert_eq!(
        s.pg.database_comment("copy").await.unwrap(),
        Some(format!("dbops.dev/uid={uid} dbops.dev/restore=pending")),
        "the database is still marked as waiting for its copy"
    );

    s.start_controller();
    s.wait("copy", dbops_e2e::harness::database::ready(), COPY)
        .await;
    let copy = as_owner(&s, "copy").await;
    assert_eq!(count(&copy, "SELECT count(*) FROM t").await, 400_000);
    assert_eq!(
        count(
            &copy,
            "SELECT count(*) FROM t WHERE email LIKE '%@example.com'"
        )
        .await,
        0
    );
    assert_eq!(
        count(&copy, "SELECT count(DISTINCT email) FROM t").await,
        400_000
    );
    assert_eq!(s.pg.count_databases_like("copy%").await.unwrap(), 1);
    assert_ne!(
        s.pg.database_oid("copy").await.unwrap(),
        oid_before,
        "the half-copied database was made anew"
    );
    let source = as_owner(&s, "big").await;
    assert_eq!(
        count(
            &source,
            "SELECT count(*) FROM t WHERE email LIKE '%@example.com'"
        )
        .await,
        400_000
    );
}
