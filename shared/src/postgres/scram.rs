//! SCRAM-SHA-256 verifiers (RFC 5802, RFC 7677) in the format PostgreSQL stores,
//! `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`, with a salt derived from
//! the login ([`salt_for`]), so that the verifier of a password dbops keeps can always be
//! made again, byte for byte, without reading `pg_authid` (which no managed service lets
//! the admin read): the pooler's userlist needs the verifier the server holds
//! (`crate::pooler`), and a Migration's target then holds the same verifier as its source.
//!
//! Why a salt that is not random is safe here: SCRAM sends the salt to anyone who starts
//! a login as that role, so a salt is never secret; what it must be is distinct per role,
//! so that one precomputed table does not serve many roles. A login's salt is distinct
//! from every other login's, and dbops's passwords are 32 random characters (190 bits;
//! a connection Secret's password is only kept while it is the one dbops wrote), which
//! no table precomputed for a login name can hold. The salt never comes from the
//! password: equal passwords of two logins give different verifiers.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

/// PostgreSQL's default (`scram_iterations`), which every client library expects.
pub const ITERATIONS: u32 = 4096;
/// PostgreSQL's salt length.
pub const SALT_LEN: usize = 16;

const SALT_CONTEXT: &[u8] = b"dbops.dev/scram-salt/v1\0";

fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// The salt of `login`'s verifiers: the first 16 bytes of SHA-256 over a fixed context
/// and the login, the same every time and different for every login.
pub fn salt_for(login: &str) -> [u8; SALT_LEN] {
    let digest = Sha256::new()
        .chain_update(SALT_CONTEXT)
        .chain_update(login.as_bytes())
        .finalize();
    let mut salt = [0u8; SALT_LEN];
    salt.copy_from_slice(&digest[..SALT_LEN]);
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
    fn salts_are_stable_per_login_and_differ_by_login() {
        assert_eq!(salt_for("app"), salt_for("app"));
        assert_ne!(salt_for("app"), salt_for("app-2"));
        assert_ne!(salt_for("app"), salt_for("App"));
    }

    #[test]
    fn verifiers_have_postgres_format_and_hide_the_password() {
        let salt = salt_for("app");
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
}
