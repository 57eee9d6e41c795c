//! Safetensors files of `f32` tensors, parsed, checked and written by the format's own
//! crate ([`safetensors`]), read the way carve needs.
//!
//! The format: an 8-byte little-endian header length `n`, `n` bytes of a JSON header
//! (`{"name": {"dtype", "shape", "data_offsets"}, …, "__metadata__": {string: string}}`),
//! then the tensors' bytes, little-endian, laid end to end as the offsets say.
//!
//! **What the crate does.** It parses each tensor's header entry ([`TensorInfo`]: its
//! dtype, shape and offsets), and checks the whole header ([`Metadata::new`]): the
//! tensors lie end to end from the data's first byte, none overlapping and none
//! leaving a gap, and each holds exactly the bytes its shape and dtype need, computed
//! without overflow. When saving, it lays out the header and the data
//! ([`safetensors::serialize`]).
//!
//! **What carve keeps.** The crate checks a *whole file in memory*
//! ([`safetensors::SafeTensors::read_metadata`] wants every byte of it); carve reads and
//! checks a file header first, so that refusing one costs O(header) whatever its size.
//! [`Tensors::open`] opens regular files only (non-blocking, so that a FIFO is refused
//! without waiting for a writer), reads the 8-byte length and refuses a header over 16
//! MiB or longer than the file before reading it, then reads the header alone, hands its
//! entries to the crate, and checks every tensor's place against the file's size (from
//! the open file, so that a file replaced meanwhile cannot swap in another size) and its
//! dtype (`F32`). Every error names the tensor at fault: the crate's errors that do not
//! are traced back to the tensor, by the crate's own check of that tensor alone. A
//! tensor's bytes are read only when a layer asks for them ([`Tensors::values`]), once
//! the whole configuration has been checked against the header, straight into the
//! tensor's own buffer, reserved fallibly (a tensor the machine cannot hold is an
//! error, not an abort). When saving, carve sorts the metadata's keys (the crate writes
//! them in a hash map's order, which differs from one save to the next: safetensors
//! issue 584), so that a model saves to the same bytes every time, and writes the file
//! beside its path and renames it, durably.
//!
//! **Why positioned reads, not a memory map.** The crate reads tensors in place from a
//! buffer, typically a memory map. A mapping of a file that another process truncates
//! faults on the next read of the lost pages (`SIGBUS` ends the process), and no safe
//! API can rule that out; carve reaches such mappings only through `unsafe`
//! constructors whose callers promise the file stays whole. The model owns its weights
//! in any case (they are laid out anew: transposed, gates reordered), so a mapping
//! would save no copy, and carve offers no mapped loader: each tensor is read once, with
//! `pread`, into the buffer that becomes its values, and a file cut short meanwhile is
//! an I/O error.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensorError, View};
use serde_json::Value;

use crate::nn::limits::reserve;
use crate::{Error, Result};

/// The header key of the string-to-string metadata.
const METADATA: &str = "__metadata__";

/// A header longer than this is refused before it is read. Parsed, a JSON header takes
/// up to about 20 times its bytes (a number is a 32-byte value), so the limit is the
/// header parse's memory too: 16 MiB, about 350 MB at worst. A model of 100,000 tensors
/// has a header of about 10 MiB (the crate allows 100 MB).
const MAX_HEADER: u64 = 16 << 20;

/// A safetensors file, open, its header read and checked: its metadata and its `f32`
/// tensors' places, read on demand.
#[derive(Debug)]
pub(crate) struct Tensors {
    path: String,
    metadata: BTreeMap<String, String>,
    /// The tensors' places, as the crate checked them.
    header: Metadata,
    /// The tensors' names, sorted.
    names: Vec<String>,
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
        // process's controlling terminal); the type is then checked on what was opened.
        // Not a FIFO, a device or a directory: those have no size to check against.
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
        // Entry by entry, not the crate's `Metadata` deserialized whole: an error then
        // names its tensor, and each tensor's place is checked against the file before
        // the crate checks its size.
        let mut metadata = BTreeMap::new();
        let mut tensors = Vec::with_capacity(header.len());
        for (name, value) in header {
            if name == METADATA {
                let not_strings = |e: serde_json::Error| {
                    let why = super::short(&e.to_string());
                    fail(None, format!("the header's {METADATA} is not an object of strings: {why}"))
                };
                metadata = serde_json::from_value(value).map_err(not_strings)?;
                continue;
            }
            let info = tensor_info(value, data_len).map_err(|reason| fail(Some(&name), reason))?;
            tensors.push((name, info));
        }
        let mut names: Vec<String> = tensors.iter().map(|(name, _)| name.clone()).collect();
        names.sort_unstable();
        // The crate checks the tensors in the order of their data, as it reads them.
        tensors.sort_by_key(|(_, info)| info.data_offsets);
        let header = Metadata::new(None, tensors.clone()).map_err(|e| {
            let (tensor, reason) = explain(&tensors, &e);
            fail(tensor, reason)
        })?;
        // Each tensor ends within the data, and they lie end to end: the last one must
        // end where the data does.
        if header.data_len() != data_len {
            return Err(fail(
                tensors.last().map(|(name, _)| name.as_str()),
                format!(
                    "the tensors end at byte {} of the data, but the file holds {data_len} bytes of data \
                     (bytes no tensor owns)",
                    header.data_len()
                ),
            ));
        }
        Ok(Tensors { path: shown, metadata, header, names, file, data_start })
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
        self.names.iter().map(String::as_str)
    }

    /// Whether the file holds a tensor of this name.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.header.info(name).is_some()
    }

    /// Checks that the file holds tensor `name` of `shape` (from the header: nothing
    /// is read).
    pub(crate) fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.info(name, shape).map(drop)
    }

    fn info(&self, name: &str, shape: &[usize]) -> Result<&TensorInfo> {
        let fail = |reason: String| file_error(&self.path, Some(name), reason);
        let Some(info) = self.header.info(name) else {
            return Err(fail("not in the file".into()));
        };
        if info.shape != shape {
            return Err(fail(format!("has shape {:?}, the model needs {shape:?}", info.shape)));
        }
        Ok(info)
    }

    /// The values of tensor `name`, which must have `shape` and hold only finite
    /// values: read from the file into a buffer of their own, reserved fallibly.
    pub(crate) fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (begin, end) = self.info(name, shape)?.data_offsets;
        let fail = |reason: String| file_error(&self.path, Some(name), reason);
        let count = (end - begin) / 4;
        let mut values = Vec::<f32>::new();
        values.try_reserve_exact(count).map_err(|e| {
            let bytes = end - begin;
            fail(format!(
                "its {count} values ({bytes} bytes) cannot be allocated ({e}): the machine cannot hold this model"
            ))
        })?;
        values.resize(count, 0.0);
        let at = self.data_start + begin as u64;
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

/// One tensor's header entry, parsed by the crate, of dtype `F32`, and lying within a
/// data section of `data_len` bytes.
fn tensor_info(value: Value, data_len: usize) -> std::result::Result<TensorInfo, String> {
    let info: TensorInfo = serde_json::from_value(value).map_err(|e| {
        format!("its header entry is not a tensor's dtype, shape and data_offsets: {}", super::short(&e.to_string()))
    })?;
    if info.dtype != Dtype::F32 {
        return Err(format!(
            "dtype {}: carve reads F32 tensors (convert with `tensor.float()` before saving)",
            info.dtype
        ));
    }
    let (begin, end) = info.data_offsets;
    if begin > end || end > data_len {
        return Err(format!(
            "data_offsets [{begin}, {end}] lie outside the file's {data_len} bytes of data (a truncated file, or a \
             header that lies about its lengths)"
        ));
    }
    Ok(info)
}

/// The tensor at fault and what is wrong, for the crate's `error` on `tensors` (in the
/// order of their data). Its errors of a tensor's size do not say which: each tensor is
/// checked alone, by the crate, to find it.
fn explain<'a>(tensors: &'a [(String, TensorInfo)], error: &SafeTensorError) -> (Option<&'a str>, String) {
    if let SafeTensorError::InvalidOffset(name) = error {
        // Not where the previous tensor ends (begin <= end was checked).
        if let Some(at) = tensors.iter().position(|(n, _)| n == name) {
            let (begin, end) = tensors[at].1.data_offsets;
            let previous = at.checked_sub(1).map(|p| (tensors[p].0.as_str(), tensors[p].1.data_offsets.1));
            let reason = match previous {
                Some((before, covered)) if begin < covered => {
                    format!(
                        "its data (bytes {begin}..{end}) overlaps tensor '{}', which ends at byte {covered}",
                        super::short(before)
                    )
                }
                _ => format!(
                    "its data starts at byte {begin} but the previous tensor ends at byte {}: the header leaves bytes \
                     no tensor owns",
                    previous.map_or(0, |(_, covered)| covered)
                ),
            };
            return (Some(tensors[at].0.as_str()), reason);
        }
    }
    for (name, info) in tensors {
        let (begin, end) = info.data_offsets;
        let alone = TensorInfo { data_offsets: (0, end - begin), ..info.clone() };
        let Err(e) = Metadata::new(None, vec![(name.clone(), alone)]) else { continue };
        let shape = super::short(&format!("{:?}", info.shape));
        let reason = match e {
            SafeTensorError::ValidationOverflow => format!("shape {shape} overflows the address space"),
            SafeTensorError::TensorInvalidInfo => {
                let needs =
                    info.shape.iter().try_fold(info.dtype.bitsize(), |n, &d| n.checked_mul(d)).map(|bits| bits / 8);
                match needs {
                    Some(bytes) => format!(
                        "shape {shape} of {} needs {bytes} bytes, but data_offsets [{begin}, {end}] give {}",
                        info.dtype,
                        end - begin
                    ),
                    None => format!("shape {shape} overflows the address space"),
                }
            }
            other => format!("its header entry is invalid: {other}"),
        };
        return (Some(name), reason);
    }
    (None, format!("the header's tensors are invalid: {error}"))
}

/// A tensor to write, as the crate sees it.
impl View for &Out {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(&self.values))
        } else {
            Cow::Owned(self.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

/// `bytes`, a file the crate serialized, with its metadata's keys sorted: the crate
/// writes them in its hash map's order, which differs from one map to the next
/// (safetensors issue 584). The header's entries in another order take the same bytes,
/// so the header keeps its length, and the data its place.
fn sort_metadata(bytes: &mut [u8]) {
    let Some(n) = bytes.get(..8).map(|n| u64::from_le_bytes(n.try_into().expect("8 bytes")) as usize) else {
        return;
    };
    let Some(header) = bytes.get_mut(8..8 + n) else { return };
    let Ok(mut entries) = serde_json::from_slice::<BTreeMap<String, Value>>(header) else { return };
    if let Some(metadata) = entries.get_mut(METADATA) {
        let Ok(sorted) = serde_json::from_value::<BTreeMap<String, String>>(metadata.take()) else { return };
        *metadata = Value::from_iter(sorted);
    }
    let Ok(canonical) = serde_json::to_vec(&entries) else { return };
    // The crate pads its JSON with spaces: what is left of the header after the
    // canonical JSON is padding.
    debug_assert!(canonical.len() <= n && header[canonical.len()..].iter().all(|&b| b == b' '), "same length");
    if canonical.len() <= n && header[canonical.len()..].iter().all(|&b| b == b' ') {
        header[..canonical.len()].copy_from_slice(&canonical);
    }
}

/// Writes `tensors` with `metadata` to `path`: to a temporary file beside it, then
/// renamed over it, so that a failed save leaves no half-written model.
pub(crate) fn write(path: &Path, metadata: &BTreeMap<String, String>, tensors: &[Out]) -> Result<()> {
    let shown = path.display().to_string();
    let cannot = |e: &dyn std::fmt::Display| file_error(&shown, None, format!("cannot be written: {e}"));
    let metadata = metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut bytes =
        safetensors::serialize(tensors.iter().map(|t| (t.name.as_str(), t)), Some(metadata)).map_err(|e| cannot(&e))?;
    sort_metadata(&mut bytes);
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
            Err(e) => return Err(cannot(&e)),
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
        cannot(&e)
    })
}
