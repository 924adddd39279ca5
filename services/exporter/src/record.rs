//! One event as a Kafka record: its topic, key, value and headers.

use arl_runtime::Delivery;
use arl_runtime::headers;
use arl_schemas::Namespace;
use bytes::Bytes;
use rdkafka::message::{Header, OwnedHeaders};
use serde_json::Value;

use crate::selection::{KeyBy, LLM_CALL, LlmCalls, Selection, split_event_type};

/// Header names on every exported record (Kafka headers are bytes; these hold UTF-8).
pub mod header {
    /// The event type, e.g. `trial.finished`.
    pub const TYPE: &str = "arl-type";
    /// Its schema version, e.g. `1`.
    pub const VERSION: &str = "arl-version";
    /// The event's de-duplication id on the bus: the same on every copy of one event, so
    /// consumers drop the duplicates that at-least-once delivery allows.
    pub const EVENT_ID: &str = "arl-event-id";
    /// The run the event belongs to.
    pub const RUN_ID: &str = "arl-run-id";
    /// JetStream's stream and sequence of the event: its position on the bus.
    pub const STREAM: &str = "arl-stream";
    pub const STREAM_SEQUENCE: &str = "arl-stream-sequence";
    /// `true` on an `llm.call` exported trimmed.
    pub const TRIMMED: &str = "arl-trimmed";
    /// W3C trace context, as the bus carried it.
    pub const TRACE_CONTEXT: [&str; 2] = ["traceparent", "tracestate"];
}

/// The fields a trimmed `llm.call` leaves out (their sizes stay, under `trimmed`).
pub const TRIMMED_LLM_CALL_FIELDS: [&str; 5] = [
    "request_messages",
    "tools",
    "prompt_token_ids",
    "completion_token_ids",
    "logprobs",
];

/// A record ready for the producer.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub topic: String,
    pub key: String,
    pub value: Bytes,
    pub headers: Vec<(&'static str, String)>,
    pub event_type: &'static str,
}

impl Record {
    /// The headers as Kafka takes them.
    pub fn kafka_headers(&self) -> OwnedHeaders {
        self.headers.iter().fold(
            OwnedHeaders::new_with_capacity(self.headers.len()),
            |headers, (key, value)| {
                headers.insert(Header {
                    key,
                    value: Some(value.as_bytes()),
                })
            },
        )
    }
}

/// Why an event cannot become a record. Each is permanent for that event: it is parked
/// on the dead-letter stream with the reason.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("subject {0} is not an event subject of this namespace")]
    NotAnEvent(String),
    #[error("event type {0} is not selected for export")]
    NotSelected(String),
    #[error("the {event_type} payload is not a JSON object ({reason}); it cannot be trimmed")]
    NotJson { event_type: String, reason: String },
}

/// The record of `delivery` under `selection`.
pub fn record(
    selection: &Selection,
    ns: &Namespace,
    stream: &str,
    delivery: &Delivery,
) -> Result<Record, RecordError> {
    let not_an_event = || RecordError::NotAnEvent(delivery.subject.clone());
    let run = ns.run_token(&delivery.subject).ok_or_else(not_an_event)?;
    let (event_type, version) = match headers::event_type(delivery.headers.as_ref()) {
        Some((event_type, version)) => (event_type, Some(version)),
        None => (
            type_of_subject(ns, &delivery.subject).ok_or_else(not_an_event)?,
            None,
        ),
    };
    let (event_type, topic) = selection
        .selected(&event_type)
        .ok_or_else(|| RecordError::NotSelected(event_type.clone()))?;
    let topic = topic.to_owned();
    let trim = event_type == LLM_CALL && selection.llm_calls == LlmCalls::Trimmed;
    let parsed = if trim || selection.key_by == KeyBy::Trial {
        Some(parse_object(event_type, &delivery.payload)?)
    } else {
        None
    };
    let key = match (&parsed, selection.key_by) {
        (Some(event), KeyBy::Trial) => event
            .get("trial_id")
            .and_then(Value::as_str)
            .unwrap_or(run)
            .to_owned(),
        _ => run.to_owned(),
    };
    let value = match parsed {
        Some(event) if trim => Bytes::from(trimmed(event).to_string()),
        _ => delivery.payload.clone(),
    };
    let mut record_headers = vec![(header::TYPE, event_type.to_owned())];
    if let Some(version) = version {
        record_headers.push((header::VERSION, version.to_string()));
    }
    let bus_headers = delivery.headers.as_ref();
    let bus_header = |name: &str| bus_headers.and_then(|h| h.get(name)).map(|v| v.to_string());
    if let Some(id) = bus_header(headers::MSG_ID) {
        record_headers.push((header::EVENT_ID, id));
    }
    record_headers.push((header::RUN_ID, run.to_owned()));
    record_headers.push((header::STREAM, stream.to_owned()));
    record_headers.push((
        header::STREAM_SEQUENCE,
        delivery.stream_sequence.to_string(),
    ));
    if trim {
        record_headers.push((header::TRIMMED, "true".to_owned()));
    }
    for name in header::TRACE_CONTEXT {
        if let Some(value) = bus_header(name) {
            record_headers.push((name, value));
        }
    }
    Ok(Record {
        topic,
        key,
        value,
        headers: record_headers,
        event_type,
    })
}

/// `arl.trial.<run>.finished` → `trial.finished` (events published without headers).
fn type_of_subject(ns: &Namespace, subject: &str) -> Option<String> {
    let run = ns.run_token(subject)?;
    let root_and_domain = subject.split(&format!(".{run}.")).next()?;
    let domain = root_and_domain.rsplit('.').next()?;
    let event = subject.rsplit('.').next()?;
    let event_type = format!("{domain}.{event}");
    split_event_type(&event_type)
        .is_some()
        .then_some(event_type)
}

fn parse_object(
    event_type: &str,
    payload: &[u8],
) -> Result<serde_json::Map<String, Value>, RecordError> {
    let not_json = |reason: String| RecordError::NotJson {
        event_type: event_type.to_owned(),
        reason,
    };
    match serde_json::from_slice::<Value>(payload) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(not_json(format!("a JSON {}", kind(&other)))),
        Err(e) => Err(not_json(e.to_string())),
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The event without its bulky fields; `trimmed` says how long each one was (items of a
/// list, keys of an object), so a consumer still sees the call's shape.
fn trimmed(mut event: serde_json::Map<String, Value>) -> Value {
    let mut sizes = serde_json::Map::new();
    for field in TRIMMED_LLM_CALL_FIELDS {
        if let Some(value) = event.remove(field) {
            let size = match &value {
                Value::Array(items) => items.len(),
                Value::Object(entries) => entries.len(),
                Value::Null => 0,
                _ => 1,
            };
            sizes.insert(field.to_owned(), Value::from(size));
        }
    }
    event.insert("trimmed".to_owned(), Value::Object(sizes));
    Value::Object(event)
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use arl_schemas::Event;
    use arl_schemas::events::{Example, LlmCallV2, TrialFinishedV1};
    use async_nats::HeaderMap;

    use super::*;
    use crate::selection::SelectionFlags;

    fn selection(key_by: KeyBy, llm_calls: LlmCalls) -> Selection {
        Selection::new(&SelectionFlags {
            events: "all",
            runs: "all",
            topic_prefix: "arl.",
            topics: &[],
            key_by,
            llm_calls,
        })
        .unwrap()
    }

    fn delivery<E: Event>(ns: &Namespace, event: &E, with_headers: bool) -> Delivery {
        let mut headers = HeaderMap::new();
        headers.insert(headers::EVENT_TYPE, E::TYPE);
        headers.insert(headers::EVENT_VERSION, E::VERSION.to_string().as_str());
        headers.insert(headers::MSG_ID, event.message_id().as_str());
        headers.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        Delivery {
            subject: event.subject(ns),
            headers: with_headers.then_some(headers),
            payload: Bytes::from(event.encode().unwrap()),
            attempt: 1,
            stream_sequence: 42,
            published: SystemTime::now(),
        }
    }

    fn header<'r>(record: &'r Record, name: &str) -> Option<&'r str> {
        record
            .headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn the_value_is_the_bus_json_and_headers_carry_type_id_and_trace() {
        let ns = Namespace::default();
        let event = TrialFinishedV1::example();
        let d = delivery(&ns, &event, true);
        let r = record(
            &selection(KeyBy::Run, LlmCalls::Full),
            &ns,
            "ARL_TRIALS",
            &d,
        )
        .unwrap();
        assert_eq!(r.topic, "arl.trial.finished");
        assert_eq!(r.key, event.run_id.as_str());
        assert_eq!(r.value, d.payload);
        assert_eq!(header(&r, header::TYPE), Some("trial.finished"));
        assert_eq!(header(&r, header::VERSION), Some("1"));
        assert_eq!(
            header(&r, header::EVENT_ID),
            Some(event.message_id().as_str())
        );
        assert_eq!(header(&r, header::STREAM_SEQUENCE), Some("42"));
        assert!(header(&r, "traceparent").is_some());
        assert_eq!(header(&r, header::TRIMMED), None);

        let by_trial = record(
            &selection(KeyBy::Trial, LlmCalls::Full),
            &ns,
            "ARL_TRIALS",
            &d,
        )
        .unwrap();
        assert_eq!(by_trial.key, event.trial_id.as_str());
        assert_eq!(by_trial.value, d.payload);
    }

    #[test]
    fn an_event_without_headers_is_typed_by_its_subject() {
        let ns = Namespace::with_prefix("t9").unwrap();
        let event = TrialFinishedV1::example();
        let d = delivery(&ns, &event, false);
        let r = record(
            &selection(KeyBy::Run, LlmCalls::Full),
            &ns,
            "T9_ARL_TRIALS",
            &d,
        )
        .unwrap();
        assert_eq!(r.event_type, "trial.finished");
        assert_eq!(header(&r, header::VERSION), None);
    }

    #[test]
    fn a_trimmed_llm_call_keeps_its_shape_and_drops_the_bulk() {
        let ns = Namespace::default();
        let event = LlmCallV2::example();
        let d = delivery(&ns, &event, true);
        let r = record(
            &selection(KeyBy::Run, LlmCalls::Trimmed),
            &ns,
            "ARL_LLM_CALLS",
            &d,
        )
        .unwrap();
        let value: Value = serde_json::from_slice(&r.value).unwrap();
        for field in TRIMMED_LLM_CALL_FIELDS {
            assert!(value.get(field).is_none(), "{field} still there");
        }
        assert_eq!(
            value["trimmed"]["prompt_token_ids"],
            Value::from(event.prompt_token_ids.len())
        );
        assert_eq!(value["policy_version"], Value::from(event.policy_version));
        assert_eq!(header(&r, header::TRIMMED), Some("true"));
        assert!(r.value.len() < d.payload.len());

        let full = record(
            &selection(KeyBy::Run, LlmCalls::Full),
            &ns,
            "ARL_LLM_CALLS",
            &d,
        )
        .unwrap();
        assert_eq!(full.value, d.payload);
    }

    #[test]
    fn what_cannot_be_a_record_says_why() {
        let ns = Namespace::default();
        let mut d = delivery(&ns, &LlmCallV2::example(), true);
        d.payload = Bytes::from_static(b"[1, 2]");
        assert!(matches!(
            record(
                &selection(KeyBy::Run, LlmCalls::Trimmed),
                &ns,
                "ARL_LLM_CALLS",
                &d
            ),
            Err(RecordError::NotJson { .. })
        ));
        d.subject = "elsewhere.subject".into();
        assert!(matches!(
            record(
                &selection(KeyBy::Run, LlmCalls::Full),
                &ns,
                "ARL_LLM_CALLS",
                &d
            ),
            Err(RecordError::NotAnEvent(_))
        ));
        let narrow = Selection::new(&SelectionFlags {
            events: "trial.started",
            runs: "all",
            topic_prefix: "arl.",
            topics: &[],
            key_by: KeyBy::Run,
            llm_calls: LlmCalls::Full,
        })
        .unwrap();
        let d = delivery(&ns, &TrialFinishedV1::example(), true);
        assert!(matches!(
            record(&narrow, &ns, "ARL_TRIALS", &d),
            Err(RecordError::NotSelected(t)) if t == "trial.finished"
        ));
    }
}
