//! The trainer's metrics: what each step did, for dashboards and alerts. Counters and
//! phase timings are summed over runs; the last step's figures are gauges labelled by run
//! (a trainer holds few runs over its life, so the label stays small).

use arl_runtime::Metrics;
use arl_schemas::events::TrainStepV2;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunLabel {
    pub run: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// `wait_for_trajectories`, `old_logprobs`, `update`, `save`.
    pub phase: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

fn phase_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.05, 2.0, 16))
}

#[derive(Clone, Debug)]
pub struct TrainerMetrics {
    steps: Counter,
    samples_trained: Counter,
    trajectories: Counter,
    zero_advantage_groups: Counter,
    phase_seconds: Family<PhaseLabel, Histogram>,
    heap_in_use: Gauge,
    last: [(&'static str, &'static str, Family<RunLabel, FloatGauge>); 9],
}

impl TrainerMetrics {
    pub fn register(metrics: &Metrics) -> Self {
        let gauge = |name, help| (name, help, Family::<RunLabel, FloatGauge>::default());
        let m = Self {
            steps: Counter::default(),
            samples_trained: Counter::default(),
            trajectories: Counter::default(),
            zero_advantage_groups: Counter::default(),
            phase_seconds: Family::new_with_constructor(phase_histogram),
            heap_in_use: Gauge::default(),
            last: [
                gauge("trainer_pg_loss", "The last step's policy-gradient loss"),
                gauge(
                    "trainer_grad_norm",
                    "The last step's gradient norm (before clipping)",
                ),
                gauge("trainer_kl", "The last step's KL to the reference policy"),
                gauge("trainer_entropy", "The last step's mean token entropy"),
                gauge("trainer_reward_mean", "The last step's mean reward"),
                gauge(
                    "trainer_response_length_mean",
                    "The last step's mean response length (tokens)",
                ),
                gauge(
                    "trainer_tokens_per_second",
                    "The last step's training throughput",
                ),
                gauge("trainer_learning_rate", "The last step's learning rate"),
                gauge(
                    "trainer_policy_version",
                    "The policy version the last step produced",
                ),
            ],
        };
        metrics.register("trainer_steps", "Steps trained", m.steps.clone());
        metrics.register(
            "trainer_samples_trained",
            "Samples that carried a gradient (non-zero advantage)",
            m.samples_trained.clone(),
        );
        metrics.register(
            "trainer_trajectories",
            "Trajectories assembled into steps",
            m.trajectories.clone(),
        );
        metrics.register(
            "trainer_zero_advantage_groups",
            "Groups whose rewards were all equal (no gradient)",
            m.zero_advantage_groups.clone(),
        );
        metrics.register(
            "trainer_phase_seconds",
            "Time per step phase",
            m.phase_seconds.clone(),
        );
        metrics.register(
            "trainer_heap_in_use_bytes",
            "Bytes the allocator hands out after the last step; the trainer keeps freed memory for the next step, so its RSS is its heap's high-water mark and this is what it holds",
            m.heap_in_use.clone(),
        );
        for (name, help, family) in &m.last {
            metrics.register(name, help, family.clone());
        }
        m
    }

    /// Records a committed step.
    pub fn step(&self, step: &TrainStepV2) {
        self.steps.inc();
        if let Some(bytes) = arl_model::ops::heap_in_use_bytes() {
            self.heap_in_use
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        self.samples_trained
            .inc_by(u64::from(step.batch.samples_trained));
        self.trajectories.inc_by(u64::from(step.batch.trajectories));
        self.zero_advantage_groups
            .inc_by(u64::from(step.batch.zero_advantage_groups));
        let t = &step.timing;
        for (phase, seconds) in [
            ("wait_for_trajectories", t.wait_for_trajectories),
            ("old_logprobs", t.old_logprobs),
            ("update", t.update),
            ("save", t.save),
        ] {
            self.phase_seconds
                .get_or_create(&PhaseLabel { phase })
                .observe(seconds);
        }
        let m = &step.metrics;
        let values = [
            m.pg_loss,
            m.grad_norm,
            m.kl,
            m.entropy,
            m.reward_mean,
            m.response_length_mean,
            m.tokens_per_second,
            m.lr,
            step.policy_version as f64,
        ];
        let run = RunLabel {
            run: step.run_id.to_string(),
        };
        for ((_, _, family), value) in self.last.iter().zip(values) {
            family.get_or_create(&run).set(value);
        }
    }
}
