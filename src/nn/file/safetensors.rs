//! The safetensors format, for `f32` tensors: an 8-byte little-endian header length
//! `n`, `n` bytes of a JSON header (`{"name": {"dtype", "shape", "data_offsets"}, …,
//! "__metadata__": {string: string}}`), then the tensors' bytes, little-endian, laid end
//! to end as the offsets say.
//!
//! The reader trusts nothing in a file: it reads regular files only, and every length
//! and offset is checked against the file's size with checked arithmetic before a
//! tensor's bytes are used; every error names the tensor at fault. It reads by value
//! (`from_le_bytes`), so data need not be aligned.
//!
//! **What a file costs before it is trusted.** [`Tensors::open`] reads the 8-byte
//! length and the header only, and checks every tensor's place against the file's size
//! (from the open file, so a file replaced meanwhile cannot swap in another size):
//! refusing a lying, truncated or huge file costs O(header), whatever its size. A
//! tensor's bytes are read only when a layer asks for them ([`Tensors::values`]), once
//! the whole configuration has been checked against the header, straight into the
//! tensor's own buffer, reserved fallibly (a tensor the machine cannot hold is an
//! error, not an abort).
//!
//! **Why positioned reads, not a memory map.** A mapping of a file that another
//! process truncates faults on the next read of the lost pages (`SIGBUS` ends the
//! process), and no safe API can rule that out; carve reaches such mappings only
//! through `unsafe` constructors whose callers promise the file stays whole. The model
//! owns its weights in any case (they are laid out anew: transposed, gates reordered),
//! so a mapping would save no copy: each tensor is read once, with `pread`, into the
//! buffer that becomes its values, and a file cut short meanwhile is an I/O error.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use serde_json::{Map, Value};

use crate::nn::limits::reserve;
use crate::{Error, Result};

/// The header key of the string-to-string metadata.
const METADATA: &str = "__metadata__";

/// A header longer than this is refused before it is read. Parsed, a JSON header takes
/// up to about 20 times its bytes (a number is a 32-byte value), so the limit is the
/// header parse's memory too: 16 MiB, about 350 MB at worst. A model of 100,000 tensors
/// has a header of about 10 MiB (the reference implementation allows 100 MB).
const MAX_HEADER: u64 = 16 << 20;

/// One tensor as the header describes it: checked against the file.
#[derive(Debug)]
struct Entry {
    shape: Vec<usize>,
    /// Bytes of the data section (after the header).
    begin: usize,
    end: usize,
}

/// A safetensors file, open, its header read and checked: its metadata and its `f32`
/// tensors' places, read on demand.
#[derive(Debug)]
pub(crate) struct Tensors {
    path: String,
    metadata: BTreeMap<String, String>,
    entries: BTreeMap<String, Entry>,
    file: File,
    /// Where the data section begins in the file (after the length and the header).
    data_start: u64,
}

/// A tensor to write: its name, shape and values (row-major).
pub(crate) struct Out {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) values: Vec<f32>,
}

/// The error for `path`, naming `tensor` when there is one.
pub(crate) fn file_error(path: &str, tensor: Option<&str>, reason: impl Into<String>) -> Error {
    let reason = reason.into();
    // A name comes from the file: shortened, so that a hostile one cannot make the error
    // as large as the header.
    let tensor = tensor.map(super::short);
    Error::ModelFile {
        path: path.to_string(),
        reason: match &tensor {
            Some(name) => format!("tensor '{name}': {reason}"),
            None => reason,
        },
        tensor,
    }
}

impl Tensors {
    /// Opens the file at `path` and reads and checks its header (nothing of its data).
    pub(crate) fn open(path: &Path) -> Result<Tensors> {
        let shown = path.display().to_string();
        let cannot = |e: std::io::Error| file_error(&shown, None, format!("cannot be read: {e}"));
        // Non-blocking, so that opening a FIFO does not wait for a writer (and never the
        // process's controlling terminal); the type is then checked on what was opened. Not a FIFO, a device or a directory: those
        // have no size to check against.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(cannot)?;
        let meta = file.metadata().map_err(cannot)?;
        if !meta.is_file() {
            return Err(file_error(&shown, None, "is not a regular file"));
        }
        let size = meta.len();
        let fail = |tensor: Option<&str>, reason: String| file_error(&shown, tensor, reason);
        let mut prefix = [0u8; 8];
        if size < 8 {
            return Err(fail(
                None,
                format!("not a safetensors file: {size} bytes, shorter than the 8-byte header length"),
            ));
        }
        file.read_exact_at(&mut prefix, 0).map_err(cannot)?;
        let declared = u64::from_le_bytes(prefix);
        let available = size - 8;
        if declared > MAX_HEADER && declared <= available {
            return Err(fail(
                None,
                format!("the header claims {declared} bytes, over the limit of {MAX_HEADER} (not a model file?)"),
            ));
        }
        if declared > available {
            return Err(fail(
                None,
                format!(
                    "the header claims {declared} bytes but the file has {available} after its length \
                     (truncated, or not a safetensors file)"
                ),
            ));
        }
        // At most MAX_HEADER bytes: the only part of the file read before it is checked.
        let mut header = reserve::<u8>(declared as usize).map_err(|why| fail(None, format!("its header: {why}")))?;
        header.resize(declared as usize, 0);
        file.read_exact_at(&mut header, 8).map_err(cannot)?;
        let header: Value =
            serde_json::from_slice(&header).map_err(|e| fail(None, format!("the header is not valid JSON: {e}")))?;
        let Value::Object(header) = header else {
            return Err(fail(None, "the header is not a JSON object".into()));
        };
        let data_start = 8 + declared;
        let data_len = usize::try_from(size - data_start)
            .map_err(|_| fail(None, format!("its {} bytes of data exceed the address space", size - data_start)))?;
        let mut metadata = BTreeMap::new();
        let mut entries = BTreeMap::new();
        for (name, value) in &header {
            if name == METADATA {
                let Value::Object(map) = value else {
                    return Err(fail(None, format!("the header's {METADATA} is not an object of strings")));
                };
                for (key, value) in map {
                    let Value::String(value) = value else {
                        return Err(fail(None, format!("the header's {METADATA} entry '{key}' is not a string")));
                    };
                    metadata.insert(key.clone(), value.clone());
                }
                continue;
            }
            let entry = entry(value, data_len).map_err(|reason| fail(Some(name), reason))?;
            entries.insert(name.clone(), entry);
        }
        // Every byte of the data section belongs to exactly one tensor, in offset order.
        let mut by_offset: Vec<(&String, &Entry)> = entries.iter().collect();
        by_offset.sort_by_key(|(_, e)| (e.begin, e.end));
        let mut covered = 0;
        let mut previous: Option<&str> = None;
        for (name, e) in &by_offset {
            if e.begin != covered {
                let reason = match (e.begin < covered, previous) {
                    (true, Some(before)) => format!(
                        "its data (bytes {}..{}) overlaps tensor '{before}', which ends at byte {covered}",
                        e.begin, e.end
                    ),
                    _ => format!(
                        "its data starts at byte {} but the previous tensor ends at byte {covered}: the header \
                         leaves bytes no tensor owns",
                        e.begin
                    ),
                };
                return Err(fail(Some(name), reason));
            }
            covered = e.end;
            previous = Some(name);
        }
        if covered != data_len {
            return Err(fail(
                previous,
                format!(
                    "the tensors end at byte {covered} of the data, but the file holds {data_len} bytes of data \
                     (bytes no tensor owns)"
                ),
            ));
        }
        drop(by_offset);
        Ok(Tensors { path: shown, metadata, entries, file, data_start })
    }

    /// The file's name, for messages.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The header's metadata.
    pub(crate) fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The names of the tensors, sorted.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether the file holds a tensor of this name.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Checks that the file holds tensor `name` of `shape` (from the header: nothing
    /// is read).
    pub(crate) fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.entry(name, shape).map(drop)
    }

    fn entry(&self, name: &str, shape: &[usize]) -> Result<&Entry> {
        let fail = |reason: String| file_error(&self.path, Some(name), reason);
        let Some(entry) = self.entries.get(name) else {
            return Err(fail("not in the file".into()));
        };
        if entry.shape != shape {
            return Err(fail(format!("has shape {:?}, the model needs {shape:?}", entry.shape)));
        }
        Ok(entry)
    }

    /// The values of tensor `name`, which must have `shape` and hold only finite
    /// values: read from the file into a buffer of their own, reserved fallibly.
    pub(crate) fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let entry = self.entry(name, shape)?;
        let fail = |reason: String| file_error(&self.path, Some(name), reason);
        let count = (entry.end - entry.begin) / 4;
        let mut values = Vec::<f32>::new();
        values.try_reserve_exact(count).map_err(|e| {
            let bytes = entry.end - entry.begin;
            fail(format!(
                "its {count} values ({bytes} bytes) cannot be allocated ({e}): the machine cannot hold this model"
            ))
        })?;
        values.resize(count, 0.0);
        let at = self.data_start + entry.begin as u64;
        self.file
            .read_exact_at(bytemuck::cast_slice_mut(&mut values), at)
            .map_err(|e| fail(format!("its data cannot be read (was the file cut short?): {e}")))?;
        for value in &mut values {
            // Little-endian in the file: a no-op on little-endian machines.
            *value = f32::from_bits(u32::from_le(value.to_bits()));
        }
        if let Some(at) = values.iter().position(|v| !v.is_finite()) {
            return Err(fail(format!("value {at} is {}: a model's weights must be finite", values[at])));
        }
        Ok(values)
    }
}

/// Checks one tensor's header entry against a data section of `data_len` bytes.
fn entry(value: &Value, data_len: usize) -> std::result::Result<Entry, String> {
    let Value::Object(info) = value else {
        return Err("its header entry is not an object with dtype, shape and data_offsets".into());
    };
    match info.get("dtype") {
        Some(Value::String(dtype)) if dtype == "F32" => {}
        Some(Value::String(dtype)) => {
            return Err(format!(
                "dtype {}: carve reads F32 tensors (convert with `tensor.float()` before saving)",
                super::short(dtype)
            ))
        }
        _ => return Err("its header entry has no dtype string".into()),
    }
    let numbers = |key: &str| -> std::result::Result<Vec<u64>, String> {
        let Some(Value::Array(items)) = info.get(key) else {
            return Err(format!("its header entry has no {key} array"));
        };
        items
            .iter()
            .map(|item| {
                item.as_u64().ok_or_else(|| {
                    format!("its {key} holds {}, not a non-negative integer", super::short(&item.to_string()))
                })
            })
            .collect()
    };
    let shape = numbers("shape")?;
    let offsets = numbers("data_offsets")?;
    let &[begin, end] = offsets.as_slice() else {
        return Err(format!("data_offsets has {} numbers, not 2", offsets.len()));
    };
    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    let bytes = elements.and_then(|n| n.checked_mul(4)).filter(|&b| b <= isize::MAX as u64);
    let Some(bytes) = bytes else {
        return Err(format!("shape {} overflows the address space", super::short(&format!("{shape:?}"))));
    };
    if begin > end || end > data_len as u64 {
        return Err(format!(
            "data_offsets [{begin}, {end}] lie outside the file's {data_len} bytes of data (a truncated file, or a \
             header that lies about its lengths)"
        ));
    }
    if end - begin != bytes {
        return Err(format!(
            "shape {} of F32 needs {bytes} bytes, but data_offsets [{begin}, {end}] give {}",
            super::short(&format!("{shape:?}")),
            end - begin
        ));
    }
    let shape = shape.into_iter().map(|d| d as usize).collect();
    Ok(Entry { shape, begin: begin as usize, end: end as usize })
}

/// Writes `tensors` (in order) with `metadata` to `path`: to a temporary file beside it,
/// then renamed over it, so that a failed save leaves no half-written model.
pub(crate) fn write(path: &Path, metadata: &BTreeMap<String, String>, tensors: &[Out]) -> Result<()> {
    let shown = path.display().to_string();
    let mut header = Map::new();
    header.insert(
        METADATA.into(),
        Value::Object(metadata.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect()),
    );
    let mut offset = 0usize;
    for tensor in tensors {
        debug_assert_eq!(tensor.shape.iter().product::<usize>(), tensor.values.len());
        let end = offset + tensor.values.len() * 4;
        header.insert(
            tensor.name.clone(),
            serde_json::json!({ "dtype": "F32", "shape": tensor.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&Value::Object(header)).expect("a JSON map of strings and numbers");
    // Padded with spaces to a multiple of 8 bytes, so that the data is aligned.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = Vec::with_capacity(8 + json.len() + offset);
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    for tensor in tensors {
        for value in &tensor.values {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
    }
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // A name of this save's own (process, counter, time), created new: two saves to one
    // path never share it, and a file or link already there is never written through.
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let unique = |attempt: u64| {
        let count = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        path.with_file_name(format!(".{file_name}.{}-{count}-{nanos}-{attempt}.tmp", std::process::id()))
    };
    let mut attempt = 0;
    let (temporary, file) = loop {
        let temporary = unique(attempt);
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&temporary) {
            Ok(file) => break (temporary, file),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 16 => attempt += 1,
            Err(e) => return Err(file_error(&shown, None, format!("cannot be written: {e}"))),
        }
    };
    let mut file = file;
    let written = file
        .write_all(&bytes)
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::rename(&temporary, path))
        .and_then(|()| {
            // The rename itself made durable (where directories can be opened).
            match path.parent().filter(|d| !d.as_os_str().is_empty()) {
                Some(dir) => std::fs::File::open(dir).and_then(|d| d.sync_all()).or(Ok(())),
                None => Ok(()),
            }
        });
    written.map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        file_error(&shown, None, format!("cannot be written: {e}"))
    })
}
