//! The one strict JSON reader of every operation's body: serde visitors reading straight into the
//! operation's raw form (no `serde_json::Value` tree, so memory stays bounded by the body and the
//! lists' bounds), naming the field of every error (`takes[3].buckets[0].capacity`) and refusing
//! unknown fields. An operation says what its objects hold by implementing [`Object`]; `null`
//! means absent; a field given twice keeps its last value. The error body of both transports'
//! HTTP form is [`error_body`].

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::domain::{Algorithm, InvalidArgument};

/// A JSON object the reader fills field by field.
pub trait Object: Default {
    /// Every field it has; any other name is refused as an unknown field (naming it).
    const FIELDS: &'static [&'static str];

    /// Reads the value of the field `name` (one of [`Object::FIELDS`]) into `self`.
    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        value: Field<'_, '_, A>,
    ) -> Result<(), A::Error>;
}

/// Decodes a whole body as `T`: a pure function over the bytes. A body that is not JSON at all,
/// or not an object, is an error with the empty field.
pub fn decode<T: Object>(body: &[u8]) -> Result<T, InvalidArgument> {
    let slot = ErrorSlot::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let seed = ObjectSeed::<T> {
        at: Path::Root,
        slot: &slot,
        _t: PhantomData,
    };
    let result = seed
        .deserialize(&mut de)
        .and_then(|raw| de.end().map(|()| raw));
    match result {
        Ok(raw) => Ok(raw),
        // A syntax error wins over what the visitor was reading when it hit it.
        Err(e) if e.is_syntax() || e.is_eof() || e.is_io() => {
            Err(InvalidArgument::new("", format!("malformed JSON: {e}")))
        }
        Err(_) => Err(slot
            .take()
            .unwrap_or_else(|| InvalidArgument::new("", "the body must be a JSON object"))),
    }
}

/// Where a value sits in the body, formatted only when an error names it (a valid body allocates
/// no field names).
#[derive(Clone, Copy)]
pub enum Path<'a> {
    /// The body itself.
    Root,
    /// A field of an object.
    Field(&'a Path<'a>, &'static str),
    /// An element of a list.
    Index(&'a Path<'a>, usize),
}

impl Path<'_> {
    /// The path of a field named `name` in the object at `self` (for names not known statically).
    fn join(&self, name: &str) -> String {
        match self {
            Path::Root => name.to_string(),
            p => format!("{p}.{name}"),
        }
    }

    /// The last field name on the path (a list's own name).
    fn name(&self) -> &'static str {
        match self {
            Path::Root => "",
            Path::Field(_, n) => n,
            Path::Index(p, _) => p.name(),
        }
    }
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Root => Ok(()),
            Path::Field(Path::Root, n) => f.write_str(n),
            Path::Field(p, n) => write!(f, "{p}.{n}"),
            Path::Index(p, i) => write!(f, "{p}[{i}]"),
        }
    }
}

/// Where a visitor leaves the field-named error it stopped on (serde's error type cannot carry
/// it); the first error recorded wins, so the innermost field is named.
#[derive(Default)]
struct ErrorSlot(RefCell<Option<InvalidArgument>>);

impl ErrorSlot {
    /// Records the error (unless one is already there) and returns a serde error to stop on.
    fn set<E: de::Error>(&self, field: impl FnOnce() -> String, message: &str) -> E {
        self.note(field, message, E::custom(message))
    }

    /// Records the error (unless one is already there) and passes `original` on: a syntax error
    /// met while reading a field stays a syntax error.
    fn note<E>(&self, field: impl FnOnce() -> String, message: &str, original: E) -> E {
        let mut s = self.0.borrow_mut();
        if s.is_none() {
            *s = Some(InvalidArgument::new(field(), message));
        }
        original
    }

    fn take(&self) -> Option<InvalidArgument> {
        self.0.borrow_mut().take()
    }
}

/// The value of one field, read by one of the typed methods.
pub struct Field<'a, 'p, A> {
    map: &'a mut A,
    at: Path<'p>,
    slot: &'a ErrorSlot,
}

impl<'de, A: MapAccess<'de>> Field<'_, '_, A> {
    /// A string.
    pub fn string(self) -> Result<Option<String>, A::Error> {
        let (at, slot) = (self.at, self.slot);
        self.map
            .next_value::<Option<String>>()
            .map_err(|e| slot.note(|| at.to_string(), "must be a string", e))
    }

    /// A non-negative integer.
    pub fn uint(self) -> Result<Option<u64>, A::Error> {
        let (at, slot) = (self.at, self.slot);
        self.map
            .next_value::<Option<u64>>()
            .map_err(|e| slot.note(|| at.to_string(), "must be a non-negative integer", e))
    }

    /// An algorithm's name.
    pub fn algorithm(self) -> Result<Option<Algorithm>, A::Error> {
        let (at, slot) = (self.at, self.slot);
        self.map
            .next_value_seed(OptionSeed(AlgorithmSeed))
            .map_err(|e| {
                let expected = format!("must be {}", Algorithm::expected());
                slot.note(|| at.to_string(), &expected, e)
            })
    }

    /// A list of objects; with `max`, an element past it stops the decoding before it is read.
    pub fn objects<T: Object>(self, max: Option<usize>) -> Result<Option<Vec<T>>, A::Error> {
        self.list(max)
    }

    /// A list of strings.
    pub fn strings(self) -> Result<Option<Vec<String>>, A::Error> {
        self.list(None)
    }

    fn list<T: Item>(self, max: Option<usize>) -> Result<Option<Vec<T>>, A::Error> {
        let (at, slot) = (self.at, self.slot);
        let seed = ListSeed::<T> {
            at,
            slot,
            max,
            _t: PhantomData,
        };
        self.map
            .next_value_seed(OptionSeed(seed))
            .map_err(|e| slot.note(|| at.to_string(), "must be a list", e))
    }
}

/// What a list holds: objects, or strings.
trait Item: Sized {
    /// The error of an element that is not one.
    const NOT_ONE: &'static str;

    fn next<'de, S: SeqAccess<'de>>(
        seq: &mut S,
        at: Path<'_>,
        slot: &ErrorSlot,
    ) -> Result<Option<Self>, S::Error>;
}

impl<T: Object> Item for T {
    const NOT_ONE: &'static str = "must be an object";

    fn next<'de, S: SeqAccess<'de>>(
        seq: &mut S,
        at: Path<'_>,
        slot: &ErrorSlot,
    ) -> Result<Option<Self>, S::Error> {
        seq.next_element_seed(ObjectSeed::<T> {
            at,
            slot,
            _t: PhantomData,
        })
    }
}

impl Item for String {
    const NOT_ONE: &'static str = "must be a string";

    fn next<'de, S: SeqAccess<'de>>(
        seq: &mut S,
        _: Path<'_>,
        _: &ErrorSlot,
    ) -> Result<Option<Self>, S::Error> {
        seq.next_element::<String>()
    }
}

/// One object at `at`.
struct ObjectSeed<'a, 'p, T> {
    at: Path<'p>,
    slot: &'a ErrorSlot,
    _t: PhantomData<T>,
}

impl<'de, T: Object> DeserializeSeed<'de> for ObjectSeed<'_, '_, T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, T: Object> Visitor<'de> for ObjectSeed<'_, '_, T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<T, M::Error> {
        let mut out = T::default();
        while let Some(key) = map.next_key_seed(KeySeed(T::FIELDS))? {
            match key {
                Key::Known(name) => {
                    let value = Field {
                        map: &mut map,
                        at: Path::Field(&self.at, name),
                        slot: self.slot,
                    };
                    out.read(name, value)?;
                }
                // Only the first unknown name is kept (in the error): one String per body at most.
                Key::Unknown(name) => {
                    return Err(self.slot.set(|| self.at.join(&name), "unknown field"))
                }
            }
        }
        Ok(out)
    }
}

enum Key {
    Known(&'static str),
    Unknown(String),
}

/// A field name, looked up among an object's fields.
struct KeySeed(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
        Ok(match self.0.iter().find(|&&n| n == v) {
            Some(n) => Key::Known(n),
            None => Key::Unknown(v.to_string()),
        })
    }
}

/// A list at `at`: at most `max` elements are read; one more stops the decoding there.
struct ListSeed<'a, 'p, T> {
    at: Path<'p>,
    slot: &'a ErrorSlot,
    max: Option<usize>,
    _t: PhantomData<T>,
}

impl<'de, T: Item> DeserializeSeed<'de> for ListSeed<'_, '_, T> {
    type Value = Vec<T>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, T: Item> Visitor<'de> for ListSeed<'_, '_, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list")
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
        let (at, slot) = (&self.at, self.slot);
        let mut out = Vec::new();
        loop {
            let i = out.len();
            if let Some(max) = self.max.filter(|&m| m == i) {
                // The element past the bound is refused before it is read.
                return match seq.next_element_seed(TooMany { at, slot, max })? {
                    None => Ok(out),
                    Some(never) => match never {},
                };
            }
            let here = Path::Index(at, i);
            let next = T::next(&mut seq, here, slot)
                .map_err(|e| slot.note(|| here.to_string(), T::NOT_ONE, e))?;
            match next {
                Some(item) => out.push(item),
                None => return Ok(out),
            }
        }
    }
}

/// Stands for an element past a list's bound: errs without reading it.
struct TooMany<'a, 'p> {
    at: &'a Path<'p>,
    slot: &'a ErrorSlot,
    max: usize,
}

impl<'de> DeserializeSeed<'de> for TooMany<'_, '_> {
    type Value = std::convert::Infallible;

    fn deserialize<D: Deserializer<'de>>(self, _: D) -> Result<Self::Value, D::Error> {
        let (max, name) = (self.max, self.at.name());
        Err(self.slot.set(
            || self.at.to_string(),
            &format!(
                "must hold at most {max} {name} (decoding stopped at the {}th)",
                max + 1
            ),
        ))
    }
}

/// `null` or what the inner seed reads.
struct OptionSeed<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for OptionSeed<S> {
    type Value = Option<S::Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for OptionSeed<S> {
    type Value = Option<S::Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(d).map(Some)
    }
}

/// An algorithm's name.
struct AlgorithmSeed;

impl<'de> DeserializeSeed<'de> for AlgorithmSeed {
    type Value = Algorithm;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Algorithm, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for AlgorithmSeed {
    type Value = Algorithm;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an algorithm name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Algorithm, E> {
        Algorithm::from_name(v).ok_or_else(|| E::custom("unknown algorithm"))
    }
}

/// The error body: `{"error": {"code", "field", "message"}}`.
pub fn error_body(code: &str, field: Option<&str>, message: &str) -> Value {
    let mut e = Map::new();
    e.insert("code".into(), Value::from(code));
    if let Some(f) = field {
        e.insert("field".into(), Value::from(f));
    }
    e.insert("message".into(), Value::from(message));
    serde_json::json!({ "error": e })
}
