//! Jaeger (v2, built from Go modules by `e2e/install` into
//! `~/.cache/dbops/jaeger-<version>/jaeger`, the version pinned in `e2e/jaeger/go.mod`):
//! an OTLP/gRPC receiver and the query API on loopback, traces kept in memory. Started
//! under a lifeline like every other process of the test bed; [`Jaeger::traces`] and
//! [`Jaeger::trace`] read what it stored through its HTTP API.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::controllers::http_get;
use crate::paths::{cache_dir, repo_root};
use crate::process::{Spec, Supervised, free_port};

/// The Go module whose version names the cache directory.
const MODULE: &str = "github.com/jaegertracing/jaeger";

/// The ports Jaeger listens on, all on 127.0.0.1.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    /// OTLP/gRPC: what the controllers' `--otlp-endpoint` names.
    pub otlp_grpc: u16,
    /// The query HTTP API and UI.
    pub query_http: u16,
    /// The query gRPC API (unused here, but it must not collide).
    pub query_grpc: u16,
    /// The health check extension.
    pub health: u16,
}

impl Ports {
    /// Free ports, for tests.
    pub fn free() -> Result<Self> {
        Ok(Self {
            otlp_grpc: free_port()?,
            query_http: free_port()?,
            query_grpc: free_port()?,
            health: free_port()?,
        })
    }
}

/// A running Jaeger; stopped when dropped.
#[derive(Debug)]
pub struct Jaeger {
    process: Supervised,
    ports: Ports,
}

/// The Jaeger version `e2e/install` builds, e.g. `v1.76.0` (the Go module version; the
/// same release is called v2.13.0 as a binary).
pub fn version() -> Result<String> {
    let go_mod = repo_root().join("e2e/jaeger/go.mod");
    let text = std::fs::read_to_string(&go_mod)
        .with_context(|| format!("reading {}", go_mod.display()))?;
    text.lines()
        .map(|line| line.trim_start_matches("require").split_whitespace())
        .find_map(|mut words| match (words.next(), words.next()) {
            (Some(m), Some(v)) if m == MODULE => Some(v.to_string()),
            _ => None,
        })
        .with_context(|| format!("{MODULE} is not required in {}", go_mod.display()))
}

/// The Jaeger binary built by `e2e/install`.
pub fn binary() -> Result<PathBuf> {
    let path = cache_dir()
        .join(format!("jaeger-{}", version()?))
        .join("jaeger");
    crate::paths::installed(path, "builds Jaeger from Go modules")
}

/// The configuration: OTLP/gRPC in, memory storage, the query API; nothing else listens.
fn config(ports: &Ports) -> String {
    format!(
        r#"service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: info
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:{health}
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query_http}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{otlp_grpc}
processors:
  batch:
    timeout: 200ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"#,
        health = ports.health,
        query_http = ports.query_http,
        query_grpc = ports.query_grpc,
        otlp_grpc = ports.otlp_grpc,
    )
}

impl Jaeger {
    /// Starts Jaeger on free loopback ports; config and log in `dir`.
    pub fn start(dir: &Path) -> Result<Self> {
        Self::start_on(dir, Ports::free()?)
    }

    /// Starts Jaeger on `ports`; returns once its query API answers.
    pub fn start_on(dir: &Path, ports: Ports) -> Result<Self> {
        let binary = binary()?;
        let config_path = dir.join("jaeger.yaml");
        std::fs::write(&config_path, config(&ports))
            .with_context(|| format!("writing {}", config_path.display()))?;
        let spec = Spec::new("jaeger", binary)
            .args(["--config".to_string(), config_path.display().to_string()]);
        let mut process = Supervised::start(&spec, dir)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = process.try_exit()? {
                bail!("jaeger exited ({status}):\n{}", process.log_tail(4000));
            }
            if http_get(ports.query_http, "/api/services").is_ok_and(|(code, _)| code == 200) {
                return Ok(Self { process, ports });
            }
            if Instant::now() > deadline {
                bail!(
                    "jaeger's query API not answering after 60s:\n{}",
                    process.log_tail(4000)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn ports(&self) -> Ports {
        self.ports
    }

    /// What a controller's `--otlp-endpoint` is set to.
    pub fn otlp_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.otlp_grpc)
    }

    /// The query API and UI.
    pub fn query_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.query_http)
    }

    pub fn log_tail(&self, max_bytes: u64) -> String {
        self.process.log_tail(max_bytes)
    }

    /// The services that have sent spans.
    pub fn services(&self) -> Result<Vec<String>> {
        let body = self.get("/api/services")?;
        Ok(serde_json::from_str::<Envelope<Vec<String>>>(&body)?
            .data
            .unwrap_or_default())
    }

    /// The traces with a span of `service` in the last hour (at most 1000).
    pub fn traces(&self, service: &str) -> Result<Vec<Trace>> {
        let body = self.get(&format!(
            "/api/traces?service={}&lookback=1h&limit=1000",
            url_encode(service)
        ))?;
        Ok(serde_json::from_str::<Envelope<Vec<Trace>>>(&body)
            .context("decoding /api/traces")?
            .data
            .unwrap_or_default())
    }

    /// One trace by id.
    pub fn trace(&self, trace_id: &str) -> Result<Trace> {
        let body = self.get(&format!("/api/traces/{}", url_encode(trace_id)))?;
        serde_json::from_str::<Envelope<Vec<Trace>>>(&body)
            .context("decoding /api/traces/<id>")?
            .data
            .unwrap_or_default()
            .into_iter()
            .next()
            .with_context(|| format!("trace {trace_id} not found"))
    }

    fn get(&self, path: &str) -> Result<String> {
        let (code, body) = http_get(self.ports.query_http, path)?;
        if code != 200 {
            bail!("GET {path}: {code}: {body}");
        }
        Ok(body)
    }
}

/// Jaeger's answer: `{"data": ..., "errors": ...}`.
#[derive(Debug, Deserialize)]
struct Envelope<T> {
    data: Option<T>,
}

/// A trace as the query API returns it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Trace {
    #[serde(rename = "traceID")]
    pub trace_id: String,
    pub spans: Vec<Span>,
    #[serde(default)]
    pub processes: BTreeMap<String, Process>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Span {
    #[serde(rename = "spanID")]
    pub span_id: String,
    pub operation_name: String,
    #[serde(default)]
    pub references: Vec<Reference>,
    #[serde(default)]
    pub tags: Vec<Tag>,
    #[serde(rename = "processID")]
    pub process_id: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reference {
    pub ref_type: String,
    #[serde(rename = "traceID")]
    pub trace_id: String,
    #[serde(rename = "spanID")]
    pub span_id: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Tag {
    pub key: String,
    pub value: serde_json::Value,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Process {
    pub service_name: String,
}

impl Span {
    /// The value of tag `key`, as text.
    pub fn tag(&self, key: &str) -> Option<String> {
        self.tags
            .iter()
            .find(|t| t.key == key)
            .map(|t| match &t.value {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            })
    }

    /// The span this one is a child of, in the same trace.
    pub fn parent_id(&self) -> Option<&str> {
        self.references
            .iter()
            .find(|r| r.ref_type == "CHILD_OF")
            .map(|r| r.span_id.as_str())
    }
}

impl Trace {
    /// The service that sent `span`.
    pub fn service_of(&self, span: &Span) -> &str {
        self.processes
            .get(&span.process_id)
            .map_or("", |p| p.service_name.as_str())
    }

    /// The services with at least one span in this trace.
    pub fn services(&self) -> std::collections::BTreeSet<&str> {
        self.spans.iter().map(|s| self.service_of(s)).collect()
    }

    /// The spans of `service` named `operation`.
    pub fn spans_of<'a>(
        &'a self,
        service: &'a str,
        operation: &'a str,
    ) -> impl Iterator<Item = &'a Span> + 'a {
        self.spans
            .iter()
            .filter(move |s| s.operation_name == operation && self.service_of(s) == service)
    }

    /// The span with id `span_id`.
    pub fn span(&self, span_id: &str) -> Option<&Span> {
        self.spans.iter().find(|s| s.span_id == span_id)
    }
}

/// Percent-encodes everything but unreserved characters.
fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}
