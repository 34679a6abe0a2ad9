//! Client-side encryption of backup artifacts (issue 37): the age format
//! (<https://age-encryption.org/v1>, X25519 recipients), by the `age` crate.
//!
//! - The backup-controller is given **recipients** (public keys, `age1…`, one per line, in
//!   a Secret of its namespace) and seals what pg_dump writes while it streams: the store
//!   only ever receives ciphertext. Several recipients at once: each can open the artifact
//!   alone, so a key is rotated by adding the new one, then removing the old one once no
//!   artifact sealed to it is still needed.
//! - The database-controller is given **identities** (secret keys, `AGE-SECRET-KEY-1…`)
//!   and opens an artifact with whichever of them it was sealed to.
//! - The checksum of an artifact is that of its bytes as stored (the ciphertext): a
//!   restore proves them before it decrypts, and the format's authentication refuses any
//!   change made after that.
//!
//! A key's text never reaches an error message or a log line: a bad line is named by its
//! number.

use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};

use age::secrecy::ExposeSecret;
use tokio::io::AsyncRead;
use tokio_util::compat::{FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};

/// The format a sealed artifact's manifest names.
pub const FORMAT: &str = "age";

/// The key of a recipients Secret that holds them.
pub const RECIPIENTS_KEY: &str = "recipients";
/// The key of an identities Secret that holds them.
pub const IDENTITIES_KEY: &str = "identities";

/// What is wrong with a list of keys.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("line {line} is not an age X25519 {what} ({expected})")]
    Invalid {
        line: usize,
        what: &'static str,
        expected: &'static str,
    },
    #[error("no {0} in it (one per line; `#` starts a comment)")]
    Empty(&'static str),
}

/// The lines that hold a key: trimmed, neither empty nor comments, with their numbers.
fn key_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
}

/// The keys of `text`, one per line (blank lines and `#` comments skipped), at least
/// one; a line that does not parse is named by its number only.
fn parse_keys<K: std::str::FromStr>(
    text: &str,
    what: &'static str,
    expected: &'static str,
) -> Result<Vec<K>, KeyError> {
    let keys = key_lines(text)
        .map(|(line, l)| {
            l.parse::<K>().map_err(|_| KeyError::Invalid {
                line,
                what,
                expected,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if keys.is_empty() {
        return Err(KeyError::Empty(what));
    }
    Ok(keys)
}

/// The public keys artifacts are sealed to.
#[derive(Clone)]
pub struct Recipients {
    keys: Vec<age::x25519::Recipient>,
}

impl Recipients {
    /// One `age1…` key per line; blank lines and `#` comments are skipped.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let keys = parse_keys(text, "recipient", "a public key, age1…")?;
        Ok(Self { keys })
    }

    /// The public keys, as written (`age1…`): what a manifest and a status show.
    pub fn public_keys(&self) -> Vec<String> {
        self.keys.iter().map(ToString::to_string).collect()
    }

    /// An encryptor with a new file key, wrapped for every recipient.
    fn encryptor(&self) -> std::io::Result<age::Encryptor> {
        age::Encryptor::with_recipients(self.keys.iter().map(|k| k as &dyn age::Recipient))
            .map_err(std::io::Error::other)
    }

    /// A sealer for one artifact: a new file key, wrapped for every recipient.
    pub fn sealer(&self) -> std::io::Result<Sealer> {
        let encryptor = self.encryptor()?;
        let out = Shared::default();
        let writer = encryptor.wrap_output(out.clone())?;
        Ok(Sealer { writer, out })
    }
}

impl std::fmt::Debug for Recipients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.public_keys()).finish()
    }
}

/// The secret keys artifacts are opened with.
pub struct Identities {
    keys: Vec<age::x25519::Identity>,
}

impl Identities {
    /// One `AGE-SECRET-KEY-1…` key per line; blank lines and `#` comments (such as the
    /// `# public key: age1…` line `age-keygen` writes) are skipped.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let keys = parse_keys(text, "identity", "a secret key, AGE-SECRET-KEY-1…")?;
        Ok(Self { keys })
    }

    /// A new identity (for tests and the dev environment): its secret key as text.
    pub fn generate() -> (String, String) {
        let key = age::x25519::Identity::generate();
        let public = key.to_public().to_string();
        (key.to_string().expose_secret().to_string(), public)
    }

    /// The public keys these identities open.
    pub fn public_keys(&self) -> Vec<String> {
        self.keys
            .iter()
            .map(|k| k.to_public().to_string())
            .collect()
    }
}

/// Never the keys themselves.
impl std::fmt::Debug for Identities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Identities({} for {:?})",
            self.keys.len(),
            self.public_keys()
        )
    }
}

/// The ciphertext a [`Sealer`] produced and its caller has not taken yet.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Shared {
    fn take(&self) -> Vec<u8> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Seals one artifact as it streams: plaintext in, ciphertext out, in the order given.
/// Holds at most one of the format's 64 KiB chunks besides what it returns.
pub struct Sealer {
    writer: age::stream::StreamWriter<Shared>,
    out: Shared,
}

impl Sealer {
    /// Seals `plaintext`; the ciphertext ready so far (the header first), maybe empty.
    pub fn seal(&mut self, plaintext: &[u8]) -> std::io::Result<Vec<u8>> {
        self.writer.write_all(plaintext)?;
        Ok(self.out.take())
    }

    /// The rest of the ciphertext: the last chunk, which marks the end (an artifact cut
    /// short anywhere fails to open).
    pub fn finish(self) -> std::io::Result<Vec<u8>> {
        self.writer.finish()?;
        Ok(self.out.take())
    }
}

impl Recipients {
    /// `plaintext` sealed whole, as ASCII-armored text (`-----BEGIN AGE ENCRYPTED
    /// FILE-----`): the sensitive part of a manifest. `age -d` opens it too.
    pub fn seal_armored(&self, plaintext: &[u8]) -> std::io::Result<String> {
        use age::armor::{ArmoredWriter, Format};
        let encryptor = self.encryptor()?;
        let armored = ArmoredWriter::wrap_output(Vec::new(), Format::AsciiArmor)?;
        let mut writer = encryptor.wrap_output(armored)?;
        writer.write_all(plaintext)?;
        let text = writer.finish()?.finish()?;
        String::from_utf8(text).map_err(std::io::Error::other)
    }
}

impl Identities {
    /// What [`Recipients::seal_armored`] sealed.
    pub fn open_armored(&self, text: &str) -> Result<Vec<u8>, OpenError> {
        use std::io::Read;
        let reader = age::armor::ArmoredReader::new(text.as_bytes());
        let decryptor = age::Decryptor::new(reader).map_err(open_error)?;
        let mut plaintext = decryptor
            .decrypt(self.keys.iter().map(|k| k as &dyn age::Identity))
            .map_err(open_error)?;
        let mut out = Vec::new();
        plaintext.read_to_end(&mut out)?;
        Ok(out)
    }
}

/// The keys in `key` of Secret `name` (`None`: there is no such Secret), as `parse`
/// reads them; otherwise why not, in words that never quote a key.
pub fn keys_from<T>(
    secret: Option<&k8s_openapi::api::core::v1::Secret>,
    name: &str,
    key: &str,
    parse: impl Fn(&str) -> Result<T, KeyError>,
) -> Result<T, String> {
    let secret = secret.ok_or_else(|| {
        format!("Secret {name} (the encryption keys) is not in the controllers' namespace")
    })?;
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .ok_or_else(|| format!("Secret {name} has no key {key:?}"))?;
    let text = std::str::from_utf8(&bytes.0)
        .map_err(|_| format!("Secret {name}'s key {key:?} is not UTF-8 text"))?;
    parse(text).map_err(|e| format!("Secret {name}'s key {key:?}: {e}"))
}

/// Why a sealed artifact does not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// None of the identities is a recipient of the artifact.
    #[error("none of the identities given opens it")]
    NoMatchingKey,
    #[error("it is not an age file the identities can read: {0}")]
    Format(String),
    #[error("reading it: {0}")]
    Io(#[from] std::io::Error),
}

/// The plaintext of the sealed artifact `ciphertext`, as a stream; its header is read
/// and the file key unwrapped now (a missing key fails here, before anything is read of
/// the body). A change to the body fails the read where it is.
pub async fn open<R>(
    ciphertext: R,
    identities: &Identities,
) -> Result<Box<dyn AsyncRead + Send + Unpin>, OpenError>
where
    R: AsyncRead + Send + Unpin + 'static,
{
    let decryptor = age::Decryptor::new_async(ciphertext.compat())
        .await
        .map_err(open_error)?;
    let plaintext = decryptor
        .decrypt_async(identities.keys.iter().map(|k| k as &dyn age::Identity))
        .map_err(open_error)?;
    Ok(Box::new(plaintext.compat()))
}

fn open_error(e: age::DecryptError) -> OpenError {
    match e {
        age::DecryptError::NoMatchingKeys => OpenError::NoMatchingKey,
        age::DecryptError::Io(e) => OpenError::Io(e),
        other => OpenError::Format(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn sealed(recipients: &Recipients, plaintext: &[u8], chunk: usize) -> Vec<u8> {
        let mut sealer = recipients.sealer().unwrap();
        let mut out = Vec::new();
        for piece in plaintext.chunks(chunk) {
            out.extend(sealer.seal(piece).unwrap());
        }
        out.extend(sealer.finish().unwrap());
        out
    }

    async fn opened(ciphertext: Vec<u8>, identities: &Identities) -> Result<Vec<u8>, OpenError> {
        let mut reader = open(std::io::Cursor::new(ciphertext), identities).await?;
        let mut out = Vec::new();
        reader.read_to_end(&mut out).await?;
        Ok(out)
    }

    #[tokio::test]
    async fn sealed_in_chunks_opens_with_either_recipient_and_holds_no_plaintext() {
        let (old, old_public) = Identities::generate();
        let (new, new_public) = Identities::generate();
        let recipients =
            Recipients::parse(&format!("# rotation\n{old_public}\n\n{new_public}\n")).unwrap();
        assert_eq!(recipients.public_keys(), vec![old_public, new_public]);
        let plaintext: Vec<u8> = (0..300_000u32)
            .flat_map(|i| format!("marker-row-{i};").into_bytes())
            .collect();
        let ciphertext = sealed(&recipients, &plaintext, 100_003);
        assert!(
            !ciphertext
                .windows(b"marker-row-".len())
                .any(|w| w == b"marker-row-"),
            "plaintext in the sealed bytes"
        );
        for key in [&old, &new] {
            let ids = Identities::parse(key).unwrap();
            assert_eq!(opened(ciphertext.clone(), &ids).await.unwrap(), plaintext);
        }
    }

    #[tokio::test]
    async fn a_missing_key_a_changed_byte_and_a_cut_are_refused() {
        let (key, public) = Identities::generate();
        let (other, _) = Identities::generate();
        let recipients = Recipients::parse(&public).unwrap();
        let plaintext = vec![7u8; 200_000];
        let ciphertext = sealed(&recipients, &plaintext, 65_536);
        let ids = Identities::parse(&key).unwrap();

        let wrong = Identities::parse(&other).unwrap();
        assert!(matches!(
            opened(ciphertext.clone(), &wrong).await,
            Err(OpenError::NoMatchingKey)
        ));
        let mut changed = ciphertext.clone();
        let at = changed.len() - 1000;
        changed[at] ^= 1;
        assert!(
            opened(changed, &ids).await.is_err(),
            "a changed byte opened"
        );
        let cut = ciphertext[..ciphertext.len() - 70_000].to_vec();
        assert!(opened(cut, &ids).await.is_err(), "a cut artifact opened");
    }

    #[test]
    fn an_armored_manifest_part_opens_with_its_identity_only() {
        let (key, public) = Identities::generate();
        let (other, _) = Identities::generate();
        let text = Recipients::parse(&public)
            .unwrap()
            .seal_armored(br#"{"databaseName":"orders"}"#)
            .unwrap();
        assert!(
            text.starts_with("-----BEGIN AGE ENCRYPTED FILE-----"),
            "{text}"
        );
        assert!(!text.contains("orders"));
        let ids = Identities::parse(&key).unwrap();
        assert_eq!(
            ids.open_armored(&text).unwrap(),
            br#"{"databaseName":"orders"}"#
        );
        let wrong = Identities::parse(&other).unwrap();
        assert!(matches!(
            wrong.open_armored(&text),
            Err(OpenError::NoMatchingKey)
        ));
    }

    #[test]
    fn bad_keys_are_named_by_line_never_echoed() {
        let (secret, public) = Identities::generate();
        let e = Recipients::parse(&format!("{public}\n{secret}\n")).unwrap_err();
        assert_eq!(
            e,
            KeyError::Invalid {
                line: 2,
                what: "recipient",
                expected: "a public key, age1…"
            }
        );
        assert!(!e.to_string().contains(&secret));
        let e = Identities::parse(&format!("# public key: {public}\n{public}\n")).unwrap_err();
        assert!(matches!(e, KeyError::Invalid { line: 2, .. }), "{e}");
        assert_eq!(
            Recipients::parse("# none\n\n").unwrap_err(),
            KeyError::Empty("recipient")
        );
        let ids = Identities::parse(&format!("# public key: {public}\n{secret}\n")).unwrap();
        assert!(!format!("{ids:?}").contains(&secret));
        assert_eq!(ids.public_keys(), vec![public]);
    }
}
