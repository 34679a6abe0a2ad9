//! The users benchmark's report: each phase's window, then the summary table.

use std::collections::BTreeMap;

use dbops_e2e::PgServer;

use super::args::UsersArgs;
use super::window::{Creation, Rotation, Window, keywords, kind_of};
use crate::scale;

/// The controller's writes in a window, counted by kind.
pub(crate) fn write_rows(w: &Window) -> Vec<(String, usize)> {
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    for write in &w.writes {
        *by_kind.entry(kind_of(write)).or_default() += 1;
    }
    by_kind.into_iter().collect()
}

pub(crate) fn print_window(title: &str, args: &UsersArgs, w: &Window) {
    let (n, u) = (args.databases as f64, args.users() as f64);
    println!("## {title}\n");
    println!(
        "| the controller's API writes (audit log) | count | per Database | per DatabaseUser | per object |"
    );
    println!("|---|---|---|---|---|");
    for (kind, count) in write_rows(w) {
        let c = count as f64;
        let (per_db, per_user) = if kind.starts_with("Database ") {
            (format!("{:.2}", c / n), String::new())
        } else if kind.starts_with("DatabaseUser ") && u > 0.0 {
            (String::new(), format!("{:.2}", c / u))
        } else {
            (String::new(), String::new())
        };
        println!(
            "| {kind} | {count} | {per_db} | {per_user} | {:.2} |",
            c / (n + u)
        );
    }
    println!(
        "| **all** | {} | | | **{:.2}** |",
        w.writes.len(),
        w.writes.len() as f64 / (n + u)
    );
    let refused = w.writes.iter().filter(|x| x.code >= 400).count();
    println!("\nnew Events by kind and reason: {}", counts(&w.events));
    println!(
        "\nrefused writes (HTTP status ≥ 400) among them: {refused}; raw: {}\n",
        crate::measure::writes_by_kind(w.writes.iter().cloned())
    );
    let mut by_word: BTreeMap<String, usize> = BTreeMap::new();
    for s in &w.statements {
        for k in keywords(s) {
            *by_word.entry(k).or_default() += 1;
        }
    }
    let ddl = w.statements.iter().filter(|s| scale::is_ddl(s)).count();
    println!(
        "SQL (server log, the controller's sessions): {} statements ({:.2} per object), {ddl} with DDL, {} new connections; by keyword: {}",
        w.statements.len(),
        w.statements.len() as f64 / (n + u),
        w.connections,
        counts(&by_word)
    );
    println!(
        "controller: dbops_external_requests_total postgres +{:.0}, kubernetes +{:.0}; reconciles: database-controller {:.0} ({:.0} failed), user-controller {:.0} ({:.0} failed); CPU {:.1} s; settled after {:.1} s\n",
        w.pg_requests,
        w.kube_requests,
        w.reconciles.0,
        w.failed.0,
        w.reconciles.1,
        w.failed.1,
        w.cpu,
        w.secs
    );
}

pub(crate) async fn report(
    args: &UsersArgs,
    creation: &Creation,
    rounds: &[Rotation],
    peak_kib: u64,
    pg: &PgServer,
) {
    let objects = args.objects() as f64;
    let version = match pg.connect_as_superuser().await {
        Ok(c) => c
            .query_one("SHOW server_version", &[])
            .await
            .map(|r| r.get::<_, String>(0))
            .unwrap_or_default(),
        Err(_) => String::new(),
    };
    println!("## summary\n");
    println!(
        "| | {} Databases + {} DatabaseUsers |",
        args.databases,
        args.users()
    );
    println!("|---|---|");
    println!(
        "| creation → all Databases Ready / all Databases and users Ready | {:.1} s / **{:.1} s** |",
        creation.dbs_ready, creation.all_ready
    );
    println!(
        "| creation: API writes per object (all kinds) | **{:.2}** ({} writes) |",
        creation.window.writes.len() as f64 / objects,
        creation.window.writes.len()
    );
    println!(
        "| creation: SQL statements per object / DDL / connections | {:.1} / {} / {} |",
        creation.window.statements.len() as f64 / objects,
        creation
            .window
            .statements
            .iter()
            .filter(|s| scale::is_ddl(s))
            .count(),
        creation.window.connections
    );
    for r in rounds {
        println!(
            "| rotation {}: annotations sent / every Secret and status on the new login / every previous login retired | {:.1} s / **{:.1} s** / **{:.1} s** |",
            r.round, r.annotated, r.rotated, r.retired
        );
        println!(
            "| rotation {}: API writes per object (all kinds) | **{:.2}** ({} writes) |",
            r.round,
            r.window.writes.len() as f64 / objects,
            r.window.writes.len()
        );
        println!(
            "| rotation {}: SQL statements per object / DDL / connections; controller's postgres requests | {:.1} / {} / {}; {:.0} |",
            r.round,
            r.window.statements.len() as f64 / objects,
            r.window
                .statements
                .iter()
                .filter(|s| scale::is_ddl(s))
                .count(),
            r.window.connections,
            r.window.pg_requests
        );
    }
    println!(
        "| controller peak RSS (VmHWM) | {:.1} MiB |",
        peak_kib as f64 / 1024.0
    );
    println!(
        "\nsettings: controller --concurrency={} --max-sessions-per-server={} --api-rate-limit={} --resync-interval={}; keepPrevious {}; binary target/{}; PostgreSQL {version}; {} cores",
        args.concurrency,
        args.sessions,
        args.api_rate_limit,
        args.resync,
        args.keep_previous,
        std::env::var("DBOPS_PROFILE").unwrap_or_else(|_| "debug".into()),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
}

/// `key count, key count, ...` in the map's order.
fn counts(by_key: &BTreeMap<String, usize>) -> String {
    by_key
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}
