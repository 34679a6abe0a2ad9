//! Shutdown on SIGTERM or SIGINT: one [`CancellationToken`] cancelled by the first signal,
//! which the controller, the leader election and the health server all watch.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Why the signal handlers could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum ShutdownError {
    #[error("failed to install the {signal} handler: {source}")]
    Handler {
        signal: &'static str,
        source: std::io::Error,
    },
}

/// A token cancelled on the first SIGTERM or SIGINT. Must be called inside the runtime.
pub fn on_signals() -> Result<CancellationToken, ShutdownError> {
    let handler = |kind, name| {
        signal(kind).map_err(|source| ShutdownError::Handler {
            signal: name,
            source,
        })
    };
    let mut terminate = handler(SignalKind::terminate(), "SIGTERM")?;
    let mut interrupt = handler(SignalKind::interrupt(), "SIGINT")?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down");
        cancel.cancel();
    });
    Ok(token)
}
