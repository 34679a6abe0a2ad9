//! A real Kubernetes control plane on loopback: etcd, kube-apiserver (RBAC, client
//! certificates from a CA made here, service-account signing keys, an audit log of every
//! write) and kube-controller-manager (garbage collector, namespace and service-account
//! controllers), each a [`Supervised`] child in one directory.
//!
//! Tests tell who wrote what through the audit log: [`ControlPlane::kubeconfig_for`] mints
//! a client certificate for a user name of the test's choosing, and
//! [`ControlPlane::audit_writes`] lists the writes that user made. To run a controller
//! with exactly the permissions it has in a cluster, apply its ServiceAccount and RBAC
//! from `deploy/` and use [`ControlPlane::kubeconfig_for_service_account`] (a token from
//! the TokenRequest API; the audit log names it [`service_account_user`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use serde::Deserialize;

use crate::paths;
use crate::process::{Spec, Supervised, free_port};

/// Ports and directory of a control plane.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where certificates, etcd data, logs and the kubeconfig go.
    pub dir: PathBuf,
    pub apiserver_port: Option<u16>,
}

/// A running control plane; every process stops when it is dropped.
#[derive(Debug)]
pub struct ControlPlane {
    dir: PathBuf,
    kubeconfig: PathBuf,
    server: String,
    pki: Pki,
    /// Numbers the kubeconfigs [`ControlPlane::kubeconfig_for`] writes, so that two tests
    /// minting the same user never overwrite files the other is reading.
    minted: AtomicU64,
    /// How kube-apiserver and kube-controller-manager were started, to start them again
    /// ([`ControlPlane::stop_apiserver`], [`ControlPlane::start_apiserver`]).
    apiserver_spec: Spec,
    controller_manager_spec: Option<Spec>,
    // Dropped in reverse order of start: controller-manager, apiserver, etcd.
    controller_manager: Option<Supervised>,
    apiserver: Option<Supervised>,
    etcd: Option<Supervised>,
}

/// The issuer and key that sign client certificates (kept so tests can mint users).
struct Pki {
    ca_key: KeyPair,
    ca_params: CertificateParams,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pki { .. }")
    }
}

/// What kube-apiserver audits: the metadata (who, verb, resource, name, response code) of
/// every write, once the response is complete; nothing about reads.
const AUDIT_POLICY: &str = "\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
";

/// One write request to the API server, from the audit log.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditWrite {
    /// create, update, patch, delete or deletecollection.
    pub verb: String,
    /// The resource (plural, e.g. `secrets`, `databases`, `events`).
    pub resource: String,
    /// `status` for a status write, empty for the object itself.
    pub subresource: String,
    /// The object's name; may be empty for a create (the name is in the body).
    pub name: String,
    pub namespace: String,
    /// The HTTP status code of the response (a refused write is still a write attempt).
    pub code: i32,
    /// When the response was complete (stage ResponseComplete).
    pub timestamp: Timestamp,
    /// When the apiserver received the request.
    pub received: Timestamp,
}

impl std::fmt::Display for AuditWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.timestamp, self.verb, self.resource)?;
        if !self.subresource.is_empty() {
            write!(f, "/{}", self.subresource)?;
        }
        write!(f, " {}/{} -> {}", self.namespace, self.name, self.code)
    }
}

/// The fields of an audit.k8s.io/v1 Event this harness reads.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AuditEvent {
    stage: String,
    verb: String,
    user: AuditUser,
    #[serde(default)]
    object_ref: Option<AuditObjectRef>,
    #[serde(default)]
    response_status: Option<AuditResponseStatus>,
    stage_timestamp: MicroTime,
    request_received_timestamp: MicroTime,
}

#[derive(Deserialize)]
struct AuditUser {
    #[serde(default)]
    username: String,
}

#[derive(Deserialize)]
struct AuditObjectRef {
    #[serde(default)]
    resource: String,
    #[serde(default)]
    subresource: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
}

#[derive(Deserialize)]
struct AuditResponseStatus {
    #[serde(default)]
    code: i32,
}

const SA_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

impl ControlPlane {
    /// Starts etcd, kube-apiserver and kube-controller-manager in `opts.dir`, waits until
    /// `/readyz` answers, writes `<dir>/kubeconfig` and installs the dbops CRDs.
    pub async fn start(opts: Options) -> Result<Self> {
        let started = Instant::now();
        let bin = paths::controlplane_bin_dir()?;
        let dir = opts.dir.clone();
        let pki_dir = dir.join("pki");
        let log_dir = dir.join("logs");
        std::fs::create_dir_all(&pki_dir)?;
        std::fs::create_dir_all(&log_dir)?;

        let pki = write_pki(&pki_dir)?;
        let audit_policy = dir.join("audit-policy.yaml");
        std::fs::write(&audit_policy, AUDIT_POLICY)
            .with_context(|| format!("writing {}", audit_policy.display()))?;

        let etcd_port = free_port()?;
        let etcd_peer_port = free_port()?;
        let api_port = match opts.apiserver_port {
            Some(p) => p,
            None => free_port()?,
        };
        let server = format!("https://127.0.0.1:{api_port}");

        let etcd = Supervised::start(
            &Spec::new("etcd", bin.join("etcd")).args([
                "--name=dbops".to_string(),
                format!("--data-dir={}", dir.join("etcd").display()),
                format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"),
                format!("--advertise-client-urls=http://127.0.0.1:{etcd_port}"),
                format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer_port}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer_port}"),
                format!("--initial-cluster=dbops=http://127.0.0.1:{etcd_peer_port}"),
                "--listen-metrics-urls=".to_string(),
                "--log-level=warn".to_string(),
                // A throwaway store: durability across power loss is not needed here.
                "--unsafe-no-fsync".to_string(),
            ]),
            &log_dir,
        )?;

        let p = |f: &str| pki_dir.join(f).display().to_string();
        let apiserver_spec = Spec::new("kube-apiserver", bin.join("kube-apiserver")).args([
            format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
            "--bind-address=127.0.0.1".to_string(),
            "--advertise-address=127.0.0.1".to_string(),
            format!("--secure-port={api_port}"),
            format!("--cert-dir={}", p("serving")),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            "--authorization-mode=RBAC".to_string(),
            format!("--service-account-issuer={SA_ISSUER}"),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-cluster-ip-range=10.96.0.0/24".to_string(),
            // The only endpoint would be a loopback address, which the endpoints
            // reconciler refuses; nothing here routes to the apiserver by Service.
            "--endpoint-reconciler-type=none".to_string(),
            "--allow-privileged=false".to_string(),
            format!("--audit-policy-file={}", audit_policy.display()),
            format!("--audit-log-path={}", dir.join("audit.log").display()),
            "--audit-log-format=json".to_string(),
            // Each event is written before the request returns (the default, stated).
            "--audit-log-mode=blocking".to_string(),
            "--v=1".to_string(),
        ]);
        let apiserver = Supervised::start(&apiserver_spec, &log_dir)?;

        let kubeconfig = dir.join("kubeconfig");
        write_kubeconfig(
            &kubeconfig,
            &server,
            &pki_dir.join("ca.crt"),
            &pki_dir.join("admin.crt"),
            &pki_dir.join("admin.key"),
            "dbops-admin",
        )?;

        let mut cp = Self {
            dir: dir.clone(),
            kubeconfig,
            server,
            pki,
            minted: AtomicU64::new(0),
            apiserver_spec,
            controller_manager_spec: None,
            controller_manager: None,
            apiserver: Some(apiserver),
            etcd: Some(etcd),
        };
        cp.wait_ready(Duration::from_secs(90)).await?;

        let controller_manager_spec = Spec::new(
            "kube-controller-manager",
            bin.join("kube-controller-manager"),
        )
        .args([
            format!("--kubeconfig={}", cp.kubeconfig.display()),
            "--controllers=garbagecollector,namespace,serviceaccount,serviceaccount-token"
                .to_string(),
            format!("--service-account-private-key-file={}", p("sa.key")),
            format!("--root-ca-file={}", p("ca.crt")),
            "--use-service-account-credentials=false".to_string(),
            "--leader-elect=false".to_string(),
            "--secure-port=0".to_string(),
            "--v=1".to_string(),
        ]);
        cp.controller_manager = Some(Supervised::start(&controller_manager_spec, &log_dir)?);
        cp.controller_manager_spec = Some(controller_manager_spec);

        cp.install_crds().await?;
        tracing::info!(
            server = %cp.server,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "control plane ready"
        );
        Ok(cp)
    }

    /// The kubeconfig of the `system:masters` admin user.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    pub fn server(&self) -> &str {
        &self.server
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A new admin client. Make one per test: a client belongs to the runtime it was
    /// made on.
    pub async fn client(&self) -> Result<Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// Writes a kubeconfig for a new client certificate with common name `user` and
    /// organizations `groups` (at most two), signed by this control plane's CA, so that
    /// a process using it appears in the audit log as `user`. RBAC applies as usual:
    /// pass `&["system:masters"]` for a user allowed everything.
    pub fn kubeconfig_for(&self, user: &str, groups: &[&str]) -> Result<PathBuf> {
        let n = self.minted.fetch_add(1, Ordering::Relaxed);
        let file_stem: String = user
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let dir = self.dir.join("users").join(format!("{file_stem}-{n}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let (cert, key) = self
            .pki
            .issue_client(user, groups)
            .with_context(|| format!("issuing a client certificate for {user}"))?;
        let (cert_path, key_path) = (dir.join("client.crt"), dir.join("client.key"));
        write_secret(&cert_path, &cert)?;
        write_secret(&key_path, &key)?;
        let kubeconfig = dir.join("kubeconfig");
        write_kubeconfig(
            &kubeconfig,
            &self.server,
            &self.dir.join("pki").join("ca.crt"),
            &cert_path,
            &key_path,
            user,
        )?;
        Ok(kubeconfig)
    }

    /// Writes a kubeconfig holding a token of ServiceAccount `namespace/name`, minted by the
    /// TokenRequest API (valid for `valid_for`, at least 10 minutes by the apiserver's
    /// rules), so that a process using it has exactly that ServiceAccount's RBAC, as it
    /// would in a pod. The audit log names it `system:serviceaccount:<namespace>:<name>`
    /// ([`service_account_user`]). The ServiceAccount must exist.
    pub async fn kubeconfig_for_service_account(
        &self,
        namespace: &str,
        name: &str,
        valid_for: Duration,
    ) -> Result<PathBuf> {
        let client = self.client().await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(client, namespace);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                expiration_seconds: Some(i64::try_from(valid_for.as_secs())?),
                ..TokenRequestSpec::default()
            },
            ..TokenRequest::default()
        };
        let minted = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .with_context(|| format!("requesting a token for ServiceAccount {namespace}/{name}"))?;
        let token = minted
            .status
            .map(|s| s.token)
            .filter(|t| !t.is_empty())
            .with_context(|| {
                format!("the TokenRequest for {namespace}/{name} returned no token")
            })?;
        let n = self.minted.fetch_add(1, Ordering::Relaxed);
        let dir = self
            .dir
            .join("users")
            .join(format!("sa-{namespace}-{name}-{n}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let kubeconfig = dir.join("kubeconfig");
        write_token_kubeconfig(
            &kubeconfig,
            &self.server,
            &self.dir.join("pki").join("ca.crt"),
            &token,
        )?;
        Ok(kubeconfig)
    }

    /// The audit log kube-apiserver writes (JSON lines, writes only).
    pub fn audit_log_path(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    /// Every write request `user` made so far (completed responses, oldest first), only
    /// those to objects in `namespace` when it is given. Count them before and after a
    /// window to see what a process wrote in between.
    pub fn audit_writes(&self, user: &str, namespace: Option<&str>) -> Result<Vec<AuditWrite>> {
        let path = self.audit_log_path();
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        // The apiserver may be writing the last line right now: only whole lines count.
        let complete = match text.rfind('\n') {
            Some(end) => &text[..end],
            None => "",
        };
        // Parsing every line is slow on a long log; most lines are other users'.
        let quoted_user = serde_json::to_string(user)?;
        let mut writes = Vec::new();
        for (i, line) in complete.lines().enumerate() {
            if line.is_empty() || !line.contains(&quoted_user) {
                continue;
            }
            let event: AuditEvent = serde_json::from_str(line).with_context(|| {
                format!("{} line {}: not an audit event", path.display(), i + 1)
            })?;
            if event.stage != "ResponseComplete" || event.user.username != user {
                continue;
            }
            let object = event.object_ref.unwrap_or(AuditObjectRef {
                resource: String::new(),
                subresource: String::new(),
                name: String::new(),
                namespace: String::new(),
            });
            if namespace.is_some_and(|ns| ns != object.namespace) {
                continue;
            }
            writes.push(AuditWrite {
                verb: event.verb,
                resource: object.resource,
                subresource: object.subresource,
                name: object.name,
                namespace: object.namespace,
                code: event.response_status.map_or(0, |s| s.code),
                timestamp: event.stage_timestamp.0,
                received: event.request_received_timestamp.0,
            });
        }
        Ok(writes)
    }

    /// Logs of etcd, kube-apiserver and kube-controller-manager, for failure reports.
    pub fn log_tails(&self, max_bytes: u64) -> String {
        [&self.etcd, &self.apiserver, &self.controller_manager]
            .into_iter()
            .flatten()
            .map(|p| format!("==> {} <==\n{}\n", p.name(), p.log_tail(max_bytes)))
            .collect()
    }

    /// Stops kube-apiserver: `signal` `TERM` is its graceful shutdown (SIGKILL after the
    /// grace period), `KILL` a crash. etcd and its data stay; clients see connection
    /// errors until [`ControlPlane::start_apiserver`]. Nothing happens when it is stopped.
    pub fn stop_apiserver(&mut self, signal: &str) -> Result<()> {
        if let Some(mut apiserver) = self.apiserver.take() {
            if signal != "TERM" {
                // It may have exited already; stop() below waits either way.
                let _ = apiserver.signal(signal);
            }
            apiserver.stop()?;
        }
        Ok(())
    }

    /// Starts kube-apiserver again after [`ControlPlane::stop_apiserver`] with the same
    /// port, certificates, etcd and audit log (appended to), and waits until `/readyz`
    /// answers; kube-controller-manager is started again too if it exited meanwhile.
    /// Nothing is started when it runs.
    pub async fn start_apiserver(&mut self, timeout: Duration) -> Result<()> {
        let log_dir = self.dir.join("logs");
        if self.apiserver.is_none() {
            self.apiserver = Some(Supervised::start(&self.apiserver_spec, &log_dir)?);
        }
        self.wait_ready(timeout).await?;
        let exited = match self.controller_manager.as_mut() {
            Some(cm) => cm.try_exit()?.is_some(),
            None => false,
        };
        if exited && let Some(spec) = &self.controller_manager_spec {
            self.controller_manager = Some(Supervised::start(spec, &log_dir)?);
        }
        Ok(())
    }

    /// [`ControlPlane::stop_apiserver`] with `signal`, `down_for`, then
    /// [`ControlPlane::start_apiserver`].
    pub async fn restart_apiserver(&mut self, signal: &str, down_for: Duration) -> Result<()> {
        self.stop_apiserver(signal)?;
        tokio::time::sleep(down_for).await;
        self.start_apiserver(Duration::from_secs(90)).await
    }

    async fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            for proc in [&mut self.etcd, &mut self.apiserver].into_iter().flatten() {
                if let Some(status) = proc.try_exit()? {
                    bail!(
                        "{} exited ({status}) while starting:\n{}",
                        proc.name(),
                        proc.log_tail(4000)
                    );
                }
            }
            let last_err = match self.readyz().await {
                Ok(()) => return Ok(()),
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver not ready after {timeout:?}: {last_err}\n{}",
                    self.log_tails(3000)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn readyz(&self) -> Result<()> {
        let client = self.client().await?;
        let req = http::Request::get("/readyz").body(Vec::new())?;
        let body = client.request_text(req).await?;
        if body.trim() == "ok" {
            Ok(())
        } else {
            bail!("/readyz: {body}")
        }
    }

    /// Applies every dbops CRD (server-side apply) and waits until each is Established.
    pub async fn install_crds(&self) -> Result<()> {
        let client = self.client().await?;
        let api: Api<CustomResourceDefinition> = Api::all(client);
        let params = PatchParams::apply("dbops-e2e").force();
        for crd in dbops_api::crds() {
            let name = crd.metadata.name.clone().unwrap_or_default();
            api.patch(&name, &params, &Patch::Apply(&crd))
                .await
                .with_context(|| format!("applying CRD {name}"))?;
            tokio::time::timeout(
                Duration::from_secs(30),
                await_condition(api.clone(), &name, conditions::is_crd_established()),
            )
            .await
            .with_context(|| format!("CRD {name} not established within 30s"))??;
        }
        Ok(())
    }
}

/// A kube client from a kubeconfig file.
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client> {
    let kubeconfig = Kubeconfig::read_from(path)
        .with_context(|| format!("reading kubeconfig {}", path.display()))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// The user name the apiserver gives a ServiceAccount's tokens (audit log, RBAC).
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

/// Writes a kubeconfig that refers to certificate files by path.
pub fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca: &Path,
    cert: &Path,
    key: &Path,
    user: &str,
) -> Result<()> {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: dbops\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    client-certificate: {cert}\n    client-key: {key}\ncontexts:\n- name: dbops\n  context:\n    cluster: dbops\n    user: {user}\n    namespace: default\ncurrent-context: dbops\n",
        ca = ca.display(),
        cert = cert.display(),
        key = key.display(),
    );
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Writes a token kubeconfig (for ServiceAccount tokens from the TokenRequest API).
pub fn write_token_kubeconfig(path: &Path, server: &str, ca: &Path, token: &str) -> Result<()> {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: dbops\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: token\n  user:\n    token: {token}\ncontexts:\n- name: dbops\n  context:\n    cluster: dbops\n    user: token\ncurrent-context: dbops\n",
        ca = ca.display(),
    );
    // Created owner-only: the token is a credential from its first byte on disk.
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    restrict(path)
}

fn restrict(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(())
}

/// CA, apiserver serving certificate, admin client certificate, service-account key;
/// returns the CA to sign more client certificates with.
fn write_pki(dir: &Path) -> Result<Pki> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.distinguished_name = dn("dbops-e2e-ca", None);
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let pki = Pki { ca_key, ca_params };

    write_secret(&dir.join("ca.crt"), &ca_cert.pem())?;
    write_secret(&dir.join("ca.key"), &pki.ca_key.serialize_pem())?;

    let (cert, key) = pki.issue(
        "kube-apiserver",
        None,
        vec![
            SanType::IpAddress([127, 0, 0, 1].into()),
            SanType::DnsName("localhost".try_into()?),
            SanType::DnsName("kubernetes.default.svc".try_into()?),
        ],
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    write_secret(&dir.join("apiserver.crt"), &cert)?;
    write_secret(&dir.join("apiserver.key"), &key)?;

    let (cert, key) = pki.issue(
        "dbops-admin",
        Some("system:masters"),
        Vec::new(),
        ExtendedKeyUsagePurpose::ClientAuth,
    )?;
    write_secret(&dir.join("admin.crt"), &cert)?;
    write_secret(&dir.join("admin.key"), &key)?;

    let sa_key = KeyPair::generate()?;
    write_secret(&dir.join("sa.key"), &sa_key.serialize_pem())?;
    write_secret(&dir.join("sa.pub"), &sa_key.public_key_pem())?;
    Ok(pki)
}

impl Pki {
    /// A client certificate for `user` in `groups` (the organizations of the subject).
    fn issue_client(&self, user: &str, groups: &[&str]) -> Result<(String, String)> {
        let mut dn = dn(user, None);
        match groups {
            [] => {}
            [one] => dn.push(DnType::OrganizationName, *one),
            // rcgen keeps one value per attribute type; a second O goes in under its OID
            // as a custom type, which Go's x509 still reads as an Organization.
            [one, two] => {
                dn.push(DnType::OrganizationName, *one);
                dn.push(DnType::CustomDnType(vec![2, 5, 4, 10]), *two);
            }
            _ => bail!("at most two groups per client certificate, got {groups:?}"),
        }
        self.sign(dn, Vec::new(), ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn issue(
        &self,
        cn: &str,
        org: Option<&str>,
        sans: Vec<SanType>,
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<(String, String)> {
        self.sign(dn(cn, org), sans, usage)
    }

    fn sign(
        &self,
        subject: DistinguishedName,
        sans: Vec<SanType>,
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<(String, String)> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = subject;
        params.subject_alt_names = sans;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![usage];
        let issuer = Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

fn dn(cn: &str, org: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    if let Some(org) = org {
        dn.push(DnType::OrganizationName, org);
    }
    dn
}

fn write_secret(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))?;
    restrict(path)
}
