//! The three controller binaries start against the real apiserver, serve health and
//! metrics, and stop cleanly on SIGTERM.
