//! `spec.expireAfter` / `spec.expiresAt` (issue 38): a Database deleted when it expires,
//! with its own `deletionPolicy`; the expiry shown in the status; a Warning Event before;
//! a changed spec extends the life; bad input refused naming the field.

use std::time::Duration;

use dbops_e2e::harness::database::{Setup, merge};
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;

/// The reasons of the Events about Database `name`, in order.
async fn reasons(s: &Setup, name: &str) -> Vec<String> {
    let mut events = s.events_for(name).await;
    events.sort_by_key(|e| e.metadata.creation_timestamp.clone());
    events.into_iter().filter_map(|e| e.reason).collect()
}

/// Delete policy: expireAfter 40s, the status shows the instant, the warning comes before
/// it (a minute is more than the life: at once), then the Database goes and its database
/// and role are dropped. Retain: the Database goes, its database and role stay. A life
/// extended before the end is kept.
#[tokio::test]
async fn an_expired_database_is_deleted_with_its_own_policy_and_an_extended_one_kept() {
    let s = Setup::new("db-expiry").await;
    let dropped = s
        .create_ready(
            "dropped",
            json!({"deletionPolicy": "Delete", "expireAfter": "40s"}),
        )
        .await;
    let kept = s
        .create_ready(
            "kept",
            json!({"deletionPolicy": "Retain", "expireAfter": "40s"}),
        )
        .await;
    let extended = s
        .create_ready(
            "extended",
            json!({"deletionPolicy": "Delete", "expireAfter": "40s"}),
        )
        .await;
    let created = dropped.metadata.creation_timestamp.clone().unwrap().0;
    let expires = dropped
        .status
        .as_ref()
        .and_then(|st| st.expires_at.clone())
        .unwrap()
        .0;
    assert_eq!(expires.duration_since(created).as_secs(), 40);
    s.databases()
        .patch(
            "extended",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"expireAfter": "2h"}})),
        )
        .await
        .unwrap();

    s.wait_gone(&dropped, Duration::from_secs(120)).await;
    s.wait_gone(&kept, Duration::from_secs(60)).await;
    assert!(
        !s.pg.database_exists("dropped").await.unwrap(),
        "Delete: the database stayed"
    );
    assert!(
        !s.pg.role_exists("dropped").await.unwrap(),
        "Delete: the role stayed"
    );
    assert!(
        s.pg.database_exists("kept").await.unwrap(),
        "Retain: the database was dropped"
    );
    assert!(
        s.pg.role_exists("kept").await.unwrap(),
        "Retain: the role was dropped"
    );
    let said = reasons(&s, "dropped").await;
    let (soon, expired) = (
        said.iter().position(|r| r == "ExpiresSoon"),
        said.iter().position(|r| r == "Expired"),
    );
    assert!(
        matches!((soon, expired), (Some(a), Some(b)) if a < b),
        "{said:?}"
    );

    // Extended to 2h: still there, and its status says until when.
    let still = s.databases().get("extended").await.unwrap();
    assert!(still.metadata.deletion_timestamp.is_none());
    let until = still.status.and_then(|st| st.expires_at).unwrap().0;
    let created = extended.metadata.creation_timestamp.unwrap().0;
    assert_eq!(until.duration_since(created).as_secs(), 7200);
    // kubectl prints the instant (a column of type date in the future read `<invalid>`).
    let shown =
        s.b.kubectl
            .run(&["get", "pgdb", "extended", "-n", s.ns()], None)
            .unwrap();
    assert!(shown.success, "{}", shown.text());
    assert!(
        shown.stdout.contains(&until.to_string()[..16]) && !shown.stdout.contains("<invalid>"),
        "{}",
        shown.stdout
    );
    assert!(
        !reasons(&s, "extended")
            .await
            .contains(&"Expired".to_string())
    );
}

/// Bad input is refused by the apiserver, naming the field.
#[tokio::test]
async fn a_bad_expiry_is_refused_naming_the_field() {
    let s = Setup::new("db-expiry-bad").await;
    for (spec, says) in [
        (
            json!({"expireAfter": "3 days"}),
            "expireAfter must be a duration",
        ),
        (
            json!({"expireAfter": "1d"}),
            "expireAfter must be a duration",
        ),
        (
            json!({"expireAfter": "1h", "expiresAt": "2030-01-01T00:00:00Z"}),
            "set expireAfter or expiresAt, not both",
        ),
    ] {
        let mut db = serde_json::to_value(s.database("bad", json!({}))).unwrap();
        merge(&mut db, json!({"spec": spec}));
        let db: dbops_api::Database = serde_json::from_value(db).unwrap();
        let refused = s.databases().create(&PostParams::default(), &db).await;
        let message = match refused {
            Err(kube::Error::Api(e)) => e.message,
            other => panic!("{spec} was not refused: {other:?}"),
        };
        assert!(message.contains(says), "{spec}: {message}");
    }
}
