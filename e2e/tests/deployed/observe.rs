//! What a platform team watches: each controller's metrics through its Service, from
//! inside the cluster, with both replicas behind it.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;

use crate::bed::{CONTROLLERS, SYSTEM, bed};

/// `GET http://<host>:<port><path>` over HTTP/1.0 (the status and the body).
pub fn http_get(host: &str, port: u16, path: &str) -> Result<(u16, String)> {
    let addr = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {host}"))?
        .next()
        .with_context(|| format!("{host} has no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP response: {head}"))?;
    Ok((status, body.to_owned()))
}

#[tokio::test]
async fn metrics_are_scraped_through_each_controllers_service() {
    let bed = bed().await;
    for controller in CONTROLLERS {
        let service = format!("dbops-{controller}-metrics");
        // Both replicas are endpoints (standbys are Ready too).
        let slices = bed
            .api::<EndpointSlice>(SYSTEM)
            .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={service}")))
            .await
            .unwrap();
        let ready = slices
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter())
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .count();
        assert_eq!(ready, 2, "{service}: ready endpoints");
        // By the Service's cluster DNS name, as a Prometheus in the cluster would.
        let host = format!("{service}.{SYSTEM}.svc.cluster.local");
        let (status, body) = http_get(&host, 8080, "/metrics").unwrap();
        assert_eq!(status, 200, "{host}/metrics: {body}");
        let families = body
            .lines()
            .filter(|l| l.starts_with("# TYPE dbops_"))
            .count();
        assert!(families > 0, "{host}/metrics has no dbops_ metric: {body}");
        assert!(
            body.ends_with("# EOF\n"),
            "{host}/metrics is not OpenMetrics text"
        );
    }
}

/// Fails unless `body` looks like a controller's `/readyz` answer.
pub fn readyz_reason(status: u16, body: &str) -> Result<String> {
    if !(body.starts_with("ready") || body.starts_with("not ready")) {
        bail!("not a /readyz answer ({status}): {body}");
    }
    Ok(body.trim().to_owned())
}
