//! deploy/argocd's health checks (issue 39), run by gopher-lua's `glua`, the interpreter
//! Argo CD embeds: every kind has one; every phase and every reason gets the health its
//! class says (synthetic statuses, one per phase or reason, so a new reason cannot slip
//! through); objects recorded from real ones in each phase (deploy/argocd/testdata) get
//! what a user expects, Suspended for a Migration awaiting approval.

use std::collections::BTreeSet;

use dbops_api::reasons::{DatabaseServerReason, DatabaseUserReason, ReasonClass};
use dbops_e2e::argocd::{HEALTH, health, scripts};
use serde_json::json;

const KINDS: [&str; 5] = [
    "Backup",
    "Database",
    "DatabaseServer",
    "DatabaseUser",
    "Migration",
];

fn script(kind: &str) -> String {
    scripts()
        .unwrap()
        .remove(kind)
        .unwrap_or_else(|| panic!("{HEALTH} has no {kind}"))
}

fn with_ready(
    kind: &str,
    status: &str,
    reason: &str,
    extra: serde_json::Value,
) -> serde_json::Value {
    let mut object = json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": kind,
        "metadata": {"name": "x", "generation": 1},
        "spec": {},
        "status": {"observedGeneration": 1, "conditions": [
            {"type": "Ready", "status": status, "reason": reason, "message": format!("said {reason}"),
             "lastTransitionTime": "2026-11-29T10:00:00Z"}]},
    });
    dbops_e2e::harness::database::merge(&mut object, extra);
    object
}

#[test]
fn every_kind_has_a_health_check() {
    let kinds: BTreeSet<String> = scripts().unwrap().into_keys().collect();
    assert_eq!(kinds, KINDS.iter().map(|k| k.to_string()).collect());
}

/// A DatabaseUser's and a DatabaseServer's every reason of Ready=False: Progressing when
/// the controller retries it (class Retried, or Progressing; and a user's
/// DatabaseNotReady, its Database being made), Degraded when it waits for a change.
/// A status of an older generation, or none, is Progressing.
#[test]
fn every_reason_gets_the_health_its_class_says() {
    let user = script("DatabaseUser");
    for reason in DatabaseUserReason::ALL {
        let status = if reason.class() == ReasonClass::Ready {
            "True"
        } else {
            "False"
        };
        let (health, message) = health(
            &user,
            &with_ready("DatabaseUser", status, reason.as_str(), json!({})),
        )
        .unwrap();
        let want = match reason.class() {
            ReasonClass::Ready => "Healthy",
            ReasonClass::Retried | ReasonClass::Progressing => "Progressing",
            _ if *reason == DatabaseUserReason::DatabaseNotReady => "Progressing",
            _ => "Degraded",
        };
        assert_eq!(
            health,
            want,
            "DatabaseUser {reason:?} ({:?}): {message}",
            reason.class()
        );
    }
    let server = script("DatabaseServer");
    for reason in DatabaseServerReason::ALL {
        if reason.as_str().starts_with("Pooler") {
            continue;
        }
        let status = if reason.class() == ReasonClass::Ready {
            "True"
        } else {
            "False"
        };
        let (health, _) = health(
            &server,
            &with_ready("DatabaseServer", status, reason.as_str(), json!({})),
        )
        .unwrap();
        let want = if reason.class() == ReasonClass::Ready {
            "Healthy"
        } else {
            "Degraded"
        };
        assert_eq!(health, want, "DatabaseServer {reason:?}");
    }
    for kind in ["DatabaseServer", "Database", "DatabaseUser"] {
        let older = with_ready(
            kind,
            "True",
            "Provisioned",
            json!({"metadata": {"generation": 2}, "status": {"phase": "Ready"}}),
        );
        assert_eq!(
            health(&script(kind), &older).unwrap().0,
            "Progressing",
            "{kind}"
        );
    }
    for kind in KINDS {
        let bare = json!({"kind": kind, "metadata": {"name": "x", "generation": 1}, "spec": {}});
        assert_eq!(
            health(&script(kind), &bare).unwrap().0,
            "Progressing",
            "{kind} without a status"
        );
    }
}

/// Every phase of a Database, a Backup and a Migration.
#[test]
fn every_phase_gets_the_health_a_user_expects() {
    let cases = [
        ("Database", "Pending", "Progressing"),
        ("Database", "Provisioning", "Progressing"),
        ("Database", "Restoring", "Progressing"),
        ("Database", "Ready", "Healthy"),
        ("Database", "Degraded", "Degraded"),
        ("Database", "Failed", "Degraded"),
        ("Database", "Deleting", "Progressing"),
        ("Backup", "Pending", "Progressing"),
        ("Backup", "Running", "Progressing"),
        ("Backup", "Completed", "Healthy"),
        ("Backup", "Failed", "Degraded"),
        ("Migration", "Pending", "Progressing"),
        ("Migration", "Running", "Progressing"),
        ("Migration", "AwaitingApproval", "Suspended"),
        ("Migration", "Succeeded", "Healthy"),
        ("Migration", "Failed", "Degraded"),
        ("Migration", "RollingBack", "Progressing"),
        ("Migration", "RolledBack", "Degraded"),
    ];
    for (kind, phase, want) in cases {
        let object = with_ready(kind, "False", "Any", json!({"status": {"phase": phase}}));
        let (health, message) = health(&script(kind), &object).unwrap();
        assert_eq!(health, want, "{kind} {phase}: {message}");
    }
    // A Ready Database over its size limit; a Backup whose verification found a difference.
    let over = with_ready(
        "Database",
        "True",
        "Provisioned",
        json!({"status": {"phase": "Ready", "conditions": [
        {"type": "Ready", "status": "True", "reason": "Provisioned", "message": "ok", "lastTransitionTime": "2026-11-29T10:00:00Z"},
        {"type": "SizeExceeded", "status": "True", "reason": "SizeExceeded", "message": "21 GB over 20Gi", "lastTransitionTime": "2026-11-29T10:00:00Z"}]}}),
    );
    assert_eq!(health(&script("Database"), &over).unwrap().0, "Degraded");
    let unverified = json!({"kind": "Backup", "metadata": {"name": "b"}, "status": {"phase": "Completed", "conditions": [
        {"type": "Verified", "status": "False", "reason": "RowCountMismatch", "message": "public.t: 3 rows, 2 restored", "lastTransitionTime": "2026-11-29T10:00:00Z"}]}});
    let (h, m) = health(&script("Backup"), &unverified).unwrap();
    assert_eq!(
        (h.as_str(), m.contains("RowCountMismatch")),
        ("Degraded", true),
        "{m}"
    );
}

/// Objects recorded from a dev environment in each state (`e2e/argocd-record`): each gets
/// the health recorded with it; every kind has a Healthy one and at least one that is
/// not, and a Migration awaiting approval is Suspended.
#[test]
fn recorded_objects_get_the_health_a_user_expects() {
    let dir = dbops_e2e::paths::repo_root().join("deploy/argocd/testdata");
    let mut seen: BTreeSet<(String, String)> = BTreeSet::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    for file in &files {
        let recorded: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        let kind = recorded["object"]["kind"].as_str().unwrap().to_string();
        let want = recorded["expect"].as_str().unwrap().to_string();
        let (health, message) = health(&script(&kind), &recorded["object"]).unwrap();
        assert_eq!(health, want, "{}: {message}", file.display());
        assert!(!message.is_empty(), "{}: no message", file.display());
        seen.insert((kind, health));
    }
    for kind in KINDS {
        assert!(
            seen.contains(&(kind.to_string(), "Healthy".into())),
            "no Healthy {kind} recorded"
        );
        assert!(
            seen.iter().any(|(k, h)| k == kind && h != "Healthy"),
            "no unhealthy {kind} recorded"
        );
    }
    assert!(seen.contains(&("Migration".into(), "Suspended".into())));
}
