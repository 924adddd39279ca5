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

/// One row as a JSON object: strings, integers, floats and booleans keep their values,
/// lists become arrays and structs objects (VeRL's chat `prompt`, its `reward_model`); a
/// null column is absent (so "is missing" names it), a null inside a list or struct is
/// JSON's null; any other type is reported.
fn row(
    batch: &RecordBatch,
    index: usize,
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let mut map = serde_json::Map::new();
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        if column.is_null(index) {
            continue;
        }
        let value = json_value(column.as_ref(), index, 0).map_err(|type_name| {
            format!(
                "column {} holds {type_name}, which a dataset row cannot hold (use strings, \
                 numbers, booleans, lists and structs)",
                field.name()
            )
        })?;
        map.insert(field.name().clone(), value);
    }
    Ok(map)
}

/// Lists and structs nested deeper than this are refused: a crafted file must not recurse
/// without bound (VeRL's rows nest two deep).
const MAX_DEPTH: usize = 32;

/// The value at `index` of `column` as JSON, or the name of a type with no JSON form.
fn json_value(column: &dyn Array, index: usize, depth: usize) -> Result<serde_json::Value, String> {
    use arrow_array::types::{
        Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type,
        UInt32Type, UInt64Type,
    };
    use serde_json::Value;
    if column.is_null(index) {
        return Ok(Value::Null);
    }
    if depth > MAX_DEPTH {
        return Err(format!("lists or structs nested over {MAX_DEPTH} deep"));
    }
    let value = match column.data_type() {
        DataType::Utf8 => column.as_string::<i32>().value(index).into(),
        DataType::LargeUtf8 => column.as_string::<i64>().value(index).into(),
        DataType::Utf8View => column.as_string_view().value(index).into(),
        DataType::Int8 => column.as_primitive::<Int8Type>().value(index).into(),
        DataType::Int16 => column.as_primitive::<Int16Type>().value(index).into(),
        DataType::Int32 => column.as_primitive::<Int32Type>().value(index).into(),
        DataType::Int64 => column.as_primitive::<Int64Type>().value(index).into(),
        DataType::UInt8 => column.as_primitive::<UInt8Type>().value(index).into(),
        DataType::UInt16 => column.as_primitive::<UInt16Type>().value(index).into(),
        DataType::UInt32 => column.as_primitive::<UInt32Type>().value(index).into(),
        DataType::UInt64 => column.as_primitive::<UInt64Type>().value(index).into(),
        DataType::Float32 => float(f64::from(column.as_primitive::<Float32Type>().value(index))),
        DataType::Float64 => float(column.as_primitive::<Float64Type>().value(index)),
        DataType::Boolean => column.as_boolean().value(index).into(),
        DataType::List(_) => items(column.as_list::<i32>().value(index).as_ref(), depth)?,
        DataType::LargeList(_) => items(column.as_list::<i64>().value(index).as_ref(), depth)?,
        DataType::FixedSizeList(_, _) => {
            items(column.as_fixed_size_list().value(index).as_ref(), depth)?
        }
        DataType::Struct(fields) => {
            let columns = column.as_struct().columns();
            let mut object = serde_json::Map::new();
            for (field, child) in fields.iter().zip(columns) {
                object.insert(
                    field.name().clone(),
                    json_value(child.as_ref(), index, depth + 1)?,
                );
            }
            Value::Object(object)
        }
        other => return Err(other.to_string()),
    };
    Ok(value)
}

fn items(list: &dyn Array, depth: usize) -> Result<serde_json::Value, String> {
    (0..list.len())
        .map(|i| json_value(list, i, depth + 1))
        .collect::<Result<Vec<_>, _>>()
        .map(serde_json::Value::Array)
}

/// JSON has no NaN or infinity: such a float is null (and then "is missing" to a reader).
fn float(x: f64) -> serde_json::Value {
    serde_json::Number::from_f64(x).map_or(serde_json::Value::Null, serde_json::Value::Number)
}
