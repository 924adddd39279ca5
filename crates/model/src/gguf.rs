//! GGUF v3 (llama.cpp's model file): metadata, tensor directory and tensor data.
//!
//! Layout: magic `GGUF`, version (u32), tensor count (u64), metadata count (u64), the
//! metadata key/values, the tensor infos (name, dims, type, offset), then padding to
//! `general.alignment` (default 32) and the tensor data; offsets are relative to it.

use std::collections::BTreeMap;
use std::path::Path;

use crate::quant::{GgmlType, QuantError};

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("not a GGUF file (magic {0:02x?})")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (only 2 and 3)")]
    Version(u32),
    #[error("the GGUF file is truncated or corrupt at byte {0}")]
    Truncated(usize),
    #[error("unknown GGUF metadata value type {0}")]
    ValueType(u32),
    #[error("GGUF metadata arrays nested deeper than {MAX_ARRAY_DEPTH} levels at byte {0}")]
    Nesting(usize),
    #[error("metadata key {key}: {reason}")]
    Metadata { key: String, reason: String },
    #[error("tensor {name}: {reason}")]
    Tensor { name: String, reason: String },
    #[error(transparent)]
    Quant(#[from] QuantError),
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor is and what it holds. `dims` are GGUF order: `dims[0]` is the
/// innermost (contiguous) one, so a `(rows, cols)` matrix has `dims = [cols, rows]`.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub kind: GgmlType,
    pub offset: u64,
}

impl TensorInfo {
    /// The number of elements (the parser refuses dims whose product overflows).
    pub fn elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |n, d| n.checked_mul(*d))
            .unwrap_or(u64::MAX)
    }
}

#[derive(Debug)]
pub struct GgufFile {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    bytes: Vec<u8>,
    data_start: usize,
}

/// Arrays nest at most this deep (llama.cpp's files nest one level: arrays of strings or
/// numbers); a deeper file is refused instead of exhausting the stack.
const MAX_ARRAY_DEPTH: usize = 8;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: usize = 4;
/// The largest `general.alignment` accepted (llama.cpp writes 32).
const MAX_ALIGNMENT: usize = 1 << 16;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.bytes.len())
            .ok_or(GgufError::Truncated(self.at))?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn len(&mut self) -> Result<usize, GgufError> {
        let at = self.at;
        usize::try_from(self.u64()?).map_err(|_| GgufError::Truncated(at))
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.len()?;
        Ok(String::from_utf8_lossy(self.take(len)?).into_owned())
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn value(&mut self, kind: u32, depth: usize) -> Result<Value, GgufError> {
        Ok(match kind {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Nesting(self.at));
                }
                let item = self.u32()?;
                let len = self.len()?;
                // Every item takes at least a byte: a length beyond the file's remaining
                // bytes is a lie, and reserving for it would be a giant allocation.
                if len > self.remaining() {
                    return Err(GgufError::Truncated(self.at));
                }
                let mut items = Vec::with_capacity(len.min(1 << 16));
                for _ in 0..len {
                    items.push(self.value(item, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(GgufError::ValueType(other)),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let bytes = std::fs::read(path).map_err(|source| GgufError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(bytes)
    }

    pub fn parse(bytes: Vec<u8>) -> Result<Self, GgufError> {
        let mut r = Reader {
            bytes: &bytes,
            at: 0,
        };
        let magic: [u8; 4] = r.array()?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let tensor_count = r.len()?;
        let kv_count = r.len()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.string()?;
            let kind = r.u32()?;
            let value = r.value(kind, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(GgufError::Metadata {
                    key,
                    reason: "given twice".into(),
                });
            }
        }
        let mut tensors = Vec::with_capacity(tensor_count.min(1 << 16));
        for _ in 0..tensor_count {
            let name = r.string()?;
            let n_dims = r.u32()? as usize;
            if n_dims > MAX_DIMS {
                return Err(GgufError::Tensor {
                    name,
                    reason: format!("{n_dims} dimensions (ggml has at most {MAX_DIMS})"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64()?);
            }
            if dims
                .iter()
                .try_fold(1u64, |n, d| n.checked_mul(*d))
                .and_then(|n| usize::try_from(n).ok())
                .is_none()
            {
                return Err(GgufError::Tensor {
                    name,
                    reason: format!("dims {dims:?} hold more elements than can be addressed"),
                });
            }
            let raw = r.u32()?;
            let kind = GgmlType::from_raw(raw).ok_or_else(|| GgufError::Tensor {
                name: name.clone(),
                reason: format!("unknown ggml type {raw}"),
            })?;
            let offset = r.u64()?;
            tensors.push(TensorInfo {
                name,
                dims,
                kind,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(value) => value
                .as_u64()
                .and_then(|a| usize::try_from(a).ok())
                .filter(|a| a.is_power_of_two() && *a <= MAX_ALIGNMENT)
                .ok_or_else(|| GgufError::Metadata {
                    key: "general.alignment".into(),
                    reason: format!("{value:?} is not a power of two up to {MAX_ALIGNMENT}"),
                })?,
        };
        let data_start = r.at.div_ceil(alignment) * alignment;
        let file = Self {
            version,
            metadata,
            tensors,
            bytes,
            data_start,
        };
        for tensor in &file.tensors {
            file.tensor_bytes(tensor)?;
        }
        Ok(file)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn string(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    pub fn u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    pub fn f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (possibly quantized) bytes of a tensor.
    pub fn tensor_bytes(&self, tensor: &TensorInfo) -> Result<&[u8], GgufError> {
        let outside = || GgufError::Tensor {
            name: tensor.name.clone(),
            reason: format!(
                "{} elements at offset {} lie outside the file ({} bytes)",
                tensor.elements(),
                tensor.offset,
                self.bytes.len()
            ),
        };
        let elements = usize::try_from(tensor.elements()).map_err(|_| outside())?;
        let size = tensor.kind.bytes_for(elements)?;
        let start = usize::try_from(tensor.offset)
            .ok()
            .and_then(|offset| self.data_start.checked_add(offset))
            .ok_or_else(outside)?;
        let end = start.checked_add(size).ok_or_else(outside)?;
        self.bytes.get(start..end).ok_or_else(outside)
    }

    /// A tensor dequantized to f32, in GGUF order (row-major over reversed `dims`).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let tensor = self.tensor(name).ok_or_else(|| GgufError::Tensor {
            name: name.to_owned(),
            reason: "not in the file".into(),
        })?;
        Ok(tensor
            .kind
            .dequantize(self.tensor_bytes(tensor)?, tensor.elements() as usize)?)
    }
}
