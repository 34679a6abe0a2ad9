//! Where a major's binaries are: Debian's packages, or the pinned ones `e2e/install` puts
//! into the cache (`e2e/postgres.versions`); and running them as `postgres` when root.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::paths;
use crate::process::is_root;

/// The file pinning the PostgreSQL packages of other majors than Debian's.
fn versions_file() -> PathBuf {
    paths::repo_root().join("e2e").join("postgres.versions")
}

/// The `<kind> <major> <version>` lines of `e2e/postgres.versions`.
fn pinned_packages() -> Result<Vec<(String, u32, String)>> {
    let path = versions_file();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut packages = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let (kind, major, version) = match words[..] {
            [kind, major, version] => (kind, major, version),
            _ => bail!("{}: not `<kind> <major> <version>`: {line}", path.display()),
        };
        let major = major
            .parse()
            .with_context(|| format!("{}: major in {line}", path.display()))?;
        packages.push((kind.to_string(), major, version.to_string()));
    }
    Ok(packages)
}

/// Debian's programs of this major, when its package is installed and has `program`.
fn debian_bin_dir(major: u32, program: &str) -> Option<PathBuf> {
    let bin = PathBuf::from(format!("/usr/lib/postgresql/{major}/bin"));
    bin.join(program).is_file().then_some(bin)
}

/// `<cache>/<prefix>-<major>-<version>/bin` of the `kind` package of this major pinned in
/// `e2e/postgres.versions`, checked to hold `program`.
fn cached_bin_dir(kind: &str, prefix: &str, major: u32, program: &str) -> Result<PathBuf> {
    let version = pinned_packages()?
        .into_iter()
        .find(|(k, m, _)| k == kind && *m == major)
        .map(|(_, _, v)| v)
        .with_context(|| {
            format!(
                "no PostgreSQL {major} {kind} in Debian's packages nor in {}",
                versions_file().display()
            )
        })?;
    let bin = paths::cache_dir()
        .join(format!("{prefix}-{major}-{version}"))
        .join("bin");
    let how = format!(
        "installs PostgreSQL {major} from {}",
        versions_file().display()
    );
    paths::installed(bin.join(program), &how)?;
    Ok(bin)
}

/// The server programs (initdb, pg_ctl, postgres) of PostgreSQL `major`: Debian's
/// `/usr/lib/postgresql/<major>/bin` when installed, else the npm package pinned in
/// `e2e/postgres.versions` (`<cache>/postgres-<major>-<version>/bin`, which has no client
/// programs: see [`client_bin_dir`]).
pub fn bin_dir(major: u32) -> Result<PathBuf> {
    match debian_bin_dir(major, "postgres") {
        Some(bin) => Ok(bin),
        None => cached_bin_dir("server", "postgres", major, "postgres"),
    }
}

/// The client programs (pg_dump, pg_restore, pg_dumpall, psql) of PostgreSQL `major`:
/// Debian's when installed, else the PyPI package pinned in `e2e/postgres.versions`
/// (`<cache>/postgres-clients-<major>-<version>/bin`, built without OpenSSL: no
/// `sslmode=require`). Only some majors have them; pg_dump of a major dumps servers of that
/// major and older ones.
pub fn client_bin_dir(major: u32) -> Result<PathBuf> {
    match debian_bin_dir(major, "pg_dump") {
        Some(bin) => Ok(bin),
        None => cached_bin_dir("clients", "postgres-clients", major, "pg_dump"),
    }
}

/// The majors [`PgServer::start_major`] can start, oldest first: Debian's installed ones
/// and those pinned in `e2e/postgres.versions` (installed or not).
pub fn server_majors() -> Result<Vec<u32>> {
    let mut majors: Vec<u32> = pinned_packages()?
        .into_iter()
        .filter(|(kind, _, _)| kind == "server")
        .map(|(_, major, _)| major)
        .collect();
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        majors.extend(
            entries
                .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter(|major| debian_bin_dir(*major, "postgres").is_some()),
        );
    }
    majors.sort_unstable();
    majors.dedup();
    Ok(majors)
}

/// `bin`, or when this process is root and the user `postgres` cannot reach it (the cache
/// is under a root-only home directory), the same installation (`bin`'s parent)
/// hard-linked, or copied, once into `<tmp>/dbops-<installation's name>/`, which it can.
pub(super) fn runnable_by_postgres(bin: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !is_root() {
        return Ok(bin.to_path_buf());
    }
    let bin = bin
        .canonicalize()
        .with_context(|| format!("resolving {}", bin.display()))?;
    let reachable = bin
        .ancestors()
        .all(|dir| std::fs::metadata(dir).is_ok_and(|m| m.permissions().mode() & 0o001 != 0));
    if reachable {
        return Ok(bin);
    }
    let install = bin.parent().context("a bin directory without a parent")?;
    let name = install
        .file_name()
        .and_then(|n| n.to_str())
        .context("an installation directory without a name")?;
    let mirror = std::env::temp_dir().join(format!("dbops-{name}"));
    // Only a mirror of root's own, that nobody else can have written, is used.
    let trusted = |path: &Path| {
        std::fs::symlink_metadata(path)
            .is_ok_and(|m| m.is_dir() && m.uid() == 0 && m.mode() & 0o022 == 0)
    };
    if !trusted(&mirror) {
        let partial =
            std::env::temp_dir().join(format!("dbops-{name}.partial.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&partial);
        let copy = |args: &[&str]| {
            std::process::Command::new("cp")
                .args(args)
                .arg(install)
                .arg(&partial)
                .status()
                .is_ok_and(|s| s.success())
        };
        if !copy(&["-al"]) {
            let _ = std::fs::remove_dir_all(&partial);
            if !copy(&["-a"]) {
                let _ = std::fs::remove_dir_all(&partial);
                bail!(
                    "copying {} to {} failed",
                    install.display(),
                    partial.display()
                );
            }
        }
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755))?;
        if std::fs::rename(&partial, &mirror).is_err() {
            // Another process was first (or something else is in the way).
            let _ = std::fs::remove_dir_all(&partial);
            if !trusted(&mirror) {
                bail!(
                    "{} is in the way of a copy of {}",
                    mirror.display(),
                    install.display()
                );
            }
        }
    }
    Ok(mirror.join("bin"))
}

pub(crate) fn chown_to_postgres(dir: &Path) -> Result<()> {
    let status = std::process::Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(dir)
        .status()?;
    if !status.success() {
        bail!("chown -R postgres {} failed", dir.display());
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_versions_file_pins_each_major_once_and_13_to_18() {
        let packages = pinned_packages().unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for (kind, major, version) in &packages {
            assert!(kind == "server" || kind == "clients", "kind {kind}");
            assert!(seen.insert((kind, major)), "{kind} {major} twice");
            assert!(
                version.starts_with(&format!("{major}.")),
                "{kind} {major} at {version}"
            );
        }
        let majors = server_majors().unwrap();
        for major in 13..=18 {
            assert!(majors.contains(&major), "{major} in {majors:?}");
        }
    }
}
