//! The regular expressions the CEL rules of the CRDs check strings against, each written
//! once, and the functions that write those rules from them.
//!
//! A rule is passed to `#[x_kube(validation = Rule::new(...))]`, which takes any
//! expression (the derive pastes it into the generated `json_schema`), so
//! `Rule::new(matches(DURATION_PATTERN))` writes exactly the rule text
//! `self.matches('^([0-9]{1,5}h|...)+$')` that a literal would.
//!
//! The patterns are put between single quotes in CEL: none may contain `'`.

/// A duration as Go and Kubernetes write it: integers with a unit each, `ms`, `s`, `m` or
/// `h` (for example `30s`, `5m`, `1h30m`, `720h`). The numbers have at most 5 digits before
/// `h`, 7 before `m` and 9 before `s` or `ms`, so that a string of at most 32 characters
/// (every such field's maxLength) stays under 834,000 hours, well within what CEL's
/// `duration()` (Go's `time.Duration`, up to 2,562,047 hours) converts: a longer one made
/// the rules that compare durations fail with a type conversion error and a message
/// about something else.
pub const DURATION_PATTERN: &str = "^([0-9]{1,5}h|[0-9]{1,7}m|[0-9]{1,9}s|[0-9]{1,9}ms)+$";
/// An amount of memory as PostgreSQL writes it: an integer and `kB`, `MB`, `GB` or `TB`.
pub const MEMORY_PATTERN: &str = "^[0-9]{1,9}(kB|MB|GB|TB)$";
/// A PostgreSQL identifier this operator accepts for databases and roles: lower case,
/// unquoted, at most 63 bytes (PostgreSQL's NAMEDATALEN - 1).
pub const IDENTIFIER_PATTERN: &str = "^[a-z_][a-z0-9_]{0,62}$";
/// An extension name: like [`IDENTIFIER_PATTERN`], with `-` allowed too (`uuid-ossp`).
/// Also what a Database's `metadata.name` must be for its database name to be derived
/// from it (`-` read as `_`).
pub const EXTENSION_NAME_PATTERN: &str = "^[a-z_][a-z0-9_-]{0,62}$";
/// The name of a Kubernetes object (a DatabaseServer, a Secret, ...): a lower case DNS
/// subdomain (its length is checked by the schema).
pub const OBJECT_NAME_PATTERN: &str = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$";
/// A size as a Kubernetes quantity of bytes without a fraction: an integer and an
/// optional binary (`Ki` to `Pi`) or decimal (`k` to `P`) suffix, e.g. `500Mi`, `20Gi`.
pub const SIZE_PATTERN: &str = "^[0-9]{1,15}(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$";
/// A backup schedule: a standard five-field cron expression (minute hour day-of-month
/// month day-of-week) or one of @hourly, @daily, @midnight, @weekly, @monthly, @yearly,
/// @annually. Each field's numbers within its range (minute 0-59, hour 0-23, day 1-31,
/// month 1-12, weekday 0-7), month and weekday names (any case), `*`, `?`, ranges, steps,
/// lists, and croner's L, W and #.
pub const CRON_PATTERN: &str = "^(@(hourly|daily|midnight|weekly|monthly|yearly|annually)|([*]|[?]|([0-5]?[0-9])(-([0-5]?[0-9]))?)(/[1-9][0-9]?)?(,([*]|[?]|([0-5]?[0-9])(-([0-5]?[0-9]))?)(/[1-9][0-9]?)?)* +([*]|[?]|([01]?[0-9]|2[0-3])(-([01]?[0-9]|2[0-3]))?)(/[1-9][0-9]?)?(,([*]|[?]|([01]?[0-9]|2[0-3])(-([01]?[0-9]|2[0-3]))?)(/[1-9][0-9]?)?)* +([*]|[?]|(0?[1-9]|[12][0-9]|3[01])(-(0?[1-9]|[12][0-9]|3[01]))?|L|LW|(0?[1-9]|[12][0-9]|3[01])W)(/[1-9][0-9]?)?(,([*]|[?]|(0?[1-9]|[12][0-9]|3[01])(-(0?[1-9]|[12][0-9]|3[01]))?|L|LW|(0?[1-9]|[12][0-9]|3[01])W)(/[1-9][0-9]?)?)* +([*]|[?]|(0?[1-9]|1[0-2])(-(0?[1-9]|1[0-2]))?|((?i)jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)(-((?i)jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec))?)(/[1-9][0-9]?)?(,([*]|[?]|(0?[1-9]|1[0-2])(-(0?[1-9]|1[0-2]))?|((?i)jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)(-((?i)jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec))?)(/[1-9][0-9]?)?)* +([*]|[?]|[0-7](-[0-7])?|((?i)sun|mon|tue|wed|thu|fri|sat)(-((?i)sun|mon|tue|wed|thu|fri|sat))?|L|[0-7]L|[0-7]#[1-5]|((?i)sun|mon|tue|wed|thu|fri|sat)#[1-5]|((?i)sun|mon|tue|wed|thu|fri|sat)L)(/[1-9][0-9]?)?(,([*]|[?]|[0-7](-[0-7])?|((?i)sun|mon|tue|wed|thu|fri|sat)(-((?i)sun|mon|tue|wed|thu|fri|sat))?|L|[0-7]L|[0-7]#[1-5]|((?i)sun|mon|tue|wed|thu|fri|sat)#[1-5]|((?i)sun|mon|tue|wed|thu|fri|sat)L)(/[1-9][0-9]?)?)*)$";

/// `<value>.matches('<pattern>')`: whether the CEL string `value` (`self`, `self.max`,
/// ...) has the pattern's form.
pub fn value_matches(value: &str, pattern: &str) -> String {
    format!("{value}.matches('{pattern}')")
}

/// `self.matches('<pattern>')`: the rule that a string field has the pattern's form.
pub fn matches(pattern: &str) -> String {
    value_matches("self", pattern)
}

/// `self.all(e, e.matches('<pattern>'))`: the rule that every item of a list of strings
/// has the pattern's form.
pub fn all_match(pattern: &str) -> String {
    format!("self.all(e, {})", value_matches("e", pattern))
}

/// `!<value>.matches('<pattern>') || ... || <rule>`, one `!...matches(...)` a value: a
/// rule that only applies when every value has the pattern's form. A value of another
/// form is refused by its own `matches` rule, with its own message; `rule` must not
/// report it a second time, nor fail converting it (`duration(self)` of `5d`).
pub fn when_all_match(values: &[&str], pattern: &str, rule: &str) -> String {
    let mut text = String::new();
    for value in values {
        text.push('!');
        text.push_str(&value_matches(value, pattern));
        text.push_str(" || ");
    }
    text.push_str(rule);
    text
}

/// `!self.matches('<pattern>') || <rule>`: [`when_all_match`] of the field itself.
pub fn when_matches(pattern: &str, rule: &str) -> String {
    when_all_match(&["self"], pattern, rule)
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde_json::Value;

    /// Every `(path, rule, message)` of a CRD: each rule of its schema, with its message
    /// and the path of the schema node that carries it.
    fn rules(node: &Value, path: &str, out: &mut Vec<(String, String, String)>) {
        match node {
            Value::Object(map) => {
                if let Some(Value::Array(validations)) = map.get("x-kubernetes-validations") {
                    for v in validations {
                        let text = |key| v.get(key).and_then(Value::as_str).unwrap_or_default();
                        out.push((path.to_owned(), text("rule").into(), text("message").into()));
                    }
                }
                for (key, child) in map {
                    rules(child, &format!("{path}/{key}"), out);
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    rules(child, &format!("{path}/{i}"), out);
                }
            }
            _ => {}
        }
    }

    /// The regular expressions of a rule's `.matches('...')` calls.
    fn matched_patterns(rule: &str) -> Vec<&str> {
        rule.split(".matches('")
            .skip(1)
            .map(|rest| &rest[..rest.find("')").expect("a closed matches('...')")])
            .collect()
    }

    const CONSTANTS: [(&str, &str); 7] = [
        ("DURATION_PATTERN", DURATION_PATTERN),
        ("MEMORY_PATTERN", MEMORY_PATTERN),
        ("IDENTIFIER_PATTERN", IDENTIFIER_PATTERN),
        ("EXTENSION_NAME_PATTERN", EXTENSION_NAME_PATTERN),
        ("OBJECT_NAME_PATTERN", OBJECT_NAME_PATTERN),
        ("SIZE_PATTERN", SIZE_PATTERN),
        ("CRON_PATTERN", CRON_PATTERN),
    ];

    /// The patterns that only one field's rule checks, left written in that rule.
    const ONE_OFFS: [(&str, &str); 5] = [
        ("expireAfter", "^([0-9]{1,9}(s|m|h))+$"),
        ("table", "^[^.]{1,63}[.][^.]{1,63}$"),
        ("host", "^[A-Za-z0-9]([-A-Za-z0-9.:]*[A-Za-z0-9])?$"),
        ("secretMountPath", "^(/[-_a-zA-Z0-9][-_.a-zA-Z0-9]*)+$"),
        ("secretTemplate key", "^[-._a-zA-Z0-9]{1,253}$"),
    ];

    #[test]
    fn the_rules_write_the_patterns_as_cel_reads_them() {
        assert_eq!(matches("^a$"), "self.matches('^a$')");
        assert_eq!(all_match("^a$"), "self.all(e, e.matches('^a$'))");
        assert_eq!(when_matches("^a$", "x"), "!self.matches('^a$') || x");
        assert_eq!(
            when_all_match(&["self.a", "self.b"], "^a$", "x"),
            "!self.a.matches('^a$') || !self.b.matches('^a$') || x"
        );
        for (name, pattern) in CONSTANTS {
            assert!(!pattern.contains('\''), "{name} has a quote");
        }
    }

    /// Each pattern the CRDs' rules check is one of the constants or a known one-off, and
    /// each constant is checked where its kind of value is: a copy of a constant's pattern
    /// written (and edited) in one rule, or the wrong constant in a rule, fails here.
    #[test]
    fn every_rule_pattern_is_a_constant_where_it_should_be() {
        let mut all = Vec::new();
        for crd in crate::crds() {
            let name = crd.metadata.name.clone().unwrap_or_default();
            let json = serde_json::to_value(&crd).expect("a CRD serializes");
            rules(&json, &name, &mut all);
        }
        assert!(!all.is_empty(), "no CEL rules found");

        let mut uses = std::collections::BTreeMap::<&str, usize>::new();
        for (path, rule, message) in &all {
            for pattern in matched_patterns(rule) {
                let name = CONSTANTS
                    .iter()
                    .chain(ONE_OFFS.iter())
                    .find(|(_, p)| *p == pattern)
                    .map(|(name, _)| *name)
                    .unwrap_or_else(|| {
                        panic!("{path}: rule {rule:?} checks {pattern:?}, neither a constant nor a known one-off")
                    });
                *uses.entry(name).or_default() += 1;

                // The kind of value, from what the rule does with it or what its message
                // says, names the one pattern it may be checked against.
                let expected = if rule.contains("duration(") {
                    Some("DURATION_PATTERN")
                } else if rule.contains("endsWith('kB')") || message.contains("amount of memory") {
                    Some("MEMORY_PATTERN")
                } else if message.contains("must be a duration such as") {
                    // expireAfter's is a duration of other units, not compared in CEL.
                    Some(if message.starts_with("expireAfter ") {
                        "expireAfter"
                    } else {
                        "DURATION_PATTERN"
                    })
                } else if message.contains("must be a PostgreSQL identifier") {
                    Some("IDENTIFIER_PATTERN")
                } else if message.contains("extension name")
                    || message.contains("is not a PostgreSQL identifier")
                {
                    Some("EXTENSION_NAME_PATTERN")
                } else if message.contains("DNS subdomain") {
                    Some("OBJECT_NAME_PATTERN")
                } else if message.contains("must be a size such as") {
                    Some("SIZE_PATTERN")
                } else if message.contains("cron expression") {
                    Some("CRON_PATTERN")
                } else {
                    None
                };
                if let Some(expected) = expected {
                    assert_eq!(name, expected, "{path}: rule {rule:?} ({message:?})");
                }
            }
        }

        // Every constant is used, and where the kinds of values are.
        for (name, _) in CONSTANTS {
            assert!(uses.contains_key(name), "{name} is checked by no rule");
        }
        let rule_at = |crd: &str, suffix: &str, expected: String| {
            assert!(
                all.iter().any(|(path, rule, _)| path.starts_with(crd)
                    && path.ends_with(suffix)
                    && *rule == expected),
                "no rule {expected:?} at {crd} {suffix}"
            );
        };
        let users = "databaseusers.dbops.dev/";
        let databases = "databases.dbops.dev/";
        let servers = "databaseservers.dbops.dev/";
        let spec = "/properties/spec/properties";
        rule_at(
            users,
            "/settings/properties/statementTimeout",
            matches(DURATION_PATTERN),
        );
        rule_at(
            databases,
            "/settings/properties/workMem",
            matches(MEMORY_PATTERN),
        );
        rule_at(
            servers,
            "/statementTimeout/properties/max",
            matches(DURATION_PATTERN),
        );
        rule_at(servers, "/workMem/properties/max", matches(MEMORY_PATTERN));
        rule_at(
            databases,
            &format!("{spec}/databaseName"),
            matches(IDENTIFIER_PATTERN),
        );
        rule_at(
            databases,
            &format!("{spec}/extensions"),
            all_match(EXTENSION_NAME_PATTERN),
        );
        rule_at(
            servers,
            &format!("{spec}/allowedExtensions"),
            all_match(EXTENSION_NAME_PATTERN),
        );
        rule_at(
            databases,
            &format!("{spec}/serverRef/properties/name"),
            matches(OBJECT_NAME_PATTERN),
        );
        rule_at(servers, "/databaseSize", matches(SIZE_PATTERN));
        rule_at(servers, "/cloneSpace", matches(SIZE_PATTERN));
        rule_at(
            databases,
            "/backup/properties/schedule",
            matches(CRON_PATTERN),
        );
    }
}
