//! The S3 side of a store: the client (built once from `AWS_*` settings, shared by every
//! clone of the store), object keys under the prefix, and S3 errors sorted into
//! [`StoreError`]s by what fixes them.

use std::fmt;
use std::sync::{Arc, Mutex};

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, RetryConfig};

use super::error::StoreError;

/// The client of an `s3://` store: built once from the settings on first use and shared
/// by every clone of the [`BackupStore`](super::BackupStore). Settings are the process
/// environment unless
/// [`BackupStore::with_s3_environment`](super::BackupStore::with_s3_environment) gave
/// others.
#[derive(Clone, Default)]
pub struct S3Client {
    settings: Option<Arc<Vec<(String, String)>>>,
    built: Arc<Mutex<Option<Arc<dyn ObjectStore>>>>,
}

/// Every client is equal: a store is identified by its URL.
impl PartialEq for S3Client {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for S3Client {}

/// Names only: the values may be credentials.
impl fmt::Debug for S3Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.settings {
            None => f.write_str("S3Client(settings from the environment)"),
            Some(vars) => {
                let names: Vec<&str> = vars.iter().map(|(k, _)| k.as_str()).collect();
                write!(f, "S3Client(settings {names:?})")
            }
        }
    }
}

impl S3Client {
    /// A client whose settings are `vars` (`AWS_*` names and values), not the process
    /// environment.
    pub(super) fn with_settings(vars: Vec<(String, String)>) -> Self {
        Self {
            settings: Some(Arc::new(vars)),
            built: Arc::default(),
        }
    }

    /// The client, built on the first call; a failure is not remembered.
    pub(super) fn get(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>, String> {
        let mut built = self
            .built
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(client) = built.as_ref() {
            return Ok(Arc::clone(client));
        }
        let client: Arc<dyn ObjectStore> = match &self.settings {
            Some(vars) => Arc::new(build_s3(bucket, vars.iter().cloned())?),
            None => Arc::new(build_s3(bucket, std::env::vars())?),
        };
        *built = Some(Arc::clone(&client));
        Ok(client)
    }
}

/// An S3 client for `bucket` from `AWS_*` settings. Requests time out only when the
/// server stalls (60 s without a byte), not by their total length: a restore may read
/// one object for an hour. Retries are few: the controller backs off per Backup.
fn build_s3(
    bucket: &str,
    settings: impl Iterator<Item = (String, String)>,
) -> Result<object_store::aws::AmazonS3, String> {
    // reqwest's rustls has no provider of its own here: use ring, as kube does.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let options = ClientOptions::new()
        .with_connect_timeout(std::time::Duration::from_secs(5))
        .with_timeout_disabled()
        .with_read_timeout(std::time::Duration::from_secs(60));
    let retry = RetryConfig {
        max_retries: 3,
        retry_timeout: std::time::Duration::from_secs(120),
        ..RetryConfig::default()
    };
    let mut builder = AmazonS3Builder::new()
        .with_client_options(options)
        .with_retry(retry);
    for (name, value) in settings {
        if !name.starts_with("AWS_") {
            continue;
        }
        if let Ok(key) = name.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
            builder = builder.with_config(key, value);
        }
    }
    builder
        .with_bucket_name(bucket)
        .build()
        .map_err(|e| e.to_string())
}

/// `<prefix>/<relative>` as an object key (no empty segments).
pub(super) fn s3_key(prefix: &str, relative: &str) -> ObjectPath {
    ObjectPath::from_iter(
        prefix
            .split('/')
            .chain(relative.split('/'))
            .filter(|part| !part.is_empty()),
    )
}

/// What an S3 error means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum S3Failure {
    /// The object does not exist (its bucket does).
    NotFound,
    /// Worth retrying: connection, timeout, 5xx, throttling.
    Transient,
    /// Needs a configuration change; the text says which.
    Permanent(&'static str),
}

/// Sorts an `object_store` error by what fixes it, from its kind and its text (the S3
/// error code and the HTTP status are only in the text).
fn classify_s3(e: &object_store::Error) -> S3Failure {
    use object_store::Error as E;
    let text = e.to_string();
    if text.contains("NoSuchBucket") {
        return S3Failure::Permanent("the bucket does not exist");
    }
    const CREDENTIALS: &str =
        "the credentials were refused (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)";
    if [
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
    ]
    .iter()
    .any(|code| text.contains(code))
    {
        return S3Failure::Permanent(CREDENTIALS);
    }
    if text.contains("HTTP error: builder error") {
        // reqwest refused to build the request: an http:// endpoint that is not allowed.
        return S3Failure::Permanent(
            "the request could not be made: an http:// AWS_ENDPOINT_URL needs AWS_ALLOW_HTTP=true",
        );
    }
    match e {
        E::NotFound { .. } => S3Failure::NotFound,
        E::Unauthenticated { .. } => S3Failure::Permanent(CREDENTIALS),
        E::PermissionDenied { .. } => S3Failure::Permanent("access denied"),
        E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::NotImplemented { .. }
        | E::UnknownConfigurationKey { .. } => S3Failure::Permanent("not supported"),
        _ => match http_status(&text) {
            Some(401) => S3Failure::Permanent(CREDENTIALS),
            Some(403) => S3Failure::Permanent("access denied"),
            Some(408 | 429) => S3Failure::Transient,
            Some(400..=499) => S3Failure::Permanent("request refused"),
            _ => S3Failure::Transient,
        },
    }
}

/// The HTTP status in an `object_store` error text ("... status code: 503 Service ...").
fn http_status(text: &str) -> Option<u16> {
    let (_, after) = text.split_once("status code: ")?;
    after.get(..3)?.parse().ok()
}

/// At most `max` bytes of `text` (on a character boundary), for condition messages.
fn shorten(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let end = (0..=max)
        .rev()
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(0);
    format!("{}…", &text[..end])
}

/// The [`StoreError`] for a failed S3 request; `location` names the object if missing.
pub(super) fn s3_error(
    store: &str,
    what: &str,
    location: &str,
    e: &object_store::Error,
) -> StoreError {
    let message = shorten(&e.to_string(), 600);
    match classify_s3(e) {
        S3Failure::NotFound => StoreError::NotFound(location.to_owned()),
        S3Failure::Transient => StoreError::Remote {
            store: store.to_owned(),
            what: what.to_owned(),
            message,
        },
        S3Failure::Permanent(why) => StoreError::Refused {
            store: store.to_owned(),
            what: what.to_owned(),
            message: format!("{why}: {message}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generic(text: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: text.into(),
        }
    }

    #[test]
    fn s3_errors_are_sorted_by_what_fixes_them() {
        use object_store::Error as E;
        let not_found = E::NotFound {
            path: "team-a/x.dump".into(),
            source: "Server returned non-2xx status code: 404 Not Found: <Code>NoSuchKey</Code>"
                .into(),
        };
        assert_eq!(classify_s3(&not_found), S3Failure::NotFound);
        let no_bucket = E::NotFound {
            path: "team-a/x.dump".into(),
            source: "Server returned non-2xx status code: 404 Not Found: <Code>NoSuchBucket</Code>"
                .into(),
        };
        assert_eq!(
            classify_s3(&no_bucket),
            S3Failure::Permanent("the bucket does not exist")
        );
        let denied = E::PermissionDenied {
            path: "x".into(),
            source: "Server returned non-2xx status code: 403 Forbidden: <Code>AccessDenied</Code>"
                .into(),
        };
        assert_eq!(classify_s3(&denied), S3Failure::Permanent("access denied"));
        let bad_key = generic(
            "Error performing PUT http://127.0.0.1:9/b/k in 2ms - Server returned non-2xx status code: 403 Forbidden: <Code>InvalidAccessKeyId</Code>",
        );
        assert!(
            matches!(classify_s3(&bad_key), S3Failure::Permanent(why) if why.contains("credentials"))
        );
        for transient in [
            "Error performing PUT http://127.0.0.1:9/b/k in 2ms, after 3 retries - Server returned non-2xx status code: 503 Service Unavailable: <Code>SlowDown</Code>",
            "Server returned non-2xx status code: 500 Internal Server Error: ",
            "Server returned non-2xx status code: 429 Too Many Requests: ",
            "Error performing PUT http://127.0.0.1:9/b/k in 2ms - HTTP error: error sending request",
        ] {
            assert_eq!(
                classify_s3(&generic(transient)),
                S3Failure::Transient,
                "{transient}"
            );
        }
        assert_eq!(
            classify_s3(&generic(
                "Server returned non-2xx status code: 400 Bad Request: "
            )),
            S3Failure::Permanent("request refused")
        );

        let e = s3_error("s3://b/p", "writing", "s3://b/p/k", &not_found);
        assert!(
            matches!(e, StoreError::NotFound(ref at) if at == "s3://b/p/k"),
            "{e}"
        );
        let e = s3_error("s3://b/p", "writing", "s3://b/p/k", &no_bucket);
        assert!(!e.is_transient(), "{e}");
        assert!(e.to_string().contains("the bucket does not exist"), "{e}");
        let e = s3_error(
            "s3://b/p",
            "writing",
            "s3://b/p/k",
            &generic(&"x".repeat(5000)),
        );
        assert!(e.is_transient(), "{e}");
        assert!(e.to_string().len() < 1000, "messages are shortened");
    }
}
