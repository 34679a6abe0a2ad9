//! `dbops-bench chaos`'s command line.

#[derive(clap::Args, Debug, Clone)]
pub struct ChaosArgs {
    /// Stop after this many SIGKILLs of controller replicas.
    #[arg(long)]
    pub kills: Option<u64>,
    /// Stop after this many seconds of chaos (120 when neither this nor --kills is given).
    #[arg(long)]
    pub duration: Option<u64>,
    /// Seed of every random choice (a random one, printed, when absent).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most Databases alive at once.
    #[arg(long, default_value_t = 20)]
    pub max_databases: usize,
    /// Shortest pause between two faults, seconds.
    #[arg(long, default_value_t = 1.0)]
    pub min_gap: f64,
    /// Longest pause between two faults, seconds.
    #[arg(long, default_value_t = 8.0)]
    pub max_gap: f64,
    /// Chance that a fault restarts a PostgreSQL server instead of killing a replica.
    #[arg(long, default_value_t = 0.06)]
    pub pg_restart_chance: f64,
    /// Chance that a fault restarts kube-apiserver instead of killing a replica.
    #[arg(long, default_value_t = 0.03)]
    pub apiserver_restart_chance: f64,
    /// How long every object may take to settle once the faults stop, seconds.
    #[arg(long, default_value_t = 600)]
    pub settle_timeout: u64,
    /// Seconds the driver goes on after the last fault, with every process left alone.
    #[arg(long, default_value_t = 30)]
    pub calm: u64,
    /// Replicas of each controller (2: leader election under fire; 1: every kill stops
    /// the controller until it is back).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub replicas: u8,
    /// Leader election (off only with one replica: each controller process then works
    /// from its first moment, as a plain Deployment of one pod without a Lease would).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// A deletion or a Database spec change that waits longer than this (seconds) for the
    /// controllers is a violation (0: only reported); a deletion that waited for a person
    /// (a failed final snapshot, by design) does not count.
    #[arg(long, default_value_t = 120)]
    pub max_latency: u64,
    /// Keep the run directory (logs, store, journal) even without violations.
    #[arg(long)]
    pub keep: bool,
    /// After settling, break one thing per invariant behind dbops' back and check that
    /// each is caught (the run then passes when exactly those are found).
    #[arg(long)]
    pub self_test: bool,
}
