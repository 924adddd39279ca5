//! Columnar dataset files — Arrow IPC (the stream or file format `datasets` caches in)
//! and Parquet (what the Hugging Face Hub serves) — read as the same rows the JSON
//! readers produce, so one validator serves every format.

use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;

use crate::{JsonRow, LoadError};

/// Rows of an `.arrow` (IPC stream or file) or `.parquet` file; the row label is the
/// 1-based row number.
pub(crate) fn rows(path: &Path, bytes: &[u8]) -> Result<Vec<JsonRow>, LoadError> {
    let unreadable = |reason: String| LoadError::Read {
        path: path.display().to_string(),
        reason,
    };
    let batches = match path.extension().and_then(|e| e.to_str()) {
        Some("parquet") => parquet_batches(bytes).map_err(unreadable)?,
        _ => arrow_batches(bytes).map_err(unreadable)?,
    };
    let mut rows = Vec::new();
    for batch in &batches {
        for index in 0..batch.num_rows() {
            let label = (rows.len() + 1).to_string();
            rows.push((label, row(batch, index)));
        }
    }
    Ok(rows)
}

fn arrow_batches(bytes: &[u8]) -> Result<Vec<RecordBatch>, String> {
    // The file format starts with the magic `ARROW1`; the stream format has none.
    if bytes.starts_with(b"ARROW1") {
        let reader = arrow_ipc::reader::FileReader::try_new(std::io::Cursor::new(bytes), None)
            .map_err(|e| format!("not an Arrow IPC file: {e}"))?;
        return reader
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("corrupt Arrow IPC file: {e}"));
    }
    let reader = arrow_ipc::reader::StreamReader::try_new(bytes, None)
        .map_err(|e| format!("not an Arrow IPC stream or file: {e}"))?;
    reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("corrupt Arrow IPC stream: {e}"))
}

fn parquet_batches(bytes: &[u8]) -> Result<Vec<RecordBatch>, String> {
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
        bytes::Bytes::copy_from_slice(bytes),
    )
    .and_then(|builder| builder.build())
    .map_err(|e| format!("not a readable Parquet file: {e}"))?;
    reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("corrupt Parquet file: {e}"))
}

/// One row as a JSON object: strings, integers, floats and booleans keep their values;
/// a null is absent (so "is missing" names it); any other type is reported.
fn row(
    batch: &RecordBatch,
    index: usize,
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let mut map = serde_json::Map::new();
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        if column.is_null(index) {
            continue;
        }
        let value = match column.data_type() {
            DataType::Utf8 => column.as_string::<i32>().value(index).into(),
            DataType::LargeUtf8 => column.as_string::<i64>().value(index).into(),
            DataType::Utf8View => column.as_string_view().value(index).into(),
            DataType::Int64 => column
                .as_primitive::<arrow_array::types::Int64Type>()
                .value(index)
                .into(),
            DataType::Int32 => column
                .as_primitive::<arrow_array::types::Int32Type>()
                .value(index)
                .into(),
            DataType::Float64 => column
                .as_primitive::<arrow_array::types::Float64Type>()
                .value(index)
                .into(),
            DataType::Boolean => column.as_boolean().value(index).into(),
            other => {
                return Err(format!(
                    "column {} has type {other}, which a dataset row cannot hold (use strings)",
                    field.name()
                ));
            }
        };
        map.insert(field.name().clone(), value);
    }
    Ok(map)
}
