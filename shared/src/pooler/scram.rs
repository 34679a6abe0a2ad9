//! SCRAM-SHA-256 verifiers with a salt dbops can derive again (RFC 5802, RFC 7677; the
//! format PostgreSQL stores: `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`).

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

/// PostgreSQL's default (`scram_iterations`), which every client library expects.
pub const ITERATIONS: u32 = 4096;
/// PostgreSQL's salt length.
pub const SALT_LEN: usize = 16;

const SALT_CONTEXT: &[u8] = b"dbops.dev/pooler-salt/v1\0";

/// A server's key for deriving salts: 32 random bytes, kept in a Secret in the
/// controllers' namespace. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct SaltKey([u8; 32]);

/// Why bytes are not a salt key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a pooler salt key is 32 bytes, not {0}")]
pub struct SaltKeyError(pub usize);

impl SaltKey {
    /// A new key from the operating system's CSPRNG.
    pub fn generate() -> Self {
        let mut key = [0u8; 32];
        rand::fill(&mut key);
        Self(key)
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SaltKeyError> {
        <[u8; 32]>::try_from(bytes)
            .map(Self)
            .map_err(|_| SaltKeyError(bytes.len()))
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for SaltKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SaltKey(<redacted>)")
    }
}

fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// The salt of `login`'s verifier on the server whose key is `key`: the same every time,
/// different for every login and server, unknowable without the key.
pub fn salt_for(key: &SaltKey, login: &str) -> [u8; SALT_LEN] {
    let mut message = SALT_CONTEXT.to_vec();
    message.extend_from_slice(login.as_bytes());
    let mac = hmac(&key.0, &message);
    let mut salt = [0u8; SALT_LEN];
    salt.copy_from_slice(&mac[..SALT_LEN]);
    salt
}

/// `(ClientKey, StoredKey, ServerKey)` of `password` with `salt`.
fn keys(password: &str, salt: &[u8], iterations: u32) -> ([u8; 32], [u8; 32], [u8; 32]) {
    // SASLprep as libpq's PQencryptPasswordConn and the server do: a password it
    // rejects is used as its bytes.
    let prepared = match stringprep::saslprep(password) {
        Ok(p) => p.into_owned().into_bytes(),
        Err(_) => password.as_bytes().to_vec(),
    };
    let salted = pbkdf2::pbkdf2_hmac_array::<Sha256, 32>(&prepared, salt, iterations);
    let client_key = hmac(&salted, b"Client Key");
    let stored_key: [u8; 32] = Sha256::digest(client_key).into();
    let server_key = hmac(&salted, b"Server Key");
    (client_key, stored_key, server_key)
}

/// The SCRAM-SHA-256 verifier of `password` with `salt`, as `CREATE ROLE ... PASSWORD`
/// takes it and as PgBouncer's `auth_file` holds it.
pub fn verifier(password: &str, salt: &[u8; SALT_LEN]) -> String {
    let (_, stored_key, server_key) = keys(password, salt, ITERATIONS);
    format!(
        "SCRAM-SHA-256${ITERATIONS}:{}${}:{}",
        STANDARD.encode(salt),
        STANDARD.encode(stored_key),
        STANDARD.encode(server_key)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7677's example exchange: the keys derived here give its client proof and
    /// server signature.
    #[test]
    fn keys_match_rfc_7677() {
        let salt = STANDARD.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
        let (client_key, stored_key, server_key) = keys("pencil", &salt, 4096);
        let auth_message = "n=user,r=rOprNGfwEbeRWgbNEkqO,\
            r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,\
            c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0";
        let client_signature = hmac(&stored_key, auth_message.as_bytes());
        let proof: Vec<u8> = client_key
            .iter()
            .zip(client_signature)
            .map(|(k, s)| k ^ s)
            .collect();
        assert_eq!(
            STANDARD.encode(proof),
            "dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
        );
        assert_eq!(
            STANDARD.encode(hmac(&server_key, auth_message.as_bytes())),
            "6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
        );
    }

    #[test]
    fn salts_are_stable_per_login_and_differ_by_login_and_key() {
        let key = SaltKey::generate();
        assert_eq!(salt_for(&key, "app"), salt_for(&key, "app"));
        assert_ne!(salt_for(&key, "app"), salt_for(&key, "app-2"));
        assert_ne!(salt_for(&key, "app"), salt_for(&SaltKey::generate(), "app"));
    }

    #[test]
    fn verifiers_have_postgres_format_and_hide_the_password() {
        let salt = salt_for(&SaltKey::generate(), "app");
        let v = verifier("s3cret-password", &salt);
        assert_eq!(
            v,
            verifier("s3cret-password", &salt),
            "one salt, one verifier"
        );
        assert_ne!(v, verifier("another-password", &salt));
        assert!(!v.contains("s3cret"));
        let (head, keys) = v.split_once('$').unwrap().1.split_once('$').unwrap();
        assert_eq!(head, format!("4096:{}", STANDARD.encode(salt)));
        let (stored, server) = keys.split_once(':').unwrap();
        assert_eq!(STANDARD.decode(stored).unwrap().len(), 32);
        assert_eq!(STANDARD.decode(server).unwrap().len(), 32);
    }

    #[test]
    fn salt_keys_are_32_bytes_and_never_printed() {
        assert_eq!(SaltKey::from_bytes(&[1; 31]), Err(SaltKeyError(31)));
        let key = SaltKey::from_bytes(&[7; 32]).unwrap();
        assert_eq!(key.as_bytes(), &[7; 32]);
        assert_eq!(format!("{key:?}"), "SaltKey(<redacted>)");
    }
}
