#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! What the API validation tests apply with `kubectl` in their test's namespace (a Database,
//! a DatabaseServer, a DatabaseUser as YAML), and how they expect the real API server to
//! answer: refused with a message naming the field, or accepted.

use crate::harness::bed::Bed;
use crate::kubectl::Output;

pub fn database(name: &str, extra_spec: &str) -> String {
    format!(
        r#"
apiVersion: dbops.dev/v1alpha1
kind: Database
metadata:
  name: {name}
spec:
  serverRef: {{name: pg-main}}
{extra_spec}
"#
    )
}

/// A DatabaseServer of this test (named after its namespace and labelled with it, so the
/// namespace's cleanup deletes it) with `spec` (YAML lines indented by two).
pub fn server(b: &Bed, name: &str, spec: &str) -> String {
    let ns = b.ns.name();
    format!(
        r#"
apiVersion: dbops.dev/v1alpha1
kind: DatabaseServer
metadata:
  name: {}
  labels: {{{}: {ns}}}
spec:
{spec}
"#,
        crate::fixtures::server_name(ns, name),
        crate::fixtures::TEST_NAMESPACE_LABEL,
    )
}

/// Applies the DatabaseServer [`server`]`(b, name, spec)` (cluster-scoped: no namespace),
/// expects a refusal, and that kubectl's message mentions each of `needles`.
pub fn server_refused(b: &Bed, name: &str, spec: &str, needles: &[&str]) {
    let yaml = server(b, name, spec);
    let out = b.kubectl.run(&["apply", "-f", "-"], Some(&yaml)).unwrap();
    expect_refused(&out, &yaml, needles);
}

/// Applies the DatabaseServer [`server`]`(b, name, spec)` and expects it accepted.
pub fn server_accepted(b: &Bed, name: &str, spec: &str) {
    let yaml = server(b, name, spec);
    let out = b.kubectl.run(&["apply", "-f", "-"], Some(&yaml)).unwrap();
    expect_accepted(&out, &yaml);
}

/// Applies `yaml`, expects a refusal, and that kubectl's message mentions each of
/// `needles`.
pub fn refused(b: &Bed, yaml: &str, needles: &[&str]) {
    expect_refused(&b.kubectl.apply(b.ns.name(), yaml).unwrap(), yaml, needles);
}

pub fn accepted(b: &Bed, yaml: &str) {
    expect_accepted(&b.kubectl.apply(b.ns.name(), yaml).unwrap(), yaml);
}

/// [`refused`] of the Database [`database`]`(name, extra_spec)`.
pub fn database_refused(b: &Bed, name: &str, extra_spec: &str, needles: &[&str]) {
    refused(b, &database(name, extra_spec), needles);
}

/// `kubectl apply` of `yaml` failed, saying each of `needles`.
pub fn expect_refused(out: &Output, yaml: &str, needles: &[&str]) {
    assert!(
        !out.success,
        "the API server accepted:\n{yaml}\n{}",
        out.text()
    );
    assert_mentions(&out.text(), needles);
}

pub fn expect_accepted(out: &Output, yaml: &str) {
    assert!(
        out.success,
        "the API server refused:\n{yaml}\n{}",
        out.text()
    );
}

pub fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "expected {needle:?} in:\n{message}"
        );
    }
}

/// A DatabaseUser of the Database `orders` with `extra_spec` (YAML lines indented by two).
pub fn user(name: &str, extra_spec: &str) -> String {
    format!(
        r#"
apiVersion: dbops.dev/v1alpha1
kind: DatabaseUser
metadata:
  name: {name}
spec:
  databaseRef: {{name: orders}}
{extra_spec}
"#
    )
}

/// [`refused`] of the DatabaseUser [`user`]`(name, extra_spec)`.
pub fn user_refused(b: &Bed, name: &str, extra_spec: &str, needles: &[&str]) {
    refused(b, &user(name, extra_spec), needles);
}

/// `kubectl get <what> <name> -o jsonpath=<path>` in the test's namespace.
pub fn jsonpath(b: &Bed, what: &str, name: &str, path: &str) -> String {
    let out = b
        .kubectl
        .run(
            &[
                "get",
                what,
                name,
                "-n",
                b.ns.name(),
                "-o",
                &format!("jsonpath={path}"),
            ],
            None,
        )
        .unwrap();
    assert!(out.success, "{}", out.text());
    out.stdout.trim().to_string()
}

/// The columns `kubectl get dbserver` prints (but `AGE`, not shown for an example).
pub const SERVER_COLUMNS: [&str; 7] = [
    "NAME",
    "HOST",
    "PORT",
    "TLS",
    "READY",
    "VERSION",
    "DATABASES",
];

/// `kubectl get <args>` prints a header naming each of `columns`.
pub fn assert_columns(b: &Bed, args: &[&str], columns: &[&str]) {
    let get = b.kubectl.run(&[&["get"], args].concat(), None).unwrap();
    let header = get.stdout.lines().next().unwrap_or_default().to_string();
    for column in columns {
        assert!(header.contains(column), "column {column} missing: {header}");
    }
}
