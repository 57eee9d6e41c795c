//! The data: the UCI digits from `examples/data/digits.csv.gz`, and their stratified
//! train/test split.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use carve_rng::Rng;
use flate2::read::GzDecoder;
use ndarray::{Array1, Array2, Axis};

use crate::{Res, CLASSES, FEATURES};

/// Images (one row each, pixels in 0..1) and their labels.
pub(crate) struct Dataset {
    pub(crate) x: Array2<f32>,
    pub(crate) y: Array1<u32>,
}

pub(crate) fn data_path() -> PathBuf {
    match std::env::var_os("TRAIN_DIGITS_DATA") {
        Some(path) => PathBuf::from(path),
        None => {
            // The repository's root package, or the bench package inside it.
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
            let file = |dir: &Path| dir.join("examples/data/digits.csv.gz");
            match manifest.parent() {
                Some(root) if !file(manifest).exists() && file(root).exists() => file(root),
                _ => file(manifest),
            }
        }
    }
}

/// Reads the gzipped CSV: 64 pixel values 0..16, then the label 0..9, no header.
pub(crate) fn load_digits(path: &Path) -> Res<Dataset> {
    let file = File::open(path).map_err(|e| {
        format!(
            "cannot open the digits data at {}: {e} (it ships with the repository as \
             examples/data/digits.csv.gz; TRAIN_DIGITS_DATA overrides the path)",
            path.display()
        )
    })?;
    let mut reader =
        csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(GzDecoder::new(BufReader::new(file)));
    let mut pixels = Vec::with_capacity(1797 * FEATURES);
    let mut labels = Vec::with_capacity(1797);
    let bad = |row: usize, what: String| format!("{}: row {row}: {what}", path.display());
    for (i, record) in reader.records().enumerate() {
        let row = i + 1;
        let record = record
            .map_err(|e| bad(row, format!("cannot read or decompress it ({e}); expected a gzip-compressed CSV")))?;
        if record.len() != FEATURES + 1 {
            return Err(bad(
                row,
                format!("{} fields, expected {} (64 pixels and a label)", record.len(), FEATURES + 1),
            )
            .into());
        }
        for field in record.iter().take(FEATURES) {
            match field.trim().parse::<f32>() {
                Ok(v) if (0.0..=16.0).contains(&v) => pixels.push(v / 16.0),
                _ => return Err(bad(row, format!("pixel value '{field}' is not a number in 0..16")).into()),
            }
        }
        let field = &record[FEATURES];
        match field.trim().parse::<u32>() {
            Ok(label) if (label as usize) < CLASSES => labels.push(label),
            _ => return Err(bad(row, format!("label '{field}' is not a class 0..9")).into()),
        }
    }
    if labels.is_empty() {
        return Err(format!("{}: no rows", path.display()).into());
    }
    let x = Array2::from_shape_vec((labels.len(), FEATURES), pixels)?;
    Ok(Dataset { x, y: Array1::from(labels) })
}

/// Stratified split: per class, the rows are shuffled and 20% (rounded) go to the
/// test set. Returns (train rows, test rows).
pub(crate) fn stratified_split(labels: &Array1<u32>, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut rng = Rng::new(seed);
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for class in 0..CLASSES as u32 {
        let mut rows: Vec<usize> = labels.iter().enumerate().filter(|&(_, &y)| y == class).map(|(i, _)| i).collect();
        rng.shuffle(&mut rows);
        let n_test = (rows.len() as f64 * 0.2).round() as usize;
        test.extend_from_slice(&rows[..n_test]);
        train.extend_from_slice(&rows[n_test..]);
    }
    (train, test)
}

pub(crate) fn subset(data: &Dataset, rows: &[usize]) -> Dataset {
    Dataset { x: data.x.select(Axis(0), rows), y: data.y.select(Axis(0), rows) }
}
