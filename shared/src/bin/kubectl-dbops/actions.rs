//! The subcommands that act: psql, backup, restore, migrate, approve, rotate.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use dbops_api::names::annotation::ROTATE;
use dbops_api::{Backup, BackupPhase, Database, DatabaseUser, Migration};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;

use crate::common::{Kube, Outcome};

#[derive(clap::Args, Debug)]
pub struct PsqlArgs {
    /// A Database or DatabaseUser (its Secret `<name>-connection`).
    name: String,
    /// Through the server's pooler (`pooler-uri`, `pooler-ca.crt`).
    #[arg(long)]
    pooler: bool,
    /// The psql program.
    #[arg(long, env = "PSQL", default_value = "psql")]
    psql: String,
    /// Arguments for psql.
    #[arg(last = true)]
    args: Vec<String>,
}

/// psql with the Secret's URI, its CA in a private temporary file (never on the command
/// line: the URI's password reaches psql through its environment).
pub async fn psql(k: &Kube, a: PsqlArgs) -> Result<Outcome> {
    let name = format!("{}-connection", a.name);
    let Some(secret) = k.api::<Secret>().get_opt(&name).await? else {
        eprintln!(
            "no Secret {}/{name}: is {} a Database or DatabaseUser here?",
            k.ns, a.name
        );
        return Ok(Outcome::NotFound);
    };
    let key = |k: &str| -> Option<String> {
        let bytes = secret.data.as_ref()?.get(k)?;
        String::from_utf8(bytes.0.clone()).ok()
    };
    let (uri_key, ca_key) = if a.pooler {
        ("pooler-uri", "pooler-ca.crt")
    } else {
        ("uri", "ca.crt")
    };
    let uri = key(uri_key).with_context(|| format!("Secret {name} has no {uri_key}"))?;
    let dir = tempfile::Builder::new()
        .prefix("kubectl-dbops-")
        .tempdir()?;
    let mut command = std::process::Command::new(&a.psql);
    if let Some(ca) = key(ca_key) {
        let file = dir.path().join("ca.crt");
        std::fs::write(&file, ca)?;
        command.env("PGSSLROOTCERT", &file);
    }
    // The connection, password included, goes through libpq's environment: nothing of it
    // on psql's command line (visible in `ps`).
    for (var, value) in libpq_env(&uri)? {
        command.env(var, value);
    }
    let status = command
        .args(&a.args)
        .status()
        .with_context(|| format!("running {}", a.psql))?;
    Ok(if status.success() {
        Outcome::Done
    } else {
        Outcome::Failed
    })
}

/// A `postgresql://user:password@host:port/dbname?sslmode=…` URI as libpq's variables.
fn libpq_env(uri: &str) -> Result<Vec<(&'static str, String)>> {
    let url = reqwest::Url::parse(uri).context("the Secret's URI does not parse")?;
    let decode = |s: &str| percent_decode(s);
    let mut env = vec![
        ("PGHOST", url.host_str().unwrap_or_default().to_string()),
        ("PGPORT", url.port().unwrap_or(5432).to_string()),
        ("PGUSER", decode(url.username())),
        ("PGPASSWORD", decode(url.password().unwrap_or_default())),
        ("PGDATABASE", decode(url.path().trim_start_matches('/'))),
    ];
    for (k, v) in url.query_pairs() {
        if k == "sslmode" {
            env.push(("PGSSLMODE", v.into_owned()));
        }
    }
    Ok(env)
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(clap::Args, Debug)]
pub struct BackupArgs {
    /// The Database.
    database: String,
    /// The Backup's name (default: `<database>-<UTC time>`).
    #[arg(long)]
    name: Option<String>,
    /// Wait until it is Completed or Failed.
    #[arg(long)]
    wait: bool,
    /// How long --wait waits, in seconds.
    #[arg(long, default_value_t = 1800)]
    timeout: u64,
}

fn stamp() -> String {
    jiff::Timestamp::now().strftime("%Y%m%d-%H%M%S").to_string()
}

pub async fn backup(k: &Kube, a: BackupArgs) -> Result<Outcome> {
    if k.api::<Database>().get_opt(&a.database).await?.is_none() {
        eprintln!("no Database {}/{}", k.ns, a.database);
        return Ok(Outcome::NotFound);
    }
    let name = a
        .name
        .unwrap_or_else(|| format!("{}-{}", a.database, stamp()));
    let backup: Backup = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Backup",
        "metadata": {"name": name}, "spec": {"databaseRef": {"name": a.database}},
    }))?;
    k.api::<Backup>()
        .create(&PostParams::default(), &backup)
        .await?;
    println!("backup.dbops.dev/{name} created");
    if !a.wait {
        return Ok(Outcome::Done);
    }
    let api = k.api::<Backup>();
    let phase = |b: &Backup| b.status.as_ref().and_then(|s| s.phase);
    let done = wait(&name, Duration::from_secs(a.timeout), || async {
        let b = api.get(&name).await?;
        Ok(matches!(
            phase(&b),
            Some(BackupPhase::Completed | BackupPhase::Failed)
        )
        .then_some(b))
    })
    .await?;
    let status = done.status.clone().unwrap_or_default();
    println!(
        "backup.dbops.dev/{name} {:?}: {} bytes, sha256 {}",
        status.phase.unwrap_or(BackupPhase::Pending),
        status.size_bytes.unwrap_or(0),
        status.checksum.as_deref().unwrap_or("-")
    );
    Ok(match phase(&done) {
        Some(BackupPhase::Completed) => Outcome::Done,
        _ => Outcome::Failed,
    })
}

/// Polls `check` every second until it returns something, or `timeout` passes.
pub async fn wait<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(done) = check().await? {
            return Ok(done);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("{what}: not done after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[derive(clap::Args, Debug)]
pub struct RestoreArgs {
    /// The Backup.
    backup: String,
    /// The new Database's name.
    #[arg(long)]
    to: String,
    /// Its DatabaseServer (default: that of the Backup's Database).
    #[arg(long)]
    server: Option<String>,
}

pub async fn restore(k: &Kube, a: RestoreArgs) -> Result<Outcome> {
    let Some(backup) = k.api::<Backup>().get_opt(&a.backup).await? else {
        eprintln!("no Backup {}/{}", k.ns, a.backup);
        return Ok(Outcome::NotFound);
    };
    let server = match a.server {
        Some(s) => s,
        None => {
            let db = k
                .api::<Database>()
                .get_opt(&backup.spec.database_ref.name)
                .await?;
            db.map(|d| d.spec.server_ref.name)
                .context("the Backup's Database is gone: name a server with --server")?
        }
    };
    create_database(
        k,
        &a.to,
        json!({"serverRef": {"name": server}, "restoreFrom": {"backupRef": {"name": a.backup}}}),
    )
    .await
}

async fn create_database(k: &Kube, name: &str, spec: serde_json::Value) -> Result<Outcome> {
    let db: Database = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
        "metadata": {"name": name}, "spec": spec,
    }))?;
    k.api::<Database>()
        .create(&PostParams::default(), &db)
        .await?;
    println!("database.dbops.dev/{name} created (kubectl dbops status {name})");
    Ok(Outcome::Done)
}

#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    /// The Database.
    database: String,
    /// The target DatabaseServer.
    #[arg(long)]
    to: String,
    /// Auto (default), Dump or Logical.
    #[arg(long)]
    mode: Option<String>,
    /// Cut over as soon as it can (`cutover: Automatic`); by default it waits in
    /// AwaitingApproval for `kubectl dbops approve`.
    #[arg(long)]
    automatic: bool,
}

pub async fn migrate(k: &Kube, a: MigrateArgs) -> Result<Outcome> {
    let name = format!("{}-to-{}", a.database, a.to);
    let cutover = if a.automatic { "Automatic" } else { "Manual" };
    let mut spec = json!({"databaseRef": {"name": a.database},
                          "target": {"serverRef": {"name": a.to}}, "cutover": cutover});
    if let Some(mode) = a.mode {
        spec["mode"] = json!(mode);
    }
    let m: Migration = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1", "kind": "Migration",
        "metadata": {"name": name}, "spec": spec,
    }))?;
    k.api::<Migration>()
        .create(&PostParams::default(), &m)
        .await?;
    println!("migration.dbops.dev/{name} created");
    Ok(Outcome::Done)
}

#[derive(clap::Args, Debug)]
pub struct ApproveArgs {
    /// The Migration.
    migration: String,
}

pub async fn approve(k: &Kube, a: ApproveArgs) -> Result<Outcome> {
    let api = k.api::<Migration>();
    if api.get_opt(&a.migration).await?.is_none() {
        eprintln!("no Migration {}/{}", k.ns, a.migration);
        return Ok(Outcome::NotFound);
    }
    let patch = json!({"spec": {"approved": true}});
    api.patch(&a.migration, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    println!("migration.dbops.dev/{} approved", a.migration);
    Ok(Outcome::Done)
}

#[derive(clap::Args, Debug)]
pub struct RotateArgs {
    /// A Database (its owner's password) or a DatabaseUser.
    name: String,
}

pub async fn rotate(k: &Kube, a: RotateArgs) -> Result<Outcome> {
    let patch = json!({"metadata": {"annotations": {ROTATE: jiff::Timestamp::now().to_string()}}});
    let params = PatchParams::default();
    if k.api::<Database>().get_opt(&a.name).await?.is_some() {
        k.api::<Database>()
            .patch(&a.name, &params, &Patch::Merge(&patch))
            .await?;
        println!("database.dbops.dev/{}: rotation asked ({ROTATE})", a.name);
        return Ok(Outcome::Done);
    }
    if k.api::<DatabaseUser>().get_opt(&a.name).await?.is_some() {
        k.api::<DatabaseUser>()
            .patch(&a.name, &params, &Patch::Merge(&patch))
            .await?;
        println!(
            "databaseuser.dbops.dev/{}: rotation asked ({ROTATE})",
            a.name
        );
        return Ok(Outcome::Done);
    }
    eprintln!("no Database or DatabaseUser {}/{}", k.ns, a.name);
    Ok(Outcome::NotFound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secrets_uri_becomes_libpqs_environment() {
        let env = libpq_env(
            "postgresql://orders_owner:p%40ss%2Fw%3Ard@pg-main.databases.svc:5433/orders?sslmode=verify-full",
        )
        .expect("parses");
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("PGHOST"), Some("pg-main.databases.svc"));
        assert_eq!(get("PGPORT"), Some("5433"));
        assert_eq!(get("PGUSER"), Some("orders_owner"));
        assert_eq!(get("PGPASSWORD"), Some("p@ss/w:rd"));
        assert_eq!(get("PGDATABASE"), Some("orders"));
        assert_eq!(get("PGSSLMODE"), Some("verify-full"));
        assert_eq!(percent_decode("a%2"), "a%2");
    }
}
