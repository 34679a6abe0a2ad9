#![allow(clippy::unwrap_used)] // a test: an unwrap that fails is a failed test
//! The deployed suite: dbops as it is installed, in the single-node cluster of
//! `e2e/cluster` (a real kubelet, containerd and runc running the images built from
//! `deploy/docker/`, the manifests of `deploy/` through the overlay `e2e/deployed/`).
//!
//! Not part of `cargo test --workspace` (`test = false` in Cargo.toml): `e2e/test` brings
//! the cluster up, deploys, and runs it inside the cluster's namespaces with
//! `e2e/cluster exec -- cargo test -p dbops-e2e --test deployed`.

mod application;
mod bed;
mod disruption;
mod memory;
mod observe;
mod pooler;
mod runtime;
mod security;
mod upgrade;
mod work;
