//! Metric family types more than one part of the metrics uses.

use prometheus_client::metrics::{family::Family, histogram::Histogram};

/// One histogram per label set `L`, each made by the family's constructor (its buckets).
pub type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;
