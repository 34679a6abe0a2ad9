//! Events about the objects a controller reconciles.

use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder};
use tracing::Instrument;

/// Publishes a Normal (or Warning) Event about `obj` in the background: the reconcile does
/// not wait for the API server (one request less on its path), and a failure is logged,
/// never fatal: an Event is a report, not a step of the reconcile. The request stays in
/// the reconcile's trace.
pub async fn publish<K>(
    recorder: &Recorder,
    obj: &K,
    normal: bool,
    action: &str,
    reason: &str,
    note: &str,
) where
    K: Resource<DynamicType = ()>,
{
    let ev = Event {
        type_: if normal {
            EventType::Normal
        } else {
            EventType::Warning
        },
        reason: reason.to_string(),
        note: Some(note.to_string()),
        action: action.to_string(),
        secondary: None,
    };
    let recorder = recorder.clone();
    let reference = obj.object_ref(&());
    let reason = ev.reason.clone();
    tokio::spawn(
        async move {
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::warn!(error = %e, reason, "could not publish an Event");
            }
        }
        .in_current_span(),
    );
}
