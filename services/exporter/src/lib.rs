//! The exporter: reads chosen event types of chosen runs from JetStream through durable,
//! ordered feeds (one per stream) and produces each event to a Kafka topic with rdkafka —
//! the value exactly the event's JSON as on the bus (or an `llm.call` trimmed, when asked),
//! the key its run (or trial), headers with its type, version, id and trace context.
//!
//! At least once, in order per key: a feed's message is acknowledged on JetStream only
//! after Kafka acknowledged it (`acks=all`, idempotent producer), acknowledgements cover
//! everything before them, and a restarted exporter resumes from the last acknowledged
//! message. While Kafka is down the producer holds what it has, the feeds stop at their
//! window and the lag grows (a metric); nothing is dropped. Duplicates are bounded by the
//! window per stream and are marked by the `arl-event-id` header.

pub mod hosted;
pub mod kafka;
pub mod metrics;
pub mod pipeline;
pub mod record;
pub mod selection;
