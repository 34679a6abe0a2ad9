#![allow(clippy::unwrap_used)] // a test: an unwrap that fails is a failed test
//! Integration tests against the real test bed: a kube-apiserver, etcd and
//! kube-controller-manager built from Go modules, PostgreSQL from Debian's packages, the
//! machine's kubectl, and this workspace's controller binaries. One control plane serves
//! the whole binary; every test works in a namespace of its own.

mod api_validation;
mod argocd_health;
mod backup;
mod backup_store;
mod chart;
mod control_plane;
mod controllers;
mod database;
mod deploy;
mod drivers;
mod isolation;
mod leader;
mod majors;
mod managed;
mod metrics;
mod migration;
mod migration_logical;
mod names;
mod pooler;
mod pooler_migration;
mod pooler_tls;
mod postgres;
mod scheduled_backups;
mod tenancy;
mod traces;
mod users;
mod users_migration;

pub use dbops_e2e::harness::bed::{
    Bed, bed, control_plane, controller_identities, controller_kubeconfig, controller_user,
    start_tenant_database_controller, test_dir, watch_args,
};
