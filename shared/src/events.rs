//! Events about the objects a controller reconciles.

use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder};

/// Publishes a Normal (or Warning) Event about `obj`; a failure is logged, never fatal:
/// an Event is a report, not a step of the reconcile.
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
    if let Err(e) = recorder.publish(&ev, &obj.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "could not publish an Event");
    }
}
