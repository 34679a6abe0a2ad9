//! `dbops-dev audit`: every password the dev environment handed out, looked for where
//! none may be (see `dbops_e2e::secret_audit`).
//!
//! Gathered: the keys of every Secret that name a password (the admin Secrets, each
//! Database's `<name>-connection`, the password in its `uri`) and the password in each
//! subscription's connection string on either server (the replication role's). With
//! `--watch`, every version of every Secret and every subscription seen until SIGTERM or
//! Ctrl-C, so that those gone by the end (a tour drops its Databases) count too.
//!
//! Searched: every line of the servers' logs (`log_statement=all`) and of the
//! controllers' logs, and every query text of `pg_stat_statements` on each server that
//! loads it; any SCRAM verifier counts as a finding as well. Checked: each server's
//! `password_encryption` is `scram-sha-256`, every role's password is a SCRAM verifier,
//! and its log shows no connection authenticated otherwise than by SCRAM (local `trust`
//! aside).
//!
//! The audit's own sessions turn their statement logging and tracking off, so that its
//! reads (of `pg_subscription`, `pg_authid`) leave nothing behind.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use dbops_api::DatabaseServer;
use dbops_e2e::secret_audit::{self, Finding, Known};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use tokio_postgres::{Client, NoTls};

use super::{AuditArgs, CONTROLLER_NAMESPACE, SERVERS};

/// How often `--watch` reads the servers' subscriptions.
const POLL: Duration = Duration::from_millis(250);

/// One of the dev servers, as its DatabaseServer and admin Secret describe it.
struct Server {
    name: &'static str,
    log: PathBuf,
    client: Client,
}

/// Runs the audit; `Ok(false)` when it found anything.
pub async fn run(args: AuditArgs) -> Result<bool> {
    let state = std::path::absolute(&args.state_dir)?;
    let kube = dbops_e2e::controlplane::client_from_kubeconfig(&state.join("kubeconfig"))
        .await
        .context("the dev environment's kubeconfig (is it up?)")?;
    let mut known = Known::default();
    let mut servers = Vec::new();
    for (name, pg_name) in SERVERS {
        servers.push(connect(&kube, &state, name, pg_name).await?);
    }
    gather_secrets(&kube, &mut known).await?;
    gather_subscriptions(&servers, &mut known).await?;
    if args.watch {
        watch(&kube, &servers, &mut known, args.ready_file.as_deref()).await?;
        gather_secrets(&kube, &mut known).await?;
        gather_subscriptions(&servers, &mut known).await?;
    }

    let mut failures: Vec<String> = Vec::new();
    let origins = known.origins();
    println!("audit: {} secrets gathered, from:", known.len());
    for origin in &origins {
        println!("  {origin}");
    }
    for kind in &args.expect {
        let needle = match kind.as_str() {
            "connection-secret" => "-connection key",
            "subscription" => "subscription ",
            other => bail!("--expect {other}: not connection-secret nor subscription"),
        };
        if !origins.iter().any(|o| o.contains(needle)) {
            failures.push(format!(
                "no {kind} was seen: nothing of that kind was checked"
            ));
        }
    }

    let mut findings: Vec<Finding> = Vec::new();
    let mut logs: Vec<PathBuf> = servers.iter().map(|s| s.log.clone()).collect();
    logs.extend(controller_logs(&state.join("logs"))?);
    for log in &logs {
        findings.extend(known.search_file(log)?);
        println!("audit: searched {}", log.display());
    }
    for server in &servers {
        let texts = secret_audit::pg_stat_statements_texts(&server.client).await?;
        let preloaded: String = server
            .client
            .query_one("SELECT current_setting('shared_preload_libraries')", &[])
            .await?
            .get(0);
        match texts {
            Some(texts) => {
                let place = format!("pg_stat_statements of {}", server.name);
                findings.extend(known.search(&place, &texts.join("\n")));
                println!("audit: searched {place} ({} statements)", texts.len());
            }
            None if preloaded.contains("pg_stat_statements") => failures.push(format!(
                "{} loads pg_stat_statements but has no view of it in database postgres",
                server.name
            )),
            None => println!("audit: {} has no pg_stat_statements", server.name),
        }
        for weak in secret_audit::weak_authentication(&server.client).await? {
            failures.push(format!("{}: {weak}", server.name));
        }
        let log = std::fs::read(&server.log)
            .with_context(|| format!("reading {}", server.log.display()))?;
        let methods = secret_audit::authentication_methods(&String::from_utf8_lossy(&log));
        println!(
            "audit: {} authenticated connections by {methods:?}",
            server.name
        );
        if methods.get("scram-sha-256").copied().unwrap_or(0) == 0 {
            failures.push(format!(
                "{}: its log shows no connection authenticated by scram-sha-256",
                server.name
            ));
        }
        for method in methods.keys() {
            if method != "scram-sha-256" && method != "trust" {
                failures.push(format!(
                    "{}: connections authenticated by {method}",
                    server.name
                ));
            }
        }
    }
    failures.extend(findings.iter().map(ToString::to_string));
    if failures.is_empty() {
        println!(
            "audit: passed: no password nor verifier in {} logs nor in pg_stat_statements; SCRAM only",
            logs.len()
        );
        Ok(true)
    } else {
        for failure in &failures {
            eprintln!("audit: FAILED: {failure}");
        }
        Ok(false)
    }
}

/// Connects to the DatabaseServer's server as its admin (its Secret's password is one of
/// those gathered later), with this session's own statements kept out of the log and
/// of pg_stat_statements.
async fn connect(
    kube: &kube::Client,
    state: &Path,
    name: &'static str,
    pg_name: &str,
) -> Result<Server> {
    let server = Api::<DatabaseServer>::all(kube.clone())
        .get(name)
        .await
        .with_context(|| format!("reading DatabaseServer {name}"))?;
    let secret_name = &server.spec.admin_secret_ref.name;
    let secret = Api::<Secret>::namespaced(kube.clone(), CONTROLLER_NAMESPACE)
        .get(secret_name)
        .await
        .with_context(|| format!("reading Secret {CONTROLLER_NAMESPACE}/{secret_name}"))?;
    let credentials = dbops_shared::postgres::Credentials::from_secret(&secret)?;
    let port = u16::try_from(server.spec.port).context("the DatabaseServer's port")?;
    let mut config = tokio_postgres::Config::new();
    config
        .host("127.0.0.1")
        .port(port)
        .user(&credentials.username)
        .password(&credentials.password)
        .dbname("postgres")
        .application_name("dbops-dev-audit")
        .connect_timeout(Duration::from_secs(5));
    let (client, connection) = config
        .connect(NoTls)
        .await
        .with_context(|| format!("connecting to {name} as its admin"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
        .batch_execute("SET log_statement = 'none'; SET log_min_error_statement = 'panic'")
        .await
        .with_context(|| format!("{name}: turning the audit's statement logging off"))?;
    // Only where the module is loaded (the setting exists then).
    let _ = client
        .batch_execute("SET pg_stat_statements.track = 'none'")
        .await;
    Ok(Server {
        name,
        log: state.join(name).join(format!("postgres-{pg_name}.log")),
        client,
    })
}

/// The passwords of every Secret there is now.
async fn gather_secrets(kube: &kube::Client, known: &mut Known) -> Result<()> {
    let secrets = Api::<Secret>::all(kube.clone())
        .list(&ListParams::default())
        .await
        .context("listing Secrets")?;
    for secret in &secrets.items {
        known.add_secret(secret);
    }
    Ok(())
}

/// The passwords in the subscriptions there are now, on either server.
async fn gather_subscriptions(servers: &[Server], known: &mut Known) -> Result<()> {
    for server in servers {
        for (subscription, conninfo) in secret_audit::subscription_conninfos(&server.client).await?
        {
            known.add_conninfo(
                &format!("subscription {subscription} on {}", server.name),
                &conninfo,
            );
        }
    }
    Ok(())
}

/// Gathers from every Secret event and every [`POLL`] of the subscriptions until SIGTERM
/// or Ctrl-C.
async fn watch(
    kube: &kube::Client,
    servers: &[Server],
    known: &mut Known,
    ready_file: Option<&Path>,
) -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut events = watcher(Api::<Secret>::all(kube.clone()), watcher::Config::default()).boxed();
    // Ready once the watch has listed what there is.
    loop {
        match events.next().await {
            Some(Ok(watcher::Event::InitDone)) => break,
            Some(Ok(watcher::Event::InitApply(secret) | watcher::Event::Apply(secret))) => {
                known.add_secret(&secret)
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => bail!("watching Secrets: {e}"),
            None => bail!("the Secret watch ended"),
        }
    }
    if let Some(file) = ready_file {
        std::fs::write(file, "watching\n")?;
    }
    let mut poll = tokio::time::interval(POLL);
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(()),
            r = tokio::signal::ctrl_c() => return r.map_err(Into::into),
            event = events.next() => match event {
                Some(Ok(watcher::Event::InitApply(secret) | watcher::Event::Apply(secret))) => {
                    known.add_secret(&secret)
                }
                Some(Ok(_)) => {}
                // The watcher re-lists by itself after an error.
                Some(Err(e)) => eprintln!("audit: the Secret watch: {e}"),
                None => bail!("the Secret watch ended"),
            },
            _ = poll.tick() => gather_subscriptions(servers, known).await?,
        }
    }
}

/// The controllers' log files (`<state>/logs/*.log`).
fn controller_logs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    Ok(logs)
}
