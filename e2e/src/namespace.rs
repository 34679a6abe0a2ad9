//! A namespace of its own for each test, deleted afterwards; when the test panics, the
//! namespace's dbops objects, Secrets (names and keys, never values) and Events are
//! printed first.

use anyhow::Result;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, PostParams};
use rand::distr::{Alphanumeric, SampleString};

use crate::kubectl::Kubectl;

/// A go-template printing each Secret without its values.
const SECRET_SUMMARY: &str = "go-template={{range .items}}Secret {{.metadata.name}}: keys [\
{{range $k, $v := .data}}{{$k}} {{end}}] labels {{.metadata.labels}} owners [\
{{range .metadata.ownerReferences}}{{.kind}}/{{.name}} controller={{.controller}} {{end}}]\n{{end}}";

#[derive(Debug)]
pub struct TestNamespace {
    name: String,
    kubectl: Kubectl,
}

impl TestNamespace {
    /// Creates `<prefix>-<random>`.
    pub async fn create(client: &Client, kubectl: &Kubectl, prefix: &str) -> Result<Self> {
        let suffix = Alphanumeric
            .sample_string(&mut rand::rng(), 6)
            .to_lowercase();
        let name = format!("{prefix}-{suffix}");
        let api: Api<Namespace> = Api::all(client.clone());
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.clone());
        ns.metadata.labels = Some([("dbops.dev/e2e".to_string(), "true".to_string())].into());
        api.create(&PostParams::default(), &ns).await?;
        Ok(Self {
            name,
            kubectl: kubectl.clone(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What a failing test leaves behind, for its report.
    pub fn dump(&self) -> String {
        let mut out = String::new();
        for args in [
            vec!["get", "dbops", "-n", &self.name, "-o", "yaml"],
            // Secrets by name, keys, labels and owners only: their values are passwords.
            vec!["get", "secrets", "-n", &self.name, "-o", SECRET_SUMMARY],
            vec![
                "get",
                "events",
                "-n",
                &self.name,
                "--sort-by=.lastTimestamp",
            ],
        ] {
            if let Ok(o) = self.kubectl.run(&args, None) {
                out.push_str(&o.text());
            }
        }
        out
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- state of namespace {} at failure ----\n{}",
                self.name,
                self.dump()
            );
        }
        let _ = self
            .kubectl
            .run(&["delete", "namespace", &self.name, "--wait=false"], None);
    }
}
