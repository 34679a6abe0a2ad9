//! What the controllers read from every kind's status without knowing the kind.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use crate::backup::Backup;
use crate::database::Database;
use crate::migration::Migration;
use crate::server::DatabaseServer;
use crate::user::DatabaseUser;

/// The kinds whose status carries conditions, read without serializing the object (the
/// controllers count them for metrics on every scrape and look at them on every
/// reconcile).
pub trait HasConditions {
    /// `status.conditions`, empty without a status.
    fn conditions(&self) -> &[Condition];
}

macro_rules! has_conditions {
    ($($kind:ty),*) => {$(
        impl HasConditions for $kind {
            fn conditions(&self) -> &[Condition] {
                self.status.as_ref().map_or(&[], |s| s.conditions.as_slice())
            }
        }
    )*};
}

has_conditions!(Database, DatabaseUser, DatabaseServer, Backup, Migration);
