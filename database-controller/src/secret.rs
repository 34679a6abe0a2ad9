//! The connection Secret `<name>-connection`: what applications read, and nothing else.

use std::collections::BTreeMap;

use dbops_api::access::LoginOptions;
use dbops_api::names::{OWN_KEYS_SHA256_KEY, annotation, label};
use dbops_api::{Database, DatabaseUser, SecretTemplate};
use dbops_shared::server::Resolved;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Resource;
use kube::api::ObjectMeta;

use crate::rotation::turn::Carried;
use crate::template::{self, RESERVED_KEYS, TemplateError, Values, percent_encode as encode};

/// Whose connection Secret it is: a Database's or a DatabaseUser's.
#[derive(Debug, Clone)]
pub struct Owner<'a> {
    pub kind: &'static str,
    pub name: &'a str,
    pub namespace: Option<&'a str>,
    pub uid: &'a str,
    pub owner_ref: Option<OwnerReference>,
    /// The label naming it (`dbops.dev/database` or `dbops.dev/database-user`).
    pub label: &'static str,
    pub template: &'a SecretTemplate,
    /// `spec.secretMountPath`: where the application mounts the Secret.
    pub mount_path: Option<&'a str>,
    /// The previous login to carry (`dbops.dev/previous-login`), while it works.
    pub carried: Option<String>,
}

impl<'a> Owner<'a> {
    /// The owner `object`, a `kind`, named by `label` on its Secret.
    fn of<K: Resource<DynamicType = ()>>(
        object: &'a K,
        kind: &'static str,
        label: &'static str,
        login: &'a LoginOptions,
    ) -> Self {
        let meta = object.meta();
        Self {
            kind,
            name: meta.name.as_deref().unwrap_or_default(),
            namespace: meta.namespace.as_deref(),
            uid: meta.uid.as_deref().unwrap_or_default(),
            owner_ref: object.controller_owner_ref(&()),
            label,
            template: &login.secret_template,
            mount_path: login.secret_mount_path.as_deref(),
            carried: None,
        }
    }

    pub fn database(db: &'a Database) -> Self {
        Self::of(db, "Database", label::DATABASE, &db.spec.login)
    }

    pub fn user(user: &'a DatabaseUser) -> Self {
        Self::of(user, "DatabaseUser", label::DATABASE_USER, &user.spec.login)
    }

    /// The same owner, its Secret carrying `carried` (the previous login, while it works).
    pub fn carrying(mut self, carried: Option<&Carried>) -> Self {
        self.carried = carried.map(Carried::to_annotation);
        self
    }

    pub fn secret_name(&self) -> String {
        format!("{}-connection", self.name)
    }
}

fn sha256_hex(s: &str) -> String {
    dbops_shared::checksum::sha256_hex(s.as_bytes())
}

/// The password of an existing Secret, if it is still the one this controller wrote.
pub fn kept_password(secret: &Secret) -> Option<String> {
    let password = secret.data.as_ref()?.get("password")?;
    let password = String::from_utf8(password.0.clone()).ok()?;
    let recorded = secret
        .metadata
        .annotations
        .as_ref()?
        .get(annotation::PASSWORD_SHA256)?;
    (recorded == &sha256_hex(&password) && !password.is_empty()).then_some(password)
}

/// The previous login a connection Secret carries (`dbops.dev/previous-login`), if any.
pub fn carried(secret: &Secret) -> Option<Carried> {
    let value = secret
        .metadata
        .annotations
        .as_ref()?
        .get(annotation::PREVIOUS_LOGIN)?;
    Carried::from_annotation(value)
}

/// The login a connection Secret names (`username`; the cache keeps it).
pub fn username(secret: &Secret) -> Option<String> {
    let value = secret.data.as_ref()?.get("username")?;
    String::from_utf8(value.0.clone()).ok()
}

/// Whether `secret` is the connection Secret this very Database created: its controller
/// owner reference carries the Database's UID. Anything else (a Secret someone made, or
/// one of an earlier Database of the same name that garbage collection has not removed
/// yet) is never written; the error says whose it is.
pub fn check_ours(secret: &Secret, db: &Database) -> Result<(), String> {
    check_owned(secret, &Owner::database(db))
}

/// [`check_ours`] for either kind of owner.
pub fn check_owned(secret: &Secret, owner: &Owner<'_>) -> Result<(), String> {
    let name = secret.metadata.name.as_deref().unwrap_or_default();
    let uid = owner.uid;
    let kind = owner.kind;
    let controller = secret
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true));
    match controller {
        Some(r) if r.uid == uid => Ok(()),
        Some(r) if r.kind == kind && r.name == owner.name => Err(format!(
            "Secret {name} belongs to an earlier {kind} of this name (UID {}) and waits for garbage collection; this {kind} writes its own once it is gone",
            r.uid
        )),
        Some(r) => Err(format!(
            "Secret {name} exists and is controlled by {} {}; it is left untouched and nothing is provisioned: delete or rename it, or rename this {kind}",
            r.kind, r.name
        )),
        None => Err(format!(
            "Secret {name} exists and was not created by dbops for this {kind}; it is left untouched and nothing is provisioned: delete or rename it, or rename this {kind}"
        )),
    }
}

/// The Secret as it should be: everything an application needs to connect to `server`
/// with its TLS mode, the server's CA (`ca.crt`) when it has its own. A template that
/// does not render (checked before anything is written, see `template::check`) is an
/// error. (Tests: the controller names the login, see [`desired_for`].)
#[cfg(test)]
pub fn desired(db: &Database, server: &Resolved, password: &str) -> Result<Secret, TemplateError> {
    desired_for(
        &Owner::database(db),
        &db.database_name(),
        &db.owner_role(),
        server,
        password,
    )
}

/// [`desired`] for either kind of owner: `user` logs in to `dbname`.
pub fn desired_for(
    owner: &Owner<'_>,
    dbname: &str,
    user: &str,
    server: &Resolved,
    password: &str,
) -> Result<Secret, TemplateError> {
    let key = &server.endpoint.key;
    let tls = &server.endpoint.tls;
    let ca_pem = tls
        .ca
        .as_ref()
        .map(|ca| String::from_utf8_lossy(ca.pem()).into_owned())
        .unwrap_or_default();
    let files = MountedFiles::of(owner.mount_path, server);
    let rendered = template::render(
        owner.template,
        &Values {
            host: &key.host,
            port: key.port,
            database: dbname,
            user,
            password,
            sslmode: tls.mode.as_str(),
            ca: &ca_pem,
            ca_file: files.ca.as_deref().unwrap_or_default(),
            pooler: server.pooler.as_ref().map(|p| template::PoolerValues {
                host: &p.host,
                port: p.port,
                ca: std::str::from_utf8(&p.ca_pem).unwrap_or_default(),
                ca_file: files.pooler_ca.as_deref().unwrap_or_default(),
            }),
        },
    )?;
    let data: BTreeMap<String, ByteString> = own_keys(server, dbname, user, password, &files)
        .into_iter()
        .chain(pooler_keys(server, dbname, user, password, &files))
        .map(|(k, v)| (k.to_string(), ByteString(v.into_bytes())))
        .chain(
            tls.ca
                .as_ref()
                .map(|ca| ("ca.crt".to_string(), ByteString(ca.pem().to_vec()))),
        )
        .chain(
            rendered
                .iter()
                .map(|(k, v)| (k.clone(), ByteString(v.as_bytes().to_vec()))),
        )
        .collect();
    Ok(Secret {
        metadata: metadata(owner, password, &rendered),
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Secret::default()
    })
}

/// The files of the mounted Secret that its URIs name, when the spec says where it is
/// mounted (`spec.secretMountPath`): `ca.crt` when the server has a CA of its own and
/// its TLS mode verifies (with `require` nothing is verified, as asked), `pooler-ca.crt`
/// when the server has a pooler.
#[derive(Debug, Default)]
struct MountedFiles {
    ca: Option<String>,
    pooler_ca: Option<String>,
}

impl MountedFiles {
    fn of(mount_path: Option<&str>, server: &Resolved) -> Self {
        let Some(dir) = mount_path.map(|p| p.trim_end_matches('/')) else {
            return Self::default();
        };
        let tls = &server.endpoint.tls;
        Self {
            ca: (tls.ca.is_some() && tls.mode.verifies()).then(|| format!("{dir}/ca.crt")),
            pooler_ca: server
                .pooler
                .as_ref()
                .map(|_| format!("{dir}/pooler-ca.crt")),
        }
    }
}

/// Every key of [`RESERVED_KEYS`] but `ca.crt`, with its value, and `PGSSLROOTCERT` when
/// the Secret's mount path is known: everything an application needs to connect to
/// `server` as `user` with its TLS mode.
fn own_keys(
    server: &Resolved,
    dbname: &str,
    user: &str,
    password: &str,
    files: &MountedFiles,
) -> Vec<(&'static str, String)> {
    let key = &server.endpoint.key;
    let (host, port) = (key.host.as_str(), key.port.to_string());
    let tls = &server.endpoint.tls;
    let ssl = tls.mode.as_str();
    // Verification against the system's roots must be asked for by name (libpq's default
    // root file is ~/.postgresql/root.crt); with a CA of the server's own, the
    // application points sslrootcert (PGSSLROOTCERT) at the mounted `ca.crt`.
    // With the mount path known, the URIs name the mounted `ca.crt` themselves (what
    // node-postgres and pgjdbc need: neither reads PGSSLROOTCERT).
    let roots = match &files.ca {
        Some(file) => format!("&sslrootcert={file}"),
        None if tls.mode.verifies() && tls.ca.is_none() => "&sslrootcert=system".to_string(),
        None => String::new(),
    };
    let jdbc_roots = files
        .ca
        .as_ref()
        .map(|file| format!("&sslrootcert={file}"))
        .unwrap_or_default();
    let (user_, password_, dbname_) = (encode(user), encode(password), encode(dbname));
    let uri =
        format!("postgresql://{user_}:{password_}@{host}:{port}/{dbname_}?sslmode={ssl}{roots}");
    let jdbc = format!(
        "jdbc:postgresql://{host}:{port}/{dbname_}?user={user_}&password={password_}&sslmode={ssl}{jdbc_roots}"
    );
    let mut keys = vec![
        ("host", host.to_string()),
        ("port", port.clone()),
        ("dbname", dbname.to_string()),
        ("username", user.to_string()),
        ("password", password.to_string()),
        ("uri", uri),
        ("jdbc-url", jdbc),
        ("PGHOST", host.to_string()),
        ("PGPORT", port),
        ("PGDATABASE", dbname.to_string()),
        ("PGUSER", user.to_string()),
        ("PGPASSWORD", password.to_string()),
        ("sslmode", ssl.to_string()),
        ("PGSSLMODE", ssl.to_string()),
    ];
    if let Some(file) = &files.ca {
        keys.push((template::MOUNT_KEY, file.clone()));
    }
    keys
}

/// The `pooler-*` keys when the server has a pooler: the same login through it, over TLS
/// verified against the pooler's own certificate (`pooler-ca.crt`, which
/// `sslrootcert`/`PGSSLROOTCERT` must point at: it names the Service, so `verify-full`).
fn pooler_keys(
    server: &Resolved,
    dbname: &str,
    user: &str,
    password: &str,
    files: &MountedFiles,
) -> Vec<(&'static str, String)> {
    let Some(pooler) = &server.pooler else {
        return Vec::new();
    };
    let roots = files
        .pooler_ca
        .as_ref()
        .map(|file| format!("&sslrootcert={file}"))
        .unwrap_or_default();
    let (host, port) = (pooler.host.as_str(), pooler.port);
    let (user_, password_, dbname_) = (encode(user), encode(password), encode(dbname));
    vec![
        ("pooler-host", host.to_string()),
        ("pooler-port", port.to_string()),
        (
            "pooler-uri",
            format!(
                "postgresql://{user_}:{password_}@{host}:{port}/{dbname_}?sslmode=verify-full{roots}"
            ),
        ),
        (
            "pooler-jdbc-url",
            format!(
                "jdbc:postgresql://{host}:{port}/{dbname_}?user={user_}&password={password_}&sslmode=verify-full{roots}"
            ),
        ),
        (
            "pooler-ca.crt",
            String::from_utf8_lossy(&pooler.ca_pem).into_owned(),
        ),
    ]
}

/// The Secret's name, labels, owner and annotations: the password's digest and the keys
/// rendered from the template.
fn metadata(owner: &Owner<'_>, password: &str, rendered: &BTreeMap<String, String>) -> ObjectMeta {
    let mut annotations: BTreeMap<String, String> = [(
        annotation::PASSWORD_SHA256.to_string(),
        sha256_hex(password),
    )]
    .into();
    if let Some(carried) = &owner.carried {
        annotations.insert(annotation::PREVIOUS_LOGIN.to_string(), carried.clone());
    }
    if !rendered.is_empty() {
        annotations.insert(
            annotation::TEMPLATE_KEYS.to_string(),
            rendered.keys().cloned().collect::<Vec<_>>().join(","),
        );
    }
    ObjectMeta {
        name: Some(owner.secret_name()),
        namespace: owner.namespace.map(str::to_string),
        labels: Some(
            [
                (
                    label::MANAGED_BY.0.to_string(),
                    label::MANAGED_BY.1.to_string(),
                ),
                (owner.label.to_string(), owner.name.to_string()),
            ]
            .into(),
        ),
        annotations: Some(annotations),
        owner_references: owner.owner_ref.clone().map(|r| vec![r]),
        ..ObjectMeta::default()
    }
}

/// The keys a Secret's `dbops.dev/template-keys` annotation ([`annotation::TEMPLATE_KEYS`]) names.
fn template_keys(secret: &Secret) -> Vec<String> {
    secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotation::TEMPLATE_KEYS))
        .map(|keys| {
            keys.split(',')
                .filter(|k| !k.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// SHA-256 of the values of [`RESERVED_KEYS`] and of the rendered `templated` keys (an absent
/// key counts, as absent).
fn digest(data: Option<&BTreeMap<String, ByteString>>, templated: &[String]) -> Vec<u8> {
    use dbops_shared::checksum::{Digest, Sha256};
    let mut h = Sha256::new();
    for key in RESERVED_KEYS
        .iter()
        .copied()
        .chain([template::MOUNT_KEY])
        .chain(templated.iter().map(String::as_str))
    {
        h.update(key.as_bytes());
        match data.and_then(|d| d.get(key)) {
            Some(v) => {
                h.update([1]);
                h.update((v.0.len() as u64).to_be_bytes());
                h.update(&v.0);
            }
            None => h.update([0]),
        }
    }
    h.finalize().to_vec()
}

/// What the watch cache keeps of a connection Secret's data: the password (a reconcile
/// reuses it), the username and the digest of everything this controller writes, instead of
/// twenty keys and values (the CA certificate among them). [`is_current`]
/// and [`kept_password`] take a kept Secret as well as a whole one; nothing writes a
/// kept one back.
pub fn keep_in_cache(secret: &mut Secret) {
    let Some(data) = secret.data.take() else {
        return;
    };
    let mut kept = BTreeMap::new();
    let templated = template_keys(secret);
    kept.insert(
        OWN_KEYS_SHA256_KEY.to_string(),
        ByteString(digest(Some(&data), &templated)),
    );
    // The password (a reconcile reuses it) and the login it belongs to (a DatabaseUser's
    // alternates).
    for key in ["password", "username"] {
        if let Some(value) = data.get(key) {
            kept.insert(key.to_string(), value.clone());
        }
    }
    secret.data = Some(kept);
}

/// Whether `actual` already carries everything of `desired` (other keys may be added by
/// others and are left alone).
pub fn is_current(actual: &Secret, desired: &Secret) -> bool {
    fn contains<V: PartialEq>(
        have: &Option<BTreeMap<String, V>>,
        want: &Option<BTreeMap<String, V>>,
    ) -> bool {
        let (Some(have), Some(want)) = (have, want) else {
            return want.as_ref().is_none_or(|w| w.is_empty());
        };
        want.iter().all(|(k, v)| have.get(k) == Some(v))
    }
    let owner_ok = desired
        .metadata
        .owner_references
        .iter()
        .flatten()
        .all(|want| {
            actual
                .metadata
                .owner_references
                .iter()
                .flatten()
                .any(|r| r.uid == want.uid)
        });
    // Every key of ours as desired; a CA the server no longer has does not linger (an
    // absent `ca.crt` is part of the digest).
    // The kept digest covers the template keys the actual Secret names; the desired ones
    // must be the same keys (the annotation is compared below).
    let templated = template_keys(desired);
    let actual_digest = match actual
        .data
        .as_ref()
        .and_then(|d| d.get(OWN_KEYS_SHA256_KEY))
    {
        Some(kept) => kept.0.clone(),
        None => digest(actual.data.as_ref(), &template_keys(actual)),
    };
    actual_digest == digest(desired.data.as_ref(), &templated)
        && template_keys(actual) == templated
        && contains(&actual.metadata.labels, &desired.metadata.labels)
        && contains(&actual.metadata.annotations, &desired.metadata.annotations)
        && owner_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Secret of a Database without templates (which cannot fail to render).
    fn desired(db: &Database, server: &Resolved, password: &str) -> Secret {
        super::desired(db, server, password).unwrap()
    }

    fn db() -> Database {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "Database",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "u-1"},
            "spec": {"serverRef": {"name": "pg-main"}, "owner": "orders_owner"}
        }))
        .unwrap()
    }

    fn server(mode: dbops_api::TlsMode, ca: Option<&str>) -> Resolved {
        use dbops_shared::postgres::{CaBundle, Credentials, Endpoint};
        let mut endpoint = Endpoint::new("pg.example", 5433, mode);
        endpoint.tls.ca = ca.map(|pem| CaBundle::from_pem(pem.as_bytes()).unwrap());
        Resolved {
            name: "pg-main".into(),
            endpoint,
            credentials: Credentials {
                username: "admin".into(),
                password: "admin-password".into(),
            },
            server: std::sync::Arc::new(
                serde_json::from_value(serde_json::json!({
                    "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
                    "metadata": {"name": "pg-main"},
                    "spec": {"host": "pg.example", "port": 5433, "adminSecretRef": {"name": "a"}}
                }))
                .unwrap(),
            ),
            pooler: None,
        }
    }

    /// With a pooler, the Secret gains its keys: the same login through the pooler's
    /// Service, verified against the pooler's certificate.
    #[test]
    fn a_pooled_server_adds_the_pooler_keys() {
        let db = db();
        let mut server = plain();
        let without = desired(&db, &server, "p@ss");
        assert!(!without.data.as_ref().unwrap().contains_key("pooler-uri"));
        server.pooler = Some(dbops_shared::pooler::Access {
            host: "dbops-pooler-pg-main.dbops-system.svc".into(),
            port: 6432,
            ca_pem: b"-----BEGIN CERTIFICATE-----".to_vec(),
        });
        let with = desired(&db, &server, "p@ss");
        let get = |k: &str| String::from_utf8(with.data.as_ref().unwrap()[k].0.clone()).unwrap();
        assert_eq!(get("pooler-host"), "dbops-pooler-pg-main.dbops-system.svc");
        assert_eq!(get("pooler-port"), "6432");
        assert_eq!(
            get("pooler-uri"),
            format!(
                "postgresql://{}:p%40ss@dbops-pooler-pg-main.dbops-system.svc:6432/{}?sslmode=verify-full",
                db.owner_role(),
                db.database_name()
            )
        );
        assert!(get("pooler-jdbc-url").starts_with("jdbc:postgresql://dbops-pooler-pg-main"));
        assert_eq!(get("pooler-ca.crt"), "-----BEGIN CERTIFICATE-----");
        // The cache's digest sees them: a Secret without them is not current.
        let mut cached = without.clone();
        keep_in_cache(&mut cached);
        assert!(!is_current(&cached, &with));
    }

    fn plain() -> Resolved {
        server(dbops_api::TlsMode::Disable, None)
    }

    /// A CA of the server's own (PEM), and the Secret desired with it and verify-ca.
    fn own_ca() -> (String, Secret) {
        let ca = rcgen::generate_simple_self_signed(vec!["pg.example".to_string()])
            .unwrap()
            .cert
            .pem();
        let secret = desired(
            &db(),
            &server(dbops_api::TlsMode::VerifyCa, Some(&ca)),
            "pw",
        );
        (ca, secret)
    }

    /// `secret` with `key` set to `value`.
    fn with(secret: &Secret, key: &str, value: &[u8]) -> Secret {
        let mut changed = secret.clone();
        changed
            .data
            .as_mut()
            .unwrap()
            .insert(key.into(), ByteString(value.to_vec()));
        changed
    }

    #[test]
    fn the_tls_mode_and_the_servers_ca_reach_the_application() {
        let get = |s: &Secret, k: &str| {
            s.data
                .as_ref()
                .unwrap()
                .get(k)
                .map(|v| String::from_utf8(v.0.clone()).unwrap())
        };
        // verify-full with the system's roots: the URI asks libpq for them by name.
        let system = desired(&db(), &server(dbops_api::TlsMode::VerifyFull, None), "pw");
        assert_eq!(
            get(&system, "uri").unwrap(),
            "postgresql://orders_owner:pw@pg.example:5433/orders?sslmode=verify-full&sslrootcert=system"
        );
        assert_eq!(get(&system, "PGSSLMODE").unwrap(), "verify-full");
        assert_eq!(get(&system, "ca.crt"), None);
        // A CA of the server's own travels as ca.crt.
        let (ca, own) = own_ca();
        assert_eq!(get(&own, "ca.crt").unwrap(), ca);
        assert!(get(&own, "uri").unwrap().ends_with("?sslmode=verify-ca"));
        assert!(
            get(&own, "jdbc-url")
                .unwrap()
                .ends_with("&sslmode=verify-ca")
        );
        // The server losing its CA makes the Secret stale.
        assert!(!is_current(&own, &system));
        assert!(is_current(&own, &own));
    }

    /// `spec.secretMountPath` makes the Secret usable as it is by drivers that read no
    /// PGSSLROOTCERT: the URIs name the mounted `ca.crt` (and `pooler-ca.crt`), and
    /// `PGSSLROOTCERT` is there for libpq and pgx. Only with a CA of the server's own and
    /// a mode that verifies; setting or changing the path makes the Secret stale.
    #[test]
    fn a_mount_path_puts_the_mounted_ca_in_the_uris() {
        let get = |s: &Secret, k: &str| {
            s.data
                .as_ref()
                .unwrap()
                .get(k)
                .map(|v| String::from_utf8(v.0.clone()).unwrap())
        };
        let ca = rcgen::generate_simple_self_signed(vec!["pg.example".to_string()])
            .unwrap()
            .cert
            .pem();
        let mut mounted = db();
        mounted.spec.login.secret_mount_path = Some("/etc/dbops/orders".into());
        let mut server = server(dbops_api::TlsMode::VerifyFull, Some(&ca));
        server.pooler = Some(dbops_shared::pooler::Access {
            host: "dbops-pooler-pg-main.dbops-system.svc".into(),
            port: 6432,
            ca_pem: b"-----BEGIN CERTIFICATE-----".to_vec(),
        });
        let secret = desired(&mounted, &server, "pw");
        assert_eq!(
            get(&secret, "uri").unwrap(),
            "postgresql://orders_owner:pw@pg.example:5433/orders?sslmode=verify-full&sslrootcert=/etc/dbops/orders/ca.crt"
        );
        assert!(
            get(&secret, "jdbc-url")
                .unwrap()
                .ends_with("&sslmode=verify-full&sslrootcert=/etc/dbops/orders/ca.crt")
        );
        assert_eq!(
            get(&secret, "PGSSLROOTCERT").unwrap(),
            "/etc/dbops/orders/ca.crt"
        );
        assert!(
            get(&secret, "pooler-uri")
                .unwrap()
                .ends_with("?sslmode=verify-full&sslrootcert=/etc/dbops/orders/pooler-ca.crt")
        );
        assert!(
            get(&secret, "pooler-jdbc-url")
                .unwrap()
                .ends_with("&sslrootcert=/etc/dbops/orders/pooler-ca.crt")
        );
        // Without the path: as before, nothing names a file.
        let unmounted = desired(&db(), &server, "pw");
        assert!(
            get(&unmounted, "uri")
                .unwrap()
                .ends_with("?sslmode=verify-full")
        );
        assert_eq!(get(&unmounted, "PGSSLROOTCERT"), None);
        let mut cached = unmounted.clone();
        keep_in_cache(&mut cached);
        assert!(
            !is_current(&cached, &secret),
            "setting the path rewrites it"
        );
        let mut cached = secret.clone();
        keep_in_cache(&mut cached);
        assert!(is_current(&cached, &secret));
        assert!(!is_current(&cached, &unmounted), "removing it too");
        // With the system's roots or with `require`, no file: nothing to name.
        for (mode, ca) in [
            (dbops_api::TlsMode::VerifyFull, None),
            (dbops_api::TlsMode::Require, Some(ca.as_str())),
        ] {
            let secret = desired(&mounted, &super::tests::server(mode, ca), "pw");
            assert_eq!(get(&secret, "PGSSLROOTCERT"), None, "{mode:?}");
            assert!(
                !get(&secret, "uri").unwrap().contains("/etc/dbops"),
                "{mode:?}"
            );
        }
    }

    #[test]
    fn the_cache_keeps_the_password_and_a_digest_and_judges_alike() {
        let (_, with_ca) = own_ca();
        // Every key written is one the digest covers.
        for key in with_ca.data.as_ref().unwrap().keys() {
            assert!(
                RESERVED_KEYS.contains(&key.as_str()),
                "{key} not in RESERVED_KEYS"
            );
        }
        let other_pw = desired(&db(), &plain(), "other");
        let plain = desired(&db(), &plain(), "pw");
        let extra = with(&plain, "extra", b"x");
        let edited = with(&plain, "PGPORT", b"1");
        let mut dropped = plain.clone();
        dropped.data.as_mut().unwrap().remove("uri");
        for actual in [&plain, &with_ca, &other_pw, &extra, &edited, &dropped] {
            let mut kept = actual.clone();
            keep_in_cache(&mut kept);
            assert_eq!(
                kept.data.as_ref().unwrap().len(),
                3,
                "password, username and digest only"
            );
            assert_eq!(kept_password(&kept), kept_password(actual));
            for want in [&plain, &with_ca, &other_pw] {
                assert_eq!(
                    is_current(&kept, want),
                    is_current(actual, want),
                    "kept and whole copies disagree"
                );
            }
        }
        assert!(is_current(&extra, &plain) && !is_current(&edited, &plain));
        assert!(!is_current(&dropped, &plain) && !is_current(&with_ca, &plain));
    }

    #[test]
    fn the_secret_has_every_key_and_a_working_uri() {
        let s = desired(&db(), &plain(), "p@ss/word");
        let data = s.data.as_ref().unwrap();
        let get = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
        // Every key of the controller's own; `ca.crt` only from a server with a CA, the
        // `pooler-*` keys only from one with a pooler.
        for key in RESERVED_KEYS
            .iter()
            .filter(|k| **k != "ca.crt" && !k.starts_with("pooler-"))
        {
            assert!(data.contains_key(*key), "missing {key}");
        }
        assert!(!data.contains_key("ca.crt"));
        assert_eq!(get("dbname"), "orders");
        assert_eq!(get("username"), "orders_owner");
        assert_eq!(
            get("uri"),
            "postgresql://orders_owner:p%40ss%2Fword@pg.example:5433/orders?sslmode=disable"
        );
        assert_eq!(s.metadata.name.as_deref(), Some("orders-connection"));
        assert_eq!(s.metadata.owner_references.as_ref().unwrap()[0].uid, "u-1");
    }

    #[test]
    fn only_a_secret_this_database_controls_is_ours() {
        let db = db();
        assert!(check_ours(&desired(&db, &plain(), "pw"), &db).is_ok());
        let mut foreign = desired(&db, &plain(), "pw");
        foreign.metadata.owner_references = None;
        let why = check_ours(&foreign, &db).unwrap_err();
        assert!(why.contains("not created by dbops"), "{why}");
        let mut earlier = desired(&db, &plain(), "pw");
        if let Some(refs) = earlier.metadata.owner_references.as_mut() {
            refs[0].uid = "u-0".into();
        }
        let why = check_ours(&earlier, &db).unwrap_err();
        assert!(why.contains("earlier Database"), "{why}");
        let mut other = desired(&db, &plain(), "pw");
        if let Some(refs) = other.metadata.owner_references.as_mut() {
            refs[0].kind = "Deployment".into();
            refs[0].uid = "u-9".into();
        }
        let why = check_ours(&other, &db).unwrap_err();
        assert!(why.contains("Deployment"), "{why}");
    }

    #[test]
    fn an_edited_password_is_not_kept() {
        let mut s = desired(&db(), &plain(), "original");
        assert_eq!(kept_password(&s).as_deref(), Some("original"));
        s.data
            .as_mut()
            .unwrap()
            .insert("password".into(), ByteString(b"edited".to_vec()));
        assert_eq!(kept_password(&s), None);
    }

    #[test]
    fn extra_keys_do_not_make_a_secret_stale_but_a_changed_one_does() {
        let want = desired(&db(), &plain(), "pw");
        let mut have = want.clone();
        have.data
            .as_mut()
            .unwrap()
            .insert("extra".into(), ByteString(b"x".to_vec()));
        assert!(is_current(&have, &want));
        have.data
            .as_mut()
            .unwrap()
            .insert("host".into(), ByteString(b"elsewhere".to_vec()));
        assert!(!is_current(&have, &want));
    }
}
