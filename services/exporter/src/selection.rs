//! What a deployment exports: which event types of which runs, to which topics, keyed how,
//! and whether `llm.call` goes whole or trimmed. Checked once at start: a type, run id or
//! topic name that cannot work is an error naming it, never skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use arl_runtime::feed::FeedSpec;
use arl_schemas::{Domain, Namespace, RunId};

/// The type of the one large event, which may be exported trimmed.
pub const LLM_CALL: &str = "llm.call";

/// What identifies a record to Kafka's partitioner: every record with the same key lands
/// in the same partition, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyBy {
    /// The run id (every event has one).
    Run,
    /// The trial id for events of a trial (trial.*, llm.call, trajectory.ready,
    /// reward.scored, sandbox.*); the run id for the rest, which belong to no trial.
    Trial,
}

/// How `llm.call` events go out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LlmCalls {
    /// The event's JSON exactly as on the bus.
    Full,
    /// Without the conversation, tools, token ids and log-probabilities (their sizes kept
    /// under `trimmed`), and the header `arl-trimmed: true`.
    Trimmed,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectionError {
    #[error("--events: unknown event type {0:?}; known types: {1}")]
    UnknownEvent(String, String),
    #[error("--events is empty: name event types (comma-separated) or `all`")]
    NoEvents,
    #[error("--runs: {0}")]
    BadRun(String),
    #[error("--topic {0:?}: expected EVENT_TYPE=TOPIC, e.g. trial.finished=rl.trials")]
    BadTopicFlag(String),
    #[error("--topic {0}: unknown event type; known types: {1}")]
    UnknownTopicEvent(String, String),
    #[error(
        "topic name {0:?} is not valid in Kafka: 1 to 249 characters of ASCII letters, digits, '.', '_' and '-', and not \".\" or \"..\""
    )]
    BadTopicName(String),
}

/// Every event type of the pipeline, in the catalog's order, each once.
pub fn known_event_types() -> Vec<&'static str> {
    let mut seen = BTreeSet::new();
    arl_schemas::catalog::all_events()
        .into_iter()
        .map(|e| e.event_type)
        .filter(|t| seen.insert(*t))
        .collect()
}

/// The domain (stream) of an event type and its event token: `trial.finished` →
/// (Trial, "finished").
pub fn split_event_type(event_type: &str) -> Option<(Domain, &str)> {
    let (domain, event) = event_type.split_once('.')?;
    let domain = Domain::ALL.into_iter().find(|d| d.token() == domain)?;
    Some((domain, event))
}

/// A deployment's export selection.
#[derive(Clone, Debug)]
pub struct Selection {
    /// Event types, each known to the catalog.
    events: Vec<&'static str>,
    /// None: every run, present and future.
    runs: Option<Vec<RunId>>,
    topics: BTreeMap<&'static str, String>,
    pub key_by: KeyBy,
    pub llm_calls: LlmCalls,
}

/// The flags a selection is made from.
#[derive(Clone, Debug)]
pub struct SelectionFlags<'a> {
    /// Comma-separated event types, or `all`.
    pub events: &'a str,
    /// Comma-separated run ids, or `all`.
    pub runs: &'a str,
    /// A topic's name is this prefix and the event type, unless `topics` names it.
    pub topic_prefix: &'a str,
    /// `EVENT_TYPE=TOPIC` overrides.
    pub topics: &'a [String],
    pub key_by: KeyBy,
    pub llm_calls: LlmCalls,
}

impl Selection {
    pub fn new(flags: &SelectionFlags<'_>) -> Result<Selection, SelectionError> {
        let known = known_event_types();
        let known_list = || known.join(", ");
        let find = |name: &str| known.iter().copied().find(|t| *t == name);
        let events: Vec<&'static str> = if flags.events.trim() == "all" {
            known.clone()
        } else {
            let mut events = Vec::new();
            for name in words(flags.events) {
                let event = find(name)
                    .ok_or_else(|| SelectionError::UnknownEvent(name.to_owned(), known_list()))?;
                if !events.contains(&event) {
                    events.push(event);
                }
            }
            events
        };
        if events.is_empty() {
            return Err(SelectionError::NoEvents);
        }
        let runs = if flags.runs.trim() == "all" {
            None
        } else {
            let runs = words(flags.runs)
                .map(|r| RunId::new(r).map_err(|e| SelectionError::BadRun(e.to_string())))
                .collect::<Result<Vec<_>, _>>()?;
            if runs.is_empty() {
                return Err(SelectionError::BadRun(
                    "no run ids: name runs (comma-separated) or `all`".into(),
                ));
            }
            Some(runs)
        };
        let mut overrides = BTreeMap::new();
        for flag in flags.topics {
            let (event, topic) = flag
                .split_once('=')
                .ok_or_else(|| SelectionError::BadTopicFlag(flag.clone()))?;
            let event = find(event.trim()).ok_or_else(|| {
                SelectionError::UnknownTopicEvent(event.trim().to_owned(), known_list())
            })?;
            overrides.insert(event, topic.trim().to_owned());
        }
        let mut topics = BTreeMap::new();
        for event in &events {
            let topic = overrides
                .remove(event)
                .unwrap_or_else(|| format!("{}{event}", flags.topic_prefix));
            check_topic_name(&topic)?;
            topics.insert(*event, topic);
        }
        Ok(Selection {
            events,
            runs,
            topics,
            key_by: flags.key_by,
            llm_calls: flags.llm_calls,
        })
    }

    pub fn events(&self) -> &[&'static str] {
        &self.events
    }

    /// The topic of a selected event type; None for a type not selected.
    pub fn topic(&self, event_type: &str) -> Option<&str> {
        self.selected(event_type).map(|(_, topic)| topic)
    }

    /// A selected event type as the catalog spells it, with its topic.
    pub fn selected(&self, event_type: &str) -> Option<(&'static str, &str)> {
        self.topics
            .get_key_value(event_type)
            .map(|(event_type, topic)| (*event_type, topic.as_str()))
    }

    /// One feed per stream holding a selected type, reading exactly the selected subjects.
    pub fn feeds(
        &self,
        ns: &Namespace,
        durable: &str,
        window: usize,
        ack_wait: Duration,
    ) -> Vec<FeedSpec> {
        let mut by_domain: BTreeMap<&'static str, (Domain, Vec<String>)> = BTreeMap::new();
        for event_type in &self.events {
            let Some((domain, event)) = split_event_type(event_type) else {
                continue;
            };
            let subjects = &mut by_domain
                .entry(domain.token())
                .or_insert_with(|| (domain, Vec::new()))
                .1;
            match &self.runs {
                None => subjects.push(ns.event_filter(domain, event)),
                Some(runs) => {
                    subjects.extend(runs.iter().map(|run| ns.event_subject(domain, run, event)));
                }
            }
        }
        by_domain
            .into_values()
            .map(|(domain, filter_subjects)| FeedSpec {
                domain,
                durable: durable.to_owned(),
                filter_subjects,
                window,
                ack_wait,
            })
            .collect()
    }
}

fn words(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim).filter(|w| !w.is_empty())
}

/// Kafka's own rule for topic names.
fn check_topic_name(topic: &str) -> Result<(), SelectionError> {
    let valid = !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if valid {
        Ok(())
    } else {
        Err(SelectionError::BadTopicName(topic.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags<'a>(events: &'a str, runs: &'a str, topics: &'a [String]) -> SelectionFlags<'a> {
        SelectionFlags {
            events,
            runs,
            topic_prefix: "arl.",
            topics,
            key_by: KeyBy::Run,
            llm_calls: LlmCalls::Full,
        }
    }

    #[test]
    fn all_selects_every_type_once_with_prefixed_topics() {
        let s = Selection::new(&flags("all", "all", &[])).unwrap();
        assert_eq!(s.events(), known_event_types().as_slice());
        assert!(s.events().contains(&"reward.scored"));
        assert_eq!(
            s.events().iter().filter(|t| **t == "reward.scored").count(),
            1
        );
        assert_eq!(s.topic("trial.finished"), Some("arl.trial.finished"));
        assert_eq!(s.topic(LLM_CALL), Some("arl.llm.call"));
    }

    #[test]
    fn feeds_group_types_by_stream_and_runs_narrow_the_subjects() {
        let ns = Namespace::with_prefix("t1").unwrap();
        let s = Selection::new(&flags(
            "trial.finished, trial.started,llm.call",
            "run-a,run-b",
            &[],
        ))
        .unwrap();
        let feeds = s.feeds(&ns, "exporter", 100, Duration::from_secs(60));
        assert_eq!(feeds.len(), 2);
        let trial = feeds.iter().find(|f| f.domain == Domain::Trial).unwrap();
        assert_eq!(
            trial.filter_subjects,
            [
                "t1.arl.trial.run-a.finished",
                "t1.arl.trial.run-b.finished",
                "t1.arl.trial.run-a.started",
                "t1.arl.trial.run-b.started",
            ]
        );
        let every_run = Selection::new(&flags("llm.call", "all", &[])).unwrap();
        let feeds = every_run.feeds(&ns, "exporter", 100, Duration::from_secs(60));
        assert_eq!(feeds[0].filter_subjects, ["t1.arl.llm.*.call"]);
    }

    #[test]
    fn bad_selections_are_refused_by_name() {
        assert!(matches!(
            Selection::new(&flags("trial.finishd", "all", &[])),
            Err(SelectionError::UnknownEvent(name, _)) if name == "trial.finishd"
        ));
        assert_eq!(
            Selection::new(&flags(" , ", "all", &[])).unwrap_err(),
            SelectionError::NoEvents
        );
        assert!(matches!(
            Selection::new(&flags("all", "run.1", &[])),
            Err(SelectionError::BadRun(_))
        ));
        let topics = ["trial.finished".to_owned()];
        assert!(matches!(
            Selection::new(&flags("all", "all", &topics)),
            Err(SelectionError::BadTopicFlag(_))
        ));
        let topics = ["trial.finished=bad topic".to_owned()];
        assert!(matches!(
            Selection::new(&flags("all", "all", &topics)),
            Err(SelectionError::BadTopicName(_))
        ));
        let topics = ["trial.finished=rl.trials".to_owned()];
        let s = Selection::new(&flags("all", "all", &topics)).unwrap();
        assert_eq!(s.topic("trial.finished"), Some("rl.trials"));
        assert_eq!(s.topic("trial.started"), Some("arl.trial.started"));
    }
}
