//! The deployment in `deploy/` against the real apiserver: it applies (for real and with
//! `--dry-run=server`), its pods would pass the `restricted` Pod Security Standard, each
//! controller does its whole job with a token of its own ServiceAccount (TokenRequest
//! API), and the apiserver refuses a controller a verb it does not need.
//!
//! The ServiceAccounts, RBAC, Deployments, PodDisruptionBudgets and Services are applied
//! once per control plane into `dbops-system` (`dbops_e2e::harness::deploy::deployed`);
//! nothing runs the Deployments (there is no scheduler or kubelet), the controllers run
//! here as processes with the ServiceAccounts' tokens, the way they would in those pods.

mod cluster_script;
mod crd_evolution;
mod identity;
mod manifests;
mod tenant_secrets;
