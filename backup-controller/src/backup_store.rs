//! The `--backup-store` URL: where Backups write their artifacts.
//!
//! `file:///absolute/path` (the default, `file:///var/lib/dbops/backups`) or
//! `s3://bucket[/prefix]`. Credentials never go in the URL (they would end up in logs);
//! an S3 store takes them from the environment.

use std::{fmt, path::PathBuf, str::FromStr};

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
}
