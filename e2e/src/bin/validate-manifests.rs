//! `validate-manifests`: `kubeconform -strict` on everything dbops ships (see
//! `dbops_e2e::kubeconform`): `deploy/`, with the S3 component, `deploy/jaeger/`, the
//! kustomizations under `e2e/`, and `charts/dbops` rendered by `helm template`. Run by
//! `e2e/validate-manifests`; needs helm and kubeconform from `e2e/install`.

use std::time::Instant;

use anyhow::Result;
use dbops_e2e::kubeconform;

fn main() -> Result<()> {
    let start = Instant::now();
    let manifests = kubeconform::shipped_manifests()?;
    for outcome in kubeconform::validate(&manifests)? {
        println!("{}: {} resources valid", outcome.name, outcome.resources);
    }
    println!(
        "kubeconform -strict: all {} streams valid in {:.1}s",
        manifests.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
