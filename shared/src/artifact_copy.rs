//! A Backup's artifact read back from the store into a writer (pg_restore's stdin, a
//! scratch file), decrypted on the way when it is encrypted, with the SHA-256 of the bytes
//! as stored (the ciphertext of an encrypted artifact) computed as they pass: what a
//! restore (database-controller) and a verification (backup-controller) both feed
//! pg_restore with.

use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::backup_store::{BackupStore, ObjectKey, StoreError, traced};
use crate::checksum::{ChunkReader, TallyingReader};
use crate::sealing::{self, Identities};

/// What a copy did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    /// What went wrong on the way, if anything (the artifact did not decrypt, the store
    /// failed while it was read, the writer refused): the writer's side (pg_restore's exit
    /// status) says the rest.
    pub error: Option<String>,
    /// SHA-256 of the bytes read from the store (lower-case hex), as far as they were read.
    pub sha256: String,
    /// How many bytes were read from the store.
    pub size: u64,
    /// Whether [`Copied::error`] is only that the writer stopped taking bytes (with
    /// [`WhenRefused::HashTheRest`], the checksum still covers the whole artifact): a
    /// pg_restore of one section may end before the archive does.
    pub only_refused: bool,
}

/// What a copy does when the writer stops taking bytes (pg_restore exited).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenRefused {
    /// Stop reading: the checksum covers what was read.
    Stop,
    /// Read (and hash) the rest, so that the checksum is of the whole artifact and can
    /// say whether the bytes were the recorded ones.
    HashTheRest,
}

/// Copies the artifact of `key` from `store` to `out` (closed at the end), decrypted with
/// `identities` when given. Only opening the artifact is an error here; everything after
/// is reported in [`Copied::error`], beside the checksum of what was read.
pub async fn copy_artifact<W: AsyncWrite + Unpin>(
    store: &BackupStore,
    key: &ObjectKey,
    identities: Option<&Identities>,
    mut out: W,
    when_refused: WhenRefused,
) -> Result<Copied, StoreError> {
    let opened = store.open_artifact(key);
    let reader = traced("open_artifact", store.location(key), opened).await?;
    // The checksum is of the bytes as stored: the ciphertext of an encrypted artifact.
    let (stored, tally) = TallyingReader::new(reader);
    let plaintext: Box<dyn tokio::io::AsyncRead + Send + Unpin> = match identities {
        None => Box::new(stored),
        Some(identities) => match sealing::open(stored, identities).await {
            Ok(plaintext) => plaintext,
            Err(e) => {
                let _ = out.shutdown().await;
                return Ok(Copied {
                    error: Some(format!("decrypting the artifact: {e}")),
                    sha256: String::new(),
                    size: 0,
                    only_refused: false,
                });
            }
        },
    };
    let mut restored = ChunkReader::new(plaintext);
    let mut refused = None;
    let error = loop {
        let chunk = match restored.next_chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break refused.clone(),
            Err(e) => break Some(format!("reading the artifact: {e}")),
        };
        if refused.is_some() {
            continue;
        }
        if let Err(e) = out.write_all(chunk).await {
            // The reader stopped (pg_restore exited): its exit status and stderr say why.
            refused = Some(format!("writing the artifact on: {e}"));
            if when_refused == WhenRefused::Stop {
                break refused.clone();
            }
        }
    };
    // Flushed and closed: pg_restore's stdin sees its end, a scratch file is complete.
    let only_refused = error.is_some() && error == refused;
    let error = match (error, out.shutdown().await) {
        (None, Err(e)) => Some(format!("closing the copy of the artifact: {e}")),
        (error, _) => error,
    };
    drop(restored);
    let tally = std::mem::take(
        &mut *tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    let size = tally.size();
    Ok(Copied {
        error,
        sha256: tally.sha256_hex(),
        size,
        only_refused,
    })
}
