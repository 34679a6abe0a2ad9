//! A throwaway S3-compatible server for the `s3://` backup store: `s3s-fs` (built from
//! crates.io by `e2e/install` at the version in `e2e/s3s-fs.version`), on a free loopback
//! port, storing into a temporary directory, with random credentials that clients must
//! sign their requests with (SigV4).
//!
//! s3s-fs keeps bucket `b`'s object `k` as the plain file `<data>/b/k`, and unfinished
//! multipart uploads as hidden `.upload_id-*` files at the top of `<data>`: a test checks
//! what a client stored by reading those files, independently of the client.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use rand::distr::{Alphanumeric, SampleString};

use crate::controllers::http_get;
use crate::paths;
use crate::process::{Spec, Supervised, free_port};

/// The region the server is told clients use (s3s-fs accepts any).
pub const REGION: &str = "us-east-1";

/// The s3s-fs version `e2e/install` builds.
pub fn version() -> Result<String> {
    let pin = paths::repo_root().join("e2e/s3s-fs.version");
    let text =
        std::fs::read_to_string(&pin).with_context(|| format!("reading {}", pin.display()))?;
    Ok(text.trim().to_string())
}

/// The s3s-fs binary: `DBOPS_S3_SERVER`, or the one `e2e/install` built into the cache.
pub fn server_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("DBOPS_S3_SERVER") {
        return Ok(PathBuf::from(path));
    }
    let path = paths::cache_dir()
        .join(format!("s3s-fs-{}", version()?))
        .join("bin/s3s-fs");
    paths::installed(path, "builds s3s-fs from crates.io")
}

/// A running s3s-fs; stopped and its data deleted when dropped.
#[derive(Debug)]
pub struct S3Server {
    process: Supervised,
    port: u16,
    data: tempfile::TempDir,
    access_key: String,
    secret_key: String,
}

impl S3Server {
    /// Starts a server named `name` (its log is `<log_dir>/<name>.log`) and waits until it
    /// answers HTTP.
    pub async fn start(name: &str, log_dir: &Path) -> Result<Self> {
        let data = tempfile::Builder::new()
            .prefix(&format!("dbops-{name}-data-"))
            .tempdir()?;
        let port = free_port()?;
        let access_key = format!("dbops{}", Alphanumeric.sample_string(&mut rand::rng(), 12));
        let secret_key = Alphanumeric.sample_string(&mut rand::rng(), 32);
        let spec = Spec::new(name, server_binary()?)
            .args([
                "--host".to_string(),
                "127.0.0.1".to_string(),
                "--port".to_string(),
                port.to_string(),
                "--access-key".to_string(),
                access_key.clone(),
                "--secret-key".to_string(),
                secret_key.clone(),
                data.path().display().to_string(),
            ])
            .env("RUST_LOG", "s3s_fs=info,s3s=warn");
        let mut process = Supervised::start(&spec, log_dir)?;
        let answered = crate::wait::wait_for(
            &format!("{name} to answer on 127.0.0.1:{port}"),
            Duration::from_secs(30),
            || async {
                // Any HTTP answer (an unsigned request is refused) means it serves.
                tokio::task::spawn_blocking(move || http_get(port, "/"))
                    .await?
                    .map(|(code, _)| code)
            },
            |code| *code > 0,
        )
        .await;
        if let Err(e) = answered {
            let exited = process.try_exit().ok().flatten();
            bail!(
                "{e:#} (exited: {exited:?})\n---- {name} log ----\n{}",
                process.log_tail(4000)
            );
        }
        Ok(Self {
            process,
            port,
            data,
            access_key,
            secret_key,
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Creates `bucket` (s3s-fs serves each top-level directory of its data as a bucket).
    pub fn create_bucket(&self, bucket: &str) -> Result<()> {
        std::fs::create_dir(self.data.path().join(bucket))
            .with_context(|| format!("creating bucket {bucket}"))
    }

    /// What a client needs in its environment to use this server: credentials, region,
    /// endpoint, and plain HTTP allowed.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ACCESS_KEY_ID", self.access_key.as_str()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_key.as_str()),
            ("AWS_REGION", REGION),
            ("AWS_ENDPOINT_URL", self.endpoint().as_str()),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// The secret key, so that a test can redact it from what it prints.
    pub fn secret_key(&self) -> &str {
        &self.secret_key
    }

    /// The file holding object `key` of `bucket`.
    pub fn object_file(&self, bucket: &str, key: &str) -> PathBuf {
        self.data.path().join(bucket).join(key)
    }

    /// Every object key in `bucket` under `prefix` (a `/`-separated path), sorted.
    pub fn keys(&self, bucket: &str, prefix: &str) -> Result<Vec<String>> {
        let bucket_dir = self.data.path().join(bucket);
        let mut keys = Vec::new();
        let mut dirs = vec![bucket_dir.join(prefix)];
        while let Some(dir) = dirs.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
            };
            for entry in entries {
                let entry = entry?;
                if entry.file_type()?.is_dir() {
                    dirs.push(entry.path());
                } else if let Ok(key) = entry.path().strip_prefix(&bucket_dir) {
                    keys.push(key.display().to_string());
                }
            }
        }
        keys.sort();
        Ok(keys)
    }

    /// Multipart uploads started and neither completed nor aborted (their part files).
    pub fn unfinished_upload_parts(&self) -> Result<usize> {
        let mut n = 0;
        for entry in std::fs::read_dir(self.data.path())? {
            let name = entry?.file_name();
            if name.to_string_lossy().starts_with(".upload_id-") {
                n += 1;
            }
        }
        Ok(n)
    }

    pub fn log_tail(&self, max_bytes: u64) -> String {
        self.process
            .log_tail(max_bytes)
            .replace(&self.secret_key, "<s3-secret-key>")
    }
}
