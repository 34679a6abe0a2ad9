//! The DatabaseServer's guardrails as a Database or DatabaseUser meets them: the ceiling
//! of `connectionLimit` (`limits.connectionLimit`), and the defaults and ceilings of the
//! session settings (`sessionLimits`). A tenant may ask for less, never more: a request
//! over a ceiling is refused (`LimitExceeded`) naming the field, before anything changes
//! on the server. Pure functions; the SQL that applies the result is elsewhere.

use dbops_api::access::{LoginOptions, parse_duration, parse_memory_kb};
use dbops_api::reasons::DatabaseReason;
use dbops_api::{DatabaseServer, DurationLimit, MemoryLimit, SessionSettings};

use crate::error::{Error, template_error};

/// The condition reason of a request over a DatabaseServer's ceiling (a Database's and a
/// DatabaseUser's alike: `Error::user_reason` carries it to `DatabaseUserReason`).
const LIMIT_EXCEEDED: DatabaseReason = DatabaseReason::LimitExceeded;
/// The condition reason of a server's session limit that does not parse.
const INVALID_SPEC: DatabaseReason = DatabaseReason::InvalidSpec;

/// The session settings of a login role, `(name, value)`, as [`settings`] gives them.
pub type Settings = Vec<(&'static str, String)>;

/// What a login (a Database's owner, a DatabaseUser) asks of `server`, refused before
/// anything is written: a `secretTemplate` that does not render, a `spec.connectionLimit`
/// (`connection_limit`) or `spec.settings` over the server's ceilings. The connection
/// limit and the settings to set.
pub fn login_requests(
    login: &LoginOptions,
    connection_limit: i32,
    server: &DatabaseServer,
) -> Result<(i32, Settings), Error> {
    crate::template::check(&login.secret_template).map_err(template_error)?;
    crate::template::check_mounted(&login.secret_template, login.secret_mount_path.as_deref())
        .map_err(template_error)?;
    Ok((
        self::connection_limit(connection_limit, server, "spec.connectionLimit")?,
        settings(login.settings.as_ref(), server, "spec.settings")?,
    ))
}

/// The connection limit to set: `asked` (`-1`: none of its own) within the server's
/// ceiling, which also replaces `-1`. `field` names the field in a refusal (for example
/// `spec.connectionLimit`).
pub fn connection_limit(asked: i32, server: &DatabaseServer, field: &str) -> Result<i32, Error> {
    let ceiling = server.spec.limits.as_ref().and_then(|l| l.connection_limit);
    match ceiling {
        None => Ok(asked),
        Some(c) if asked < 0 => Ok(c),
        Some(c) if asked > c => Err(Error::Reported {
            reason: LIMIT_EXCEEDED.into(),
            message: format!(
                "{field} is {asked}, over DatabaseServer {}'s limits.connectionLimit {c}: ask for {c} or less; nothing was changed on the server",
                server.metadata.name.as_deref().unwrap_or_default()
            ),
        }),
        Some(_) => Ok(asked),
    }
}

/// The PostgreSQL settings a login role gets, as `(name, value)` in PostgreSQL's own
/// units (milliseconds, kB), sorted by name: what `asked` says, else the server's default;
/// a setting neither names is absent. `field` prefixes the field in a refusal (for example
/// `spec.settings`).
pub fn settings(
    asked: Option<&SessionSettings>,
    server: &DatabaseServer,
    field: &str,
) -> Result<Settings, Error> {
    let limits = server.spec.session_limits.clone().unwrap_or_default();
    let asked = asked.cloned().unwrap_or_default();
    let name = server.metadata.name.as_deref().unwrap_or_default();
    let mut out = Vec::new();
    for (pg, key, value, limit) in [
        (
            "idle_in_transaction_session_timeout",
            "idleInTransactionSessionTimeout",
            asked.idle_in_transaction_session_timeout,
            limits.idle_in_transaction_session_timeout,
        ),
        (
            "lock_timeout",
            "lockTimeout",
            asked.lock_timeout,
            limits.lock_timeout,
        ),
        (
            "statement_timeout",
            "statementTimeout",
            asked.statement_timeout,
            limits.statement_timeout,
        ),
    ] {
        if let Some(ms) = duration_setting(value.as_deref(), limit.as_ref(), name, field, key)? {
            out.push((pg, ms.to_string()));
        }
    }
    if let Some(kb) = memory_setting(
        asked.work_mem.as_deref(),
        limits.work_mem.as_ref(),
        name,
        field,
    )? {
        out.push(("work_mem", kb.to_string()));
    }
    out.sort();
    Ok(out)
}

/// The names of the settings [`settings`] manages: others on a role are left alone.
pub const MANAGED_SETTINGS: [&str; 4] = [
    "idle_in_transaction_session_timeout",
    "lock_timeout",
    "statement_timeout",
    "work_mem",
];

fn duration_setting(
    asked: Option<&str>,
    limit: Option<&DurationLimit>,
    server: &str,
    field: &str,
    key: &str,
) -> Result<Option<u128>, Error> {
    let bad = |what: &str| Error::Reported {
        reason: INVALID_SPEC.into(),
        message: format!("{what} is not a duration"),
    };
    let max = match limit.and_then(|l| l.max.as_deref()) {
        Some(m) => Some(
            parse_duration(m)
                .ok_or_else(|| bad(&format!("sessionLimits.{key}.max of {server}")))?,
        ),
        None => None,
    }
    // `0s` as a ceiling: none.
    .filter(|m| !m.is_zero());
    let Some(value) = asked.or_else(|| limit.and_then(|l| l.default.as_deref())) else {
        return Ok(None);
    };
    let d = parse_duration(value).ok_or_else(|| bad(&format!("{field}.{key}")))?;
    if let Some(max) = max
        && (d.is_zero() || d > max)
    {
        let asked_for = if d.is_zero() {
            "0s (no timeout)".to_string()
        } else {
            value.to_string()
        };
        return Err(Error::Reported {
            reason: LIMIT_EXCEEDED.into(),
            message: format!(
                "{field}.{key} is {asked_for}, over DatabaseServer {server}'s sessionLimits.{key}.max {}: ask for less; nothing was changed on the server",
                limit.and_then(|l| l.max.as_deref()).unwrap_or_default()
            ),
        });
    }
    Ok(Some(d.as_millis()))
}

fn memory_setting(
    asked: Option<&str>,
    limit: Option<&MemoryLimit>,
    server: &str,
    field: &str,
) -> Result<Option<u64>, Error> {
    let bad = |what: &str| Error::Reported {
        reason: INVALID_SPEC.into(),
        message: format!("{what} is not an amount of memory"),
    };
    let max = match limit.and_then(|l| l.max.as_deref()) {
        Some(m) => Some(
            parse_memory_kb(m)
                .ok_or_else(|| bad(&format!("sessionLimits.workMem.max of {server}")))?,
        ),
        None => None,
    };
    let Some(value) = asked.or_else(|| limit.and_then(|l| l.default.as_deref())) else {
        return Ok(None);
    };
    let kb = parse_memory_kb(value).ok_or_else(|| bad(&format!("{field}.workMem")))?;
    if let Some(max) = max
        && kb > max
    {
        return Err(Error::Reported {
            reason: LIMIT_EXCEEDED.into(),
            message: format!(
                "{field}.workMem is {value}, over DatabaseServer {server}'s sessionLimits.workMem.max {}: ask for less; nothing was changed on the server",
                limit.and_then(|l| l.max.as_deref()).unwrap_or_default()
            ),
        });
    }
    Ok(Some(kb))
}

/// Bytes of a Kubernetes quantity of `limits.databaseSize`'s form (`20Gi`, `500M`, `1024`).
pub fn quantity_bytes(text: &str) -> Option<i64> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let n: i64 = text.get(..digits)?.parse().ok()?;
    let factor: i64 = match &text[digits..] {
        "" => 1,
        "k" => 1000,
        "M" => 1000_i64.pow(2),
        "G" => 1000_i64.pow(3),
        "T" => 1000_i64.pow(4),
        "P" => 1000_i64.pow(5),
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        _ => return None,
    };
    n.checked_mul(factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(spec: serde_json::Value) -> DatabaseServer {
        let mut s = serde_json::json!({"host": "pg", "adminSecretRef": {"name": "a"}});
        if let (Some(s), Some(extra)) = (s.as_object_mut(), spec.as_object()) {
            s.extend(extra.clone());
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dbops.dev/v1alpha1", "kind": "DatabaseServer",
            "metadata": {"name": "pg-main"}, "spec": s
        }))
        .unwrap()
    }

    fn reason(r: Result<impl std::fmt::Debug, Error>) -> (&'static str, String) {
        match r {
            Err(Error::Reported { reason, message }) => (reason.as_str(), message),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn the_connection_ceiling_replaces_no_limit_and_refuses_more() {
        let open = server(serde_json::json!({}));
        assert_eq!(
            connection_limit(-1, &open, "spec.connectionLimit").unwrap(),
            -1
        );
        assert_eq!(
            connection_limit(500, &open, "spec.connectionLimit").unwrap(),
            500
        );
        let capped = server(serde_json::json!({"limits": {"connectionLimit": 50}}));
        assert_eq!(
            connection_limit(-1, &capped, "spec.connectionLimit").unwrap(),
            50
        );
        assert_eq!(
            connection_limit(5, &capped, "spec.connectionLimit").unwrap(),
            5
        );
        assert_eq!(
            connection_limit(50, &capped, "spec.connectionLimit").unwrap(),
            50
        );
        let (r, m) = reason(connection_limit(51, &capped, "spec.connectionLimit"));
        assert_eq!(r, LIMIT_EXCEEDED);
        assert!(
            m.contains("spec.connectionLimit") && m.contains("50"),
            "{m}"
        );
    }

    #[test]
    fn settings_take_defaults_and_stay_under_ceilings() {
        let s = server(serde_json::json!({"sessionLimits": {
            "statementTimeout": {"default": "30s", "max": "10m"},
            "idleInTransactionSessionTimeout": {"default": "5m"},
            "workMem": {"max": "64MB"},
        }}));
        assert_eq!(
            settings(None, &s, "spec.settings").unwrap(),
            [
                ("idle_in_transaction_session_timeout", "300000".to_string()),
                ("statement_timeout", "30000".to_string())
            ]
        );
        let asked = SessionSettings {
            statement_timeout: Some("1m30s".into()),
            lock_timeout: Some("250ms".into()),
            work_mem: Some("16MB".into()),
            ..SessionSettings::default()
        };
        assert_eq!(
            settings(Some(&asked), &s, "spec.settings").unwrap(),
            [
                ("idle_in_transaction_session_timeout", "300000".to_string()),
                ("lock_timeout", "250".to_string()),
                ("statement_timeout", "90000".to_string()),
                ("work_mem", "16384".to_string())
            ]
        );
        for (over, field) in [
            (
                SessionSettings {
                    statement_timeout: Some("11m".into()),
                    ..SessionSettings::default()
                },
                "spec.settings.statementTimeout",
            ),
            (
                SessionSettings {
                    statement_timeout: Some("0s".into()),
                    ..SessionSettings::default()
                },
                "spec.settings.statementTimeout",
            ),
            (
                SessionSettings {
                    work_mem: Some("1GB".into()),
                    ..SessionSettings::default()
                },
                "spec.settings.workMem",
            ),
        ] {
            let (r, m) = reason(settings(Some(&over), &s, "spec.settings"));
            assert_eq!(r, LIMIT_EXCEEDED);
            assert!(m.contains(field), "{m}");
        }
        // No ceiling: anything goes, 0s (none) included.
        let open = server(serde_json::json!({}));
        let none = SessionSettings {
            statement_timeout: Some("0s".into()),
            ..SessionSettings::default()
        };
        assert_eq!(
            settings(Some(&none), &open, "spec.settings").unwrap(),
            [("statement_timeout", "0".to_string())]
        );
    }

    #[test]
    fn sizes_read_as_kubernetes_writes_them() {
        assert_eq!(quantity_bytes("20Gi"), Some(20 << 30));
        assert_eq!(quantity_bytes("500M"), Some(500_000_000));
        assert_eq!(quantity_bytes("1024"), Some(1024));
        assert_eq!(quantity_bytes("1.5Gi"), None);
        assert_eq!(quantity_bytes("Gi"), None);
    }
}
