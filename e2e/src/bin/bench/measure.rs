//! What a bench measures besides wall time: API writes (the apiserver's /metrics and its
//! audit log) and a process's CPU and memory (/proc).

use std::collections::BTreeMap;

use anyhow::{Context, Result};

/// Sum of write requests the apiserver served for databases, databaseservers, secrets and
/// events.
pub(crate) async fn api_writes(client: &kube::Client) -> Result<f64> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client
        .request_text(req)
        .await
        .context("apiserver /metrics")?;
    let mut sum = 0.0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let write = [
            "verb=\"POST\"",
            "verb=\"PATCH\"",
            "verb=\"PUT\"",
            "verb=\"DELETE\"",
            "verb=\"APPLY\"",
        ]
        .iter()
        .any(|v| line.contains(v));
        let ours = [
            "resource=\"databases\"",
            "resource=\"databaseservers\"",
            "resource=\"secrets\"",
            "resource=\"events\"",
        ]
        .iter()
        .any(|r| line.contains(r));
        if write
            && ours
            && let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())
        {
            sum += v;
        }
    }
    Ok(sum)
}

/// (CPU seconds, peak RSS in KiB) of a process, from /proc.
pub(crate) fn proc_usage(pid: u32) -> Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let ticks = cpu_ticks(&stat, false);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok((ticks / 100.0, hwm))
}

/// CPU seconds used so far by each program on the machine (user and system, its reaped
/// children's included, so a PostgreSQL backend that exited still counts under the
/// postmaster), by the program's name: `postgres`, `kube-apiserver`, `etcd`, the
/// controllers, `dbops-bench`, everything else as `other`. The difference of two of these
/// says where a run's CPU went.
pub(crate) fn cpu_by_program() -> BTreeMap<&'static str, f64> {
    let mut by: BTreeMap<&'static str, f64> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return by;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let program = match comm {
            "postgres" => "postgres",
            "kube-apiserver" => "kube-apiserver",
            "etcd" => "etcd",
            c if c.starts_with("dbops-database") => "database-controller",
            c if c.starts_with("dbops-bench") => "dbops-bench",
            _ => "other",
        };
        *by.entry(program).or_default() += cpu_ticks(&stat, true) / 100.0;
    }
    by
}

/// The CPU clock ticks of a `/proc/<pid>/stat` line: user and system time, and with
/// `children` those of its reaped children too.
fn cpu_ticks(stat: &str, children: bool) -> f64 {
    let after = stat.rsplit_once(')').map(|(_, a)| a).unwrap_or_default();
    after
        .split_whitespace()
        .skip(11)
        .take(if children { 4 } else { 2 })
        .filter_map(|v| v.parse::<f64>().ok())
        .sum()
}

/// `after - before` of [`cpu_by_program`], as "postgres 12.3 s, etcd 4.5 s, ..." with the
/// cores kept busy over `wall` seconds.
pub(crate) fn cpu_spent(
    before: &BTreeMap<&'static str, f64>,
    after: &BTreeMap<&'static str, f64>,
    wall: f64,
) -> String {
    let mut spent: Vec<(&str, f64)> = after
        .iter()
        .map(|(k, v)| (*k, v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v >= 0.05)
        .collect();
    spent.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = spent.iter().map(|(_, v)| v).sum();
    let parts: Vec<String> = spent.iter().map(|(k, v)| format!("{k} {v:.1}")).collect();
    format!(
        "{} (sum {total:.1} s: {:.2} cores busy)",
        parts.join(", "),
        total / wall.max(0.001)
    )
}

/// "verb resource[/subresource]: count, …" of audited writes, sorted.
pub(crate) fn writes_by_kind(writes: impl IntoIterator<Item = dbops_e2e::AuditWrite>) -> String {
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    for w in writes {
        let kind = if w.subresource.is_empty() {
            format!("{} {}", w.verb, w.resource)
        } else {
            format!("{} {}/{}", w.verb, w.resource, w.subresource)
        };
        *by_kind.entry(kind).or_default() += 1;
    }
    by_kind
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_read_after_the_command_name() {
        // A name with a space and a parenthesis; utime 11, stime 22, cutime 33, cstime 44.
        let stat = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 11 22 33 44 20 0 1 0 5 0 0";
        assert_eq!(cpu_ticks(stat, false), 33.0);
        assert_eq!(cpu_ticks(stat, true), 110.0);
    }
}
