//! What the integration tests (`tests/e2e`) set up before they test: the shared control
//! plane and a namespace per test ([`bed`]), the deployment of `deploy/` ([`deploy`]), and
//! per kind the controllers, servers and stores one test runs against. A test file reads
//! top to bottom; how its world is built lives here.

pub mod api_validation;
pub mod backup;
pub mod bed;
pub mod database;
pub mod deploy;
pub mod isolation;
pub mod leader;
pub mod majors;
pub mod managed;
pub mod migration;
pub mod migration_logical;
pub mod object;
pub mod observability;
pub mod redact;
pub mod schedule;
pub mod users;
