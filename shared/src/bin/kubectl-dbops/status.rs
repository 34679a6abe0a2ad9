//! `kubectl dbops status <database>`: the Database and what hangs on it, as a tree.

use anyhow::Result;
use dbops_api::{Backup, Database, DatabasePhase, DatabaseUser, Migration};
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::ListParams;

use crate::common::{Kube, Outcome};

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The Database.
    database: String,
    /// How many of its latest Events to show.
    #[arg(long, default_value_t = 5)]
    events: usize,
}

fn ready(conditions: &[Condition]) -> String {
    match conditions.iter().find(|c| c.type_ == "Ready") {
        Some(c) => format!("Ready={} {}: {}", c.status, c.reason, c.message),
        None => "no Ready condition yet".to_string(),
    }
}

fn other_conditions(conditions: &[Condition]) -> Vec<String> {
    conditions
        .iter()
        .filter(|c| c.type_ != "Ready" && c.status == "True" && c.type_ != "Progressing")
        .map(|c| format!("{}={} {}", c.type_, c.status, c.reason))
        .collect()
}

pub async fn run(k: &Kube, a: StatusArgs) -> Result<Outcome> {
    let Some(db) = k.api::<Database>().get_opt(&a.database).await? else {
        eprintln!("no Database {}/{}", k.ns, a.database);
        return Ok(Outcome::NotFound);
    };
    let status = db.status.clone().unwrap_or_default();
    let phase = status.phase;
    println!(
        "Database {}/{}  {}  server {}",
        k.ns,
        a.database,
        phase.map_or("(no phase yet)".to_string(), |p| format!("{p:?}")),
        status.server.as_deref().unwrap_or(&db.spec.server_ref.name)
    );
    println!("│  {}", ready(&status.conditions));
    for more in other_conditions(&status.conditions) {
        println!("│  {more}");
    }
    if let Some(at) = &status.expires_at {
        println!("│  expires {}", at.0);
    }
    if let Some(clone) = &status.clone_status {
        println!(
            "│  cloned from {} as of {} ({} of {} tables)",
            clone.source.as_deref().unwrap_or("-"),
            clone
                .copied_at
                .as_ref()
                .map_or("-".into(), |t| t.0.to_string()),
            clone.tables.unwrap_or(0),
            clone.tables_total.unwrap_or(0)
        );
    }
    related(k, &a.database).await?;
    events(k, &a.database, a.events).await?;
    Ok(match phase {
        Some(DatabasePhase::Ready) => Outcome::Done,
        Some(DatabasePhase::Failed | DatabasePhase::Degraded) => Outcome::Failed,
        _ => Outcome::OnTheWay,
    })
}

/// Its DatabaseUsers, Backups and Migrations.
async fn related(k: &Kube, database: &str) -> Result<()> {
    for u in k.api::<DatabaseUser>().list(&ListParams::default()).await? {
        if u.spec.database_ref.name == database {
            let s = u.status.clone().unwrap_or_default();
            println!(
                "├─ DatabaseUser {}  {}",
                name(&u.metadata),
                ready(&s.conditions)
            );
        }
    }
    for b in k.api::<Backup>().list(&ListParams::default()).await? {
        if b.spec.database_ref.name == database {
            let s = b.status.clone().unwrap_or_default();
            let verified = s
                .conditions
                .iter()
                .find(|c| c.type_ == "Verified")
                .map(|c| format!("  Verified={} {}", c.status, c.reason))
                .unwrap_or_default();
            println!(
                "├─ Backup {}  {}  {} bytes{verified}",
                name(&b.metadata),
                s.phase.map_or("-".to_string(), |p| format!("{p:?}")),
                s.size_bytes.unwrap_or(0)
            );
        }
    }
    for m in k.api::<Migration>().list(&ListParams::default()).await? {
        if m.spec.database_ref.name == database {
            let s = m.status.clone().unwrap_or_default();
            println!(
                "├─ Migration {}  {}  step {}  → {}",
                name(&m.metadata),
                s.phase.map_or("-".to_string(), |p| format!("{p:?}")),
                s.current_step.map_or("-".to_string(), |p| format!("{p:?}")),
                m.spec.target.server_ref.name
            );
        }
    }
    Ok(())
}

fn name(meta: &kube::api::ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or_default()
}

/// The Database's latest Events.
async fn events(k: &Kube, database: &str, most: usize) -> Result<()> {
    let selector = format!("involvedObject.kind=Database,involvedObject.name={database}");
    let mut events = k
        .api::<Event>()
        .list(&ListParams::default().fields(&selector))
        .await?
        .items;
    let when = |e: &Event| {
        e.last_timestamp
            .as_ref()
            .map(|t| t.0)
            .or(e.event_time.as_ref().map(|t| t.0))
            .or(e.metadata.creation_timestamp.as_ref().map(|t| t.0))
    };
    events.sort_by_key(|e| when(e));
    let shown = events.len().saturating_sub(most);
    println!("└─ Events ({} of {})", events.len() - shown, events.len());
    for e in &events[shown..] {
        println!(
            "     {}  {}  {}  {}",
            when(e).map_or("-".to_string(), |t| t.to_string()),
            e.type_.as_deref().unwrap_or("-"),
            e.reason.as_deref().unwrap_or("-"),
            e.message.as_deref().unwrap_or("")
        );
    }
    Ok(())
}
