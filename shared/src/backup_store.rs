//! The `--backup-store` URL, where Backups write their artifacts, and the operations on it.
//!
//! `file:///absolute/path` (the default, `file:///var/lib/dbops/backups`) or
//! `s3://bucket[/prefix]`. Credentials never go in the URL (they would end up in logs);
//! an S3 store takes them from the environment. Only `file://` stores can be written yet:
//! operations on an S3 store fail with [`StoreError::Unsupported`].
//!
//! Layout: one object key per Backup, `<namespace>/<name>-<uid>`, so whatever retries or
//! crashes happen a Backup has at most one artifact (`<key>.dump`) and one manifest
//! (`<key>.manifest.json`) beside it. Both are written under a temporary name in the same
//! directory (`.<name>-<uid>.dump.partial`) and renamed into place once complete: a
//! reader never sees half an artifact, and a retry overwrites the partial one.

use std::{fmt, path::PathBuf, str::FromStr};

use tokio::io::AsyncWriteExt;
/// A parsed, validated backup store location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackupStore {
    File { root: PathBuf },
    S3 { bucket: String, prefix: String },
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
            Self::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Self::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
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
}

/// Why a store operation failed. `Io` errors may pass (a full disk, an
/// unmounted volume, a permission fixed by an operator): callers retry them.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("backup store {store}: {what}: {source}")]
    Io {
        store: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("backup store {0} cannot be written yet: only file:// stores are supported")]
    Unsupported(String),
    #[error("{0} does not exist in the backup store")]
    NotFound(String),
}

impl StoreError {
    /// Whether the operation may work later without a configuration change.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Io { .. })
    }
}

/// A complete artifact being read.
pub type ArtifactReader = Box<dyn tokio::io::AsyncRead + Send + Unpin>;

/// An artifact being written; [`ArtifactWriter::commit`] puts it in place.
pub struct ArtifactWriter {
    store: String,
    partial: PathBuf,
    target: PathBuf,
    file: tokio::io::BufWriter<tokio::fs::File>,
}

impl BackupStore {
    fn io(&self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError {
        let store = self.to_string();
        let what = what.into();
        move |source| StoreError::Io {
            store,
            what,
            source,
        }
    }

    fn root(&self) -> Result<&PathBuf, StoreError> {
        match self {
            Self::File { root } => Ok(root),
            Self::S3 { .. } => Err(StoreError::Unsupported(self.to_string())),
        }
    }

    /// The URL of the artifact, as status.location shows it.
    pub fn location(&self, key: &ObjectKey) -> String {
        match self {
            Self::File { root } => format!("file://{}", root.join(key.artifact()).display()),
            Self::S3 { bucket, prefix } if prefix.is_empty() => {
                format!("s3://{bucket}/{}", key.artifact())
            }
            Self::S3 { bucket, prefix } => format!("s3://{bucket}/{prefix}/{}", key.artifact()),
        }
    }

    fn paths(&self, key: &ObjectKey) -> Result<(PathBuf, PathBuf, PathBuf, PathBuf), StoreError> {
        let dir = self.root()?.join(&key.namespace);
        Ok((
            dir.join(format!("{}.dump", key.stem)),
            dir.join(format!(".{}.dump.partial", key.stem)),
            dir.join(format!("{}.manifest.json", key.stem)),
            dir.join(format!(".{}.manifest.json.partial", key.stem)),
        ))
    }

    /// Starts (or starts over) the artifact of `key` under its temporary name.
    pub async fn create_artifact(&self, key: &ObjectKey) -> Result<ArtifactWriter, StoreError> {
        let (target, partial, _, _) = self.paths(key)?;
        if let Some(dir) = target.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(self.io(format!("creating {}", dir.display())))?;
        }
        let file = tokio::fs::File::create(&partial)
            .await
            .map_err(self.io(format!("creating {}", partial.display())))?;
        Ok(ArtifactWriter {
            store: self.to_string(),
            partial,
            target,
            file: tokio::io::BufWriter::with_capacity(1 << 20, file),
        })
    }

    /// Writes the manifest of `key` (temporary name, then renamed into place).
    pub async fn put_manifest(&self, key: &ObjectKey, body: &[u8]) -> Result<(), StoreError> {
        let (_, _, target, partial) = self.paths(key)?;
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

    /// Opens the complete artifact of `key` for reading (a restore reads it). A missing
    /// artifact is [`StoreError::NotFound`].
    pub async fn open_artifact(&self, key: &ObjectKey) -> Result<ArtifactReader, StoreError> {
        let (target, _, _, _) = self.paths(key)?;
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
        let (_, _, manifest, _) = self.paths(key)?;
        match tokio::fs::read(&manifest).await {
            Ok(body) => Ok(body),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(StoreError::NotFound(format!("{}", manifest.display())))
            }
            Err(e) => Err(self.io(format!("reading {}", manifest.display()))(e)),
        }
    }

    /// Removes the artifact, its manifest and any partial file of `key`; what is already
    /// gone counts as removed.
    pub async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let (artifact, partial, manifest, manifest_partial) = self.paths(key)?;
        for path in [manifest, artifact, partial, manifest_partial] {
            match tokio::fs::remove_file(&path).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.io(format!("removing {}", path.display()))(e)),
            }
        }
        Ok(())
    }

    /// Removes only the partial artifact of `key` (after an attempt that gave up).
    pub async fn discard_partial(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let (_, partial, _, _) = self.paths(key)?;
        match tokio::fs::remove_file(&partial).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.io(format!("removing {}", partial.display()))(e)),
        }
    }
}

impl ArtifactWriter {
    pub async fn write(&mut self, chunk: &[u8]) -> Result<(), StoreError> {
        self.file
            .write_all(chunk)
            .await
            .map_err(|source| StoreError::Io {
                store: self.store.clone(),
                what: format!("writing {}", self.partial.display()),
                source,
            })
    }

    /// Flushes and syncs the artifact, then renames it into place.
    pub async fn commit(mut self) -> Result<(), StoreError> {
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
                prefix: "dbops/prod".into()
            })
        );
        assert_eq!(
            "s3://backups".parse(),
            Ok(BackupStore::S3 {
                bucket: "backups".into(),
                prefix: String::new()
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
        let s3: BackupStore = "s3://bucket/x".parse().unwrap();
        let e = s3.create_artifact(&key()).await.err().unwrap();
        assert!(!e.is_transient(), "{e}");
    }
}
