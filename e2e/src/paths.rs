//! Where the test bed finds its programs.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

/// The repository root (the workspace that holds this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The cache outside the repository where `e2e/install` puts Go-built binaries.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("DBOPS_CACHE") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    base.join("dbops")
}

/// `path` when it is a file: a program `e2e/install` puts into the cache (`how` it does,
/// for the error that says to run it).
pub fn installed(path: PathBuf, how: &str) -> Result<PathBuf> {
    if !path.is_file() {
        bail!("{} is missing: run e2e/install (it {how})", path.display());
    }
    Ok(path)
}

fn go_mod_version(module: &str) -> Result<String> {
    go_mod_version_in("controlplane", module)
}

/// The version of `module` required in `e2e/<dir>/go.mod`.
fn go_mod_version_in(dir: &str, module: &str) -> Result<String> {
    let go_mod = repo_root().join("e2e").join(dir).join("go.mod");
    let text = std::fs::read_to_string(&go_mod)
        .with_context(|| format!("reading {}", go_mod.display()))?;
    text.lines()
        .map(str::split_whitespace)
        .find_map(
            |mut words| match (words.next(), words.next(), words.next()) {
                // `<module> <version>` in a require block, or `require <module> <version>`.
                (Some(m), Some(v), _) if m == module => Some(v.to_string()),
                (Some("require"), Some(m), Some(v)) if m == module => Some(v.to_string()),
                _ => None,
            },
        )
        .with_context(|| format!("{module} is not required in {}", go_mod.display()))
}

/// Prometheus's promtool, built by e2e/install from the module pinned in
/// `e2e/promtool/go.mod` into `<cache>/promtool-<version>/promtool`.
pub fn promtool() -> Result<PathBuf> {
    let version = go_mod_version_in("promtool", "github.com/prometheus/prometheus")?;
    let path = cache_dir()
        .join(format!("promtool-{version}"))
        .join("promtool");
    installed(path, "builds promtool from Go modules")
}

/// A Go-built tool of `e2e/install` (e2e/install.d/helm-kubeconform.sh): the module
/// `module` pinned in `e2e/<dir>/go.mod`, built into `<cache>/<name>-<version>/<name>`.
fn go_tool(name: &str, dir: &str, module: &str) -> Result<PathBuf> {
    let version = go_mod_version_in(dir, module)?;
    let path = cache_dir().join(format!("{name}-{version}")).join(name);
    installed(path, &format!("builds {name} from Go modules"))
}

/// Helm 3, pinned in `e2e/helm/go.mod`.
pub fn helm() -> Result<PathBuf> {
    go_tool("helm", "helm", "helm.sh/helm/v3")
}

/// kubeconform, pinned in `e2e/kubeconform/go.mod`.
pub fn kubeconform() -> Result<PathBuf> {
    go_tool("kubeconform", "kubeconform", "github.com/yannh/kubeconform")
}

/// The version of `driver` pinned in `e2e/drivers/versions`.
fn driver_version(driver: &str) -> Result<String> {
    let file = repo_root().join("e2e/drivers/versions");
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    text.lines()
        .map(str::split_whitespace)
        .find_map(|mut words| match (words.next(), words.next()) {
            (Some(name), Some(version)) if name == driver => Some(version.to_string()),
            _ => None,
        })
        .with_context(|| format!("{driver} is not pinned in {}", file.display()))
}

/// The drivers applications use, as e2e/install (install.d/drivers.sh) installs them.
#[derive(Debug, Clone)]
pub struct Drivers {
    /// The Python of a venv holding psycopg 3.
    pub python: PathBuf,
    /// A directory holding `node_modules/pg` (node-postgres).
    pub node_modules: PathBuf,
    /// pgjdbc's jar.
    pub pgjdbc_jar: PathBuf,
    /// e2e/drivers/pgx built against the pinned pgx.
    pub pgx_connect: PathBuf,
}

/// Where e2e/install put the drivers.
pub fn drivers() -> Result<Drivers> {
    let how = "installs the drivers of e2e/drivers/versions";
    let cache = cache_dir();
    let psycopg = cache.join(format!("psycopg-{}", driver_version("psycopg")?));
    installed(psycopg.join("installed"), how)?;
    let node = cache.join(format!(
        "node-postgres-{}",
        driver_version("node-postgres")?
    ));
    installed(node.join("node_modules/pg/package.json"), how)?;
    let jdbc = driver_version("pgjdbc")?;
    Ok(Drivers {
        python: psycopg.join("venv/bin/python"),
        node_modules: node.join("node_modules"),
        pgjdbc_jar: installed(
            cache
                .join(format!("pgjdbc-{jdbc}"))
                .join(format!("postgresql-{jdbc}.jar")),
            how,
        )?,
        pgx_connect: go_tool("pgx-connect", "drivers/pgx", "github.com/jackc/pgx/v5")?,
    })
}

/// The Kubernetes release the test bed builds, e.g. `v1.33.13`.
pub fn kubernetes_version() -> Result<String> {
    go_mod_version("k8s.io/kubernetes")
}

/// The directory holding kube-apiserver, kube-controller-manager and etcd.
pub fn controlplane_bin_dir() -> Result<PathBuf> {
    let dir = cache_dir().join(format!(
        "controlplane-{}-etcd-{}",
        kubernetes_version()?,
        go_mod_version("go.etcd.io/etcd/server/v3")?
    ));
    for bin in ["kube-apiserver", "kube-controller-manager", "etcd"] {
        installed(dir.join(bin), "builds the control plane from Go modules")?;
    }
    Ok(dir)
}

/// The PostgreSQL server programs (initdb, postgres) of the newest installed major version,
/// or `DBOPS_PG_BIN`.
pub fn postgres_bin_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("DBOPS_PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("PostgreSQL is not installed (/usr/lib/postgresql): run e2e/install")?
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let major = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("postgres").is_file().then_some((major, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .context("no PostgreSQL server under /usr/lib/postgresql/*/bin: run e2e/install")
}

/// A binary of this workspace, built by `cargo build --workspace --bins`.
pub fn workspace_bin(name: &str) -> Result<PathBuf> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let profile = std::env::var("DBOPS_PROFILE").unwrap_or_else(|_| "debug".into());
    let path = target.join(profile).join(name);
    if !path.is_file() {
        bail!(
            "{} is missing: run `cargo build --workspace --bins` first",
            path.display()
        );
    }
    Ok(path)
}

/// glua, gopher-lua's interpreter (the Lua Argo CD embeds), pinned in `e2e/glua/go.mod`.
pub fn glua() -> Result<PathBuf> {
    go_tool("glua", "glua", "github.com/yuin/gopher-lua")
}
