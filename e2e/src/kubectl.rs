//! The real `kubectl` on this machine, pointed at a test bed's kubeconfig.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

/// What a kubectl run printed and how it ended.
#[derive(Debug, Clone)]
pub struct Output {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// stdout and stderr together, for assertions on messages.
    pub fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// kubectl with a fixed kubeconfig.
#[derive(Debug, Clone)]
pub struct Kubectl {
    kubeconfig: PathBuf,
}

impl Kubectl {
    pub fn new(kubeconfig: &Path) -> Self {
        Self {
            kubeconfig: kubeconfig.to_path_buf(),
        }
    }

    /// Runs `kubectl ARGS`, optionally feeding `stdin`.
    pub fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<Output> {
        let mut child = Command::new("kubectl")
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running kubectl (is it installed? e2e/install installs it)")?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        Ok(Output {
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// `kubectl apply -f -` of a YAML document in `namespace`.
    pub fn apply(&self, namespace: &str, yaml: &str) -> Result<Output> {
        self.run(&["apply", "-n", namespace, "-f", "-"], Some(yaml))
    }

    /// `kubectl apply -k <dir>`: for real, or with `--dry-run=server` (the apiserver runs
    /// admission and validation and stores nothing).
    pub fn apply_kustomization(&self, dir: &Path, server_dry_run: bool) -> Result<Output> {
        let dir = dir.display().to_string();
        let mut args = vec!["apply", "-k", &dir];
        if server_dry_run {
            args.push("--dry-run=server");
        }
        self.run(&args, None)
    }

    /// `kubectl auth can-i <verb> <resource>` in `namespace` (all namespaces when
    /// `None`), as this kubeconfig's user: whether RBAC allows it. An answer other than
    /// yes or no (a failed request) is an error.
    pub fn can_i(&self, verb: &str, resource: &str, namespace: Option<&str>) -> Result<bool> {
        let mut args = vec!["auth", "can-i", verb, resource];
        match namespace {
            Some(ns) => args.extend(["-n", ns]),
            None => args.push("--all-namespaces"),
        }
        let out = self.run(&args, None)?;
        // "no" may carry the authorizer's reason: "no - <reason>".
        let answer = out.stdout.trim();
        match answer.split_whitespace().next() {
            Some("yes") => Ok(true),
            Some("no") => Ok(false),
            _ => anyhow::bail!(
                "kubectl auth can-i {verb} {resource} answered neither yes nor no: {}",
                out.text()
            ),
        }
    }
}
