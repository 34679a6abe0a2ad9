//! `--self-test`: after settling, break one thing per invariant behind dbops' back, so the
//! run shows that each check catches what it is there for. Returns, per injected fault,
//! a piece of the violation it must produce.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dbops_api::{Backup, BackupPhase, Database};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use super::world::{NS, World};
use super::writer::{TABLE, Writers};

/// A finalizer nobody removes: the Database it is on never finishes its deletion.
const HOLD: &str = "chaos.dbops.dev/self-test-hold";

pub(crate) async fn inject(world: &World, writers: &Writers) -> Result<Vec<String>> {
    let mut expected = Vec::new();
    let dbs: Api<Database> = Api::namespaced(world.client.clone(), NS);
    let backups: Api<Backup> = Api::namespaced(world.client.clone(), NS);
    let live = dbs.list(&ListParams::default()).await?.items;

    // (4) A Database whose deletion cannot complete.
    let stuck: Database = serde_json::from_value(serde_json::json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
        "metadata": {"name": "selftest-stuck", "finalizers": [HOLD]},
        "spec": {"serverRef": {"name": "chaos-a"}, "deletionPolicy": "Retain"},
    }))?;
    dbs.create(&PostParams::default(), &stuck).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !dbs
        .get_opt("selftest-stuck")
        .await?
        .is_some_and(|d| super::world::is_ready(&d))
    {
        if Instant::now() > deadline {
            bail!("selftest-stuck not Ready within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    dbs.delete("selftest-stuck", &DeleteParams::default())
        .await?;
    inject_line(
        world,
        "Database selftest-stuck: deleted with a finalizer nobody removes",
    );
    expected.push("(4) finalizer stuck / deletion never completed: Database selftest-stuck".into());

    // (1) A database nobody asked for.
    let a = world.server("chaos-a").context("no chaos-a")?;
    a.connect("postgres")
        .await?
        .batch_execute("CREATE DATABASE selftest_unmarked")
        .await?;
    inject_line(world, "CREATE DATABASE selftest_unmarked on chaos-a");
    expected.push("(1) database selftest_unmarked on chaos-a carries no dbops mark".into());

    // (3) A partial file, and an artifact that no longer matches its checksum.
    let partial = world.store.join(NS).join(".selftest.dump.partial");
    std::fs::create_dir_all(world.store.join(NS))?;
    std::fs::write(&partial, b"half a dump")?;
    inject_line(world, format!("wrote {}", partial.display()));
    expected.push(".selftest.dump.partial".into());
    if let Some(b) = backups
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .find(|b| b.status.as_ref().and_then(|s| s.phase) == Some(BackupPhase::Completed))
    {
        let path = world.store.join(NS).join(format!(
            "{}-{}.dump",
            b.name_any(),
            b.uid().unwrap_or_default()
        ));
        let mut bytes = std::fs::read(&path)?;
        bytes.extend_from_slice(b"tampered");
        std::fs::write(&path, bytes)?;
        inject_line(
            world,
            format!("appended to the artifact of Backup {}", b.name_any()),
        );
        expected.push(format!(
            "(3) Backup {}: the artifact's SHA-256",
            b.name_any()
        ));
    }

    // (5) A committed write lost.
    let mut lost_in = None;
    for w in writers.all() {
        let last = w.committed().last().map(|(n, _)| *n);
        let Some(d) = live
            .iter()
            .find(|d| d.uid().as_deref() == Some(w.uid.as_str()))
        else {
            continue;
        };
        let (Some(n), Some(server)) = (last, world.server(&d.spec.server_ref.name)) else {
            continue;
        };
        let deleted = server
            .connect(&d.database_name())
            .await?
            .execute(&format!("DELETE FROM {TABLE} WHERE n = $1"), &[&n])
            .await?;
        if deleted == 1 {
            inject_line(
                world,
                format!(
                    "deleted committed write #{} of Database {}",
                    n - w.base,
                    d.name_any()
                ),
            );
            expected.push(format!("(5) Database {} ", d.name_any()));
            lost_in = Some(d.name_any());
            break;
        }
    }

    // (2) A Secret that no longer logs in: the role's password changed behind dbops.
    if let Some(d) = live
        .iter()
        .find(|d| super::world::is_ready(d) && lost_in.as_deref() != Some(d.name_any().as_str()))
        && let Some(server) = world.server(&d.spec.server_ref.name)
    {
        let role = d.owner_role();
        server
            .connect("postgres")
            .await?
            .batch_execute(&format!(
                "ALTER ROLE {} PASSWORD 'self-test'",
                dbops_e2e::postgres::quote_ident(&role)
            ))
            .await?;
        inject_line(
            world,
            format!("changed the password of role {role} on {}", server.name),
        );
        expected.push(format!(
            "(2) Database {} is Ready but its Secret does not log in",
            d.name_any()
        ));
    }
    Ok(expected)
}

fn inject_line(world: &World, what: impl std::fmt::Display) {
    world.journal.line("INJECT", what);
}
