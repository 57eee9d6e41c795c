//! `POST /predict`'s body, `{"inputs": [[f32; features], …]}`, read straight into the
//! rows' values as serde_json scans it.
//!
//! Why not `serde_json::Value`: a tree of values takes 16 to 32 times the text of a
//! body of numbers (each `Value` 32 bytes and more, against two bytes of text for
//! `0,`), so that the in-flight bodies of a busy server took gigabytes, and one body at
//! a large `--max-body` could take more than the machine. Read here, a body takes its
//! values (4 bytes each, in a vector that at most doubles) and nothing per value
//! beside them; what is wrong with it is said as before, naming the row and column.

use std::cell::RefCell;
use std::fmt;

use ndarray::Array2;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// What the body needs, said when it lacks it.
const USAGE: &str = "the body needs \"inputs\": [[f32, ...], ...], one row of features per example";

/// `{"inputs": [[f32; features], …]}` as a matrix, or what is wrong with it.
pub(crate) fn parse_inputs(body: &[u8], features: usize) -> Result<Array2<f32>, String> {
    // What is wrong with a body that is JSON is said here, not in serde_json's words
    // (which would add where in the text it was found).
    let problem = RefCell::new(None);
    let mut reader = serde_json::Deserializer::from_slice(body);
    let read = Body { features, problem: &problem }.deserialize(&mut reader).and_then(|rows| {
        reader.end()?;
        Ok(rows)
    });
    match read {
        Ok((rows, values)) => Ok(Array2::from_shape_vec((rows, features), values).expect("rows × features values")),
        Err(e) => Err(problem.into_inner().unwrap_or_else(|| {
            let text = String::from_utf8_lossy(body);
            if ["NaN", "Infinity"].iter().any(|word| text.contains(word)) {
                format!(
                    "malformed JSON ({e}): NaN and Infinity are not JSON numbers, and the model takes finite values"
                )
            } else {
                format!("malformed JSON: {e}")
            }
        })),
    }
}

/// `message` as the body's problem (in `problem`), and the error that stops the scan.
fn refuse<E: de::Error>(problem: &RefCell<Option<String>>, message: String) -> E {
    *problem.borrow_mut() = Some(message);
    E::custom("refused")
}

/// A visitor's refusals of the scalars (booleans, numbers, strings, `null`), each with
/// its `wrong_kind()`: for the levels that take only a list or an object.
macro_rules! refuse_scalars {
    ($value:ty) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<$value, E> {
            Err(self.wrong_kind())
        }

        fn visit_f64<E: de::Error>(self, _: f64) -> Result<$value, E> {
            Err(self.wrong_kind())
        }

        fn visit_i64<E: de::Error>(self, _: i64) -> Result<$value, E> {
            Err(self.wrong_kind())
        }

        fn visit_u64<E: de::Error>(self, _: u64) -> Result<$value, E> {
            Err(self.wrong_kind())
        }

        fn visit_str<E: de::Error>(self, _: &str) -> Result<$value, E> {
            Err(self.wrong_kind())
        }

        fn visit_unit<E: de::Error>(self) -> Result<$value, E> {
            Err(self.wrong_kind())
        }
    };
}

/// The body: an object whose only field is `"inputs"`; gives the rows and their values.
struct Body<'p> {
    features: usize,
    problem: &'p RefCell<Option<String>>,
}

impl Body<'_> {
    fn refuse<E: de::Error>(&self, message: String) -> E {
        refuse(self.problem, message)
    }

    fn wrong_kind<E: de::Error>(&self) -> E {
        self.refuse(format!("the body is not a JSON object: {USAGE}"))
    }
}

impl<'de> DeserializeSeed<'de> for Body<'_> {
    type Value = (usize, Vec<f32>);

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Body<'_> {
    type Value = (usize, Vec<f32>);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut inputs = None;
        while let Some(key) = map.next_key::<String>()? {
            if key != "inputs" {
                let key = serde_json::Value::String(key);
                return Err(self.refuse(format!("unknown field {key}: the body's fields are \"inputs\"")));
            }
            if inputs.is_some() {
                return Err(self.refuse("the field \"inputs\" is given twice".into()));
            }
            inputs = Some(map.next_value_seed(Rows { features: self.features, problem: self.problem })?);
        }
        match inputs {
            None => Err(self.refuse(USAGE.into())),
            Some((0, _)) => Err(self.refuse("an empty batch: \"inputs\" holds no rows".into())),
            Some(rows) => Ok(rows),
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(self.wrong_kind())
    }

    refuse_scalars!((usize, Vec<f32>));
}

/// `"inputs"`: a list of rows, each of `features` numbers; gives the rows and their
/// values, row by row.
struct Rows<'p> {
    features: usize,
    problem: &'p RefCell<Option<String>>,
}

impl<'de> DeserializeSeed<'de> for Rows<'_> {
    type Value = (usize, Vec<f32>);

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl Rows<'_> {
    fn wrong_kind<E: de::Error>(&self) -> E {
        refuse(self.problem, "\"inputs\" must be a list of rows, each a list of numbers".into())
    }
}

impl<'de> Visitor<'de> for Rows<'_> {
    type Value = (usize, Vec<f32>);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of rows")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut rows: A) -> Result<Self::Value, A::Error> {
        let mut values = Vec::new();
        let mut r = 0;
        while rows
            .next_element_seed(Row { r, features: self.features, values: &mut values, problem: self.problem })?
            .is_some()
        {
            r += 1;
        }
        Ok((r, values))
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(self.wrong_kind())
    }

    refuse_scalars!((usize, Vec<f32>));
}

/// Row `r`: `features` numbers, appended to `values`.
struct Row<'v, 'p> {
    r: usize,
    features: usize,
    values: &'v mut Vec<f32>,
    problem: &'p RefCell<Option<String>>,
}

impl Row<'_, '_> {
    fn refuse<E: de::Error>(&self, message: String) -> E {
        refuse(self.problem, message)
    }

    fn wrong_kind<E: de::Error>(&self) -> E {
        self.refuse(format!("row {} of \"inputs\" is not a list of numbers", self.r))
    }
}

impl<'de> DeserializeSeed<'de> for Row<'_, '_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Row<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a row of numbers")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut row: A) -> Result<(), A::Error> {
        let (r, features) = (self.r, self.features);
        let mut c = 0;
        loop {
            if c == features {
                // One value too many: the rest only counted, for the message.
                let mut count = features;
                while row.next_element::<IgnoredAny>()?.is_some() {
                    count += 1;
                }
                if count == features {
                    return Ok(());
                }
                return Err(
                    self.refuse(format!("row {r} has {count} values; the model takes {features} features per row"))
                );
            }
            match row.next_element_seed(Number { r, c, problem: self.problem })? {
                // A number beyond f32's range becomes infinite: the pool refuses it,
                // naming it.
                Some(number) => self.values.push(number as f32),
                None => {
                    return Err(
                        self.refuse(format!("row {r} has {c} values; the model takes {features} features per row"))
                    )
                }
            }
            c += 1;
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(self.wrong_kind())
    }

    refuse_scalars!(());
}

/// The value at row `r`, column `c`: a number.
struct Number<'p> {
    r: usize,
    c: usize,
    problem: &'p RefCell<Option<String>>,
}

impl Number<'_> {
    /// Refuses a value that is not a number, shown as JSON (`what`).
    fn refuse<E: de::Error>(&self, what: &str) -> E {
        refuse(self.problem, format!("row {}, column {} is {what}, not a number", self.r, self.c))
    }
}

impl<'de> DeserializeSeed<'de> for Number<'_> {
    type Value = f64;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<f64, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Number<'_> {
    type Value = f64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number")
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
        Ok(v as f64)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
        Ok(v as f64)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
        Err(self.refuse(&serde_json::Value::String(v.to_owned()).to_string()))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<f64, E> {
        Err(self.refuse(if v { "true" } else { "false" }))
    }

    fn visit_unit<E: de::Error>(self) -> Result<f64, E> {
        Err(self.refuse("null"))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<f64, A::Error> {
        Err(self.refuse("a list"))
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<f64, A::Error> {
        Err(self.refuse("an object"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    /// The system allocator, counting this thread's live heap bytes and their peak.
    struct Peak;

    thread_local! {
        static LIVE: Cell<usize> = const { Cell::new(0) };
        static PEAK: Cell<usize> = const { Cell::new(0) };
    }

    fn grew(bytes: usize) {
        let live = LIVE.with(|l| {
            l.set(l.get() + bytes);
            l.get()
        });
        PEAK.with(|p| p.set(p.get().max(live)));
    }

    fn shrank(bytes: usize) {
        LIVE.with(|l| l.set(l.get().saturating_sub(bytes)));
    }

    // SAFETY: every call is the system allocator's, with the same arguments; the
    // counters are thread-local cells with constant initialisers (no allocation).
    unsafe impl GlobalAlloc for Peak {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            grew(layout.size());
            // SAFETY: as the caller's contract for `GlobalAlloc::alloc`.
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            shrank(layout.size());
            // SAFETY: as the caller's contract for `GlobalAlloc::dealloc`.
            unsafe { System.dealloc(ptr, layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
            grew(new);
            shrank(layout.size());
            // SAFETY: as the caller's contract for `GlobalAlloc::realloc`.
            unsafe { System.realloc(ptr, layout, new) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Peak = Peak;

    /// The most heap bytes this thread held at once while `f` ran, beyond what it held
    /// before.
    fn peak_of<R>(f: impl FnOnce() -> R) -> usize {
        let before = LIVE.with(Cell::get);
        PEAK.with(|p| p.set(before));
        drop(f());
        PEAK.with(Cell::get) - before
    }

    #[test]
    fn a_body_of_numbers_takes_its_values_not_a_tree_of_them() {
        // The densest body: one character a value, `0,`; 1 MiB of it.
        let row = format!("[{}]", vec!["0"; 64].join(","));
        let rows = (1 << 20) / (row.len() + 1);
        let body = format!("{{\"inputs\": [{}]}}", vec![row; rows].join(","));
        let tree = peak_of(|| serde_json::from_slice::<serde_json::Value>(body.as_bytes()).unwrap());
        let scanned = peak_of(|| parse_inputs(body.as_bytes(), 64).unwrap());
        println!("a body of {} B: a tree of values {tree} B at its peak, the scan {scanned} B", body.len());
        // 4 bytes a value, twice the body here, and the vector's last growth (its old
        // and new buffers live at once): at most three times the body. The tree takes
        // over five times that.
        assert!(scanned <= body.len() * 7 / 2, "{scanned} bytes for a body of {}", body.len());
        assert!(tree >= 4 * scanned, "the tree took {tree} bytes, the scan {scanned}");
    }

    fn refused(body: &str) -> String {
        parse_inputs(body.as_bytes(), 2).unwrap_err()
    }

    #[test]
    fn rows_of_numbers_are_read_in_order() {
        let x = parse_inputs(br#"{"inputs": [[1, -2.5], [3e2, 4]]}"#, 2).unwrap();
        assert_eq!(x, ndarray::array![[1.0, -2.5], [300.0, 4.0]]);
        let beyond = parse_inputs(br#"{"inputs": [[1e39, 0]]}"#, 2).unwrap();
        assert!(beyond[[0, 0]].is_infinite(), "left for the pool to refuse, naming it");
    }

    #[test]
    fn what_is_wrong_is_said_as_the_tree_of_values_said_it() {
        for (body, needle) in [
            (r#"{"inputs": [[1, 2],"#, "malformed JSON"),
            ("inputs=1,2", "malformed JSON"),
            (r#"{"inputs": [[NaN, 1]]}"#, "NaN and Infinity are not JSON numbers"),
            (r#"{"inputs": [[1, 2]]} x"#, "malformed JSON"),
            (r#"{"inputs": [[1, 2], [1, 2, 3]]}"#, "row 1 has 3 values; the model takes 2 features per row"),
            (r#"{"inputs": [[1]]}"#, "row 0 has 1 values; the model takes 2 features per row"),
            (r#"{"inputs": [[1, "7"]]}"#, "row 0, column 1 is \"7\", not a number"),
            (r#"{"inputs": [[null, 1]]}"#, "row 0, column 0 is null, not a number"),
            (r#"{"inputs": [[1, 2], 3]}"#, "row 1 of \"inputs\" is not a list of numbers"),
            (r#"{"inputs": []}"#, "an empty batch"),
            (r#"{"rows": [[1, 2]]}"#, "unknown field \"rows\""),
            (r#"{}"#, "the body needs \"inputs\""),
            (r#"{"inputs": 3}"#, "must be a list of rows"),
            (r#"{"inputs": [[1, 2]], "inputs": [[1, 2]]}"#, "given twice"),
            ("[[1, 2]]", "not a JSON object"),
            ("3", "not a JSON object"),
        ] {
            let message = refused(body);
            assert!(message.contains(needle), "{body}: '{message}' should say '{needle}'");
            assert!(!message.contains("refused"), "{body}: the sentinel leaked: {message}");
        }
    }
}
