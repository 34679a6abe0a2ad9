//! Sentinels and their template text, and the merge of the base and the S3 variant of one
//! object into one template (what differs becomes an `if`/`else` on the store's type).

use anyhow::{Context, Result, bail, ensure};
use serde_norway::{Mapping, Value};

pub(super) const IF_FILE: &str = r#"{{- if eq .Values.backupStore.type "file" }}"#;
pub(super) const IF_S3: &str = r#"{{- if eq .Values.backupStore.type "s3" }}"#;
pub(super) const END: &str = "{{- end }}";

/// What a sentinel stands for.
pub(super) enum Tpl {
    /// Replaces the sentinel inside its line (a scalar's value).
    Inline(String),
    /// Replaces the sentinel's whole line (a mapping key `dbopstpl<n>x: null` or a
    /// sequence item `- dbopstpl<n>x`) with these lines, at the sentinel's indentation.
    Raw(Vec<String>),
    /// A mapping value `key: dbopstpl<n>x` becomes `key:` and `toYaml <expr>` below it.
    Block(String),
    /// A sequence item `- dbopstpl<n>x` becomes the items of the list `<expr>` (none when
    /// it is empty), at the sentinel's indentation.
    Items(String),
}

#[derive(Default)]
pub(super) struct Templates(Vec<Tpl>);

impl Templates {
    pub(super) fn add(&mut self, t: Tpl) -> Value {
        self.0.push(t);
        Value::String(format!("dbopstpl{}x", self.0.len() - 1))
    }
    pub(super) fn inline(&mut self, text: impl Into<String>) -> Value {
        self.add(Tpl::Inline(text.into()))
    }
    pub(super) fn raw(&mut self, lines: &[&str]) -> Value {
        self.add(Tpl::Raw(lines.iter().map(|l| l.to_string()).collect()))
    }
    pub(super) fn block(&mut self, expr: impl Into<String>) -> Value {
        self.add(Tpl::Block(expr.into()))
    }
    pub(super) fn items(&mut self, expr: impl Into<String>) -> Value {
        self.add(Tpl::Items(expr.into()))
    }

    /// The YAML of `value` with its sentinels expanded (and any literal `{{` escaped, so
    /// Helm renders it as it is).
    pub(super) fn render(&self, value: &Value) -> Result<String> {
        let text = serde_norway::to_string(value).context("serializing a template")?;
        let text = text.replace("{{", r#"{{ "{{" }}"#);
        let mut out = String::new();
        for line in text.lines() {
            let Some(at) = line.find("dbopstpl") else {
                out.push_str(line);
                out.push('\n');
                continue;
            };
            let rest = &line[at + "dbopstpl".len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let token = format!("dbopstpl{digits}x");
            ensure!(
                rest[digits.len()..].starts_with('x'),
                "a malformed sentinel in {line:?}"
            );
            let n: usize = digits.parse().context("a sentinel's number")?;
            let tpl = self.0.get(n).context("an unknown sentinel")?;
            let indent = line.len() - line.trim_start().len();
            let trimmed = line.trim();
            match tpl {
                Tpl::Inline(text) => {
                    ensure!(
                        line.matches("dbopstpl").count() == 1,
                        "two sentinels in {line:?}"
                    );
                    out.push_str(&line.replace(&token, text));
                    out.push('\n');
                }
                Tpl::Raw(lines) => {
                    ensure!(
                        trimmed == format!("- {token}") || trimmed == format!("{token}: null"),
                        "a raw sentinel that is neither a key nor an item: {line:?}"
                    );
                    for l in lines {
                        out.push_str(&" ".repeat(indent));
                        out.push_str(l);
                        out.push('\n');
                    }
                }
                Tpl::Items(expr) => {
                    ensure!(
                        trimmed == format!("- {token}"),
                        "an items sentinel that is not a sequence item: {line:?}"
                    );
                    let pad = " ".repeat(indent);
                    out.push_str(&format!(
                        "{pad}{{{{- with {expr} }}}}\n\
                         {pad}{{{{- toYaml . | nindent {indent} }}}}\n\
                         {pad}{END}\n"
                    ));
                }
                Tpl::Block(expr) => {
                    let head = line
                        .strip_suffix(&token)
                        .with_context(|| format!("a block sentinel not at the end: {line:?}"))?;
                    ensure!(
                        head.ends_with(": "),
                        "a block sentinel not a value: {line:?}"
                    );
                    // The key's column: past the indentation and a sequence item's dash.
                    let key_col = indent + if trimmed.starts_with("- ") { 2 } else { 0 };
                    out.push_str(head.trim_end());
                    out.push('\n');
                    let inner = key_col + 2;
                    out.push_str(&format!(
                        "{}{{{{- toYaml {expr} | nindent {inner} }}}}\n",
                        " ".repeat(inner)
                    ));
                }
            }
        }
        Ok(out)
    }
}

/// The S3 variant's settings that become values.
pub(super) struct S3Defaults {
    pub(super) url: String,
    pub(super) secret_name: String,
}

impl S3Defaults {
    /// From the S3 variant: the backup store URL and the Secret in `envFrom`.
    pub(super) fn from_variant(docs: &[Value]) -> Result<Self> {
        let mut url = None;
        let mut secret = None;
        for d in docs.iter().filter(|d| d["kind"] == "Deployment") {
            for c in d["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .into_iter()
                .flatten()
            {
                for e in c["env"].as_sequence().into_iter().flatten() {
                    if e["name"] == "DBOPS_BACKUP_STORE"
                        && let Some(v) = e["value"].as_str()
                        && v.starts_with("s3://")
                    {
                        url = Some(v.to_string());
                    }
                }
                for e in c["envFrom"].as_sequence().into_iter().flatten() {
                    if let Some(name) = e["secretRef"]["name"].as_str() {
                        secret = Some(name.to_string());
                    }
                }
            }
        }
        Ok(Self {
            url: url.context("the S3 variant sets no DBOPS_BACKUP_STORE=s3://...")?,
            secret_name: secret.context("the S3 variant takes no Secret in envFrom")?,
        })
    }

    /// A scalar of the S3 variant as template text: a value where it is one.
    pub(super) fn scalar(&self, v: &Value) -> Result<String> {
        Ok(match v.as_str() {
            Some(s) if s == self.url => "{{ .Values.backupStore.s3.url | quote }}".into(),
            Some(s) if s == self.secret_name => {
                "{{ .Values.backupStore.s3.secretName | quote }}".into()
            }
            _ => literal(v)?,
        })
    }

    /// `v` (only in the S3 variant) with its URL and Secret name as values.
    pub(super) fn parametrize(&self, t: &mut Templates, v: &Value) -> Result<Value> {
        Ok(match v {
            Value::String(s) if *s == self.url || *s == self.secret_name => {
                let text = self.scalar(v)?;
                t.inline(text)
            }
            Value::Mapping(m) => {
                let mut out = Mapping::new();
                for (k, v) in m {
                    out.insert(k.clone(), self.parametrize(t, v)?);
                }
                Value::Mapping(out)
            }
            Value::Sequence(s) => Value::Sequence(
                s.iter()
                    .map(|v| self.parametrize(t, v))
                    .collect::<Result<_>>()?,
            ),
            other => other.clone(),
        })
    }
}

/// A scalar as YAML flow text (JSON is YAML), with `{{` escaped.
pub(super) fn literal(v: &Value) -> Result<String> {
    let json = serde_json::to_string(v).context("a scalar as JSON")?;
    Ok(json.replace("{{", r#"{{ "{{" }}"#))
}

/// The name of a sequence item (`name:`), when it has one.
pub(super) fn item_name(v: &Value) -> Option<&str> {
    v.get("name").and_then(Value::as_str)
}

/// One template out of the base (`file`) and the S3 variant of the same object.
pub(super) fn merge(
    t: &mut Templates,
    s3: &S3Defaults,
    base: &Value,
    other: &Value,
    path: &str,
) -> Result<Value> {
    if base == other {
        return Ok(base.clone());
    }
    match (base, other) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            // Keys only the S3 variant has, after the key they follow there.
            let mut added: Vec<(Option<&Value>, &Value, &Value)> = Vec::new();
            let mut prev = None;
            for (k, v) in o {
                if b.contains_key(k) {
                    prev = Some(k);
                } else {
                    added.push((prev, k, v));
                }
            }
            let mut out = Mapping::new();
            let add_after = |out: &mut Mapping, t: &mut Templates, after: Option<&Value>| {
                for (_, k, v) in added.iter().filter(|(a, _, _)| *a == after) {
                    out.insert(t.raw(&[IF_S3]), Value::Null);
                    out.insert((*k).clone(), s3.parametrize(t, v)?);
                    out.insert(t.raw(&[END]), Value::Null);
                }
                anyhow::Ok(())
            };
            add_after(&mut out, t, None)?;
            for (k, v) in b {
                let key = k.as_str().unwrap_or("?");
                match o.get(k) {
                    Some(ov) => {
                        let merged = merge(t, s3, v, ov, &format!("{path}.{key}"))?;
                        out.insert(k.clone(), merged);
                    }
                    None => {
                        out.insert(t.raw(&[IF_FILE]), Value::Null);
                        out.insert(k.clone(), v.clone());
                        out.insert(t.raw(&[END]), Value::Null);
                    }
                }
                add_after(&mut out, t, Some(k))?;
            }
            Ok(Value::Mapping(out))
        }
        (Value::Sequence(b), Value::Sequence(o)) => {
            let names = |s: &[Value]| -> Option<Vec<String>> {
                let names: Option<Vec<String>> =
                    s.iter().map(|v| item_name(v).map(String::from)).collect();
                let names = names?;
                let mut unique = names.clone();
                unique.sort();
                unique.dedup();
                (unique.len() == names.len()).then_some(names)
            };
            match (names(b), names(o)) {
                (Some(bn), Some(on)) => {
                    let mut added: Vec<(Option<&str>, &Value)> = Vec::new();
                    let mut prev = None;
                    for (name, v) in on.iter().zip(o) {
                        if bn.contains(name) {
                            prev = Some(name.as_str());
                        } else {
                            added.push((prev, v));
                        }
                    }
                    let mut out = Vec::new();
                    let add_after =
                        |out: &mut Vec<Value>, t: &mut Templates, after: Option<&str>| {
                            for (_, v) in added.iter().filter(|(a, _)| *a == after) {
                                out.push(t.raw(&[IF_S3]));
                                out.push(s3.parametrize(t, v)?);
                                out.push(t.raw(&[END]));
                            }
                            anyhow::Ok(())
                        };
                    add_after(&mut out, t, None)?;
                    for (name, v) in bn.iter().zip(b) {
                        match on.iter().position(|n| n == name) {
                            Some(i) => {
                                out.push(merge(t, s3, v, &o[i], &format!("{path}[{name}]"))?)
                            }
                            None => {
                                out.push(t.raw(&[IF_FILE]));
                                out.push(v.clone());
                                out.push(t.raw(&[END]));
                            }
                        }
                        add_after(&mut out, t, Some(name))?;
                    }
                    ensure!(
                        !out.is_empty() && bn.iter().any(|n| on.contains(n)),
                        "{path}: the base and the S3 variant share no item; a list that may \
                         render empty is not supported"
                    );
                    Ok(Value::Sequence(out))
                }
                _ if b.len() == o.len() => Ok(Value::Sequence(
                    b.iter()
                        .zip(o)
                        .enumerate()
                        .map(|(i, (bv, ov))| merge(t, s3, bv, ov, &format!("{path}[{i}]")))
                        .collect::<Result<_>>()?,
                )),
                _ => bail!(
                    "{path}: the S3 variant changes a list without names; chartgen cannot \
                     template that change of components/s3-backup-store"
                ),
            }
        }
        (b, o) if !b.is_mapping() && !b.is_sequence() && !o.is_mapping() && !o.is_sequence() => {
            Ok(t.inline(format!(
                r#"{{{{ if eq .Values.backupStore.type "s3" }}}}{}{{{{ else }}}}{}{{{{ end }}}}"#,
                s3.scalar(o)?,
                literal(b)?
            )))
        }
        _ => bail!("{path}: the S3 variant changes its type; chartgen cannot template that"),
    }
}
