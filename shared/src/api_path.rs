//! What a Kubernetes API request names, read once for the client's stack (its spans,
//! its metrics, the write fence) and for the watch health: the resource, and whether the
//! path is a collection (what a list or a watch reads) or one object, and whether its
//! query asks for a watch.

/// The segments after `/api/<version>` or `/apis/<group>/<version>`: `["secrets"]`,
/// `["namespaces", "ns", "databases", "orders", "status"]`; `None` for any other path
/// (`/version`, discovery).
fn resource_segments(path: &str) -> Option<Vec<&str>> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let skip = match segments.first() {
        Some(&"api") if segments.len() > 2 => 2,
        Some(&"apis") if segments.len() > 3 => 3,
        _ => return None,
    };
    Some(segments[skip..].to_vec())
}

/// The resource a request path names, without namespace or object name: `databases`,
/// `databases/status`, `secrets`, `namespaces`; the path itself when it is not a
/// resource path (`/version`).
pub fn resource_of(path: &str) -> String {
    let Some(rest) = resource_segments(path) else {
        return path.to_owned();
    };
    let rest = match rest.as_slice() {
        ["namespaces", _namespace, resource, more @ ..] => {
            let mut r = vec![*resource];
            r.extend(more);
            r
        }
        _ => rest,
    };
    match rest.as_slice() {
        [resource] | [resource, _] => (*resource).to_owned(),
        [resource, _, subresource, ..] => format!("{resource}/{subresource}"),
        [] => path.to_owned(),
    }
}

/// `/api/v1/secrets`, `/api/v1/namespaces/ns/secrets`, `/apis/g/v/databases`,
/// `/apis/g/v/namespaces/ns/databases`, `/api/v1/namespaces`: a collection; an object's
/// path, a subresource's or a discovery path is none.
pub fn is_collection(path: &str) -> bool {
    resource_segments(path)
        .is_some_and(|rest| matches!(rest.as_slice(), [_] | ["namespaces", _, _]))
}

/// Whether a request's query asks for a watch (`watch=true`, or `watch=1`).
pub fn is_watch(query: Option<&str>) -> bool {
    query.is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_name_the_resource_not_the_object() {
        assert_eq!(
            resource_of("/api/v1/namespaces/ns/secrets/pg-admin"),
            "secrets"
        );
        assert_eq!(resource_of("/api/v1/namespaces/ns/secrets"), "secrets");
        assert_eq!(resource_of("/api/v1/namespaces/ns"), "namespaces");
        assert_eq!(
            resource_of("/apis/dbops.dev/v1alpha1/namespaces/ns/databases/orders/status"),
            "databases/status"
        );
        assert_eq!(
            resource_of("/apis/dbops.dev/v1alpha1/databases"),
            "databases"
        );
        assert_eq!(
            resource_of("/apis/coordination.k8s.io/v1/namespaces/ns/leases/x"),
            "leases"
        );
        assert_eq!(resource_of("/version"), "/version");
    }

    #[test]
    fn a_watch_is_asked_for_in_the_query() {
        assert!(is_watch(Some("watch=true&resourceVersion=1")));
        assert!(is_watch(Some("labelSelector=a&watch=1")));
        assert!(!is_watch(Some("limit=500")));
        assert!(!is_watch(None));
    }
}
