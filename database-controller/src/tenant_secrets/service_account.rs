//! The ServiceAccount the RoleBindings name: `--service-account` as given, or the one a
//! username `system:serviceaccount:<namespace>:<name>` is.

use k8s_openapi::api::rbac::v1::Subject;

/// A ServiceAccount: the subject of the RoleBindings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccount {
    pub namespace: String,
    pub name: String,
}

/// `--service-account` as given: `<namespace>/<name>`, or `<name>` (then in
/// `--controller-namespace`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccountArg {
    namespace: Option<String>,
    name: String,
}

impl ServiceAccountArg {
    /// clap's parser of `--service-account`.
    pub fn parse(value: &str) -> std::result::Result<Self, String> {
        let valid = |part: &str| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        };
        let (namespace, name) = match value.split_once('/') {
            Some((namespace, name)) => (Some(namespace), name),
            None => (None, value),
        };
        if !valid(name) || namespace.is_some_and(|ns| !valid(ns)) {
            return Err(format!(
                "{value:?} is not <namespace>/<name> or <name> of a ServiceAccount"
            ));
        }
        Ok(Self {
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        })
    }

    /// The ServiceAccount, a bare name being in `controller_namespace`.
    pub fn in_namespace(&self, controller_namespace: &str) -> ServiceAccount {
        ServiceAccount {
            namespace: self
                .namespace
                .clone()
                .unwrap_or_else(|| controller_namespace.to_string()),
            name: self.name.clone(),
        }
    }
}

impl ServiceAccount {
    /// The ServiceAccount a username `system:serviceaccount:<namespace>:<name>` is.
    pub fn from_username(username: &str) -> Option<Self> {
        let rest = username.strip_prefix("system:serviceaccount:")?;
        let (namespace, name) = rest.split_once(':')?;
        (!namespace.is_empty() && !name.is_empty() && !name.contains(':')).then(|| Self {
            namespace: namespace.to_string(),
            name: name.to_string(),
        })
    }

    pub(super) fn subject(&self) -> Subject {
        Subject {
            api_group: None,
            kind: "ServiceAccount".into(),
            name: self.name.clone(),
            namespace: Some(self.namespace.clone()),
        }
    }

    pub(super) fn is(&self, subject: &Subject) -> bool {
        subject.kind == "ServiceAccount"
            && subject.name == self.name
            && subject.namespace.as_deref() == Some(self.namespace.as_str())
    }
}

impl std::fmt::Display for ServiceAccount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(namespace: &str) -> ServiceAccount {
        ServiceAccount {
            namespace: namespace.into(),
            name: "dbops-database-controller".into(),
        }
    }

    #[test]
    fn the_service_account_comes_from_the_flag_or_the_username() {
        let bare = ServiceAccountArg::parse("dbops-database-controller").unwrap();
        assert_eq!(bare.in_namespace("dbops-system"), account("dbops-system"));
        let full = ServiceAccountArg::parse("dbops-blue/dbops-database-controller").unwrap();
        assert_eq!(full.in_namespace("dbops-system"), account("dbops-blue"));
        for bad in ["", "/x", "x/", "a/b/c", "Upper", "a b"] {
            assert!(ServiceAccountArg::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            ServiceAccount::from_username(
                "system:serviceaccount:dbops-system:dbops-database-controller"
            ),
            Some(account("dbops-system"))
        );
        for not_one in [
            "kubernetes-admin",
            "system:serviceaccount:x",
            "system:node:a",
        ] {
            assert_eq!(ServiceAccount::from_username(not_one), None, "{not_one}");
        }
    }
}
