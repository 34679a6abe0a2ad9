//! The store itself: the `--backup-store` URL parsed into a [`BackupStore`], the
//! [`ObjectKey`] of a Backup, and the URL of each object.

use std::sync::Arc;
use std::{fmt, path::PathBuf, str::FromStr};

use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;

use super::error::StoreError;
use super::s3::{S3Client, s3_key};

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
                client: S3Client::with_settings(
                    vars.into_iter()
                        .map(|(k, v)| (k.into(), v.into()))
                        .collect(),
                ),
            },
            file => file,
        }
    }

    pub(super) fn io(&self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError {
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
    pub(super) fn url_of(&self, relative: &str) -> String {
        match self {
            Self::File { root } => format!("file://{}", root.join(relative).display()),
            Self::S3 { bucket, prefix, .. } => {
                format!("s3://{bucket}/{}", s3_key(prefix, relative))
            }
        }
    }

    /// The S3 client and the key of `relative` in the bucket.
    pub(super) fn s3(
        &self,
        relative: &str,
    ) -> Result<(Arc<dyn ObjectStore>, ObjectPath), StoreError> {
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
        for (url, error) in [
            (
                "gs://bucket",
                BackupStoreError::UnsupportedScheme("gs://".into()),
            ),
            (
                "/var/lib/dbops",
                BackupStoreError::UnsupportedScheme("(none)://".into()),
            ),
            ("file://backups", BackupStoreError::RelativePath),
            ("s3://", BackupStoreError::MissingBucket),
            (
                "s3://Bucket_1/x",
                BackupStoreError::InvalidBucket("Bucket_1".into()),
            ),
            (
                "s3://key:secret@bucket/x",
                BackupStoreError::CredentialsInUrl,
            ),
        ] {
            assert_eq!(url.parse::<BackupStore>(), Err(error), "{url}");
        }
    }
}
