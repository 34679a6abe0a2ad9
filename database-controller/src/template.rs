//! `spec.secretTemplate` of a Database or a DatabaseUser: extra keys of its connection
//! Secret, each rendered from a template over the connection's `host`, `port`,
//! `database`, `user`, `password`, `sslmode`, `ca` (the server's CA in PEM, empty
//! when it has none) and `ca_file` (where the application finds it: `ca.crt` under
//! `spec.secretMountPath`, empty without either), and the server's pooler: `pooler_host`,
//! `pooler_port`, `pooler_ca` and `pooler_ca_file` (empty, 0, empty and empty when the
//! server has no pooler: `{% if pooler_host %}`).
//!
//! The language is MiniJinja's Jinja syntax without its builtins, macros or includes:
//! `{{ variable }}`, `{% if %}`, `{% for %}`, and two filters, `urlencode` (RFC 3986
//! percent-encoding, for a URL inside a template that is not one) and `safe` (no
//! escaping). A template whose text begins with a URL scheme (`postgresql://`,
//! `jdbc:postgresql://`, ...) renders every value percent-encoded, so a password with
//! `@:/?#` cannot change the URL's shape; any other template renders values as they are.
//! An undefined variable is an error, and fuel bounds what any one template can cost.
//!
//! [`check`] refuses a map that does not parse, names an unknown variable, or has a key
//! that is not a valid Secret key or is one of the controller's own ([`RESERVED_KEYS`]),
//! before anything is written; [`render`] renders it for one credential. An error names
//! the key and never carries a password.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::sync::OnceLock;

use minijinja::value::Value;
use minijinja::{
    AutoEscape, Environment, Error, ErrorKind, Output, State, UndefinedBehavior, escape_formatter,
};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

/// The keys the controller writes itself (every key `secret::desired_for` may write;
/// `ca.crt` only when the server has a CA of its own, the `pooler-*` keys only when it has
/// a pooler): no template may replace one.
pub const RESERVED_KEYS: [&str; 20] = [
    "host",
    "port",
    "dbname",
    "username",
    "password",
    "uri",
    "jdbc-url",
    "PGHOST",
    "PGPORT",
    "PGDATABASE",
    "PGUSER",
    "PGPASSWORD",
    "sslmode",
    "PGSSLMODE",
    "ca.crt",
    "pooler-host",
    "pooler-port",
    "pooler-uri",
    "pooler-jdbc-url",
    "pooler-ca.crt",
];

/// The key the controller adds when the spec names the Secret's mount path
/// (`spec.secretMountPath`): the mounted `ca.crt` for libpq and pgx. Not in
/// [`RESERVED_KEYS`], so that a template that wrote it before keeps working without a mount
/// path; with one, such a template is refused ([`check_mounted`]).
pub const MOUNT_KEY: &str = "PGSSLROOTCERT";

/// At most this many templates in one `secretTemplate`.
pub const MAX_KEYS: usize = 32;
/// At most this many bytes of template text per key.
pub const MAX_TEMPLATE_BYTES: usize = 4096;
/// A Secret data key's length limit (Kubernetes' own).
pub const MAX_KEY_CHARS: usize = 253;
/// At most this many bytes of rendered values, all keys together: the rest of the Secret
/// (and its 1 MiB limit) must still fit.
pub const MAX_RENDERED_BYTES: usize = 512 * 1024;

/// The work one template may make the engine do: one fuel per instruction and per 64
/// bytes produced. The SPEC's `DATABASE_URL` costs about 30; a CA bundle of 250 KiB,
/// percent-encoded, about 12,000.
const FUEL: u64 = 50_000;

/// The variables a template may use, for error messages.
const VARIABLES: &str = "host, port, database, user, password, sslmode, ca, ca_file, pooler_host, pooler_port, pooler_ca, pooler_ca_file";

/// Everything but RFC 3986's unreserved characters (`A-Za-z0-9-._~`) is percent-encoded.
const NOT_UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `s` with everything but RFC 3986's unreserved characters percent-encoded.
pub fn percent_encode(s: &str) -> String {
    utf8_percent_encode(s, NOT_UNRESERVED).to_string()
}

/// The auto-escape mode of URL templates, and the template names that select it.
const URL_ESCAPE: &str = "url";
const URL_TEMPLATE: &str = "url-template";
const TEXT_TEMPLATE: &str = "text-template";

/// What one credential's templates are rendered with.
#[derive(Clone, Copy)]
pub struct Values<'a> {
    pub host: &'a str,
    pub port: u16,
    pub database: &'a str,
    pub user: &'a str,
    pub password: &'a str,
    pub sslmode: &'a str,
    /// The server's CA in PEM, "" when it has none.
    pub ca: &'a str,
    /// Where the application finds `ca.crt` (`spec.secretMountPath`/ca.crt), "" when the
    /// spec names no mount path or the server has no CA of its own.
    pub ca_file: &'a str,
    /// The server's pooler (its Service's name, port and certificate), when it has one.
    pub pooler: Option<PoolerValues<'a>>,
}

/// The pooler's values of a template.
#[derive(Clone, Copy, Debug)]
pub struct PoolerValues<'a> {
    pub host: &'a str,
    pub port: u16,
    pub ca: &'a str,
    /// `spec.secretMountPath`/pooler-ca.crt, "" without a mount path.
    pub ca_file: &'a str,
}

impl fmt::Debug for Values<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Values")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("database", &self.database)
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .field("sslmode", &self.sslmode)
            .field("ca", &self.ca)
            .field("ca_file", &self.ca_file)
            .field("pooler", &self.pooler)
            .finish()
    }
}

impl Values<'_> {
    fn context(&self) -> Value {
        Value::from_pairs([
            ("host", Value::from(self.host)),
            ("port", Value::from(self.port)),
            ("database", Value::from(self.database)),
            ("user", Value::from(self.user)),
            ("password", Value::from(self.password)),
            ("sslmode", Value::from(self.sslmode)),
            ("ca", Value::from(self.ca)),
            ("ca_file", Value::from(self.ca_file)),
            (
                "pooler_host",
                Value::from(self.pooler.map_or("", |p| p.host)),
            ),
            (
                "pooler_port",
                Value::from(self.pooler.map_or(0, |p| p.port)),
            ),
            ("pooler_ca", Value::from(self.pooler.map_or("", |p| p.ca))),
            (
                "pooler_ca_file",
                Value::from(self.pooler.map_or("", |p| p.ca_file)),
            ),
        ])
    }
}

/// A `secretTemplate` refused: which key (none when the map as a whole is at fault) and
/// why. Never carries a password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct TemplateError {
    pub key: Option<String>,
    pub reason: String,
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(key) if key.chars().count() > MAX_KEY_CHARS => {
                let head: String = key.chars().take(64).collect();
                write!(f, "spec.secretTemplate[{head:?}…]: {}", self.reason)
            }
            Some(key) => write!(f, "spec.secretTemplate[{key:?}]: {}", self.reason),
            None => write!(f, "spec.secretTemplate: {}", self.reason),
        }
    }
}

impl TemplateError {
    fn key(key: &str, reason: impl Into<String>) -> Self {
        TemplateError {
            key: Some(key.to_string()),
            reason: reason.into(),
        }
    }
}

/// The one environment every template is rendered in: no loader (a template can reach
/// nothing but its own text), strict undefined, fuel, URL auto-escaping by template name.
fn environment() -> &'static Environment<'static> {
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = Environment::empty();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        env.set_fuel(Some(FUEL));
        env.set_auto_escape_callback(|name| match name {
            URL_TEMPLATE => AutoEscape::Custom(URL_ESCAPE.into()),
            _ => AutoEscape::None,
        });
        env.set_formatter(format_value);
        env.add_filter("urlencode", urlencode);
        env.add_filter("safe", minijinja::filters::safe);
        env
    })
}

/// Writes a `{{ ... }}` value: percent-encoded in a URL template unless marked safe,
/// as it is otherwise.
fn format_value(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    match state.auto_escape() {
        AutoEscape::Custom(mode) if mode == URL_ESCAPE && !value.is_safe() => {
            let text = value.to_string();
            write!(out, "{}", utf8_percent_encode(&text, NOT_UNRESERVED)).map_err(Error::from)
        }
        _ => escape_formatter(out, state, value),
    }
}

/// The `urlencode` filter: RFC 3986 percent-encoding, marked safe so that a URL template
/// does not encode it twice.
fn urlencode(value: Value) -> Result<Value, Error> {
    if value.is_undefined() {
        return Err(Error::new(
            ErrorKind::UndefinedError,
            "urlencode of an undefined value",
        ));
    }
    let text = value.to_string();
    Ok(Value::from_safe_string(
        utf8_percent_encode(&text, NOT_UNRESERVED).to_string(),
    ))
}

/// Whether `text` begins with a URL scheme, `^[A-Za-z][A-Za-z0-9+.-]*://`, or a chain of
/// them such as `jdbc:postgresql://`.
fn is_url(text: &str) -> bool {
    let Some((schemes, _)) = text.split_once("://") else {
        return false;
    };
    schemes.split(':').all(|scheme| {
        let mut chars = scheme.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '.' | '-'))
    })
}

/// Why `key` cannot be a key of this Secret, if it cannot.
fn key_problem(key: &str) -> Option<String> {
    if key.is_empty() {
        return Some("a Secret key must not be empty".into());
    }
    if key.chars().count() > MAX_KEY_CHARS {
        return Some(format!(
            "a Secret key is at most {MAX_KEY_CHARS} characters"
        ));
    }
    if !key
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Some(
            "not a valid Secret key: only letters, digits, '-', '.' and '_' (^[-._a-zA-Z0-9]+$)"
                .into(),
        );
    }
    if key == "." || key.starts_with("..") {
        return Some("not a valid Secret key: must not be '.' or start with '..'".into());
    }
    if RESERVED_KEYS.contains(&key) {
        return Some(format!(
            "{key} is one of the keys dbops writes itself ({})",
            RESERVED_KEYS.join(" ")
        ));
    }
    None
}

/// Everything [`check`] and [`render`] refuse without rendering.
fn check_shape(templates: &BTreeMap<String, String>) -> Result<(), TemplateError> {
    if templates.len() > MAX_KEYS {
        return Err(TemplateError {
            key: None,
            reason: format!("{} keys, at most {MAX_KEYS}", templates.len()),
        });
    }
    for (key, text) in templates {
        if let Some(reason) = key_problem(key) {
            return Err(TemplateError::key(key, reason));
        }
        if text.len() > MAX_TEMPLATE_BYTES {
            return Err(TemplateError::key(
                key,
                format!(
                    "the template is {} bytes, at most {MAX_TEMPLATE_BYTES}",
                    text.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Renders one template; the error is described without any value in it.
fn render_one(text: &str, context: Value, password: &str) -> Result<String, String> {
    let name = if is_url(text) {
        URL_TEMPLATE
    } else {
        TEXT_TEMPLATE
    };
    environment()
        .template_from_named_str(name, text)
        .and_then(|template| template.render(context))
        .map_err(|err| describe(&err, password))
}

/// A render error as a condition can say it: what went wrong and on which line, with the
/// password (raw or percent-encoded) removed should the engine ever quote it.
fn describe(err: &Error, password: &str) -> String {
    let line = err
        .line()
        .map(|l| format!(" (line {l})"))
        .unwrap_or_default();
    let detail = err.detail().map(|d| format!(": {d}")).unwrap_or_default();
    let reason = match err.kind() {
        ErrorKind::SyntaxError => format!("does not parse{detail}{line}"),
        ErrorKind::UndefinedError => {
            format!("undefined value{detail}{line}; the variables are {VARIABLES}")
        }
        ErrorKind::UnknownFilter => {
            format!("unknown filter{detail}{line}; the filters are urlencode and safe")
        }
        ErrorKind::UnknownFunction => {
            format!("unknown function{detail}{line}; templates have no functions")
        }
        ErrorKind::OutOfFuel => {
            format!("too expensive to render (out of fuel after {FUEL}){line}")
        }
        kind => format!("{kind}{detail}{line}"),
    };
    redact(reason, password)
}

fn redact(mut text: String, password: &str) -> String {
    if password.is_empty() {
        return text;
    }
    let encoded = utf8_percent_encode(password, NOT_UNRESERVED).to_string();
    for secret in [password, encoded.as_str()] {
        if text.contains(secret) {
            text = text.replace(secret, "<redacted>");
        }
    }
    text
}

/// Dummy credentials `check` renders with: with and without a CA and a pooler, so that
/// both sides of an `{% if ca %}` or `{% if pooler_host %}` are tried.
const DUMMY_CA: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

fn dummies() -> [Values<'static>; 2] {
    let values = Values {
        host: "pg.example.svc",
        port: 5432,
        database: "orders",
        user: "orders_owner",
        password: "p@ss:w/rd?#%",
        sslmode: "verify-full",
        ca: "",
        ca_file: "",
        pooler: None,
    };
    [
        values,
        Values {
            ca: DUMMY_CA,
            ca_file: "/etc/dbops/orders/ca.crt",
            pooler: Some(PoolerValues {
                host: "dbops-pooler-pg.dbops-system.svc",
                port: 6432,
                ca: DUMMY_CA,
                ca_file: "/etc/dbops/orders/pooler-ca.crt",
            }),
            ..values
        },
    ]
}

/// Refuses a `secretTemplate` that could not be rendered: too many keys, a key that is not
/// a valid Secret key or is one of [`RESERVED_KEYS`], a template over
/// [`MAX_TEMPLATE_BYTES`], one that does not parse, or one that fails against dummy
/// values (an unknown variable or filter, out of fuel).
pub fn check(templates: &BTreeMap<String, String>) -> Result<(), TemplateError> {
    check_shape(templates)?;
    for values in dummies() {
        for (key, text) in templates {
            render_one(text, values.context(), values.password)
                .map_err(|reason| TemplateError::key(key, reason))?;
        }
    }
    Ok(())
}

/// Refuses a template key the controller writes itself because the spec names the
/// Secret's mount path ([`MOUNT_KEY`]).
pub fn check_mounted(
    templates: &BTreeMap<String, String>,
    mount_path: Option<&str>,
) -> Result<(), TemplateError> {
    match mount_path {
        Some(_) if templates.contains_key(MOUNT_KEY) => Err(TemplateError::key(
            MOUNT_KEY,
            format!(
                "{MOUNT_KEY} is written by dbops when spec.secretMountPath is set (the mounted ca.crt): remove the template or the mount path"
            ),
        )),
        _ => Ok(()),
    }
}

/// The extra Secret keys `templates` give for one credential.
pub fn render(
    templates: &BTreeMap<String, String>,
    values: &Values,
) -> Result<BTreeMap<String, String>, TemplateError> {
    check_shape(templates)?;
    let context = values.context();
    let mut total = 0;
    let mut rendered = BTreeMap::new();
    for (key, text) in templates {
        let value = render_one(text, context.clone(), values.password)
            .map_err(|reason| TemplateError::key(key, reason))?;
        total += value.len();
        if total > MAX_RENDERED_BYTES {
            return Err(TemplateError::key(
                key,
                format!("the rendered values exceed {MAX_RENDERED_BYTES} bytes together"),
            ));
        }
        rendered.insert(key.clone(), value);
    }
    Ok(rendered)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC_URL: &str = "postgresql://{{ user }}:{{ password }}@{{ host }}:{{ port }}/{{ database }}?sslmode={{ sslmode }}";
    const PASSWORD: &str = "p@ss:w/rd?#%";

    fn map(entries: &[(&str, &str)]) -> BTreeMap<String, String> {
        entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn values(password: &str) -> Values<'_> {
        Values {
            host: "pg-main.dbops-system.svc",
            port: 5433,
            database: "orders",
            user: "orders_dashboard",
            password,
            sslmode: "verify-full",
            ca: "",
            ca_file: "",
            pooler: None,
        }
    }

    #[test]
    fn the_pooler_values_are_there_when_the_server_has_a_pooler() {
        let templates = map(&[
            (
                "POOLED_URL",
                "postgresql://{{ user }}:{{ password }}@{{ pooler_host }}:{{ pooler_port }}/{{ database }}",
            ),
            (
                "pooled",
                "{% if pooler_host %}{{ pooler_host }}{% else %}direct{% endif %}",
            ),
        ]);
        check(&templates).unwrap();
        let pooled = Values {
            pooler: Some(PoolerValues {
                host: "dbops-pooler-pg-main.dbops-system.svc",
                port: 6432,
                ca: "PEM",
                ca_file: "",
            }),
            ..values(PASSWORD)
        };
        let out = render(&templates, &pooled).unwrap();
        assert_eq!(
            out["POOLED_URL"],
            "postgresql://orders_dashboard:p%40ss%3Aw%2Frd%3F%23%25@dbops-pooler-pg-main.dbops-system.svc:6432/orders"
        );
        assert_eq!(out["pooled"], "dbops-pooler-pg-main.dbops-system.svc");
        let direct = render(&templates, &values(PASSWORD)).unwrap();
        assert_eq!(direct["pooled"], "direct");
    }

    fn refused(templates: &BTreeMap<String, String>) -> TemplateError {
        let err = check(templates).expect_err("check refuses it");
        let shown = err.to_string();
        assert!(!shown.contains(PASSWORD), "{shown}");
        err
    }

    #[test]
    fn spec_example_renders_exactly() {
        let templates = map(&[("DATABASE_URL", SPEC_URL)]);
        check(&templates).unwrap();
        let out = render(&templates, &values("s3cret")).unwrap();
        assert_eq!(
            out,
            map(&[(
                "DATABASE_URL",
                "postgresql://orders_dashboard:s3cret@pg-main.dbops-system.svc:5433/orders?sslmode=verify-full"
            )])
        );
    }

    #[test]
    fn url_templates_percent_encode_values_and_others_do_not() {
        let templates = map(&[
            ("DATABASE_URL", SPEC_URL),
            ("PASSWORD_COPY", "{{ password }}"),
            (
                "JDBC_URL",
                "jdbc:postgresql://{{ host }}:{{ port }}/{{ database }}?user={{ user }}&password={{ password }}",
            ),
            ("DSN", "host={{ host }} password={{ password|urlencode }}"),
            (
                "DOUBLE",
                "postgres://{{ user }}:{{ password|urlencode }}@{{ host }}",
            ),
        ]);
        check(&templates).unwrap();
        let out = render(&templates, &values(PASSWORD)).unwrap();
        assert_eq!(
            out["DATABASE_URL"],
            "postgresql://orders_dashboard:p%40ss%3Aw%2Frd%3F%23%25@pg-main.dbops-system.svc:5433/orders?sslmode=verify-full"
        );
        assert_eq!(out["PASSWORD_COPY"], PASSWORD);
        assert_eq!(
            out["JDBC_URL"],
            "jdbc:postgresql://pg-main.dbops-system.svc:5433/orders?user=orders_dashboard&password=p%40ss%3Aw%2Frd%3F%23%25"
        );
        assert_eq!(
            out["DSN"],
            "host=pg-main.dbops-system.svc password=p%40ss%3Aw%2Frd%3F%23%25"
        );
        // |urlencode inside a URL template is not encoded twice.
        assert_eq!(
            out["DOUBLE"],
            "postgres://orders_dashboard:p%40ss%3Aw%2Frd%3F%23%25@pg-main.dbops-system.svc"
        );
    }

    #[test]
    fn unreserved_characters_and_utf8() {
        let templates = map(&[("U", "x://{{ password }}")]);
        let out = render(&templates, &values("aZ09-._~ é")).unwrap();
        assert_eq!(out["U"], "x://aZ09-._~%20%C3%A9");
    }

    #[test]
    fn url_scheme_detection() {
        for url in [
            "postgresql://x",
            "postgres://x",
            "jdbc:postgresql://x",
            "a+b.c-d://",
        ] {
            assert!(is_url(url), "{url}");
        }
        for text in [
            "",
            "host={{ host }}",
            " postgresql://x",
            "://x",
            "1abc://x",
            "jdbc::postgresql://x",
            "DATABASE_URL=postgresql://x",
            "{{ host }}://x",
        ] {
            assert!(!is_url(text), "{text}");
        }
    }

    #[test]
    fn safe_disables_escaping() {
        let templates = map(&[(
            "DATABASE_URL",
            "postgresql://{{ user }}:{{ password|safe }}@{{ host }}",
        )]);
        let out = render(&templates, &values(PASSWORD)).unwrap();
        assert_eq!(
            out["DATABASE_URL"],
            format!("postgresql://orders_dashboard:{PASSWORD}@pg-main.dbops-system.svc")
        );
    }

    #[test]
    fn ca_and_conditionals() {
        let templates = map(&[(
            "PGSSLROOTCERT_PEM",
            "{% if ca %}{{ ca }}{% else %}none{% endif %}",
        )]);
        check(&templates).unwrap();
        assert_eq!(
            render(&templates, &values("x")).unwrap()["PGSSLROOTCERT_PEM"],
            "none"
        );
        let with_ca = Values {
            ca: DUMMY_CA,
            ..values("x")
        };
        assert_eq!(
            render(&templates, &with_ca).unwrap()["PGSSLROOTCERT_PEM"],
            DUMMY_CA
        );
    }

    #[test]
    fn unknown_variable_refused_naming_the_key() {
        let err = refused(&map(&[("DATABASE_URL", SPEC_URL), ("EXTRA", "{{ nope }}")]));
        assert_eq!(err.key.as_deref(), Some("EXTRA"));
        let shown = err.to_string();
        assert!(shown.contains("spec.secretTemplate[\"EXTRA\"]"), "{shown}");
        assert!(shown.contains("undefined"), "{shown}");
        // Also behind a filter, and in a URL template.
        for text in [
            "{{ nope|safe }}",
            "{{ nope|urlencode }}",
            "postgresql://{{ nope }}",
        ] {
            let err = refused(&map(&[("K", text)]));
            assert_eq!(err.key.as_deref(), Some("K"), "{text}");
        }
        // Only on the branch taken with a CA: check tries both.
        let err = refused(&map(&[("K", "{% if ca %}{{ nope }}{% endif %}")]));
        assert_eq!(err.key.as_deref(), Some("K"));
    }

    #[test]
    fn template_that_does_not_parse_refused_naming_the_key() {
        for text in [
            "{{ user ",
            "{% if user %}",
            "{% macro m() %}{% endmacro %}",
            "{% include 'x' %}",
        ] {
            let err = refused(&map(&[("DATABASE_URL", SPEC_URL), ("BROKEN", text)]));
            assert_eq!(err.key.as_deref(), Some("BROKEN"), "{text}");
            assert!(
                err.to_string().contains("spec.secretTemplate[\"BROKEN\"]"),
                "{err}"
            );
        }
        let err = refused(&map(&[("BROKEN", "{{ user ")]));
        assert!(err.reason.contains("does not parse"), "{err}");
    }

    #[test]
    fn unknown_filters_and_functions_refused() {
        for text in ["{{ user|upper }}", "{{ range(3) }}", "{{ lipsum() }}"] {
            let err = refused(&map(&[("K", text)]));
            assert_eq!(err.key.as_deref(), Some("K"), "{text}");
        }
    }

    #[test]
    fn reserved_and_bad_keys_refused() {
        for key in RESERVED_KEYS {
            let err = refused(&map(&[(key, "{{ user }}")]));
            assert_eq!(err.key.as_deref(), Some(key));
            assert!(err.reason.contains("dbops writes itself"), "{err}");
        }
        let long = "k".repeat(MAX_KEY_CHARS + 1);
        for key in ["a/b", "", "a b", "ü", ".", "..", "..x", long.as_str()] {
            let err = refused(&map(&[(key, "{{ user }}")]));
            assert_eq!(err.key.as_deref(), Some(key), "{key:?}");
        }
        let ok = "k".repeat(MAX_KEY_CHARS);
        check(&map(&[
            (ok.as_str(), "x"),
            ("a.b-c_D9", "x"),
            (".env", "x"),
        ]))
        .unwrap();
    }

    #[test]
    fn too_many_keys_and_too_long_templates_refused() {
        let many: BTreeMap<String, String> = (0..=MAX_KEYS)
            .map(|i| (format!("K{i}"), "{{ user }}".to_string()))
            .collect();
        let err = refused(&many);
        assert_eq!(err.key, None);
        assert!(err.to_string().contains("at most 32"), "{err}");
        let mut enough = many;
        enough.remove("K0");
        check(&enough).unwrap();

        let long = "x".repeat(MAX_TEMPLATE_BYTES + 1);
        let err = refused(&map(&[("LONG", long.as_str())]));
        assert_eq!(err.key.as_deref(), Some("LONG"));
        check(&map(&[("LONG", &long[1..])])).unwrap();
    }

    #[test]
    fn endless_templates_run_out_of_fuel() {
        let digits = "\"0123456789\"";
        let mut text = String::new();
        for i in 0..9 {
            text.push_str(&format!("{{% for x{i} in {digits} %}}"));
        }
        text.push_str("{{ password }}");
        for _ in 0..9 {
            text.push_str("{% endfor %}");
        }
        let started = std::time::Instant::now();
        let err = refused(&map(&[("LOOP", text.as_str())]));
        assert_eq!(err.key.as_deref(), Some("LOOP"));
        assert!(err.reason.contains("fuel"), "{err}");
        // A big output from a small template is stopped the same way.
        let err = refused(&map(&[(
            "BIG",
            "{% for a in password %}{% for b in password %}{% for c in password %}{% for d in password %}{{ ca }}{{ ca }}{% endfor %}{% endfor %}{% endfor %}{% endfor %}",
        )]));
        assert!(err.reason.contains("fuel"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn errors_never_contain_the_password() {
        let password = "Sup3r-S3cret/value@";
        for text in [
            "{{ password + 1 }}",
            "{{ password - 1 }}",
            "{{ password() }}",
            "{{ password.x.y }}",
            "{{ password[99] }}",
            "{{ password * 100000000 }}",
            "{% for a, b in password %}{% endfor %}",
            "{% if password == 'x' %}{% else %}{{ password ~ nope }}{% endif %}",
            "{{ password|nofilter }}",
            "{{ 1 / 0 }}",
            "postgresql://{{ password ~ nope }}",
            "{{ password|safe ~ 1 }}{{ user.missing.attr }}",
        ] {
            let templates = map(&[("K", text)]);
            let err = render(&templates, &values(password)).expect_err(text);
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains(password), "{text}: {shown}");
            assert!(
                !shown.contains("Sup3r-S3cret%2Fvalue%40"),
                "{text}: {shown}"
            );
            assert_eq!(err.key.as_deref(), Some("K"));
        }
        assert_eq!(
            redact(format!("x {password} y"), password),
            "x <redacted> y"
        );
    }

    /// `ca_file` in a URL template: percent-encoded like every value (libpq, pgjdbc,
    /// node-postgres and pgx decode a query value), empty without a mount path.
    #[test]
    fn ca_file_names_the_mounted_ca() {
        let templates = map(&[(
            "SPRING_DATASOURCE_URL",
            "jdbc:postgresql://{{ host }}:{{ port }}/{{ database }}?sslmode={{ sslmode }}{% if ca_file %}&sslrootcert={{ ca_file }}{% endif %}",
        )]);
        let mounted = Values {
            ca_file: "/etc/dbops/orders/ca.crt",
            ..values(PASSWORD)
        };
        assert_eq!(
            render(&templates, &mounted).unwrap()["SPRING_DATASOURCE_URL"],
            "jdbc:postgresql://pg-main.dbops-system.svc:5433/orders?sslmode=verify-full&sslrootcert=%2Fetc%2Fdbops%2Forders%2Fca.crt"
        );
        assert_eq!(
            render(&templates, &values(PASSWORD)).unwrap()["SPRING_DATASOURCE_URL"],
            "jdbc:postgresql://pg-main.dbops-system.svc:5433/orders?sslmode=verify-full"
        );
        check(&templates).unwrap();
    }

    /// A template of `PGSSLROOTCERT` keeps working without a mount path and is refused
    /// with one, where the controller writes that key itself.
    #[test]
    fn the_mount_key_is_refused_only_with_a_mount_path() {
        let templates = map(&[(MOUNT_KEY, "/certs/ca.crt")]);
        check(&templates).unwrap();
        check_mounted(&templates, None).unwrap();
        let err = check_mounted(&templates, Some("/etc/dbops/orders")).unwrap_err();
        assert_eq!(err.key.as_deref(), Some(MOUNT_KEY));
        assert!(err.reason.contains("secretMountPath"), "{err}");
        check_mounted(&map(&[("OTHER", "x")]), Some("/etc/dbops/orders")).unwrap();
    }

    #[test]
    fn values_debug_redacts_the_password() {
        let shown = format!("{:?}", values(PASSWORD));
        assert!(!shown.contains(PASSWORD), "{shown}");
        assert!(shown.contains("orders_dashboard"), "{shown}");
    }

    #[test]
    fn rendered_total_is_bounded() {
        let ca = "A".repeat(200 * 1024);
        let with_ca = Values {
            ca: &ca,
            ..values("x")
        };
        let templates = map(&[("A", "{{ ca }}"), ("B", "{{ ca }}"), ("C", "{{ ca }}")]);
        let err = render(&templates, &with_ca).expect_err("over the total");
        assert_eq!(err.key.as_deref(), Some("C"));
        let two = map(&[("A", "{{ ca }}"), ("B", "{{ ca }}")]);
        assert_eq!(render(&two, &with_ca).unwrap()["B"], ca);
    }
}
