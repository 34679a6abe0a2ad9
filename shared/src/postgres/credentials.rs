//! Admin credentials read from a Secret, and passwords: generated ones and the SCRAM
//! verifiers that stand for them in SQL.

use std::fmt;

use k8s_openapi::api::core::v1::Secret;

/// A role name and password. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// Why admin credentials could not be read from a Secret.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CredentialsError {
    #[error("Secret {0} has no key {1:?}")]
    MissingKey(String, &'static str),
    #[error("Secret {0} key {1:?} is not UTF-8")]
    NotUtf8(String, &'static str),
}

impl Credentials {
    /// The keys `username` and `password` of an admin Secret.
    pub fn from_secret(secret: &Secret) -> Result<Self, CredentialsError> {
        let name = secret.metadata.name.clone().unwrap_or_default();
        let key = |k: &'static str| -> Result<String, CredentialsError> {
            let data = secret.data.as_ref().and_then(|d| d.get(k));
            let string = secret.string_data.as_ref().and_then(|d| d.get(k));
            match (data, string) {
                (_, Some(s)) => Ok(s.clone()),
                (Some(bytes), None) => String::from_utf8(bytes.0.clone())
                    .map_err(|_| CredentialsError::NotUtf8(name.clone(), k)),
                (None, None) => Err(CredentialsError::MissingKey(name.clone(), k)),
            }
        };
        let username = key("username")?;
        let password = key("password")?;
        if username.is_empty() {
            return Err(CredentialsError::MissingKey(name, "username"));
        }
        Ok(Self { username, password })
    }
}

/// The SCRAM-SHA-256 verifier of `login`'s `password`, for `PASSWORD '...'`: its salt is
/// the login's ([`super::scram::salt_for`]), so the same login and password always give
/// the same verifier, on every server (the pooler's userlist holds it too).
pub fn password_verifier(login: &str, password: &str) -> String {
    super::scram::verifier(password, &super::scram::salt_for(login))
}

/// A new random password: 32 characters from a CSPRNG.
pub fn generate_password() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    Alphanumeric.sample_string(&mut rand::rng(), 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifiers_hide_the_password_and_are_the_logins_own() {
        let a = password_verifier("app", "s3cret");
        assert!(a.starts_with("SCRAM-SHA-256$4096:"));
        assert!(!a.contains("s3cret"));
        assert_eq!(
            a,
            password_verifier("app", "s3cret"),
            "made again, byte for byte"
        );
        assert_ne!(
            a,
            password_verifier("app-2", "s3cret"),
            "another login's salt"
        );
    }

    #[test]
    fn generated_passwords_are_long_and_distinct() {
        let a = generate_password();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, generate_password());
    }

    #[test]
    fn credentials_debug_redacts_the_password() {
        let c = Credentials {
            username: "admin".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{c:?}").contains("hunter2"));
    }

    #[test]
    fn credentials_need_both_keys() {
        let mut secret = Secret::default();
        secret.metadata.name = Some("admin".into());
        secret.string_data = Some([("username".to_string(), "postgres".to_string())].into());
        assert_eq!(
            Credentials::from_secret(&secret),
            Err(CredentialsError::MissingKey("admin".into(), "password"))
        );
    }
}
