//! The invariants, checked once everything has settled, each violation printed with what
//! the harness knows about it; and for what did not settle, a diagnosis.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dbops_api::{Backup, BackupPhase, Database, MigrationPhase};
use dbops_shared::checksum::sha256_hex;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::evidence::{evidence, keep_evidence};
use super::faults::Fleet;
use super::settle::{
    Objects, UNEXPECTED, Unsettled, database_state, list, secret_consistent, settle,
};
use super::world::{NS, World, ready_condition};
use super::writer::{TABLE, Writers, connect, login_of};

/// Every check; returns the end state's figures for the summary.
pub(crate) async fn check_all(
    world: &Arc<World>,
    unsettled: &[Unsettled],
    writers: &Writers,
    fleet: &Fleet,
) -> String {
    for u in unsettled {
        let what = if u.deleting.is_some() {
            "(4) finalizer stuck / deletion never completed"
        } else {
            "(settle) not settled"
        };
        world
            .journal
            .violation(format!("{what}: {} {}: {}", u.kind, u.name, u.detail));
        let window = u.deleting.map(|t| (t, Timestamp::now()));
        let text = evidence(world, fleet, u.kind, &u.name, window);
        keep_evidence(world, &format!("{}-{}.txt", u.kind, u.name), &text);
    }
    let objects = match list(world).await {
        Ok(o) => o,
        Err(e) => {
            world
                .journal
                .violation(format!("cannot list the objects to check: {e:#}"));
            return "no end state".into();
        }
    };
    for d in &objects.dbs {
        if let Some(("False", reason, message)) = d
            .status
            .as_ref()
            .and_then(|s| ready_condition(&s.conditions))
            && UNEXPECTED.contains(&reason)
        {
            world.journal.violation(format!(
                "(6) Database {} ended {reason}, which nothing in this run should cause: {message}",
                d.name_any()
            ));
        }
    }
    let marks = match check_marks(world, &objects).await {
        Ok(n) => n,
        Err(e) => {
            world
                .journal
                .violation(format!("(1) could not read the servers: {e:#}"));
            0
        }
    };
    let logins = check_logins(world, &objects).await;
    let artifacts = match check_store(world, &objects) {
        Ok(n) => n,
        Err(e) => {
            world
                .journal
                .violation(format!("(3) could not read the store: {e:#}"));
            0
        }
    };
    let (writes, writer_dbs) = check_writes(world, &objects, writers).await;

    if !unsettled.is_empty() {
        diagnose(world, fleet, unsettled).await;
    }

    let count = |p: BackupPhase| {
        objects
            .backups
            .iter()
            .filter(|b| b.status.as_ref().and_then(|s| s.phase) == Some(p))
            .count()
    };
    let mcount = |p: MigrationPhase| {
        objects
            .migrations
            .iter()
            .filter(|m| m.status.as_ref().and_then(|s| s.phase) == Some(p))
            .count()
    };
    let ever = world.history.all();
    let ever_of = |k: &str| ever.iter().filter(|(_, s)| s.kind == k).count();
    format!(
        "{} Databases ever, {} at the end ({} Ready), {} Backups ever, {} at the end ({} Completed, {} Failed), {} Migrations ever, {} at the end ({} Succeeded, {} RolledBack, {} Failed); checked {marks} marked PostgreSQL objects, {logins} logins, {artifacts} artifacts, {writes} committed writes on {writer_dbs} migrated Databases",
        ever_of("Database"),
        objects.dbs.len(),
        objects
            .dbs
            .iter()
            .filter(|d| super::world::is_ready(d))
            .count(),
        ever_of("Backup"),
        objects.backups.len(),
        count(BackupPhase::Completed),
        count(BackupPhase::Failed),
        ever_of("Migration"),
        objects.migrations.len(),
        mcount(MigrationPhase::Succeeded),
        mcount(MigrationPhase::RolledBack),
        mcount(MigrationPhase::Failed),
    )
}

/// (1): marked databases and roles on both servers against the Databases.
async fn check_marks(world: &World, o: &Objects) -> Result<usize> {
    let live: BTreeMap<String, &Database> = o
        .dbs
        .iter()
        .map(|d| (d.uid().unwrap_or_default(), d))
        .collect();
    // (uid, kind) -> where.
    let mut found: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut checked = 0;
    for server in &world.servers {
        let client = server.connect("postgres").await?;
        let rows = client
            .query(
                "SELECT 'database', datname::text, shobj_description(oid, 'pg_database'), pg_get_userbyid(datdba)::text
                   FROM pg_database WHERE NOT datistemplate AND datname <> 'postgres'
                 UNION ALL
                 SELECT 'role', rolname::text, shobj_description(oid, 'pg_authid'), ''
                   FROM pg_roles WHERE rolname !~ '^pg_' AND rolname <> $1",
                &[&dbops_e2e::postgres::SUPERUSER],
            )
            .await
            .with_context(|| format!("listing {}", server.name))?;
        for row in rows {
            checked += 1;
            let kind: String = row.get(0);
            let name: String = row.get(1);
            let comment: Option<String> = row.get(2);
            let owner: String = row.get(3);
            let uid = comment
                .as_deref()
                .and_then(|c| c.split_whitespace().next())
                .and_then(|w| w.strip_prefix("dbops.dev/uid="))
                .map(str::to_string);
            let Some(uid) = uid else {
                world.journal.violation(format!(
                    "(1) {kind} {name} on {} carries no dbops mark (comment {comment:?}, owner {owner:?}): nothing else creates objects on this server",
                    server.name
                ));
                continue;
            };
            found
                .entry((uid.clone(), kind.clone()))
                .or_default()
                .push(format!("{kind} {name} on {}", server.name));
            if let Some(d) = live.get(&uid) {
                if d.spec.server_ref.name != server.name {
                    world.journal.violation(format!(
                        "(1) {kind} {name} on {} is marked for Database {}, which is on {} ({})",
                        server.name,
                        d.name_any(),
                        d.spec.server_ref.name,
                        database_state(d)
                    ));
                }
                if comment
                    .as_deref()
                    .is_some_and(|c| c.contains("restore=pending"))
                    && super::world::is_ready(d)
                {
                    world.journal.violation(format!(
                        "(1) {kind} {name} on {} is still marked restore=pending while Database {} is Ready",
                        server.name,
                        d.name_any()
                    ));
                }
                continue;
            }
            match world.history.get(&uid) {
                Some(s) if s.kind == "Database" && s.policy == "Retain" => {}
                Some(s) => world.journal.violation(format!(
                    "(1) {kind} {name} on {} belongs to {}: it should have been dropped",
                    server.name,
                    s.gone()
                )),
                None => world.journal.violation(format!(
                    "(1) {kind} {name} on {} is marked for UID {uid}, which no Database of this run ever had",
                    server.name
                )),
            }
        }
    }
    for ((uid, kind), places) in &found {
        if places.len() > 1 {
            let owner = live
                .get(uid)
                .map(|d| d.name_any())
                .or_else(|| world.history.get(uid).map(|s| s.name))
                .unwrap_or_else(|| uid.clone());
            world.journal.violation(format!(
                "(1) the {kind} of Database {owner} exists {} times: {}",
                places.len(),
                places.join(", ")
            ));
        }
    }
    for d in o.dbs.iter().filter(|d| super::world::is_ready(d)) {
        let uid = d.uid().unwrap_or_default();
        for kind in ["database", "role"] {
            if !found.contains_key(&(uid.clone(), kind.to_string())) {
                world.journal.violation(format!(
                    "(1) Database {} is Ready but no {kind} marked for it exists on {}",
                    d.name_any(),
                    d.spec.server_ref.name
                ));
            }
        }
    }
    Ok(checked)
}

/// (2): every Ready Database's connection Secret logs in, to its own server.
async fn check_logins(world: &World, o: &Objects) -> usize {
    let mut n = 0;
    for d in o.dbs.iter().filter(|d| {
        super::world::is_ready(d)
            && d.metadata.deletion_timestamp.is_none()
            && d.status.as_ref().and_then(|s| s.observed_generation) == d.metadata.generation
    }) {
        let name = d.connection_secret_name();
        let Some(secret) = o.secrets.iter().find(|s| s.name_any() == name) else {
            world.journal.violation(format!(
                "(2) Database {} is Ready without its Secret {name}",
                d.name_any()
            ));
            continue;
        };
        let Some(login) = login_of(secret) else {
            world.journal.violation(format!(
                "(2) Secret {name} lacks a PG* key or has a bad PGPORT"
            ));
            continue;
        };
        if let Err(e) = secret_consistent(d, &o.secrets) {
            world.journal.violation(format!("(2) {e}"));
        }
        if let Some(server) = world.server(&d.spec.server_ref.name)
            && server.port != login.port
        {
            world.journal.violation(format!(
                "(2) Secret {name} points at port {}, but Database {} is on {} (port {})",
                login.port,
                d.name_any(),
                server.name,
                server.port
            ));
        }
        let mut last = String::new();
        let mut ok = false;
        for attempt in 0..3 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            match connect(&login).await {
                Ok(c) => match c.query_one("SELECT current_database()::text", &[]).await {
                    Ok(row) if row.get::<_, String>(0) == login.dbname => {
                        ok = true;
                        break;
                    }
                    Ok(row) => last = format!("connected to {}", row.get::<_, String>(0)),
                    Err(e) => last = e.to_string(),
                },
                Err(e) => last = format!("{e:#}"),
            }
        }
        n += 1;
        if !ok {
            world.journal.violation(format!(
                "(2) Database {} is Ready but its Secret does not log in as {} to {}:{}/{}: {last}",
                d.name_any(),
                login.user,
                login.host,
                login.port,
                login.dbname
            ));
        }
    }
    n
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            walk(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// A UID at the end of an artifact's stem `<name>-<uid>`.
fn stem_uid(stem: &str) -> Option<(&str, &str)> {
    if stem.len() < 38 {
        return None;
    }
    let (name, uid) = stem.split_at(stem.len() - 36);
    Some((name.strip_suffix('-')?, uid))
}

/// (3): the store against the Backups.
fn check_store(world: &World, o: &Objects) -> Result<usize> {
    let mut files = Vec::new();
    walk(&world.store, &mut files)?;
    // uid -> artifact paths; uid -> manifest paths.
    let mut artifacts: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let mut manifests: BTreeMap<String, PathBuf> = BTreeMap::new();
    for f in &files {
        let file = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if file.ends_with(".partial") || file.starts_with(".dbops-probe") {
            world.journal.violation(format!(
                "(3) temporary file left in the store: {}",
                f.display()
            ));
        } else if let Some(stem) = file.strip_suffix(".dump") {
            match stem_uid(stem) {
                Some((_, uid)) => artifacts
                    .entry(uid.to_string())
                    .or_default()
                    .push(f.clone()),
                None => world.journal.violation(format!(
                    "(3) artifact with no Backup UID in its name: {}",
                    f.display()
                )),
            }
        } else if let Some(stem) = file.strip_suffix(".manifest.json")
            && let Some((_, uid)) = stem_uid(stem)
        {
            manifests.insert(uid.to_string(), f.clone());
        }
    }
    let live: BTreeMap<String, &Backup> = o
        .backups
        .iter()
        .map(|b| (b.uid().unwrap_or_default(), b))
        .collect();
    let mut checked = 0;
    for b in &o.backups {
        let uid = b.uid().unwrap_or_default();
        let status = b.status.clone().unwrap_or_default();
        let found = artifacts.get(&uid).cloned().unwrap_or_default();
        if status.phase != Some(BackupPhase::Completed) {
            if !found.is_empty() {
                world.journal.line(
                    "NOTE",
                    format!(
                        "Backup {} is {:?} yet has an artifact: {}",
                        b.name_any(),
                        status.phase,
                        found[0].display()
                    ),
                );
            }
            continue;
        }
        checked += 1;
        let expected = world
            .store
            .join(NS)
            .join(format!("{}-{uid}.dump", b.name_any()));
        if found.len() != 1 || found[0] != expected {
            world.journal.violation(format!(
                "(3) Completed Backup {} has {} artifact(s) {:?}, expected exactly {}",
                b.name_any(),
                found.len(),
                found,
                expected.display()
            ));
            continue;
        }
        let want = status.checksum.clone().unwrap_or_default();
        match std::fs::read(&expected) {
            Ok(bytes) => {
                let got = sha256_hex(&bytes);
                if got != want {
                    world.journal.violation(format!(
                        "(3) Backup {}: the artifact's SHA-256 is {got}, status.checksum says {want:?}",
                        b.name_any()
                    ));
                }
            }
            Err(e) => world.journal.violation(format!(
                "(3) Backup {}: cannot read {}: {e}",
                b.name_any(),
                expected.display()
            )),
        }
        let location = status.location.clone().unwrap_or_default();
        if location != format!("file://{}", expected.display()) {
            world.journal.violation(format!(
                "(3) Backup {}: status.location {location:?} is not its artifact {}",
                b.name_any(),
                expected.display()
            ));
        }
        match manifests.get(&uid).map(std::fs::read) {
            Some(Ok(body)) => {
                let m: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                if m["checksum"].as_str() != Some(want.as_str())
                    || m["backup"]["uid"].as_str() != Some(uid.as_str())
                {
                    world.journal.violation(format!(
                        "(3) Backup {}: its manifest says checksum {} and uid {}, status says {want}",
                        b.name_any(),
                        m["checksum"],
                        m["backup"]["uid"]
                    ));
                }
            }
            _ => world.journal.violation(format!(
                "(3) Completed Backup {} has no manifest beside its artifact",
                b.name_any()
            )),
        }
    }
    for (uid, paths) in &artifacts {
        if live.contains_key(uid) {
            continue;
        }
        match world.history.get(uid) {
            Some(s) if s.kind == "Backup" && s.policy == "Retain" => {}
            Some(s) => world.journal.violation(format!(
                "(3) artifact {} of {}, is still in the store",
                paths[0].display(),
                s.gone()
            )),
            None => world.journal.violation(format!(
                "(3) artifact {} belongs to no Backup this run ever saw",
                paths[0].display()
            )),
        }
    }
    for (uid, path) in &manifests {
        if !artifacts.contains_key(uid)
            && live.get(uid).is_some_and(|b| {
                b.status.as_ref().and_then(|s| s.phase) == Some(BackupPhase::Completed)
            })
        {
            world.journal.violation(format!(
                "(3) manifest {} without its artifact",
                path.display()
            ));
        }
    }
    Ok(checked)
}

/// (5): every committed write on the server its Database ends on.
async fn check_writes(world: &World, o: &Objects, writers: &Writers) -> (usize, usize) {
    let (mut total, mut dbs) = (0, 0);
    for w in writers.all() {
        let committed = w.committed();
        // Where the rows must be: the Database's server, or for a deleted Database with
        // policy Retain the server it was last on (its database stays there).
        let (label, server_name, dbname) = match o
            .dbs
            .iter()
            .find(|d| d.uid().as_deref() == Some(w.uid.as_str()))
        {
            Some(d) => (
                d.name_any(),
                d.spec.server_ref.name.clone(),
                d.status
                    .as_ref()
                    .and_then(|s| s.database_name.clone())
                    .unwrap_or_else(|| d.database_name()),
            ),
            None => match world.history.get(&w.uid) {
                Some(s) if s.policy == "Retain" => (
                    format!("{} (deleted, policy Retain)", s.name),
                    s.server.clone(),
                    s.name.replace('-', "_"),
                ),
                _ => {
                    world.journal.line(
                            "NOTE",
                            format!(
                                "Database {} is gone with its database: its {} committed writes are not checked",
                                w.database,
                                committed.len()
                            ),
                        );
                    continue;
                }
            },
        };
        let Some(server) = world.server(&server_name) else {
            continue;
        };
        let present: Result<BTreeSet<i64>> = async {
            let client = server.connect(&dbname).await?;
            let exists: bool = client
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[&TABLE])
                .await?
                .get(0);
            if !exists {
                return Ok(BTreeSet::new());
            }
            let rows = client
                .query(
                    &format!("SELECT n FROM {TABLE} WHERE n > $1 AND n < $2"),
                    &[&w.base, &(w.base + 1_000_000_000)],
                )
                .await?;
            Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
        }
        .await;
        let present = match present {
            Ok(p) => p,
            Err(e) => {
                if !committed.is_empty() {
                    world.journal.violation(format!(
                        "(5) Database {label}: cannot read its {} committed writes on {} ({dbname}): {e:#}",
                        committed.len(),
                        server.name
                    ));
                }
                continue;
            }
        };
        dbs += 1;
        total += committed.len();
        let missing: Vec<&(i64, Timestamp)> = committed
            .iter()
            .filter(|(n, _)| !present.contains(n))
            .collect();
        if !missing.is_empty() {
            let first: Vec<String> = missing
                .iter()
                .take(5)
                .map(|(n, t)| format!("#{} committed {t}", n - w.base))
                .collect();
            world.journal.violation(format!(
                "(5) Database {label} (on {} at the end): {} of {} committed writes are missing: {}",
                server.name,
                missing.len(),
                committed.len(),
                first.join(", ")
            ));
        }
    }
    (total, dbs)
}

/// After the verdict: restart the leader of each controller with stuck objects and see
/// whether a fresh process settles them (then the live one had lost them).
async fn diagnose(world: &Arc<World>, fleet: &Fleet, unsettled: &[Unsettled]) {
    // What --self-test holds on purpose needs no diagnosis.
    let unsettled: Vec<&Unsettled> = unsettled
        .iter()
        .filter(|u| !u.name.starts_with("selftest"))
        .collect();
    if unsettled.is_empty() {
        return;
    }
    let controllers: BTreeSet<&str> = unsettled.iter().map(|u| u.controller()).collect();
    for c in controllers {
        let holder = super::faults::lease_holder(&world.client, c).await;
        world.journal.line(
            "DIAG",
            format!("{c}: the Lease holder is {holder}; restarting it (SIGTERM) to see whether a fresh leader settles what it left"),
        );
        if let Some(r) = fleet.of(c).into_iter().find(|r| r.identity() == holder) {
            fleet.restart_gracefully(world, &r).await;
        }
    }
    let started = Instant::now();
    let left = settle(world, Duration::from_secs(90)).await;
    let secs = started.elapsed().as_secs_f64();
    for u in unsettled {
        let still = left.iter().any(|l| l.kind == u.kind && l.name == u.name);
        world.journal.line(
            "DIAG",
            if still {
                format!("{} {}: still not settled {secs:.0} s after the restart", u.kind, u.name)
            } else {
                format!(
                    "{} {}: settled within {secs:.0} s of the leader's restart (the old leader had left it)",
                    u.kind, u.name
                )
            },
        );
    }
}
