//! Writing an artifact: an [`ArtifactWriter`] puts bytes in a temporary file renamed into
//! place (`file://`), or in a multipart upload completed at commit (`s3://`); nothing is
//! visible before [`ArtifactWriter::commit`].

use std::path::PathBuf;
use std::sync::Arc;

use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use tokio::io::AsyncWriteExt;

use super::error::StoreError;
use super::s3::s3_error;

/// The size of one part of an S3 multipart upload. S3 allows 10,000 parts, so one
/// artifact can hold up to ~156 GiB.
pub const S3_PART_SIZE: usize = 16 << 20;
/// Parts uploading at once while the next one fills: an S3 artifact being written holds
/// at most `(S3_PARTS_IN_FLIGHT + 1) * S3_PART_SIZE` bytes in memory.
pub const S3_PARTS_IN_FLIGHT: usize = 2;

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

impl ArtifactWriter {
    /// A writer of the temporary file `partial`, renamed to `target` at commit.
    pub(super) fn file(
        store: String,
        partial: PathBuf,
        target: PathBuf,
        file: tokio::fs::File,
    ) -> Self {
        Self {
            sink: Sink::File(FileSink {
                store,
                partial,
                target,
                file: tokio::io::BufWriter::with_capacity(1 << 20, file),
            }),
        }
    }

    /// A writer of the object `path`: nothing is sent before a part is full.
    pub(super) fn s3(
        store: String,
        location: String,
        client: Arc<dyn ObjectStore>,
        path: ObjectPath,
    ) -> Self {
        Self {
            sink: Sink::S3(S3Sink {
                store,
                location,
                client,
                path,
                pending: Vec::new(),
                upload: None,
            }),
        }
    }

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
