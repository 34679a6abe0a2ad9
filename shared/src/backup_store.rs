//! The `--backup-store` URL, where Backups write their artifacts, and the operations on it.
//!
//! `file:///absolute/path` (the default, `file:///var/lib/dbops/backups`) or
//! `s3://bucket[/prefix]`. Credentials never go in the URL (they would end up in logs):
//! an S3 store takes them, its region and its endpoint from the environment
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
//! `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP=true` for a plain-HTTP endpoint, and the rest of
//! the `AWS_*` settings `object_store` knows), read once, when the first operation needs
//! the client; every clone of the store shares that client.
//!
//! Layout: one object key per Backup, `<namespace>/<name>-<uid>`, so whatever retries or
//! crashes happen a Backup has at most one artifact (`<key>.dump`) and one manifest
//! (`<key>.manifest.json`) beside it.
//!
//! - `file://`: both are written under a temporary name of their own in the same
//!   directory (`.<name>-<uid>.<random>.dump.partial`) and renamed into place once
//!   complete: a reader never sees half an artifact, two writers of one key never write
//!   into one file, and the partial files an interrupted attempt left are removed when a
//!   later one completes or gives up ([`BackupStore::discard_partial`]).
//! - `s3://`: the artifact is streamed as a multipart upload of [`S3_PART_SIZE`] parts,
//!   at most [`S3_PARTS_IN_FLIGHT`] of them uploading while the next one fills (bounded
//!   memory whatever the dump's size), and becomes visible only when the upload is
//!   completed in [`ArtifactWriter::commit`]. A dump smaller than one part is a single
//!   PUT at commit. A writer dropped without commit aborts its upload; parts left by a
//!   process that died are invisible and are removed by the bucket's
//!   `AbortIncompleteMultipartUpload` lifecycle rule. A retry overwrites the same key.

pub mod registry;

use std::sync::{Arc, Mutex};
use std::{fmt, path::PathBuf, str::FromStr};

use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{
    ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};
use tokio::io::AsyncWriteExt;

/// The size of one part of an S3 multipart upload. S3 allows 10,000 parts, so one
/// artifact can hold up to ~156 GiB.
pub const S3_PART_SIZE: usize = 16 << 20;
/// Parts uploading at once while the next one fills: an S3 artifact being written holds
/// at most `(S3_PARTS_IN_FLIGHT + 1) * S3_PART_SIZE` bytes in memory.
pub const S3_PARTS_IN_FLIGHT: usize = 2;

/// A parsed, validated backup store location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackupStore {
    File {
        root: PathBuf,
    },
    S3 {
        bucket: String,
        prefix: String,
        /// Where the settings come from and the client, built on first use.
        client: S3Client,
    },
}

/// The client of an `s3://` store: built once from the settings on first use and shared
/// by every clone of the [`BackupStore`]. Settings are the process environment unless
/// [`BackupStore::with_s3_environment`] gave others.
#[derive(Clone, Default)]
pub struct S3Client {
    settings: Option<Arc<Vec<(String, String)>>>,
    built: Arc<Mutex<Option<Arc<dyn ObjectStore>>>>,
}

/// Every client is equal: a store is identified by its URL.
impl PartialEq for S3Client {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for S3Client {}

/// Names only: the values may be credentials.
impl fmt::Debug for S3Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.settings {
            None => f.write_str("S3Client(settings from the environment)"),
            Some(vars) => {
                let names: Vec<&str> = vars.iter().map(|(k, _)| k.as_str()).collect();
                write!(f, "S3Client(settings {names:?})")
            }
        }
    }
}

impl S3Client {
    /// The client, built on the first call; a failure is not remembered.
    fn get(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>, String> {
        let mut built = self
            .built
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(client) = built.as_ref() {
            return Ok(Arc::clone(client));
        }
        let client: Arc<dyn ObjectStore> = match &self.settings {
            Some(vars) => Arc::new(build_s3(bucket, vars.iter().cloned())?),
            None => Arc::new(build_s3(bucket, std::env::vars())?),
        };
        *built = Some(Arc::clone(&client));
        Ok(client)
    }
}

/// An S3 client for `bucket` from `AWS_*` settings. Requests time out only when the
/// server stalls (60 s without a byte), not by their total length: a restore may read
/// one object for an hour. Retries are few: the controller backs off per Backup.
fn build_s3(
    bucket: &str,
    settings: impl Iterator<Item = (String, String)>,
) -> Result<object_store::aws::AmazonS3, String> {
    // reqwest's rustls has no provider of its own here: use ring, as kube does.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let options = ClientOptions::new()
        .with_connect_timeout(std::time::Duration::from_secs(5))
        .with_timeout_disabled()
        .with_read_timeout(std::time::Duration::from_secs(60));
    let retry = RetryConfig {
        max_retries: 3,
        retry_timeout: std::time::Duration::from_secs(120),
        ..RetryConfig::default()
    };
    let mut builder = AmazonS3Builder::new()
        .with_client_options(options)
        .with_retry(retry);
    for (name, value) in settings {
        if !name.starts_with("AWS_") {
            continue;
        }
        if let Ok(key) = name.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
            builder = builder.with_config(key, value);
        }
    }
    builder
        .with_bucket_name(bucket)
        .build()
        .map_err(|e| e.to_string())
}

/// Why a `--backup-store` URL was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BackupStoreError {
    #[error("unsupported backup store `{0}`: expected file:///absolute/path or s3://bucket/prefix")]
    UnsupportedScheme(String),
    #[error(
        "file:// backup store needs an absolute path, for example file:///var/lib/dbops/backups"
    )]
    RelativePath,
    #[error("s3:// backup store needs a bucket, for example s3://my-bucket/dbops")]
    MissingBucket,
    #[error("invalid S3 bucket name `{0}`: use lower-case letters, digits, '.' and '-'")]
    InvalidBucket(String),
    #[error("credentials do not belong in the backup store URL; set them in the environment")]
    CredentialsInUrl,
}

impl FromStr for BackupStore {
    type Err = BackupStoreError;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(BackupStoreError::RelativePath);
            }
            return Ok(Self::File {
                root: PathBuf::from(path),
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.contains('@') {
                return Err(BackupStoreError::CredentialsInUrl);
            }
            if bucket.is_empty() {
                return Err(BackupStoreError::MissingBucket);
            }
            let valid = bucket
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-');
            if !valid {
                return Err(BackupStoreError::InvalidBucket(bucket.to_owned()));
            }
            return Ok(Self::S3 {
                bucket: bucket.to_owned(),
                prefix: prefix.trim_matches('/').to_owned(),
                client: S3Client::default(),
            });
        }
        // Only the scheme is echoed back: the rest may hold credentials.
        let scheme = url.split_once("://").map_or("(none)", |(scheme, _)| scheme);
        Err(BackupStoreError::UnsupportedScheme(format!("{scheme}://")))
    }
}

impl fmt::Display for BackupStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File { root } => write!(f, "file://{}", root.display()),
            Self::S3 { bucket, prefix, .. } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Self::S3 { bucket, prefix, .. } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

/// Where one Backup's artifact and manifest live in a store: `<namespace>/<name>-<uid>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectKey {
    pub namespace: String,
    /// `<name>-<uid>`.
    pub stem: String,
}

impl ObjectKey {
    pub fn new(namespace: &str, name: &str, uid: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            stem: format!("{name}-{uid}"),
        }
    }

    /// The artifact's key relative to the store root.
    pub fn artifact(&self) -> String {
        format!("{}/{}.dump", self.namespace, self.stem)
    }

    /// The manifest's key relative to the store root.
    pub fn manifest(&self) -> String {
        format!("{}/{}.manifest.json", self.namespace, self.stem)
    }
}

/// `<prefix>/<relative>` as an object key (no empty segments).
fn s3_key(prefix: &str, relative: &str) -> ObjectPath {
    ObjectPath::from_iter(
        prefix
            .split('/')
            .chain(relative.split('/'))
            .filter(|part| !part.is_empty()),
    )
}

/// Why a store operation failed. `Io` and `Remote` errors may pass (a full disk, an
/// unmounted volume, a permission fixed by an operator, an S3 endpoint down or
/// throttling): callers retry them. `Refused` and `Misconfigured` need a change of
/// configuration.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("backup store {store}: {what}: {source}")]
    Io {
        store: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The S3 endpoint could not be reached, timed out, failed (5xx) or throttled.
    #[error("backup store {store}: {what}: {message}")]
    Remote {
        store: String,
        what: String,
        message: String,
    },
    /// The S3 endpoint refused the request for good: credentials refused (401/403), the
    /// bucket does not exist, or another client error (4xx).
    #[error("backup store {store}: {what}: {message}")]
    Refused {
        store: String,
        what: String,
        message: String,
    },
    /// The S3 client could not be built from the environment (an invalid endpoint URL,
    /// an `http://` endpoint without `AWS_ALLOW_HTTP=true`, ...).
    #[error("backup store {store} is misconfigured: {message}")]
    Misconfigured { store: String, message: String },
    #[error("{0} does not exist in the backup store")]
    NotFound(String),
}

impl StoreError {
    /// Whether the operation may work later without a configuration change.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Io { .. } | StoreError::Remote { .. })
    }
}

/// What an S3 error means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum S3Failure {
    /// The object does not exist (its bucket does).
    NotFound,
    /// Worth retrying: connection, timeout, 5xx, throttling.
    Transient,
    /// Needs a configuration change; the text says which.
    Permanent(&'static str),
}

/// Sorts an `object_store` error by what fixes it, from its kind and its text (the S3
/// error code and the HTTP status are only in the text).
fn classify_s3(e: &object_store::Error) -> S3Failure {
    use object_store::Error as E;
    let text = e.to_string();
    if text.contains("NoSuchBucket") {
        return S3Failure::Permanent("the bucket does not exist");
    }
    const CREDENTIALS: &str =
        "the credentials were refused (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)";
    if [
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
    ]
    .iter()
    .any(|code| text.contains(code))
    {
        return S3Failure::Permanent(CREDENTIALS);
    }
    if text.contains("HTTP error: builder error") {
        // reqwest refused to build the request: an http:// endpoint that is not allowed.
        return S3Failure::Permanent(
            "the request could not be made: an http:// AWS_ENDPOINT_URL needs AWS_ALLOW_HTTP=true",
        );
    }
    match e {
        E::NotFound { .. } => S3Failure::NotFound,
        E::Unauthenticated { .. } => S3Failure::Permanent(CREDENTIALS),
        E::PermissionDenied { .. } => S3Failure::Permanent("access denied"),
        E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::NotImplemented { .. }
        | E::UnknownConfigurationKey { .. } => S3Failure::Permanent("not supported"),
        _ => match http_status(&text) {
            Some(401) => S3Failure::Permanent(CREDENTIALS),
            Some(403) => S3Failure::Permanent("access denied"),
            Some(408 | 429) => S3Failure::Transient,
            Some(400..=499) => S3Failure::Permanent("request refused"),
            _ => S3Failure::Transient,
        },
    }
}

/// The HTTP status in an `object_store` error text ("... status code: 503 Service ...").
fn http_status(text: &str) -> Option<u16> {
    let (_, after) = text.split_once("status code: ")?;
    after.get(..3)?.parse().ok()
}

/// At most `max` bytes of `text` (on a character boundary), for condition messages.
fn shorten(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let end = (0..=max)
        .rev()
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(0);
    format!("{}…", &text[..end])
}

/// The [`StoreError`] for a failed S3 request; `location` names the object if missing.
fn s3_error(store: &str, what: &str, location: &str, e: &object_store::Error) -> StoreError {
    let message = shorten(&e.to_string(), 600);
    match classify_s3(e) {
        S3Failure::NotFound => StoreError::NotFound(location.to_owned()),
        S3Failure::Transient => StoreError::Remote {
            store: store.to_owned(),
            what: what.to_owned(),
            message,
        },
        S3Failure::Permanent(why) => StoreError::Refused {
            store: store.to_owned(),
            what: what.to_owned(),
            message: format!("{why}: {message}"),
        },
    }
}

/// A complete artifact being read.
pub type ArtifactReader = Box<dyn tokio::io::AsyncRead + Send + Unpin>;

/// An artifact being written; [`ArtifactWriter::commit`] puts it in place. Dropped
/// without commit, nothing becomes visible.
pub struct ArtifactWriter {
    sink: Sink,
}

enum Sink {
    File(FileSink),
    S3(S3Sink),
}

struct FileSink {
    store: String,
    partial: PathBuf,
    target: PathBuf,
    file: tokio::io::BufWriter<tokio::fs::File>,
}

struct S3Sink {
    store: String,
    location: String,
    client: Arc<dyn ObjectStore>,
    path: ObjectPath,
    /// The bytes written before the first part is full: a small artifact is one PUT.
    pending: Vec<u8>,
    /// The multipart upload, once the first part is full.
    upload: Option<WriteMultipart>,
}

impl BackupStore {
    /// This `s3://` store with its settings (`AWS_*` names and values) from `vars` rather
    /// than the process environment, for tests and tools. A `file://` store is unchanged.
    pub fn with_s3_environment<K, V>(self, vars: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<String>,
    {
        match self {
            Self::S3 { bucket, prefix, .. } => Self::S3 {
                bucket,
                prefix,
                client: S3Client {
                    settings: Some(Arc::new(
                        vars.into_iter()
                            .map(|(k, v)| (k.into(), v.into()))
                            .collect(),
                    )),
                    built: Arc::default(),
                },
            },
            file => file,
        }
    }

    fn io(&self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError {
        let store = self.to_string();
        let what = what.into();
        move |source| StoreError::Io {
            store,
            what,
            source,
        }
    }

    /// The URL of the artifact, as status.location shows it.
    pub fn location(&self, key: &ObjectKey) -> String {
        self.url_of(&key.artifact())
    }

    /// The URL of an object given relative to the store root.
    fn url_of(&self, relative: &str) -> String {
        match self {
            Self::File { root } => format!("file://{}", root.join(relative).display()),
            Self::S3 { bucket, prefix, .. } => {
                format!("s3://{bucket}/{}", s3_key(prefix, relative))
            }
        }
    }

    /// The artifact of `key`, a new temporary name for it, its manifest and a new
    /// temporary name for that: each writer has its own temporary file.
    fn paths(
        &self,
        root: &std::path::Path,
        key: &ObjectKey,
    ) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
        let dir = root.join(&key.namespace);
        let writer = rand::random::<u32>();
        (
            dir.join(format!("{}.dump", key.stem)),
            dir.join(format!(".{}.{writer:08x}.dump.partial", key.stem)),
            dir.join(format!("{}.manifest.json", key.stem)),
            dir.join(format!(".{}.{writer:08x}.manifest.json.partial", key.stem)),
        )
    }

    /// The temporary files of `key` that are there now, whoever's: `.<stem>.` names
    /// ending in `.partial` (the older `.<stem>.dump.partial` included).
    async fn partial_files(
        &self,
        root: &std::path::Path,
        key: &ObjectKey,
    ) -> Result<Vec<PathBuf>, StoreError> {
        let dir = root.join(&key.namespace);
        let mut entries = match tokio::fs::read_dir(&dir).await {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(self.io(format!("listing {}", dir.display()))(e)),
        };
        let prefix = format!(".{}.", key.stem);
        let mut found = Vec::new();
        while let Some(entry) = entries
            .next_entry()
            .await
            .map_err(self.io(format!("listing {}", dir.display())))?
        {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(&prefix) && name.ends_with(".partial") {
                found.push(entry.path());
            }
        }
        Ok(found)
    }

    async fn remove_files(&self, paths: Vec<PathBuf>) -> Result<(), StoreError> {
        for path in paths {
            match tokio::fs::remove_file(&path).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.io(format!("removing {}", path.display()))(e)),
            }
        }
        Ok(())
    }

    /// The S3 client and the key of `relative` in the bucket.
    fn s3(&self, relative: &str) -> Result<(Arc<dyn ObjectStore>, ObjectPath), StoreError> {
        match self {
            Self::S3 {
                bucket,
                prefix,
                client,
            } => {
                let client = client
                    .get(bucket)
                    .map_err(|message| StoreError::Misconfigured {
                        store: self.to_string(),
                        message,
                    })?;
                Ok((client, s3_key(prefix, relative)))
            }
            Self::File { .. } => Err(StoreError::Misconfigured {
                store: self.to_string(),
                message: "not an s3:// store".into(),
            }),
        }
    }

    /// Starts (or starts over) the artifact of `key`: under its temporary name in a
    /// `file://` store; in an `s3://` store nothing is sent before a part is full.
    pub async fn create_artifact(&self, key: &ObjectKey) -> Result<ArtifactWriter, StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                let (client, path) = self.s3(&key.artifact())?;
                return Ok(ArtifactWriter {
                    sink: Sink::S3(S3Sink {
                        store: self.to_string(),
                        location: self.location(key),
                        client,
                        path,
                        pending: Vec::new(),
                        upload: None,
                    }),
                });
            }
        };
        let (target, partial, _, _) = self.paths(root, key);
        if let Some(dir) = target.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(self.io(format!("creating {}", dir.display())))?;
        }
        let file = tokio::fs::File::create(&partial)
            .await
            .map_err(self.io(format!("creating {}", partial.display())))?;
        Ok(ArtifactWriter {
            sink: Sink::File(FileSink {
                store: self.to_string(),
                partial,
                target,
                file: tokio::io::BufWriter::with_capacity(1 << 20, file),
            }),
        })
    }

    /// Writes the manifest of `key`: a temporary name renamed into place (`file://`), or
    /// one PUT (`s3://`).
    pub async fn put_manifest(&self, key: &ObjectKey, body: &[u8]) -> Result<(), StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                let (client, path) = self.s3(&key.manifest())?;
                let location = self.url_of(&key.manifest());
                return client
                    .put(&path, PutPayload::from(body.to_vec()))
                    .await
                    .map(drop)
                    .map_err(|e| {
                        s3_error(&self.to_string(), "writing the manifest", &location, &e)
                    });
            }
        };
        let (_, _, target, partial) = self.paths(root, key);
        let mut file = tokio::fs::File::create(&partial)
            .await
            .map_err(self.io(format!("creating {}", partial.display())))?;
        file.write_all(body)
            .await
            .map_err(self.io(format!("writing {}", partial.display())))?;
        file.sync_all()
            .await
            .map_err(self.io(format!("syncing {}", partial.display())))?;
        drop(file);
        tokio::fs::rename(&partial, &target)
            .await
            .map_err(self.io(format!("renaming {}", partial.display())))
    }

    /// Opens the complete artifact of `key` for reading (a restore reads it), streamed:
    /// nothing is read ahead beyond a buffer. A missing artifact is
    /// [`StoreError::NotFound`].
    pub async fn open_artifact(&self, key: &ObjectKey) -> Result<ArtifactReader, StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                let (client, path) = self.s3(&key.artifact())?;
                let location = self.location(key);
                let found = client.get(&path).await.map_err(|e| {
                    s3_error(&self.to_string(), "reading the artifact", &location, &e)
                })?;
                let stream = found.into_stream().map_err(std::io::Error::from);
                return Ok(Box::new(tokio_util::io::StreamReader::new(stream)));
            }
        };
        let (target, _, _, _) = self.paths(root, key);
        match tokio::fs::File::open(&target).await {
            Ok(file) => Ok(Box::new(tokio::io::BufReader::with_capacity(1 << 20, file))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(StoreError::NotFound(self.location(key)))
            }
            Err(e) => Err(self.io(format!("opening {}", target.display()))(e)),
        }
    }

    /// Reads the manifest of `key`. A missing manifest is [`StoreError::NotFound`].
    pub async fn get_manifest(&self, key: &ObjectKey) -> Result<Vec<u8>, StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                let (client, path) = self.s3(&key.manifest())?;
                let location = self.url_of(&key.manifest());
                let error = |e: object_store::Error| {
                    s3_error(&self.to_string(), "reading the manifest", &location, &e)
                };
                let found = client.get(&path).await.map_err(error)?;
                return Ok(found.bytes().await.map_err(error)?.to_vec());
            }
        };
        let (_, _, manifest, _) = self.paths(root, key);
        match tokio::fs::read(&manifest).await {
            Ok(body) => Ok(body),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(StoreError::NotFound(format!("{}", manifest.display())))
            }
            Err(e) => Err(self.io(format!("reading {}", manifest.display()))(e)),
        }
    }

    /// Removes the artifact, its manifest and every partial file of `key`; what is
    /// already gone counts as removed.
    pub async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                for relative in [key.manifest(), key.artifact()] {
                    let (client, path) = self.s3(&relative)?;
                    match client.delete(&path).await {
                        Ok(()) => {}
                        Err(e) => match s3_error(
                            &self.to_string(),
                            "removing an object",
                            &self.url_of(&relative),
                            &e,
                        ) {
                            StoreError::NotFound(_) => {}
                            e => return Err(e),
                        },
                    }
                }
                return Ok(());
            }
        };
        let (artifact, _, manifest, _) = self.paths(root, key);
        self.remove_files(vec![manifest, artifact]).await?;
        let partials = self.partial_files(root, key).await?;
        self.remove_files(partials).await
    }

    /// Removes only the partial files of `key` (after an attempt that gave up, or
    /// completed after an interrupted one). An `s3://` store has none to remove: an
    /// unfinished upload is invisible, aborted when its writer is dropped, and otherwise
    /// expired by the bucket's lifecycle rule.
    pub async fn discard_partial(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => return Ok(()),
        };
        let partials = self.partial_files(root, key).await?;
        self.remove_files(partials).await
    }
}

impl ArtifactWriter {
    pub async fn write(&mut self, chunk: &[u8]) -> Result<(), StoreError> {
        match &mut self.sink {
            Sink::File(sink) => sink.write(chunk).await,
            Sink::S3(sink) => sink.write(chunk).await,
        }
    }

    /// Makes the artifact visible: flushed, synced and renamed into place (`file://`),
    /// or the multipart upload completed (or the single PUT sent) (`s3://`).
    pub async fn commit(self) -> Result<(), StoreError> {
        match self.sink {
            Sink::File(sink) => sink.commit().await,
            Sink::S3(mut sink) => sink.commit().await,
        }
    }
}

impl FileSink {
    async fn write(&mut self, chunk: &[u8]) -> Result<(), StoreError> {
        self.file
            .write_all(chunk)
            .await
            .map_err(|source| StoreError::Io {
                store: self.store.clone(),
                what: format!("writing {}", self.partial.display()),
                source,
            })
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        let store = self.store.clone();
        let partial = self.partial.clone();
        let io = |what: &str| {
            let store = store.clone();
            let what = format!("{what} {}", partial.display());
            move |source| StoreError::Io {
                store,
                what,
                source,
            }
        };
        self.file.flush().await.map_err(io("flushing"))?;
        self.file
            .get_ref()
            .sync_all()
            .await
            .map_err(io("syncing"))?;
        tokio::fs::rename(&self.partial, &self.target)
            .await
            .map_err(io("renaming"))
    }
}

impl S3Sink {
    fn error(&self, what: &str, e: &object_store::Error) -> StoreError {
        s3_error(&self.store, what, &self.location, e)
    }

    async fn write(&mut self, chunk: &[u8]) -> Result<(), StoreError> {
        if let Some(upload) = self.upload.as_mut() {
            // Back pressure: wait while enough parts are on their way.
            return match upload.wait_for_capacity(S3_PARTS_IN_FLIGHT).await {
                Ok(()) => {
                    upload.write(chunk);
                    Ok(())
                }
                Err(e) => Err(s3_error(
                    &self.store,
                    "uploading a part of the artifact",
                    &self.location,
                    &e,
                )),
            };
        }
        if self.pending.len() + chunk.len() < S3_PART_SIZE {
            self.pending.extend_from_slice(chunk);
            return Ok(());
        }
        // The first part is full: from now on the artifact goes up in parts.
        let started = self.client.put_multipart(&self.path).await;
        let upload = started.map_err(|e| self.error("starting the upload", &e))?;
        let mut upload = WriteMultipart::new_with_chunk_size(upload, S3_PART_SIZE);
        upload.write(&std::mem::take(&mut self.pending));
        upload.write(chunk);
        self.upload = Some(upload);
        Ok(())
    }

    async fn commit(&mut self) -> Result<(), StoreError> {
        match self.upload.take() {
            // On failure, finish aborts the upload itself.
            Some(upload) => upload
                .finish()
                .await
                .map(drop)
                .map_err(|e| self.error("completing the upload", &e)),
            None => {
                let body = PutPayload::from(std::mem::take(&mut self.pending));
                self.client
                    .put(&self.path, body)
                    .await
                    .map(drop)
                    .map_err(|e| self.error("writing the artifact", &e))
            }
        }
    }
}

/// An upload that was not committed is aborted in the background (its parts freed).
impl Drop for S3Sink {
    fn drop(&mut self) {
        if let (Some(upload), Ok(runtime)) =
            (self.upload.take(), tokio::runtime::Handle::try_current())
        {
            runtime.spawn(async move {
                if let Err(e) = upload.abort().await {
                    tracing::warn!(error = %e, "could not abort an unfinished multipart upload");
                }
            });
        }
    }
}

/// The object at a store's root that names the store: [`BackupStore::identity`].
pub const IDENTITY_OBJECT: &str = ".dbops-store-id";

/// What a store is, whatever URL or mount reaches it: a random id kept in the store
/// itself ([`IDENTITY_OBJECT`]), written by the first process that asks for it. Two
/// processes see the same artifacts exactly when they read the same identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreIdentity(String);

impl StoreIdentity {
    /// A new identity: 32 random hex digits.
    fn random() -> Self {
        Self(format!("{:032x}", rand::random::<u128>()))
    }

    /// An identity read back from a store or a registration: one short line of letters,
    /// digits, `-` and `_` (what [`StoreIdentity::random`] writes, or what an operator
    /// wrote by hand); anything else is not an identity.
    pub fn parse(text: &str) -> Option<Self> {
        let id = text.trim();
        let valid = !id.is_empty()
            && id.len() <= 128
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        valid.then(|| Self(id.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StoreIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl BackupStore {
    /// The store's identity: read from [`IDENTITY_OBJECT`] at its root (`file://`:
    /// `<root>/.dbops-store-id`; `s3://`: `<prefix>/.dbops-store-id`), or created with a
    /// random id when absent. Processes racing to create it agree on one id: a `file://`
    /// store writes a temporary file and hard-links it into place, which fails when the
    /// name exists (a file system without hard links gets an exclusive create); an
    /// `s3://` store puts with `If-None-Match: *`; the loser reads the winner's id.
    pub async fn identity(&self) -> Result<StoreIdentity, StoreError> {
        match self {
            Self::File { root } => self.file_identity(root).await,
            Self::S3 { .. } => self.s3_identity().await,
        }
    }

    /// Checks that this process can write to a `file://` store: creates its root when
    /// missing, then creates, syncs and removes `.dbops-probe-<random>` in it. The error
    /// names the path and the OS error (permission denied, read-only file system, not a
    /// directory, ...). An `s3://` store is not probed (nothing is written).
    pub async fn probe_writable(&self) -> Result<(), StoreError> {
        let Self::File { root } = self else {
            return Ok(());
        };
        tokio::fs::create_dir_all(root)
            .await
            .map_err(self.io(format!("creating the directory {}", root.display())))?;
        // First an unnamed file (O_TMPFILE): written and synced like an artifact, and gone
        // with its descriptor, so a process killed mid-probe leaves nothing in the store.
        // A filesystem without O_TMPFILE (NFS, for one) gets a named probe file.
        let unnamed = {
            let mut options = tokio::fs::OpenOptions::new();
            options
                .write(true)
                .mode(0o600)
                .custom_flags(libc::O_TMPFILE);
            options.open(root).await
        };
        match unnamed {
            Ok(mut file) => {
                let what = format!("writing an unnamed probe file in {}", root.display());
                file.write_all(b"dbops write probe\n")
                    .await
                    .map_err(self.io(what.clone()))?;
                return file.sync_all().await.map_err(self.io(what));
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
                ) => {}
            Err(e) => {
                return Err(self.io(format!(
                    "creating an unnamed probe file in {}",
                    root.display()
                ))(e));
            }
        }
        let probe = root.join(format!(".dbops-probe-{:016x}", rand::random::<u64>()));
        let written = self.write_synced(&probe, b"dbops write probe\n").await;
        let removed = tokio::fs::remove_file(&probe).await;
        written?;
        match removed {
            Ok(()) => Ok(()),
            // Created, so it exists: a failing removal is worth knowing.
            Err(e) => Err(self.io(format!("removing {}", probe.display()))(e)),
        }
    }

    async fn file_identity(&self, root: &std::path::Path) -> Result<StoreIdentity, StoreError> {
        let target = root.join(IDENTITY_OBJECT);
        if let Some(found) = self.read_file_identity(&target).await? {
            return Ok(found);
        }
        tokio::fs::create_dir_all(root)
            .await
            .map_err(self.io(format!("creating the directory {}", root.display())))?;
        let fresh = StoreIdentity::random();
        let temporary = root.join(format!(
            "{IDENTITY_OBJECT}.{:016x}.partial",
            rand::random::<u64>()
        ));
        let written = self
            .write_synced(&temporary, format!("{fresh}\n").as_bytes())
            .await;
        let linked = match written {
            Ok(()) => tokio::fs::hard_link(&temporary, &target).await,
            Err(e) => {
                let _ = tokio::fs::remove_file(&temporary).await;
                return Err(e);
            }
        };
        let _ = tokio::fs::remove_file(&temporary).await;
        match linked {
            Ok(()) => {
                // Best effort: the new name survives a crash of the machine.
                if let Ok(dir) = tokio::fs::File::open(root).await {
                    let _ = dir.sync_all().await;
                }
                return Ok(fresh);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            // No hard links here (some FUSE and SMB file systems): an exclusive create.
            Err(e) if matches!(e.raw_os_error(), Some(1 | 95)) => {
                if self.create_new_identity(&target, &fresh).await? {
                    return Ok(fresh);
                }
            }
            Err(e) => return Err(self.io(format!("creating {}", target.display()))(e)),
        }
        // Another process created it first: its id is the store's.
        match self.read_file_identity(&target).await? {
            Some(found) => Ok(found),
            None => Err(StoreError::Io {
                store: self.to_string(),
                what: format!("reading {}", target.display()),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "created by another process, then removed",
                ),
            }),
        }
    }

    /// The id in `target`; `None` when the file does not exist.
    async fn read_file_identity(
        &self,
        target: &std::path::Path,
    ) -> Result<Option<StoreIdentity>, StoreError> {
        match tokio::fs::read_to_string(target).await {
            Ok(text) => match StoreIdentity::parse(&text) {
                Some(id) => Ok(Some(id)),
                None => Err(self.not_an_identity(&target.display().to_string())),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.io(format!("reading {}", target.display()))(e)),
        }
    }

    /// Writes `body` to a new file `path`, synced.
    async fn write_synced(&self, path: &std::path::Path, body: &[u8]) -> Result<(), StoreError> {
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .await
            .map_err(self.io(format!("creating {}", path.display())))?;
        file.write_all(body)
            .await
            .map_err(self.io(format!("writing {}", path.display())))?;
        file.sync_all()
            .await
            .map_err(self.io(format!("syncing {}", path.display())))
    }

    /// `target` created exclusively with `id`; `false` when it already existed.
    async fn create_new_identity(
        &self,
        target: &std::path::Path,
        id: &StoreIdentity,
    ) -> Result<bool, StoreError> {
        match self
            .write_synced(target, format!("{id}\n").as_bytes())
            .await
        {
            Ok(()) => Ok(true),
            Err(StoreError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    fn not_an_identity(&self, location: &str) -> StoreError {
        StoreError::Misconfigured {
            store: self.to_string(),
            message: format!(
                "{location} does not hold a store identity (one line of letters, digits, \
                 '-' or '_'); remove it and a new identity is written"
            ),
        }
    }

    async fn s3_identity(&self) -> Result<StoreIdentity, StoreError> {
        let (client, path) = self.s3(IDENTITY_OBJECT)?;
        let location = self.url_of(IDENTITY_OBJECT);
        if let Some(found) = self.get_s3_identity(&client, &path, &location).await? {
            return Ok(found);
        }
        let fresh = StoreIdentity::random();
        let body = PutPayload::from(format!("{fresh}\n").into_bytes());
        let created = client
            .put_opts(&path, body, object_store::PutMode::Create.into())
            .await;
        match created {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => {}
            Err(e) => {
                return Err(s3_error(
                    &self.to_string(),
                    "writing the store identity",
                    &location,
                    &e,
                ));
            }
        }
        // What is there now, whoever put it (a server that ignores If-None-Match lets the
        // last writer win: reading back still makes this process use the stored id).
        match self.get_s3_identity(&client, &path, &location).await? {
            Some(found) => Ok(found),
            None => Err(StoreError::NotFound(location)),
        }
    }

    async fn get_s3_identity(
        &self,
        client: &Arc<dyn ObjectStore>,
        path: &ObjectPath,
        location: &str,
    ) -> Result<Option<StoreIdentity>, StoreError> {
        let error = |e: object_store::Error| {
            s3_error(
                &self.to_string(),
                "reading the store identity",
                location,
                &e,
            )
        };
        let found = match client.get(path).await {
            Ok(found) => found,
            Err(e) => {
                return match error(e) {
                    StoreError::NotFound(_) => Ok(None),
                    e => Err(e),
                };
            }
        };
        let bytes = found.bytes().await.map_err(error)?;
        match std::str::from_utf8(&bytes)
            .ok()
            .and_then(StoreIdentity::parse)
        {
            Some(id) => Ok(Some(id)),
            None => Err(self.not_an_identity(location)),
        }
    }
}

/// Runs one operation on the store (`create_artifact`, `commit`, `put_manifest`,
/// `open_artifact`, `get_manifest`, `delete`, `discard_partial`) inside a `store` span
/// (`store.operation`, `store.location`: the artifact's URL, never a credential) and counts
/// it in `dbops_external_requests_total{target="store"}`. Callers wrap their calls:
/// `traced("put_manifest", store.location(&key), store.put_manifest(&key, &body))`.
pub async fn traced<T>(
    operation: &'static str,
    location: String,
    work: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    use tracing::Instrument;
    let span = tracing::info_span!(
        "store",
        otel.name = %format_args!("store {operation}"),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        store.operation = operation,
        store.location = location.as_str(),
    );
    let result = work.instrument(span.clone()).await;
    let outcome = match &result {
        Ok(_) => "ok",
        Err(_) => {
            span.record("otel.status_code", "ERROR");
            "error"
        }
    };
    crate::metrics::record_external_request(crate::metrics::Target::Store, outcome);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_file_store_parses() {
        let store: BackupStore = "file:///var/lib/dbops/backups".parse().unwrap();
        assert_eq!(
            store,
            BackupStore::File {
                root: "/var/lib/dbops/backups".into()
            }
        );
        assert_eq!(store.to_string(), "file:///var/lib/dbops/backups");
    }

    #[test]
    fn s3_stores_parse_with_and_without_prefix() {
        assert_eq!(
            "s3://backups/dbops/prod/".parse(),
            Ok(BackupStore::S3 {
                bucket: "backups".into(),
                prefix: "dbops/prod".into(),
                client: S3Client::default(),
            })
        );
        assert_eq!(
            "s3://backups".parse(),
            Ok(BackupStore::S3 {
                bucket: "backups".into(),
                prefix: String::new(),
                client: S3Client::default(),
            })
        );
    }

    #[test]
    fn other_urls_are_refused_with_a_clear_error() {
        assert_eq!(
            "gs://bucket".parse::<BackupStore>(),
            Err(BackupStoreError::UnsupportedScheme("gs://".into()))
        );
        assert_eq!(
            "/var/lib/dbops".parse::<BackupStore>(),
            Err(BackupStoreError::UnsupportedScheme("(none)://".into()))
        );
        assert_eq!(
            "file://backups".parse::<BackupStore>(),
            Err(BackupStoreError::RelativePath)
        );
        assert_eq!(
            "s3://".parse::<BackupStore>(),
            Err(BackupStoreError::MissingBucket)
        );
        assert_eq!(
            "s3://Bucket_1/x".parse::<BackupStore>(),
            Err(BackupStoreError::InvalidBucket("Bucket_1".into()))
        );
        assert_eq!(
            "s3://key:secret@bucket/x".parse::<BackupStore>(),
            Err(BackupStoreError::CredentialsInUrl)
        );
    }

    fn key() -> ObjectKey {
        ObjectKey::new("team-a", "orders-1", "0b5c")
    }

    #[tokio::test]
    async fn an_artifact_appears_only_when_committed_and_a_retry_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let store = BackupStore::File {
            root: dir.path().into(),
        };
        let artifact = dir.path().join("team-a/orders-1-0b5c.dump");
        let mut first = store.create_artifact(&key()).await.unwrap();
        first.write(b"half of a dump").await.unwrap();
        drop(first); // a crash mid-dump
        assert!(!artifact.exists());

        let mut second = store.create_artifact(&key()).await.unwrap();
        second.write(b"all").await.unwrap();
        second.commit().await.unwrap();
        store.put_manifest(&key(), b"{}").await.unwrap();
        assert_eq!(std::fs::read(&artifact).unwrap(), b"all");
        // Each writer had its own partial file: the crashed one's is still there until
        // the completed attempt discards the leftovers.
        let partials = std::fs::read_dir(dir.path().join("team-a"))
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().ends_with(".dump.partial")
            })
            .count();
        assert_eq!(partials, 1);
        store.discard_partial(&key()).await.unwrap();
        let mut names: Vec<_> = std::fs::read_dir(dir.path().join("team-a"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["orders-1-0b5c.dump", "orders-1-0b5c.manifest.json"]);
        assert_eq!(
            store.location(&key()),
            format!("file://{}", artifact.display())
        );
        let mut read = String::new();
        tokio::io::AsyncReadExt::read_to_string(
            &mut store.open_artifact(&key()).await.unwrap(),
            &mut read,
        )
        .await
        .unwrap();
        assert_eq!(read, "all");

        store.delete(&key()).await.unwrap();
        store.delete(&key()).await.unwrap(); // already gone: still a success
        assert_eq!(
            std::fs::read_dir(dir.path().join("team-a"))
                .unwrap()
                .count(),
            0
        );
    }

    #[tokio::test]
    async fn an_unwritable_store_is_a_transient_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-directory");
        std::fs::write(&file, b"").unwrap();
        let store = BackupStore::File { root: file };
        let e = store.create_artifact(&key()).await.err().unwrap();
        assert!(e.is_transient(), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn processes_racing_on_one_store_agree_on_its_identity() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("store");
            let racers: Vec<_> = (0..8)
                .map(|_| {
                    let store = BackupStore::File { root: root.clone() };
                    tokio::spawn(async move { store.identity().await })
                })
                .collect();
            let mut ids = Vec::new();
            for racer in racers {
                ids.push(racer.await.unwrap().unwrap());
            }
            assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
            let id = &ids[0];
            assert_eq!(id.as_str().len(), 32);
            assert!(id.as_str().chars().all(|c| c.is_ascii_hexdigit()), "{id}");
            let kept = std::fs::read_to_string(root.join(IDENTITY_OBJECT)).unwrap();
            assert_eq!(kept.trim(), id.as_str());
            // Asked again, the store answers the same; no temporary file is left.
            let again = BackupStore::File { root: root.clone() };
            assert_eq!(&again.identity().await.unwrap(), id);
            let names: Vec<_> = std::fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            assert_eq!(names, [IDENTITY_OBJECT]);
        }
    }

    #[tokio::test]
    async fn another_root_is_another_store() {
        let dir = tempfile::tempdir().unwrap();
        let first = BackupStore::File {
            root: dir.path().join("a"),
        };
        let second = BackupStore::File {
            root: dir.path().join("b"),
        };
        assert_ne!(
            first.identity().await.unwrap(),
            second.identity().await.unwrap()
        );
    }

    #[tokio::test]
    async fn an_identity_file_that_is_not_one_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(IDENTITY_OBJECT), "").unwrap();
        let store = BackupStore::File {
            root: dir.path().into(),
        };
        let e = store.identity().await.unwrap_err();
        assert!(e.to_string().contains(".dbops-store-id"), "{e}");
        assert!(e.to_string().contains("remove it"), "{e}");
        assert_eq!(
            StoreIdentity::parse(" 0f3a-x_9\n").map(|id| id.to_string()),
            Some("0f3a-x_9".to_owned())
        );
        assert_eq!(StoreIdentity::parse("two words"), None);
    }

    #[tokio::test]
    async fn the_write_probe_creates_the_root_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("new/store");
        let store = BackupStore::File { root: root.clone() };
        store.probe_writable().await.unwrap();
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn the_write_probe_names_the_path_and_the_os_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        let root = file.join("store");
        let store = BackupStore::File { root: root.clone() };
        let e = store.probe_writable().await.unwrap_err().to_string();
        assert!(e.contains(&root.display().to_string()), "{e}");
        assert!(e.contains("Not a directory"), "{e}");
        // The identity needs the same directory: no id is invented for it.
        assert!(store.identity().await.is_err());
    }

    /// Settings for an S3 endpoint on loopback (never a real one: no test leaves 127/8).
    fn s3_settings(endpoint: &str) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", "test-key".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "test-secret-value".to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ENDPOINT_URL", endpoint.to_string()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
            ("HOME", "/nowhere".to_string()),
        ]
    }

    #[test]
    fn s3_objects_sit_under_the_prefix() {
        let store: BackupStore = "s3://backups/dbops/prod/".parse().unwrap();
        assert_eq!(
            store.location(&key()),
            "s3://backups/dbops/prod/team-a/orders-1-0b5c.dump"
        );
        assert_eq!(
            store.url_of(&key().manifest()),
            "s3://backups/dbops/prod/team-a/orders-1-0b5c.manifest.json"
        );
        let bare: BackupStore = "s3://backups".parse().unwrap();
        assert_eq!(
            bare.location(&key()),
            "s3://backups/team-a/orders-1-0b5c.dump"
        );
        assert_eq!(
            s3_key("a//b/", "ns/x.dump").as_ref(),
            "a/b/ns/x.dump",
            "no empty segment"
        );
    }

    #[test]
    fn s3_settings_values_never_show_in_debug_output() {
        let store = "s3://backups/x"
            .parse::<BackupStore>()
            .unwrap()
            .with_s3_environment(s3_settings("http://127.0.0.1:1"));
        let shown = format!("{store:?}");
        assert!(shown.contains("AWS_SECRET_ACCESS_KEY"), "{shown}");
        assert!(!shown.contains("test-secret-value"), "{shown}");
        assert!(!shown.contains("test-key\""), "{shown}");
    }

    fn generic(text: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: text.into(),
        }
    }

    #[test]
    fn s3_errors_are_sorted_by_what_fixes_them() {
        use object_store::Error as E;
        let not_found = E::NotFound {
            path: "team-a/x.dump".into(),
            source: "Server returned non-2xx status code: 404 Not Found: <Code>NoSuchKey</Code>"
                .into(),
        };
        assert_eq!(classify_s3(&not_found), S3Failure::NotFound);
        let no_bucket = E::NotFound {
            path: "team-a/x.dump".into(),
            source: "Server returned non-2xx status code: 404 Not Found: <Code>NoSuchBucket</Code>"
                .into(),
        };
        assert_eq!(
            classify_s3(&no_bucket),
            S3Failure::Permanent("the bucket does not exist")
        );
        let denied = E::PermissionDenied {
            path: "x".into(),
            source: "Server returned non-2xx status code: 403 Forbidden: <Code>AccessDenied</Code>"
                .into(),
        };
        assert_eq!(classify_s3(&denied), S3Failure::Permanent("access denied"));
        let bad_key = generic(
            "Error performing PUT http://127.0.0.1:9/b/k in 2ms - Server returned non-2xx status code: 403 Forbidden: <Code>InvalidAccessKeyId</Code>",
        );
        assert!(
            matches!(classify_s3(&bad_key), S3Failure::Permanent(why) if why.contains("credentials"))
        );
        for transient in [
            "Error performing PUT http://127.0.0.1:9/b/k in 2ms, after 3 retries - Server returned non-2xx status code: 503 Service Unavailable: <Code>SlowDown</Code>",
            "Server returned non-2xx status code: 500 Internal Server Error: ",
            "Server returned non-2xx status code: 429 Too Many Requests: ",
            "Error performing PUT http://127.0.0.1:9/b/k in 2ms - HTTP error: error sending request",
        ] {
            assert_eq!(
                classify_s3(&generic(transient)),
                S3Failure::Transient,
                "{transient}"
            );
        }
        assert_eq!(
            classify_s3(&generic(
                "Server returned non-2xx status code: 400 Bad Request: "
            )),
            S3Failure::Permanent("request refused")
        );

        let e = s3_error("s3://b/p", "writing", "s3://b/p/k", &not_found);
        assert!(
            matches!(e, StoreError::NotFound(ref at) if at == "s3://b/p/k"),
            "{e}"
        );
        let e = s3_error("s3://b/p", "writing", "s3://b/p/k", &no_bucket);
        assert!(!e.is_transient(), "{e}");
        assert!(e.to_string().contains("the bucket does not exist"), "{e}");
        let e = s3_error(
            "s3://b/p",
            "writing",
            "s3://b/p/k",
            &generic(&"x".repeat(5000)),
        );
        assert!(e.is_transient(), "{e}");
        assert!(e.to_string().len() < 1000, "messages are shortened");
    }

    #[tokio::test]
    async fn an_unreachable_s3_endpoint_is_a_transient_error() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let store = "s3://backups/x"
            .parse::<BackupStore>()
            .unwrap()
            .with_s3_environment(s3_settings(&endpoint));
        let e = store.put_manifest(&key(), b"{}").await.unwrap_err();
        assert!(matches!(e, StoreError::Remote { .. }), "{e}");
        assert!(e.is_transient(), "{e}");
        assert!(!e.to_string().contains("test-secret-value"), "{e}");
        // Nothing is sent before a part is full: starting an artifact cannot fail.
        let mut writer = store.create_artifact(&key()).await.unwrap();
        writer.write(b"a small dump").await.unwrap();
        let e = writer.commit().await.unwrap_err();
        assert!(e.is_transient(), "{e}");
    }

    #[tokio::test]
    async fn a_plain_http_endpoint_needs_to_be_allowed() {
        let mut settings = s3_settings("http://127.0.0.1:1");
        settings.retain(|(k, _)| *k != "AWS_ALLOW_HTTP");
        let store = "s3://backups"
            .parse::<BackupStore>()
            .unwrap()
            .with_s3_environment(settings);
        let e = store.get_manifest(&key()).await.unwrap_err();
        assert!(!e.is_transient(), "{e}");
        assert!(e.to_string().contains("AWS_ALLOW_HTTP"), "{e}");
    }
}
