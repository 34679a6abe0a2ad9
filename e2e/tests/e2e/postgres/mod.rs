//! The PostgreSQL harness: real servers from Debian's packages, several at once, some
//! speaking TLS with certificates of a test CA; the shared client's TLS against them,
//! and the same through DatabaseServers and a database-controller.

mod secrets;
mod servers;
mod tls;
