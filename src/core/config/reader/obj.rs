//! One JSON object being read: its path, its known fields (a section's table, `config::fields`, or
//! a rule's names, `config::rules`), and its values read with their path at hand, so that every
//! error names the field; and [`Refusals`], where every reader keeps its errors and goes on.

use super::super::fields::{self, Field, IfAbsent, Value as Form};
use super::super::model::ConfigError;
use serde_json::{Map, Value};
use std::cell::Cell;

/// Every refusal of one reading, in the order the reader finds them. A reader that refuses a
/// value keeps the refusal here and answers `None` for it; the reader goes on with what does not
/// depend on that value, and skips what does (it would only be refused again, or for nothing).
/// A `Cell`: every object read holds it by `&`, and keeping a refusal cannot fail.
#[derive(Default)]
pub(super) struct Refusals(Cell<Vec<ConfigError>>);

impl Refusals {
    /// Keeps `e`.
    #[inline(never)]
    pub(super) fn keep(&self, e: ConfigError) {
        let mut all = self.0.take();
        all.push(e);
        self.0.set(all);
    }

    /// Refuses `field`: `None`, the refusal kept.
    pub(super) fn refuse<T>(
        &self,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Option<T> {
        self.keep(ConfigError {
            field: field.into(),
            message: message.into(),
        });
        None
    }

    /// The refusals kept.
    pub(super) fn into_inner(self) -> Vec<ConfigError> {
        self.0.into_inner()
    }
}

/// One JSON object being read, with its path, the table of its fields (empty for a rule, whose
/// names are checked by [`Obj::named`]) and where its refusals are kept. Each read answers `None`
/// when it refuses the value (the refusal kept).
pub(super) struct Obj<'a> {
    at: String,
    /// `None`: the section is absent, every field its default.
    map: Option<&'a Map<String, Value>>,
    table: &'static [Field],
    refusals: &'a Refusals,
}

fn join(at: &str, field: &str) -> String {
    if at.is_empty() {
        field.to_string()
    } else {
        format!("{at}.{field}")
    }
}

impl<'a> Obj<'a> {
    /// `v` (absent: an empty object) must be an object whose fields are all in `table`.
    pub(super) fn new(
        v: Option<&'a Value>,
        at: &str,
        table: &'static [Field],
        refusals: &'a Refusals,
    ) -> Option<Obj<'a>> {
        let mut obj = match v {
            Some(v) => Obj::named(v, at, &fields::names(table).collect::<Vec<_>>(), refusals)?,
            None => Obj {
                at: at.to_string(),
                map: None,
                table,
                refusals,
            },
        };
        obj.table = table;
        Some(obj)
    }

    /// `v` must be an object whose fields are all in `known`. Not an object: `None` (none of its
    /// fields can be read). Each unknown field is refused, and the known ones are still read: a
    /// misspelt field does not make the others wrong.
    pub(super) fn named(
        v: &'a Value,
        at: &str,
        known: &[&str],
        refusals: &'a Refusals,
    ) -> Option<Obj<'a>> {
        let Value::Object(map) = v else {
            return refusals.refuse(
                if at.is_empty() { "config" } else { at },
                "must be an object",
            );
        };
        for k in map.keys() {
            if !known.contains(&k.as_str()) {
                // An empty key still gets a name in the error.
                let name = if k.is_empty() { "\"\"" } else { k.as_str() };
                refusals.keep(ConfigError {
                    field: join(at, name),
                    message: format!("unknown field (expected one of: {})", listed(known, "")),
                });
            }
        }
        Some(Obj {
            at: at.to_string(),
            map: Some(map),
            table: &[],
            refusals,
        })
    }

    pub(super) fn path(&self, f: &str) -> String {
        join(&self.at, f)
    }

    /// Where this object's refusals are kept.
    pub(super) fn refusals(&self) -> &'a Refusals {
        self.refusals
    }

    /// Refuses field `f`.
    pub(super) fn refuse<T>(&self, f: &str, message: impl Into<String>) -> Option<T> {
        self.refusals.refuse(self.path(f), message)
    }

    /// A field's value; JSON `null` counts as absent.
    pub(super) fn get(&self, f: &str) -> Option<&'a Value> {
        self.map.and_then(|m| m.get(f)).filter(|v| !v.is_null())
    }

    pub(super) fn required(&self, f: &str) -> Option<&'a Value> {
        match self.get(f) {
            Some(v) => Some(v),
            None => self.refuse(f, "missing (required)"),
        }
    }

    /// The row of `f` in the table. Every field read by its row is in its section's table (the
    /// reader's tests read every one); a name that is not reads as a text without a default.
    #[inline(never)]
    fn row(&self, f: &str) -> Field {
        let row = fields::find(self.table, f);
        debug_assert!(row.is_some(), "{f} is not in the table of {}", self.at);
        row.copied().unwrap_or(Field {
            name: "",
            value: Form::Text,
            default: IfAbsent::Nothing,
            #[cfg(not(target_arch = "wasm32"))]
            doc: "",
        })
    }

    /// An integer within its row's bounds, its row's default when absent.
    pub(super) fn int(&self, f: &str) -> Option<u64> {
        let default = match self.row(f).default {
            IfAbsent::Int(d) => Some(u64::from(d)),
            _ => None,
        };
        let (lo, hi) = self.bounds(f);
        self.int_within(f, default, lo, hi)
    }

    /// An integer within its row's bounds, `default` when absent (a default the reader works out).
    pub(super) fn int_or(&self, f: &str, default: u64) -> Option<u64> {
        let (lo, hi) = self.bounds(f);
        self.int_within(f, Some(default), lo, hi)
    }

    /// An integer from `lo` up to its row's upper bound, `default` when absent.
    pub(super) fn int_at_least(&self, f: &str, default: u64, lo: u64) -> Option<u64> {
        let (_, hi) = self.bounds(f);
        self.int_within(f, Some(default), lo, hi)
    }

    /// Its row's bounds.
    fn bounds(&self, f: &str) -> (u64, u64) {
        match self.row(f).value {
            Form::Int(lo, hi) => (u64::from(lo), hi),
            _ => (0, u64::MAX),
        }
    }

    /// An integer in `lo..=hi`, or `default` when absent (`None`: required).
    pub(super) fn int_within(
        &self,
        f: &str,
        default: Option<u64>,
        lo: u64,
        hi: u64,
    ) -> Option<u64> {
        let v = match (self.get(f), default) {
            (Some(v), _) => v,
            (None, Some(d)) => return Some(d),
            (None, None) => return self.refuse(f, "missing (required)"),
        };
        int_value(&self.path(f), v, lo, hi, self.refusals)
    }

    /// A string, `Some(None)` when absent (`None`: refused).
    pub(super) fn string(&self, f: &str) -> Option<Option<String>> {
        match self.get(f) {
            None => Some(None),
            Some(Value::String(s)) => Some(Some(s.clone())),
            Some(_) => self.refuse(f, "must be a string"),
        }
    }

    /// A string, its row's default when absent (empty when it has none).
    pub(super) fn text(&self, f: &str) -> Option<String> {
        Some(match (self.string(f)?, self.row(f).default) {
            (Some(s), _) => s,
            (None, IfAbsent::Text(d)) => d.to_string(),
            (None, _) => String::new(),
        })
    }

    /// A boolean, its row's default when absent (`false` when it has none).
    pub(super) fn boolean(&self, f: &str) -> Option<bool> {
        let default = matches!(self.row(f).default, IfAbsent::Bool(true));
        self.boolean_or(f, default)
    }

    /// A boolean field, `default` when absent.
    pub(super) fn boolean_or(&self, f: &str, default: bool) -> Option<bool> {
        match self.get(f) {
            None => Some(default),
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => self.refuse(f, "must be true or false"),
        }
    }

    /// A list, `Some(None)` when absent (`None`: refused).
    pub(super) fn array(&self, f: &str) -> Option<Option<&'a Vec<Value>>> {
        match self.get(f) {
            None => Some(None),
            Some(Value::Array(a)) => Some(Some(a)),
            Some(_) => self.refuse(f, "must be a list"),
        }
    }

    /// One of its row's names, as the value at the same place in `values`; its row's default
    /// when absent.
    pub(super) fn choice<T: Copy>(&self, f: &str, values: &[T]) -> Option<T> {
        let i = self.choice_index(f)?;
        debug_assert!(i < values.len(), "{f}: a value for every name");
        match values.get(i) {
            Some(v) => Some(*v),
            None => self.refuse(f, "missing (required)"),
        }
    }

    /// The place of a [`Form::Choice`]'s name among its row's names.
    fn choice_index(&self, f: &str) -> Option<usize> {
        let row = self.row(f);
        let names = match row.value {
            Form::Choice(names) => names,
            _ => &[],
        };
        let default = match row.default {
            IfAbsent::Text(d) => names.iter().position(|n| *n == d),
            _ => None,
        };
        self.pick(f, names, default)
    }

    /// The place of a field's value among `names` (a rule's field), `default` when absent
    /// (`None`: required).
    pub(super) fn pick(&self, f: &str, names: &[&str], default: Option<usize>) -> Option<usize> {
        match (self.get(f), default) {
            (Some(v), _) => pick_value(&self.path(f), v, names, self.refusals),
            (None, Some(d)) => Some(d),
            (None, None) => self.refuse(f, "missing (required)"),
        }
    }
}

pub(super) fn int_value(at: &str, v: &Value, lo: u64, hi: u64, refusals: &Refusals) -> Option<u64> {
    match v.as_u64() {
        Some(n) if (lo..=hi).contains(&n) => Some(n),
        _ => refusals.refuse(at, format!("must be between {lo} and {hi}")),
    }
}

/// The place of `v` among `names`.
pub(super) fn pick_value(
    at: &str,
    v: &Value,
    names: &[&str],
    refusals: &Refusals,
) -> Option<usize> {
    match names.iter().position(|n| Some(*n) == v.as_str()) {
        Some(i) => Some(i),
        None => refusals.refuse(at, format!("must be one of {}", listed(names, "\""))),
    }
}

/// `names` separated by `, `, each between `quote`s (one loop, not `join`'s code per type).
fn listed(names: &[&str], quote: &str) -> String {
    let mut out = String::new();
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(quote);
        out.push_str(n);
        out.push_str(quote);
    }
    out
}

/// Text that goes into a header value or a header name must not smuggle a line break or other
/// control characters into the response.
pub(super) fn header_safe(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b) || b == b'\t')
}

pub(super) fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

pub(super) fn header_name(field: &str, name: &str, refusals: &Refusals) -> Option<String> {
    if name.is_empty() || name.len() > 256 || !name.bytes().all(is_token_char) {
        return refusals.refuse(field, "must be a header name (1..=256 token characters)");
    }
    Some(name.to_ascii_lowercase())
}
