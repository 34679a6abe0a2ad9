//! `kubectl dbops trace <kind>/<name>`: the object's last trace in Jaeger.

use anyhow::{Context, Result, bail};
use dbops_api::{Backup, Database, DatabaseUser, Migration};
use kube::ResourceExt;

use crate::common::{Kube, Outcome};

#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    /// `database/<name>`, `databaseuser/<name>`, `backup/<name>` or `migration/<name>`.
    object: String,
    /// Jaeger's query API.
    #[arg(long, env = "JAEGER", default_value = "http://127.0.0.1:16686")]
    jaeger: String,
    /// How many of the slowest spans to show.
    #[arg(long, default_value_t = 5)]
    slowest: usize,
}

/// The object's kind (as the reconcile spans name it), the controller that reconciles
/// it, and its annotations.
async fn object(
    k: &Kube,
    object: &str,
) -> Result<
    Option<(
        &'static str,
        &'static str,
        String,
        std::collections::BTreeMap<String, String>,
    )>,
> {
    let (kind, name) = object
        .split_once('/')
        .context("name the object as <kind>/<name>, for example migration/orders-to-target")?;
    let name = name.to_string();
    let found = match kind.to_ascii_lowercase().as_str() {
        "database" | "databases" | "pgdb" => k
            .api::<Database>()
            .get_opt(&name)
            .await?
            .map(|o| ("Database", "database", o.annotations().clone())),
        "databaseuser" | "databaseusers" | "dbuser" => k
            .api::<DatabaseUser>()
            .get_opt(&name)
            .await?
            .map(|o| ("DatabaseUser", "database", o.annotations().clone())),
        "backup" | "backups" => k
            .api::<Backup>()
            .get_opt(&name)
            .await?
            .map(|o| ("Backup", "backup", o.annotations().clone())),
        "migration" | "migrations" | "pgmig" => k
            .api::<Migration>()
            .get_opt(&name)
            .await?
            .map(|o| ("Migration", "migration", o.annotations().clone())),
        other => bail!(
            "kubectl dbops trace knows database, databaseuser, backup and migration, not {other:?}"
        ),
    };
    Ok(found.map(|(kind, controller, annotations)| (kind, controller, name, annotations)))
}

pub async fn run(k: &Kube, a: TraceArgs) -> Result<Outcome> {
    let Some((kind, controller, name, annotations)) = object(k, &a.object).await? else {
        eprintln!("no {} in {}", a.object, k.ns);
        return Ok(Outcome::NotFound);
    };
    let http = reqwest::Client::new();
    let base = a.jaeger.trim_end_matches('/');
    // The trace the object was made in, else the object's last reconcile.
    let trace_id = annotations
        .get(dbops_api::names::annotation::TRACEPARENT)
        .and_then(|t| t.split('-').nth(1))
        .map(str::to_string);
    let url = match &trace_id {
        Some(id) => format!("{base}/api/traces/{id}"),
        None => {
            let tags =
                serde_json::json!({"object.name": name, "object.namespace": k.ns}).to_string();
            let mut url = reqwest::Url::parse(&format!("{base}/api/traces"))?;
            url.query_pairs_mut()
                .append_pair("service", &format!("dbops-{controller}-controller"))
                .append_pair("operation", &format!("reconcile {kind}"))
                .append_pair("tags", &tags)
                .append_pair("limit", "1")
                .append_pair("lookback", "24h");
            url.to_string()
        }
    };
    let bytes = http
        .get(&url)
        .send()
        .await?
        .error_for_status()?
        .bytes()
        .await?;
    let body: serde_json::Value = serde_json::from_slice(&bytes)?;
    let Some(trace) = body["data"].as_array().and_then(|d| d.first()) else {
        eprintln!(
            "Jaeger at {base} has no trace of {} (is the controller sending traces there?)",
            a.object
        );
        return Ok(Outcome::NotFound);
    };
    print_trace(trace, a.slowest);
    Ok(Outcome::Done)
}

fn print_trace(trace: &serde_json::Value, slowest: usize) {
    let processes = &trace["processes"];
    let spans = trace["spans"].as_array().cloned().unwrap_or_default();
    let service = |s: &serde_json::Value| {
        let p = s["processID"].as_str().unwrap_or_default();
        processes[p]["serviceName"]
            .as_str()
            .unwrap_or("?")
            .to_string()
    };
    let mut services: Vec<String> = spans.iter().map(service).collect();
    services.sort();
    services.dedup();
    println!(
        "trace {}: {} spans from {}",
        trace["traceID"].as_str().unwrap_or("?"),
        spans.len(),
        services.join(", ")
    );
    let mut by_time = spans.clone();
    by_time.sort_by_key(|s| std::cmp::Reverse(s["duration"].as_u64().unwrap_or(0)));
    println!("slowest:");
    for s in by_time.iter().take(slowest) {
        println!(
            "  {:>10.1} ms  {}  {}",
            s["duration"].as_u64().unwrap_or(0) as f64 / 1000.0,
            service(s),
            s["operationName"].as_str().unwrap_or("?")
        );
    }
}
