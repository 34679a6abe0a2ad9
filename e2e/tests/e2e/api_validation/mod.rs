//! Bad input is refused by the real API server, with a message naming the field.

mod backups;
mod databases;
mod examples;
mod migrations;
mod servers;
mod user_fields;
