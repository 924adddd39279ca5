//! The Kafka side: the producer's configuration (what ARL sets, what the operator passes
//! through for SASL/TLS and tuning) and how a failed delivery is judged.

use std::collections::BTreeMap;
use std::path::Path;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::FutureProducer;

/// Record compression (the producer compresses batches; brokers and consumers decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Compression {
    None,
    Gzip,
    Snappy,
    Lz4,
    Zstd,
}

impl Compression {
    fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Gzip => "gzip",
            Compression::Snappy => "snappy",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        }
    }
}

/// How the producer is made.
#[derive(Clone, Debug)]
pub struct ProducerSettings {
    pub brokers: String,
    pub compression: Compression,
    /// The idempotent producer (no duplicates or reordering from the producer's own
    /// retries); off only for a broker without `InitProducerId`.
    pub idempotence: bool,
    /// librdkafka properties passed through (`security.protocol`, `sasl.*`, `ssl.*`,
    /// `linger.ms`, …), after those of the file, so a flag wins.
    pub passthrough: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum KafkaSettingsError {
    #[error("--kafka-config {0:?}: expected KEY=VALUE, e.g. security.protocol=SASL_SSL")]
    BadPair(String),
    #[error("--kafka-config-file {path}: {reason}")]
    File { path: String, reason: String },
    #[error(
        "--kafka-config {key}: ARL sets this itself ({why}); remove it (or use the flag that sets it)"
    )]
    Reserved { key: String, why: &'static str },
    #[error("the Kafka producer refused its configuration: {0}")]
    Producer(KafkaError),
}

/// Properties ARL owns, because the exporter's guarantees rest on them.
const RESERVED: [(&str, &str); 6] = [
    ("bootstrap.servers", "from --kafka-brokers"),
    (
        "acks",
        "acks=all: a record counts once every in-sync replica has it",
    ),
    ("enable.idempotence", "from --kafka-idempotence"),
    ("compression.type", "from --kafka-compression"),
    (
        "message.timeout.ms",
        "0: a record waits for the broker however long it is down",
    ),
    (
        "max.in.flight.requests.per.connection",
        "5: the most the idempotent producer keeps in order",
    ),
];

/// `KEY=VALUE` pairs, checked against the properties ARL owns.
pub fn parse_pairs<'a>(
    pairs: impl IntoIterator<Item = &'a str>,
    into: &mut BTreeMap<String, String>,
) -> Result<(), KafkaSettingsError> {
    for pair in pairs {
        let (key, value) = pair
            .split_once('=')
            .filter(|(k, _)| !k.trim().is_empty())
            .ok_or_else(|| KafkaSettingsError::BadPair(pair.to_owned()))?;
        let key = key.trim();
        if let Some((_, why)) = RESERVED.iter().find(|(k, _)| *k == key) {
            return Err(KafkaSettingsError::Reserved {
                key: key.to_owned(),
                why,
            });
        }
        into.insert(key.to_owned(), value.trim().to_owned());
    }
    Ok(())
}

/// A Java-style properties file of librdkafka settings (`key=value` lines, `#` comments):
/// where secrets such as `sasl.password` come from, mounted from a Kubernetes Secret,
/// rather than the command line.
pub fn read_properties(
    path: &Path,
    into: &mut BTreeMap<String, String>,
) -> Result<(), KafkaSettingsError> {
    let text = std::fs::read_to_string(path).map_err(|e| KafkaSettingsError::File {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('!'));
    parse_pairs(lines, into).map_err(|e| KafkaSettingsError::File {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

impl ProducerSettings {
    pub fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("client.id", "arl-exporter")
            .set("acks", "all")
            .set("enable.idempotence", self.idempotence.to_string())
            .set("compression.type", self.compression.name())
            .set("message.timeout.ms", "0")
            .set("max.in.flight.requests.per.connection", "5")
            // Java clients hash keys with murmur2: the same key lands in the same partition
            // whichever client produced it.
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "5");
        for (key, value) in &self.passthrough {
            config.set(key, value);
        }
        config
    }

    pub fn producer(&self) -> Result<FutureProducer, KafkaSettingsError> {
        self.client_config()
            .create()
            .map_err(KafkaSettingsError::Producer)
    }
}

/// What a failed delivery means for the record and the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// This record can never be written (too large, refused as invalid): parked on the
    /// dead-letter stream, and the export goes on.
    Record,
    /// The export as a whole cannot go on as it is (a fatal producer error, a topic that
    /// does not exist or is not allowed, the broker refusing the producer): it starts over
    /// from the last acknowledged event after a pause, and nothing is acknowledged past it.
    Export,
}

pub fn judge(error: &KafkaError) -> Failure {
    use RDKafkaErrorCode as C;
    match error.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::MessageBatchTooLarge,
        ) => Failure::Record,
        _ => Failure::Export,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_pass_through_and_reserved_keys_are_refused() {
        let mut into = BTreeMap::new();
        parse_pairs(
            ["security.protocol=SASL_SSL", " linger.ms = 20 "],
            &mut into,
        )
        .unwrap();
        assert_eq!(into["security.protocol"], "SASL_SSL");
        assert_eq!(into["linger.ms"], "20");
        assert!(matches!(
            parse_pairs(["acks=1"], &mut into),
            Err(KafkaSettingsError::Reserved { key, .. }) if key == "acks"
        ));
        assert!(matches!(
            parse_pairs(["no-equals"], &mut into),
            Err(KafkaSettingsError::BadPair(_))
        ));
    }

    #[test]
    fn a_properties_file_gives_secrets_and_comments_are_skipped() {
        let dir = std::env::temp_dir().join(format!("arl-exporter-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("kafka.properties");
        std::fs::write(
            &file,
            "# SASL\nsasl.mechanism=SCRAM-SHA-512\nsasl.password=s3cr=t\n\n! old style\n",
        )
        .unwrap();
        let mut into = BTreeMap::new();
        read_properties(&file, &mut into).unwrap();
        assert_eq!(into["sasl.password"], "s3cr=t");
        assert_eq!(into.len(), 2);
        std::fs::write(&file, "acks=0\n").unwrap();
        let err = read_properties(&file, &mut into).unwrap_err().to_string();
        assert!(err.contains("acks"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_producer_keeps_arls_guarantees_and_takes_the_rest() {
        let mut passthrough = BTreeMap::new();
        passthrough.insert("linger.ms".to_owned(), "50".to_owned());
        let settings = ProducerSettings {
            brokers: "127.0.0.1:9092".into(),
            compression: Compression::Zstd,
            idempotence: true,
            passthrough,
        };
        let config = settings.client_config();
        assert_eq!(config.get("acks"), Some("all"));
        assert_eq!(config.get("enable.idempotence"), Some("true"));
        assert_eq!(config.get("message.timeout.ms"), Some("0"));
        assert_eq!(config.get("compression.type"), Some("zstd"));
        assert_eq!(config.get("linger.ms"), Some("50"));
        // librdkafka accepts it (every property name and value is checked at creation).
        drop(settings.producer().unwrap());
    }

    #[test]
    fn record_faults_are_told_from_export_faults() {
        let too_large = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert_eq!(judge(&too_large), Failure::Record);
        let unknown = KafkaError::MessageProduction(RDKafkaErrorCode::UnknownTopicOrPartition);
        assert_eq!(judge(&unknown), Failure::Export);
        let denied = KafkaError::MessageProduction(RDKafkaErrorCode::TopicAuthorizationFailed);
        assert_eq!(judge(&denied), Failure::Export);
    }
}
