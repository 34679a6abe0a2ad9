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
