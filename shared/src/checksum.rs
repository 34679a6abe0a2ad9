//! Checksums as the status and manifests show them: SHA-256 in lower-case hex.

pub use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Read size of a [`HashingReader`]: pg_dump's stdout, an artifact from the store.
const CHUNK: usize = 256 * 1024;

/// Lower-case hex, two digits per byte.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// The SHA-256 of `bytes`, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// A stream read to its end in chunks, each chunk counted and hashed on the way: the one
/// SHA-256 loop of a dump (pg_dump's output into the store), of a restore's verification
/// and of the restore itself (the artifact into pg_restore).
pub struct HashingReader<R> {
    inner: R,
    buf: Vec<u8>,
    hasher: Sha256,
    size: u64,
}

impl<R: AsyncRead + Unpin> HashingReader<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            buf: vec![0; CHUNK],
            hasher: Sha256::new(),
            size: 0,
        }
    }

    /// The next chunk, already hashed and counted; `None` at the end of the stream.
    pub async fn next_chunk(&mut self) -> std::io::Result<Option<&[u8]>> {
        let n = self.inner.read(&mut self.buf).await?;
        if n == 0 {
            return Ok(None);
        }
        let chunk = &self.buf[..n];
        self.hasher.update(chunk);
        self.size += n as u64;
        Ok(Some(chunk))
    }

    /// Reads the rest of the stream; the SHA-256 of all of it, hex.
    pub async fn sha256_hex_to_end(mut self) -> std::io::Result<String> {
        while self.next_chunk().await?.is_some() {}
        Ok(self.sha256_hex())
    }

    /// The bytes read so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The SHA-256 of the bytes read so far, hex.
    pub fn sha256_hex(self) -> String {
        hex(&self.hasher.finalize())
    }
}

/// A stream read in chunks (of [`HashingReader`]'s size) without hashing them: what is
/// hashed is what a caller makes of them (a [`Tally`] of the sealed bytes).
pub struct ChunkReader<R> {
    inner: R,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> ChunkReader<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            buf: vec![0; CHUNK],
        }
    }

    /// The next chunk; `None` at the end of the stream.
    pub async fn next_chunk(&mut self) -> std::io::Result<Option<&[u8]>> {
        let n = self.inner.read(&mut self.buf).await?;
        Ok((n > 0).then(|| &self.buf[..n]))
    }
}

/// The size and SHA-256 of bytes given to it piece by piece.
#[derive(Default)]
pub struct Tally {
    hasher: Sha256,
    size: u64,
}

impl Tally {
    pub fn update(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
        self.size += bytes.len() as u64;
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The SHA-256 of the bytes so far, hex.
    pub fn sha256_hex(self) -> String {
        hex(&self.hasher.finalize())
    }
}

/// A reader that hashes what is read through it, for a reader that consumes the stream
/// itself (a decryptor): the [`Tally`] is shared, read once the stream is done.
pub struct TallyingReader<R> {
    inner: R,
    tally: std::sync::Arc<std::sync::Mutex<Tally>>,
}

impl<R> TallyingReader<R> {
    pub fn new(inner: R) -> (Self, std::sync::Arc<std::sync::Mutex<Tally>>) {
        let tally = std::sync::Arc::default();
        (
            Self {
                inner,
                tally: std::sync::Arc::clone(&tally),
            },
            tally,
        )
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for TallyingReader<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = &polled {
            let read = &buf.filled()[before..];
            self.tally
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .update(read);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lower_case_and_padded() {
        assert_eq!(hex(&[0, 1, 0xab, 0xff]), "0001abff");
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[tokio::test]
    async fn a_hashing_reader_hashes_and_counts_every_chunk() {
        // Longer than one chunk, so the loop goes round more than once.
        let bytes: Vec<u8> = (0..CHUNK * 2 + 7).map(|i| i as u8).collect();
        let mut reader = HashingReader::new(&bytes[..]);
        let mut seen = Vec::new();
        while let Some(chunk) = reader.next_chunk().await.unwrap() {
            seen.extend_from_slice(chunk);
            assert_eq!(reader.size(), seen.len() as u64);
        }
        assert_eq!(seen, bytes);
        assert_eq!(reader.sha256_hex(), sha256_hex(&bytes));
        assert_eq!(
            HashingReader::new(&bytes[..])
                .sha256_hex_to_end()
                .await
                .unwrap(),
            sha256_hex(&bytes)
        );
    }
}
