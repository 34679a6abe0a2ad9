//! What a harness shows of a log or an error: its servers' superuser passwords as
//! `<label-password>` (and its emulated managed admins' as `<label-role>`), then every password in SQL redacted
//! ([`crate::postgres::redact_passwords`]). No test prints a password.

use std::fmt::Display;

use crate::postgres::admin::AdminKind;
use crate::postgres::{PgServer, redact_passwords};

/// `text` with the superuser password of each `(label, server)` shown as
/// `<label-password>`, and every password in SQL redacted.
pub fn redact<'a, L: Display>(
    text: &str,
    servers: impl IntoIterator<Item = (L, &'a PgServer)>,
) -> String {
    let mut text = text.to_string();
    for (label, pg) in servers {
        for kind in AdminKind::ALL {
            let who = match kind {
                AdminKind::Superuser => "password",
                _ => kind.role(),
            };
            text = text.replace(&pg.admin_password(kind), &format!("<{label}-{who}>"));
        }
    }
    redact_passwords(&text)
}
