//! The UCI Japanese Vowels data (examples/data/japanese_vowels.csv.gz): loading and
//! standardizing, shared by `train_sequences` and the sequence tests.

// Each user takes part of this module.
#![allow(dead_code)]

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;
use ndarray::Array2;

/// Coefficients per frame.
pub(crate) const FEATURES: usize = 12;
/// Speakers.
pub(crate) const CLASSES: usize = 9;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// One split of the data: sequences `(steps, 12)` and speakers 0..9.
pub(crate) struct Split {
    pub(crate) sequences: Vec<Array2<f32>>,
    pub(crate) labels: Vec<u32>,
}

pub(crate) fn data_path() -> PathBuf {
    match std::env::var_os("TRAIN_SEQUENCES_DATA") {
        Some(path) => PathBuf::from(path),
        None => {
            // The repository's root package, or the bench package inside it.
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
            let file = |dir: &Path| dir.join("examples/data/japanese_vowels.csv.gz");
            match manifest.parent() {
                Some(root) if !file(manifest).exists() && file(root).exists() => file(root),
                _ => file(manifest),
            }
        }
    }
}

/// Reads `split,series,label,step,c1..c12` rows into the train and test splits.
pub(crate) fn load(path: &Path) -> Res<(Split, Split)> {
    let file = File::open(path).map_err(|e| {
        format!(
            "cannot open the Japanese Vowels data at {}: {e} (it ships with the repository as \
             examples/data/japanese_vowels.csv.gz; TRAIN_SEQUENCES_DATA overrides the path)",
            path.display()
        )
    })?;
    let mut reader = csv::Reader::from_reader(GzDecoder::new(BufReader::new(file)));
    let mut splits = [(Vec::<Vec<f32>>::new(), Vec::<u32>::new()), (Vec::new(), Vec::new())];
    for (i, record) in reader.records().enumerate() {
        let bad = |what: String| format!("{}: row {}: {what}", path.display(), i + 2);
        let record = record.map_err(|e| bad(format!("cannot read it ({e})")))?;
        if record.len() != 4 + FEATURES {
            return Err(bad(format!("{} fields, expected {}", record.len(), 4 + FEATURES)).into());
        }
        let which = match &record[0] {
            "train" => 0,
            "test" => 1,
            other => return Err(bad(format!("split '{other}' is neither train nor test")).into()),
        };
        let number = |field: &str| field.trim().parse::<usize>().map_err(|_| bad(format!("'{field}' is not a count")));
        let (series, label, step) = (number(&record[1])?, number(&record[2])?, number(&record[3])?);
        if !(1..=CLASSES).contains(&label) {
            return Err(bad(format!("speaker {label} is not 1 to {CLASSES}")).into());
        }
        let (frames, labels) = &mut splits[which];
        if series == frames.len() {
            frames.push(Vec::new());
            labels.push(label as u32 - 1);
        }
        if series + 1 != frames.len() || frames[series].len() != step * FEATURES || labels[series] != label as u32 - 1 {
            return Err(bad(format!("series {series} step {step} is out of order")).into());
        }
        for field in record.iter().skip(4) {
            let v: f32 = field.trim().parse().map_err(|_| bad(format!("'{field}' is not a number")))?;
            frames[series].push(v);
        }
    }
    let [train, test] = splits.map(|(frames, labels)| Split {
        sequences: frames
            .into_iter()
            .map(|f| Array2::from_shape_vec((f.len() / FEATURES, FEATURES), f).expect("whole frames"))
            .collect(),
        labels,
    });
    if train.labels.is_empty() || test.labels.is_empty() {
        return Err(format!("{}: no training or no test sequences", path.display()).into());
    }
    let (mut train, mut test) = (train, test);
    standardize(&mut train, &mut test);
    Ok((train, test))
}

/// Scales each coefficient to mean 0 and standard deviation 1 over the training
/// frames (the test set with the training set's statistics).
fn standardize(train: &mut Split, test: &mut Split) {
    let frames = train.sequences.iter().map(|s| s.nrows()).sum::<usize>() as f64;
    let mut mean = [0.0f64; FEATURES];
    let mut square = [0.0f64; FEATURES];
    for seq in &train.sequences {
        for row in seq.rows() {
            for (j, &v) in row.iter().enumerate() {
                mean[j] += f64::from(v);
                square[j] += f64::from(v) * f64::from(v);
            }
        }
    }
    let scale: Vec<(f32, f32)> = (0..FEATURES)
        .map(|j| {
            let m = mean[j] / frames;
            let sd = (square[j] / frames - m * m).max(1e-12).sqrt();
            (m as f32, (1.0 / sd) as f32)
        })
        .collect();
    for seq in train.sequences.iter_mut().chain(test.sequences.iter_mut()) {
        for mut row in seq.rows_mut() {
            for (v, &(m, s)) in row.iter_mut().zip(&scale) {
                *v = (*v - m) * s;
            }
        }
    }
}
