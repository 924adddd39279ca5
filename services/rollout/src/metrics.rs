//! The rollout service's metrics: rates are ratios of these counters (branches per
//! trajectory, unproven per completion token, parse failures per turn).

use arl_runtime::Metrics;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `scored`, `masked`, `scored_zero`, `retried`, `dropped` (its run ended while it ran).
    pub outcome: String,
    /// The failure class, or `none`.
    pub class: String,
}

#[derive(Clone, Debug, Default)]
pub struct RolloutMetrics {
    pub trials: Family<OutcomeLabel, Counter>,
    pub turns: Counter,
    pub trajectories: Counter,
    pub branches: Counter,
    pub completion_tokens: Counter,
    pub unproven_tokens: Counter,
    pub parse_failures: Counter,
}

impl RolloutMetrics {
    pub fn register(metrics: &Metrics) -> Self {
        let m = Self::default();
        metrics.register(
            "rollout_trials",
            "Trial attempts by outcome and failure class",
            m.trials.clone(),
        );
        metrics.register(
            "rollout_turns",
            "LLM calls of finished trials",
            m.turns.clone(),
        );
        metrics.register(
            "rollout_trajectories",
            "Trajectories published",
            m.trajectories.clone(),
        );
        metrics.register(
            "rollout_branches",
            "Branches of published trajectories (more than one per trajectory = diverged history)",
            m.branches.clone(),
        );
        metrics.register(
            "rollout_completion_tokens",
            "Completion tokens of published trajectories",
            m.completion_tokens.clone(),
        );
        metrics.register(
            "rollout_unproven_tokens",
            "Completion tokens masked because their origin could not be proven",
            m.unproven_tokens.clone(),
        );
        metrics.register(
            "rollout_parse_failures",
            "Agent replies that broke the action protocol (no command, bad tool call)",
            m.parse_failures.clone(),
        );
        m
    }

    pub fn trial(&self, outcome: &str, class: Option<arl_schemas::events::FailureClass>) {
        self.trials
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
                class: class.map_or("none", |c| c.as_str()).to_owned(),
            })
            .inc();
    }
}
