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
    let after = stat.rsplit_once(')').map(|(_, a)| a).unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok((ticks / 100.0, hwm))
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
