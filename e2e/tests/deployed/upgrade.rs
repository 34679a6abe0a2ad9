//! An upgrade with work in flight (issue 40): the cluster runs the previous release as its
//! users installed it (`e2e/cluster deploy --release v0.1.0`: that tag's manifests, CRDs
//! and images); work of every kind is started, and in the middle of it this checkout is
//! applied the way docs/installing.md says (`kubectl apply -k`, or with
//! `DBOPS_UPGRADE_WITH=helm` the CRDs then `helm upgrade`). Everything settles with no
//! manual step: the Migration that waited for approval is approved and succeeds with every
//! committed write on the target, the Backup that was streaming completes with one
//! artifact, the 50 Databases being made are Ready, the DatabaseUser's rotation is not
//! undone (same login, its previous one still works until keepPrevious) and the scheduled
//! Backup that was due is taken once.
//!
//! Ignored by a plain run: `e2e/test` runs it right after deploying the release.

use std::time::{Duration, Instant};

use dbops_api::{Backup, DatabaseUser, Migration, MigrationPhase};
use dbops_e2e::fixtures::{Connection, manifest};
use dbops_e2e::wait::wait_for;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::bed::{Bed, CONTROLLERS, SYSTEM, bed};
use crate::runtime::backup_ready;
use crate::work::{self, Shape};

const SETTLE: Duration = Duration::from_secs(300);

/// The release the cluster was deployed at, as e2e/test passes it.
fn from_release() -> String {
    std::env::var("DBOPS_UPGRADE_FROM")
        .expect("DBOPS_UPGRADE_FROM: the release deployed (e2e/cluster deploy --release REF)")
}

/// The image tags the three controllers' Deployments name.
async fn controller_tags(bed: &Bed) -> Vec<String> {
    let deployments: Api<Deployment> = bed.api(SYSTEM);
    let mut tags = Vec::new();
    for c in CONTROLLERS {
        let d = deployments.get(&format!("dbops-{c}")).await.unwrap();
        let image = d
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|s| s.containers.into_iter().next())
            .and_then(|c| c.image)
            .unwrap_or_default();
        tags.push(image.rsplit(':').next().unwrap_or_default().to_string());
    }
    tags
}

/// Applies this checkout as docs/installing.md says, with kubectl or with helm.
fn upgrade(bed: &Bed) {
    let root = dbops_e2e::paths::repo_root();
    if std::env::var("DBOPS_UPGRADE_WITH").as_deref() == Ok("helm") {
        // Helm leaves the CRDs alone: they are applied first, as the docs say.
        bed.kubectl(&[
            "apply",
            "-f",
            &root.join("charts/dbops/crds").display().to_string(),
        ])
        .unwrap();
        let helm = dbops_e2e::paths::helm().unwrap();
        let out = std::process::Command::new(helm)
            .args(["upgrade", "dbops"])
            .arg(root.join("charts/dbops"))
            .args(["--namespace", SYSTEM, "--values"])
            .arg(root.join("e2e/deployed/helm-values.yaml"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "helm upgrade: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    } else {
        bed.kubectl(&[
            "apply",
            "-k",
            &root.join("e2e/deployed").display().to_string(),
        ])
        .unwrap();
    }
}

/// A DatabaseUser of `db` in its rotation's overlap: the Secret before the rotation, and
/// the login the rotation gave out.
async fn rotated_user(bed: &Bed, ns: &str, db: &str) -> (Connection, String) {
    let users: Api<DatabaseUser> = bed.api(ns);
    let user: DatabaseUser = manifest(
        "reader",
        json!({"databaseRef": {"name": db}, "access": "ReadOnly",
               "passwordRotation": {"every": "720h", "keepPrevious": "1h"}}),
    )
    .unwrap();
    users.create(&PostParams::default(), &user).await.unwrap();
    let secrets: Api<Secret> = bed.api(ns);
    wait_for(
        "DatabaseUser reader's Secret",
        SETTLE,
        || async { Ok(secrets.get_opt("reader-connection").await?.is_some()) },
        |found: &bool| *found,
    )
    .await
    .unwrap();
    let before = Connection::read(&secrets, "reader-connection")
        .await
        .unwrap();
    let rotate = json!({"metadata": {"annotations": {"dbops.dev/rotate": "upgrade"}}});
    users
        .patch("reader", &PatchParams::default(), &Patch::Merge(&rotate))
        .await
        .unwrap();
    let rotated = wait_for(
        "DatabaseUser reader rotated",
        SETTLE,
        || async { Ok(users.get("reader").await?) },
        |u: &DatabaseUser| {
            u.status.as_ref().is_some_and(|s| {
                s.previous_role.is_some() && s.rotation.rotate_request.as_deref() == Some("upgrade")
            })
        },
    )
    .await
    .unwrap();
    let role = rotated.status.and_then(|s| s.role).unwrap_or_default();
    (before, role)
}

/// The scheduled Backups of Database `db`.
async fn scheduled(bed: &Bed, ns: &str, db: &str) -> Vec<Backup> {
    bed.api::<Backup>(ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|b| b.spec.database_ref.name == db && b.name_any() != "kept-1")
        .collect()
}

#[tokio::test]
#[ignore = "e2e/test runs it right after e2e/cluster deploy --release <previous release>"]
async fn an_upgrade_from_the_previous_release_in_the_middle_of_work() {
    let bed = bed().await;
    let release = from_release();
    assert_eq!(
        controller_tags(bed).await,
        [release.as_str(); 3],
        "the controllers run {release}'s images"
    );
    let started = Instant::now();
    let mut work = work::start_with(
        bed,
        "upgrade",
        Shape {
            approved: false,
            databases: 0,
            kept_mb: 100,
            backup: false,
        },
    )
    .await;
    let ns = work.ns().to_string();
    let migrations: Api<Migration> = bed.api(&ns);
    wait_for(
        "Migration move AwaitingApproval",
        SETTLE,
        || async { Ok(migrations.get("move").await?) },
        |m: &Migration| {
            m.status.as_ref().and_then(|s| s.phase) == Some(MigrationPhase::AwaitingApproval)
        },
    )
    .await
    .unwrap();
    let kept = work.tenant.db("kept");
    let (before_rotation, rotated_login) = rotated_user(bed, &ns, &kept).await;
    // A schedule due every minute on `kept`, the Backup of its 100 MB, then the upgrade.
    let schedule =
        json!({"spec": {"backup": {"schedule": "* * * * *", "retention": {"keepLast": 10}}}});
    bed.api::<dbops_api::Database>(&ns)
        .patch(&kept, &PatchParams::default(), &Patch::Merge(&schedule))
        .await
        .unwrap();
    work.back_up(bed).await;
    work.create_databases(bed, 50).await;
    let in_flight = work.under_way(bed).await;
    // In the middle of it: the Migration waiting, the Backup running, Databases being made.
    assert!(
        in_flight.starts_with("Migration (Some(AwaitingApproval)), Backup, ")
            && !in_flight.ends_with(" 0 Databases not Ready"),
        "{in_flight}"
    );
    let prepared = started.elapsed();
    let upgrade_at = Instant::now();
    upgrade(bed);
    for c in CONTROLLERS {
        bed.rolled_out(c, SETTLE).await.unwrap();
    }
    let rolled = upgrade_at.elapsed();
    let tags = controller_tags(bed).await;
    assert!(
        tags.iter().all(|t| *t != release),
        "still {release} after the upgrade: {tags:?}"
    );

    // No manual step but the approval the Migration was waiting for.
    work.approve(bed).await;
    let backups: Api<Backup> = bed.api(&ns);
    backup_ready(&backups, "kept-1", SETTLE).await;
    let store = if std::env::var("DBOPS_UPGRADE_WITH").as_deref() == Ok("helm") {
        None
    } else {
        Some(crate::runtime::backup_store_dir(bed).await)
    };
    // The scheduled Backups: at least one taken, each slot once.
    let taken = wait_for(
        "a scheduled Backup of kept Ready",
        SETTLE,
        || async { Ok(scheduled(bed, &ns, &kept).await) },
        |bs: &Vec<Backup>| {
            bs.iter().any(|b| {
                b.status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                })
            })
        },
    )
    .await
    .unwrap();
    let mut slots: Vec<String> = taken
        .iter()
        .filter_map(|b| {
            b.annotations()
                .get(dbops_api::names::annotation::SCHEDULED_AT)
                .cloned()
        })
        .collect();
    let count = slots.len();
    slots.sort();
    slots.dedup();
    assert_eq!(slots.len(), count, "a slot backed up twice: {taken:?}");
    // The schedule off again, and every scheduled Backup ended, so that the store holds
    // a fixed set: then one artifact and one manifest per Backup, nothing else (`settles`).
    let unschedule = json!({"spec": {"backup": null}});
    bed.api::<dbops_api::Database>(&ns)
        .patch(&kept, &PatchParams::default(), &Patch::Merge(&unschedule))
        .await
        .unwrap();
    wait_for(
        "every scheduled Backup of kept ended",
        SETTLE,
        || async { Ok(scheduled(bed, &ns, &kept).await) },
        |bs: &Vec<Backup>| {
            bs.iter().all(|b| {
                b.status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| (c.type_ == "Ready" || c.type_ == "Failed") && c.status == "True")
                })
            })
        },
    )
    .await
    .unwrap();
    work.settles(bed, store.as_deref()).await;

    // The rotation is not undone: the same login, and the one before it still works.
    let users: Api<DatabaseUser> = bed.api(&ns);
    let user = users.get("reader").await.unwrap();
    let status = user.status.unwrap();
    assert_eq!(status.role.as_deref(), Some(rotated_login.as_str()));
    assert_eq!(status.rotation.rotate_request.as_deref(), Some("upgrade"));
    let after = Connection::read(&bed.api::<Secret>(&ns), "reader-connection")
        .await
        .unwrap();
    assert_eq!(after.user, rotated_login);
    for (which, c) in [("previous", &before_rotation), ("current", &after)] {
        let ca = bed.api::<Secret>(SYSTEM).get("pg-ca").await.unwrap();
        let ca = ca.data.unwrap()["ca.crt"].0.clone();
        let tls = dbops_shared::postgres::tls::connector(
            dbops_shared::postgres::tls::Verify::ChainAndHost,
            Some(dbops_shared::postgres::tls::roots_from_pem(&ca).unwrap()),
        )
        .unwrap();
        let mut config = c.config();
        config
            .ssl_mode(tokio_postgres::config::SslMode::Require)
            .connect_timeout(Duration::from_secs(5));
        let (client, conn) = config
            .connect(tls)
            .await
            .unwrap_or_else(|e| panic!("the {which} login {} after the upgrade: {e}", c.user));
        tokio::spawn(conn);
        client.simple_query("SELECT 1").await.unwrap();
    }
    println!(
        "upgrade from {release} ({}): work prepared in {:.0}s, in flight at the upgrade: {in_flight}; \
         rolled out in {:.1}s; {} scheduled Backup(s) taken; everything settled {:.0}s after the upgrade",
        if std::env::var("DBOPS_UPGRADE_WITH").as_deref() == Ok("helm") {
            "helm upgrade"
        } else {
            "kubectl apply -k"
        },
        prepared.as_secs_f64(),
        rolled.as_secs_f64(),
        count,
        upgrade_at.elapsed().as_secs_f64(),
    );
}
