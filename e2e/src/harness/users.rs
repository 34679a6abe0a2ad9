#![allow(clippy::unwrap_used)] // a test harness: an unwrap that fails is a failed test
//! What the DatabaseUser tests ask on top of [`crate::harness::database`]: a user created,
//! waited for (its status shown without its Secret's values), its connection Secret and a
//! session through it, a refused statement's SQLSTATE, a retired login, roles by prefix.

use std::time::Duration;

use dbops_api::DatabaseUser;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio_postgres::error::SqlState;

use crate::harness::database::{READY, Setup, connect, value};
use crate::wait::eventually;

pub fn users(s: &Setup) -> Api<DatabaseUser> {
    Api::namespaced(s.b.client.clone(), s.ns())
}

pub async fn create_user(s: &Setup, name: &str, spec: serde_json::Value) -> DatabaseUser {
    let user: DatabaseUser = serde_json::from_value(json!({
        "apiVersion": "dbops.dev/v1alpha1",
        "kind": "DatabaseUser",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap();
    users(s)
        .create(&PostParams::default(), &user)
        .await
        .unwrap_or_else(|e| panic!("creating DatabaseUser {name}: {e}"))
}

/// Waits until the user's Ready condition has `status` and `reason`, for its current
/// generation.
pub async fn wait_user(s: &Setup, name: &str, status: &str, reason: &str) -> DatabaseUser {
    wait_user_where(s, name, status, reason, |_| true).await
}

/// [`wait_user`], once `also` holds for the user too.
pub async fn wait_user_where(
    s: &Setup,
    name: &str,
    status: &str,
    reason: &str,
    also: impl Fn(&DatabaseUser) -> bool,
) -> DatabaseUser {
    let api = users(s);
    let found = crate::wait::wait_for(
        &format!("DatabaseUser {name} Ready={status} ({reason})"),
        READY,
        || async { Ok(api.get_opt(name).await?.map(Shown)) },
        |u| {
            u.as_ref().is_some_and(|u| {
                let st = u.0.status.as_ref();
                st.is_some_and(|st| st.observed_generation == u.0.metadata.generation)
                    && st
                        .and_then(|st| st.conditions.iter().find(|c| c.type_ == "Ready"))
                        .is_some_and(|c| c.status == status && c.reason == reason)
                    && also(&u.0)
            })
        },
    )
    .await;
    match found {
        Ok(u) => u.map(|u| u.0).unwrap(),
        Err(e) => panic!(
            "{e:#}\n---- controller log tail ----\n{}",
            s.controller_log(8000)
        ),
    }
}

/// A DatabaseUser shown by its status only (never a Secret).
pub struct Shown(DatabaseUser);

impl std::fmt::Debug for Shown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0.status)
    }
}

/// The connection Secret of a DatabaseUser, once it names `login` (any login if `None`).
pub async fn user_secret(s: &Setup, name: &str, login: Option<&str>) -> Secret {
    let secrets: Api<Secret> = Api::namespaced(s.b.client.clone(), s.ns());
    let secret_name = format!("{name}-connection");
    eventually(
        &format!("Secret {secret_name} naming {login:?}"),
        READY,
        || async { Ok(secrets.get_opt(&secret_name).await?.map(Keys)) },
        |found| {
            found.as_ref().is_some_and(|k| {
                login.is_none_or(|l| {
                    k.0.data
                        .as_ref()
                        .and_then(|d| d.get("username"))
                        .is_some_and(|u| u.0 == l.as_bytes())
                })
            })
        },
    )
    .await
    .map(|k| k.0)
    .unwrap()
}

/// A Secret shown by its keys only.
pub struct Keys(Secret);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&String> = self.0.data.iter().flat_map(|d| d.keys()).collect();
        write!(f, "Secret {:?} keys {keys:?}", self.0.metadata.name)
    }
}

pub async fn connect_with(s: &Setup, secret: &Secret) -> tokio_postgres::Client {
    connect(
        "127.0.0.1",
        s.pg.port(),
        &value(secret, "username"),
        &value(secret, "password"),
        &value(secret, "dbname"),
    )
    .await
    .unwrap()
}

/// The SQLSTATE of a statement that must fail.
pub async fn refused(c: &tokio_postgres::Client, sql: &str) -> SqlState {
    match c.batch_execute(sql).await {
        Ok(()) => panic!("{sql:?} succeeded; it must be refused"),
        Err(e) => e.code().cloned().unwrap_or_else(|| panic!("{sql:?}: {e}")),
    }
}

/// Waits (40 s at most) until `login` can no longer log in: retired after keepPrevious.
pub async fn wait_retired(s: &Setup, login: &str) {
    s.pg.wait_retired(login, Duration::from_secs(40)).await;
}

pub async fn roles_like(s: &Setup, prefix: &str) -> Vec<String> {
    let admin = s.pg.connect_as_superuser().await.unwrap();
    admin
        .query(
            "SELECT rolname::text FROM pg_roles WHERE rolname LIKE $1 || '%' ORDER BY 1",
            &[&prefix],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}
