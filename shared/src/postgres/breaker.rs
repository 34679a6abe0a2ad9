//! The per-server circuit breaker: closed while the server answers, open (no attempts)
//! after repeated connection failures, then half-open for one trial connection.

use std::time::{Duration, Instant};

/// Closed while the server answers; open (no attempts) for `open_for` after
/// `failure_threshold` consecutive connection failures; then half-open: one trial
/// connection while every other caller is still refused; its success closes the breaker,
/// its failure opens it again for `open_for`.
#[derive(Debug, Default)]
pub(super) struct Breaker {
    consecutive_failures: u32,
    open_until: Option<Instant>,
    /// A half-open trial is under way.
    pub(super) trial: bool,
    /// What the last failure said (shown while open).
    pub(super) last_error: String,
}

/// What the breaker lets a caller do now.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Admission {
    /// Closed: go ahead.
    Go,
    /// Half-open: go ahead as the one trial.
    Trial,
    /// Open (or a trial is under way): do not connect.
    Refuse(Duration),
}

impl Breaker {
    pub(super) fn admit(&mut self, now: Instant) -> Admission {
        match self.open_until {
            None => Admission::Go,
            Some(until) if until > now => Admission::Refuse(until - now),
            Some(_) if self.trial => Admission::Refuse(Duration::ZERO),
            Some(_) => {
                self.trial = true;
                Admission::Trial
            }
        }
    }

    /// Records a connection's outcome (`None`: success).
    pub(super) fn record(&mut self, failure: Option<String>, threshold: u32, open_for: Duration) {
        self.trial = false;
        match failure {
            None => {
                self.consecutive_failures = 0;
                self.open_until = None;
            }
            Some(message) => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                self.last_error = message;
                if self.consecutive_failures >= threshold {
                    self.open_until = Some(Instant::now() + open_for);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_half_open_breaker_lets_one_trial_through_and_its_outcome_decides() {
        let open_for = Duration::from_secs(30);
        let mut b = Breaker::default();
        let now = Instant::now();
        assert_eq!(b.admit(now), Admission::Go);
        b.record(Some("refused".into()), 2, open_for);
        assert_eq!(b.admit(now), Admission::Go, "below the threshold");
        b.record(Some("refused".into()), 2, open_for);
        assert!(matches!(b.admit(Instant::now()), Admission::Refuse(d) if d > Duration::ZERO));
        // Once the open time has passed: one trial, every other caller still refused.
        let later = Instant::now() + open_for + Duration::from_secs(1);
        assert_eq!(b.admit(later), Admission::Trial);
        assert_eq!(b.admit(later), Admission::Refuse(Duration::ZERO));
        // The trial fails: open again for the whole period, with its message.
        b.record(Some("still refused".into()), 2, open_for);
        assert!(
            matches!(b.admit(Instant::now()), Admission::Refuse(d) if d > Duration::from_secs(29))
        );
        assert_eq!(b.last_error, "still refused");
        // The next trial succeeds: closed.
        let later = Instant::now() + open_for + Duration::from_secs(1);
        assert_eq!(b.admit(later), Admission::Trial);
        b.record(None, 2, open_for);
        assert_eq!(b.admit(Instant::now()), Admission::Go);
        assert_eq!(b.consecutive_failures, 0);
    }
}
