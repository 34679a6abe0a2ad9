//! A Database's `spec.backup.schedule`: five cron fields or a macro, evaluated in UTC at
//! minute precision; its slots.

use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use jiff::tz::TimeZone;
use jiff::{Timestamp, Zoned};

/// Skipped slots are counted up to this many (the Event then says "at least").
pub const MAX_COUNTED: u32 = 10_000;

/// A parsed five-field cron schedule, evaluated in UTC at minute precision.
#[derive(Debug, Clone)]
pub struct Schedule(Cron);

/// Parses `text`: five fields (minute hour day-of-month month day-of-week) or a macro
/// (@hourly, @daily, @midnight, @weekly, @monthly, @yearly, @annually). A schedule that
/// never fires is refused too.
pub fn parse_schedule(text: &str) -> Result<Schedule, String> {
    let text = text.trim();
    // croner knows every macro the API allows but @midnight, which is @daily.
    let text = if text.eq_ignore_ascii_case("@midnight") {
        "@daily"
    } else {
        text
    };
    let cron = CronParser::builder()
        .seconds(Seconds::Disallowed)
        .year(Year::Disallowed)
        .build()
        .parse(text)
        .map_err(|e| e.to_string())?;
    let schedule = Schedule(cron);
    if schedule.next_after(Timestamp::UNIX_EPOCH).is_none() {
        return Err("the expression never matches a date".to_string());
    }
    Ok(schedule)
}

impl Schedule {
    /// The latest scheduled time at or before `t`.
    pub fn latest_at_or_before(&self, t: Timestamp) -> Option<Timestamp> {
        self.0
            .find_previous_occurrence(&in_utc(t), true)
            .ok()
            .map(|z| z.timestamp())
    }

    /// Seconds between the next two slots after `t` (what "on schedule" means for the
    /// alert on an old last success).
    pub fn interval_after(&self, t: Timestamp) -> Option<i64> {
        let first = self.next_after(t)?;
        let second = self.next_after(first)?;
        Some(second.as_second() - first.as_second())
    }

    /// The first scheduled time after `t`.
    pub fn next_after(&self, t: Timestamp) -> Option<Timestamp> {
        self.0
            .find_next_occurrence(&in_utc(t), false)
            .ok()
            .map(|z| z.timestamp())
    }

    /// How many scheduled times lie strictly between `after` and `before`, counted up
    /// to [`MAX_COUNTED`].
    pub fn count_between(&self, after: Timestamp, before: Timestamp) -> u32 {
        let mut count = 0;
        let mut t = after;
        while count < MAX_COUNTED {
            match self.next_after(t) {
                Some(next) if next < before => {
                    count += 1;
                    t = next;
                }
                _ => break,
            }
        }
        count
    }
}

/// `t` to the whole second, in UTC: what the schedule's occurrences are looked up from.
fn in_utc(t: Timestamp) -> Zoned {
    let whole_second = Timestamp::from_second(t.as_second()).unwrap_or(t);
    whole_second.to_zoned(TimeZone::UTC)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::testing::{at, every_minute};

    #[test]
    fn five_fields_and_macros_parse_and_other_shapes_do_not() {
        for ok in [
            "* * * * *",
            "0 3 * * *",
            "*/15 * * * MON-FRI",
            "@daily",
            "@midnight",
            "@hourly",
            "@weekly",
            "@monthly",
            "@yearly",
            "@annually",
        ] {
            assert!(parse_schedule(ok).is_ok(), "{ok}");
        }
        for bad in [
            "* * * *",
            "0 * * * * *",
            "61 * * * *",
            "0 25 * * *",
            "@every-minute",
            "0 0 30 2 *",
            "",
        ] {
            assert!(parse_schedule(bad).is_err(), "{bad}");
        }
        let midnight = parse_schedule("@midnight").unwrap();
        assert_eq!(
            midnight.latest_at_or_before(at("2026-11-22T16:11:20Z")),
            Some(at("2026-11-22T00:00:00Z"))
        );
    }

    #[test]
    fn the_slot_is_the_latest_scheduled_time_at_or_before_now_in_utc() {
        let s = parse_schedule("0 3 * * *").unwrap();
        for (now, slot) in [
            ("2026-11-22T16:11:20.5Z", "2026-11-22T03:00:00Z"),
            ("2026-11-22T03:00:00Z", "2026-11-22T03:00:00Z"),
            ("2026-11-22T02:59:59.9Z", "2026-11-21T03:00:00Z"),
        ] {
            assert_eq!(s.latest_at_or_before(at(now)), Some(at(slot)), "{now}");
        }
        assert_eq!(
            s.next_after(at("2026-11-22T03:00:00Z")),
            Some(at("2026-11-23T03:00:00Z"))
        );
        let m = every_minute();
        assert_eq!(
            m.latest_at_or_before(at("2026-11-22T16:11:59.999Z")),
            Some(at("2026-11-22T16:11:00Z"))
        );
        assert_eq!(
            m.count_between(at("2026-11-22T16:00:00Z"), at("2026-11-22T16:03:00Z")),
            2
        );
        assert_eq!(
            m.count_between(at("2026-11-22T16:00:00Z"), at("2026-11-22T16:01:00Z")),
            0
        );
    }
}
