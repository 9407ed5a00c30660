//! One JSON object being read: its path, its known fields (a section's table, `config::fields`, or
//! a rule's names, `config::rules`), and its values read with their path at hand, so that every
//! error names the field.

use super::super::fields::{self, Field, IfAbsent, Value as Form};
use super::super::model::ConfigError;
use serde_json::{Map, Value};

pub(super) fn err<T>(
    field: impl Into<String>,
    message: impl Into<String>,
) -> Result<T, ConfigError> {
    Err(ConfigError {
        field: field.into(),
        message: message.into(),
    })
}

/// One JSON object being read, with its path and the table of its fields (empty for a rule,
/// whose names are checked by [`Obj::named`]).
pub(super) struct Obj<'a> {
    at: String,
    /// `None`: the section is absent, every field its default.
    map: Option<&'a Map<String, Value>>,
    table: &'static [Field],
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
    ) -> Result<Obj<'a>, ConfigError> {
        let mut obj = match v {
            Some(v) => Obj::named(v, at, &fields::names(table).collect::<Vec<_>>())?,
            None => Obj {
                at: at.to_string(),
                map: None,
                table,
            },
        };
        obj.table = table;
        Ok(obj)
    }

    /// `v` must be an object whose fields are all in `known`.
    pub(super) fn named(v: &'a Value, at: &str, known: &[&str]) -> Result<Obj<'a>, ConfigError> {
        let Value::Object(map) = v else {
            return err(
                if at.is_empty() { "config" } else { at },
                "must be an object",
            );
        };
        for k in map.keys() {
            if !known.contains(&k.as_str()) {
                // An empty key still gets a name in the error.
                let name = if k.is_empty() { "\"\"" } else { k.as_str() };
                return err(
                    join(at, name),
                    format!("unknown field (expected one of: {})", listed(known, "")),
                );
            }
        }
        Ok(Obj {
            at: at.to_string(),
            map: Some(map),
            table: &[],
        })
    }

    pub(super) fn path(&self, f: &str) -> String {
        join(&self.at, f)
    }

    /// A field's value; JSON `null` counts as absent.
    pub(super) fn get(&self, f: &str) -> Option<&'a Value> {
        self.map.and_then(|m| m.get(f)).filter(|v| !v.is_null())
    }

    pub(super) fn required(&self, f: &str) -> Result<&'a Value, ConfigError> {
        match self.get(f) {
            Some(v) => Ok(v),
            None => err(self.path(f), "missing (required)"),
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
    pub(super) fn int(&self, f: &str) -> Result<u64, ConfigError> {
        let default = match self.row(f).default {
            IfAbsent::Int(d) => Some(u64::from(d)),
            _ => None,
        };
        let (lo, hi) = self.bounds(f);
        self.int_within(f, default, lo, hi)
    }

    /// An integer within its row's bounds, `default` when absent (a default the reader works out).
    pub(super) fn int_or(&self, f: &str, default: u64) -> Result<u64, ConfigError> {
        let (lo, hi) = self.bounds(f);
        self.int_within(f, Some(default), lo, hi)
    }

    /// An integer from `lo` up to its row's upper bound, `default` when absent.
    pub(super) fn int_at_least(&self, f: &str, default: u64, lo: u64) -> Result<u64, ConfigError> {
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
    ) -> Result<u64, ConfigError> {
        let v = match (self.get(f), default) {
            (Some(v), _) => v,
            (None, Some(d)) => return Ok(d),
            (None, None) => return err(self.path(f), "missing (required)"),
        };
        int_value(&self.path(f), v, lo, hi)
    }

    pub(super) fn string(&self, f: &str) -> Result<Option<String>, ConfigError> {
        match self.get(f) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => err(self.path(f), "must be a string"),
        }
    }

    /// A string, its row's default when absent (empty when it has none).
    pub(super) fn text(&self, f: &str) -> Result<String, ConfigError> {
        Ok(match (self.string(f)?, self.row(f).default) {
            (Some(s), _) => s,
            (None, IfAbsent::Text(d)) => d.to_string(),
            (None, _) => String::new(),
        })
    }

    /// A boolean, its row's default when absent (`false` when it has none).
    pub(super) fn boolean(&self, f: &str) -> Result<bool, ConfigError> {
        let default = matches!(self.row(f).default, IfAbsent::Bool(true));
        self.boolean_or(f, default)
    }

    /// A boolean field, `default` when absent.
    pub(super) fn boolean_or(&self, f: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(f) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => err(self.path(f), "must be true or false"),
        }
    }

    pub(super) fn array(&self, f: &str) -> Result<Option<&'a Vec<Value>>, ConfigError> {
        match self.get(f) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(_) => err(self.path(f), "must be a list"),
        }
    }

    /// One of its row's names, as the value at the same place in `values`; its row's default
    /// when absent.
    pub(super) fn choice<T: Copy>(&self, f: &str, values: &[T]) -> Result<T, ConfigError> {
        let i = self.choice_index(f)?;
        debug_assert!(i < values.len(), "{f}: a value for every name");
        values
            .get(i)
            .copied()
            .map_or_else(|| err(self.path(f), "missing (required)"), Ok)
    }

    /// The place of a [`Form::Choice`]'s name among its row's names.
    fn choice_index(&self, f: &str) -> Result<usize, ConfigError> {
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
    pub(super) fn pick(
        &self,
        f: &str,
        names: &[&str],
        default: Option<usize>,
    ) -> Result<usize, ConfigError> {
        match (self.get(f), default) {
            (Some(v), _) => pick_value(&self.path(f), v, names),
            (None, Some(d)) => Ok(d),
            (None, None) => err(self.path(f), "missing (required)"),
        }
    }
}

pub(super) fn int_value(at: &str, v: &Value, lo: u64, hi: u64) -> Result<u64, ConfigError> {
    match v.as_u64() {
        Some(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => err(at, format!("must be between {lo} and {hi}")),
    }
}

/// The place of `v` among `names`.
pub(super) fn pick_value(at: &str, v: &Value, names: &[&str]) -> Result<usize, ConfigError> {
    match names.iter().position(|n| Some(*n) == v.as_str()) {
        Some(i) => Ok(i),
        None => err(at, format!("must be one of {}", listed(names, "\""))),
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

pub(super) fn header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    if name.is_empty() || name.len() > 256 || !name.bytes().all(is_token_char) {
        return err(field, "must be a header name (1..=256 token characters)");
    }
    Ok(name.to_ascii_lowercase())
}
