//! deploy/argocd's health checks run as Argo CD runs them: each kind's Lua script, from
//! the `argocd-cm` keys `resource.customizations.health.dbops.dev_<Kind>`, as the body of
//! a function with the object in the global `obj`, by gopher-lua's `glua` (the
//! interpreter Argo CD embeds, built by `e2e/install`).

use std::collections::BTreeMap;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The health checks file, from the repository root.
pub const HEALTH: &str = "deploy/argocd/health.yaml";

const KEY: &str = "resource.customizations.health.dbops.dev_";

/// Each kind's script, read from the ConfigMap's `data` (block scalars, `|`).
pub fn scripts() -> Result<BTreeMap<String, String>> {
    let path = crate::paths::repo_root().join(HEALTH);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {HEALTH}"))?;
    let mut scripts = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some(rest) = line.trim_start().strip_prefix(KEY)
            && line.starts_with("  ")
            && !line.starts_with("    ")
        {
            if let Some((kind, body)) = current.take() {
                scripts.insert(kind, body);
            }
            let kind = rest
                .strip_suffix(": |")
                .with_context(|| format!("{HEALTH}: {line:?} is not a block scalar"))?;
            current = Some((kind.to_string(), String::new()));
            continue;
        }
        match &mut current {
            Some((_, body)) if line.starts_with("    ") || line.trim().is_empty() => {
                body.push_str(line.get(4..).unwrap_or_default());
                body.push('\n');
            }
            Some(_) => {
                if let Some((kind, body)) = current.take() {
                    scripts.insert(kind, body);
                }
            }
            None => {}
        }
    }
    if let Some((kind, body)) = current {
        scripts.insert(kind, body);
    }
    Ok(scripts)
}

/// `value` as a Lua table constructor (JSON null as nil: Argo CD's conversion leaves
/// absent what is null).
pub fn lua(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "nil".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => lua_string(s),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(lua).collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("[{}] = {}", lua_string(k), lua(v)))
                .collect();
            format!("{{{}}}", fields.join(", "))
        }
    }
}

fn lua_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\{:03}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// What Argo CD would show for `object` of `kind`: its health status and message.
pub fn health(script: &str, object: &serde_json::Value) -> Result<(String, String)> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("check.lua");
    let program = format!(
        "obj = {}\nlocal hs = (function()\n{script}\nend)()\nio.write(hs.status, \"\\t\", hs.message or \"\", \"\\n\")\n",
        lua(object)
    );
    std::fs::write(&file, program)?;
    let out = Command::new(crate::paths::glua()?).arg(&file).output()?;
    if !out.status.success() {
        bail!("glua failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout).trim_end().to_string();
    let (status, message) = text.split_once('\t').unwrap_or((&text, ""));
    Ok((status.to_string(), message.to_string()))
}
