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

    /// `status.observedGeneration`, none without a status.
    fn observed_generation(&self) -> Option<i64>;
}

macro_rules! has_conditions {
    ($($kind:ty),*) => {$(
        impl HasConditions for $kind {
            fn conditions(&self) -> &[Condition] {
                self.status.as_ref().map_or(&[], |s| s.conditions.as_slice())
            }

            fn observed_generation(&self) -> Option<i64> {
                self.status.as_ref().and_then(|s| s.observed_generation)
            }
        }
    )*};
}

has_conditions!(Database, DatabaseUser, DatabaseServer, Backup, Migration);
