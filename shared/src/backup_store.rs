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
//!
//! The map (everything public is re-exported here; use these paths):
//!
//! | module | holds |
//! |---|---|
//! | `error` | [`StoreError`] and whether a retry may cure it |
//! | `s3` | the S3 client built from `AWS_*` settings, object keys, S3 errors sorted by what fixes them |
//! | `store` | [`BackupStore`] parsed from its URL ([`BackupStoreError`]), [`ObjectKey`], object URLs |
//! | `sink` | [`ArtifactWriter`]: the temporary file or the multipart upload, and commit |
//! | `objects` | a Backup's artifact and manifest: create, put, open, get, delete, discard partials |
//! | `identity` | [`StoreIdentity`] ([`IDENTITY_OBJECT`]) and the `file://` write probe |
//! | `trace` | [`traced`]: the `store` span and counter around each operation |
//! | [`registry`] | the store registered in a namespace's ConfigMap, checked against the identity |
//!
//! Each module imports only the ones above it in this table (never this file's
//! re-exports), so there is no circle among them.

mod error;
mod identity;
mod objects;
pub mod registry;
mod s3;
mod sink;
mod store;
mod trace;

pub use error::StoreError;
pub use identity::{IDENTITY_OBJECT, StoreIdentity};
pub use s3::S3Client;
pub use sink::{ArtifactReader, ArtifactWriter, S3_PART_SIZE, S3_PARTS_IN_FLIGHT};
pub use store::{BackupStore, BackupStoreError, ObjectKey};
pub use trace::traced;
