//! What kubelet does for the controllers: restarts a container the runtime killed, keeps
//! a replica that cannot write the backup store out of its Service, restarts a hung one.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use dbops_api::{Backup, Database, Migration, MigrationPhase};
use dbops_e2e::fixtures::manifest;
use dbops_e2e::wait::wait_for;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use crate::bed::{Bed, CONTROLLERS, MAIN, SYSTEM, Tenant, bed, pod_ready, restart_count};
use crate::observe::{http_get, readyz_reason};

const SETTLE: Duration = Duration::from_secs(180);

/// Creates Database `name` on pg-main in `ns` and waits for it to be Ready.
pub async fn ready_database(bed: &Bed, ns: &str, name: &str) -> Database {
    let db: Database = manifest(
        name,
        json!({"serverRef": {"name": MAIN}, "deletionPolicy": "Delete"}),
    )
    .unwrap();
    let api: Api<Database> = bed.api(ns);
    api.create(&PostParams::default(), &db).await.unwrap();
    wait_for(
        &format!("Database {ns}/{name} Ready"),
        SETTLE,
        || async { Ok(api.get(name).await?) },
        |d: &Database| {
            dbops_e2e::wait::database_has(d, dbops_e2e::wait::Want::new("Ready", "True", None))
        },
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_container_sigkilled_by_the_runtime_is_restarted_and_work_resumes() {
    let bed = bed().await;
    for controller in CONTROLLERS {
        let leader = bed.ready_leader(controller, SETTLE).await.unwrap();
        let pods: Api<Pod> = bed.api(SYSTEM);
        let pod = pods.get(&leader).await.unwrap();
        let before = restart_count(&pod);
        let (id, _pid) = bed.container_pid(&pod).unwrap();
        bed.ctr(&["tasks", "kill", "--signal", "SIGKILL", &id])
            .unwrap();
        let restarted = wait_for(
            &format!("{leader} restarted by kubelet and Ready"),
            SETTLE,
            || async { Ok(pods.get(&leader).await?) },
            |p: &Pod| restart_count(p) > before && pod_ready(p),
        )
        .await
        .unwrap();
        let last = restarted
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.last_state.as_ref())
            .and_then(|s| s.terminated.as_ref())
            .map(|t| t.exit_code);
        assert_eq!(last, Some(137), "{leader}: the last run ended by SIGKILL");
        bed.ready_leader(controller, SETTLE).await.unwrap();
    }
    // Work resumes: a Database and its Backup, each through a controller killed above.
    let tenant = Tenant::create(bed, "sigkill").await.unwrap();
    let db = tenant.db("after-kill");
    let backup_name = tenant.db("after-kill-1");
    ready_database(bed, &tenant.name, &db).await;
    let backup: Backup = manifest(&backup_name, json!({"databaseRef": {"name": db}})).unwrap();
    let backups: Api<Backup> = bed.api(&tenant.name);
    backups
        .create(&PostParams::default(), &backup)
        .await
        .unwrap();
    backup_ready(&backups, &backup_name, SETTLE).await;
}

/// Waits for Backup `name` to be Ready.
pub async fn backup_ready(backups: &Api<Backup>, name: &str, timeout: Duration) -> Backup {
    wait_for(
        &format!("Backup {name} Ready"),
        timeout,
        || async { Ok(backups.get(name).await?) },
        |b: &Backup| {
            b.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            })
        },
    )
    .await
    .unwrap()
}

/// Waits for Migration `name` to end (Succeeded, RolledBack or Failed).
pub async fn migration_ended(
    migrations: &Api<Migration>,
    name: &str,
    timeout: Duration,
) -> Migration {
    wait_for(
        &format!("Migration {name} ended"),
        timeout,
        || async { Ok(migrations.get(name).await?) },
        |m: &Migration| {
            m.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(MigrationPhase::is_final)
        },
    )
    .await
    .unwrap()
}

/// The directory on the node behind the claim `dbops-backups` (a hostPath volume).
pub async fn backup_store_dir(bed: &Bed) -> PathBuf {
    let claim = bed
        .api::<PersistentVolumeClaim>(SYSTEM)
        .get("dbops-backups")
        .await
        .unwrap();
    let volume = claim
        .spec
        .and_then(|s| s.volume_name)
        .expect("the claim dbops-backups is bound");
    let pv = Api::<PersistentVolume>::all(bed.client.clone())
        .get(&volume)
        .await
        .unwrap();
    PathBuf::from(
        pv.spec
            .and_then(|s| s.host_path)
            .expect("the test bed's backups volume is a hostPath")
            .path,
    )
}

/// Puts a directory's mode back when dropped (also when the test fails).
struct ModeGuard(PathBuf, u32);

impl Drop for ModeGuard {
    fn drop(&mut self) {
        let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(self.1));
    }
}

fn endpoint_ready(slices: &[EndpointSlice], pod: &str) -> Option<bool> {
    slices
        .iter()
        .flat_map(|s| s.endpoints.iter())
        .find(|e| e.target_ref.as_ref().and_then(|t| t.name.as_deref()) == Some(pod))
        .map(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
}

#[tokio::test]
async fn a_replica_that_cannot_write_the_backup_store_gets_no_traffic() {
    let bed = bed().await;
    let controller = "backup-controller";
    bed.rolled_out(controller, SETTLE).await.unwrap();
    let dir = backup_store_dir(bed).await;
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777;
    let _restore = ModeGuard(dir.clone(), mode);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();

    // A new replica starts while the store is read-only (the standby is replaced).
    let (leader, standby) = bed.leader_and_standby(controller, SETTLE).await.unwrap();
    let standby = standby.name_any();
    let pods: Api<Pod> = bed.api(SYSTEM);
    pods.delete(&standby, &DeleteParams::default())
        .await
        .unwrap();
    let fresh = wait_for(
        "a new backup-controller Pod running",
        SETTLE,
        || async { bed.pods_of(controller).await },
        |ps: &Vec<Pod>| {
            ps.iter().any(|p| {
                p.name_any() != leader
                    && p.name_any() != standby
                    && p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some()
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
        },
    )
    .await
    .unwrap()
    .into_iter()
    .find(|p| p.name_any() != leader && p.name_any() != standby)
    .unwrap();
    let name = fresh.name_any();
    let ip = fresh.status.and_then(|s| s.pod_ip).unwrap();
    let service = "dbops-backup-controller-metrics";
    let slices: Api<EndpointSlice> = bed.api(SYSTEM);
    let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={service}"));

    // Not Ready, and why; listed in the Service's EndpointSlice as not ready.
    let (status, body) = wait_for(
        &format!("{name} answering /readyz"),
        Duration::from_secs(60),
        || async { Ok(http_get(&ip, 8080, "/readyz").ok()) },
        |r: &Option<(u16, String)>| r.as_ref().is_some_and(|(_, b)| b.contains("BackupStore")),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(status, 503, "{name}: {body}");
    readyz_reason(status, &body).unwrap();
    for _ in 0..3 {
        let pod = pods.get(&name).await.unwrap();
        assert!(!pod_ready(&pod), "{name} Ready with a read-only store");
        let listed = slices.list(&lp).await.unwrap().items;
        assert_ne!(
            endpoint_ready(&listed, &name),
            Some(true),
            "{name} gets Service traffic"
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
    }

    // Writable again: it passes its check, becomes Ready and an endpoint.
    drop(_restore);
    wait_for(
        &format!("{name} Ready and a ready endpoint of {service}"),
        SETTLE,
        || async {
            let pod = pods.get(&name).await?;
            let listed = slices.list(&lp).await?.items;
            Ok(pod_ready(&pod) && endpoint_ready(&listed, &name) == Some(true))
        },
        |ok: &bool| *ok,
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn liveness_restarts_a_hung_controller() {
    let bed = bed().await;
    let controller = "migration-controller";
    bed.rolled_out(controller, SETTLE).await.unwrap();
    let (_, standby) = bed.leader_and_standby(controller, SETTLE).await.unwrap();
    let pods: Api<Pod> = bed.api(SYSTEM);
    let name = standby.name_any();
    let before = restart_count(&standby);
    let (_, pid) = bed.container_pid(&standby).unwrap();
    // Hung: stopped, it answers no probe (the process lives, its port accepts nothing).
    let stopped = Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let restarted = wait_for(
        &format!("{name} restarted by its liveness probe"),
        Duration::from_secs(240),
        || async { Ok(pods.get(&name).await?) },
        |p: &Pod| restart_count(p) > before && pod_ready(p),
    )
    .await
    .unwrap();
    let events = bed
        .kubectl(&[
            "get",
            "events",
            "-n",
            SYSTEM,
            "--field-selector",
            &format!("involvedObject.name={name}"),
            "-o",
            "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}",
        ])
        .unwrap();
    assert!(
        events.contains("Liveness probe failed"),
        "{name} restarted, but not for its liveness probe: {events}"
    );
    assert!(restart_count(&restarted) > before);
}
