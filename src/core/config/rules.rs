//! A rule's fields, once: the one table of which fields exist and which kind of rule each belongs
//! to. The reader checks a rule against it (unknown fields, and fields of the other kind), and
//! the tests check against it that docs/filter-config.md documents every field with its kind
//! (tests/docs.rs) and that the fuzz seeds reach every field (fuzz/seeds/filter_config, written by
//! fuzz/seeds.py; `config::tests`).

/// The kind of rule a field belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kinds {
    /// Every rule.
    Every,
    /// Rate rules only (`kind` absent or `"rate"`).
    Rate,
    /// Concurrency rules only (`kind: "concurrency"`).
    Concurrency,
}

/// Every field a rule may hold, in the order the reader reads them, with the kind it belongs to.
pub const RULE_FIELDS: [(&str, Kinds); 24] = [
    ("name", Kinds::Every),
    ("match", Kinds::Every),
    ("key", Kinds::Every),
    ("on_missing", Kinds::Every),
    ("capacity", Kinds::Rate),
    ("rate", Kinds::Rate),
    ("period_ms", Kinds::Rate),
    ("cost", Kinds::Rate),
    ("algorithm", Kinds::Rate),
    ("calendar", Kinds::Rate),
    ("time_zone", Kinds::Rate),
    ("lease", Kinds::Rate),
    ("shape", Kinds::Rate),
    ("overrides", Kinds::Rate),
    ("tiers", Kinds::Rate),
    ("from_request", Kinds::Rate),
    ("shadow", Kinds::Every),
    ("response", Kinds::Every),
    ("descriptor", Kinds::Rate),
    ("kind", Kinds::Every),
    ("max_in_flight", Kinds::Concurrency),
    ("deadline_ms", Kinds::Concurrency),
    ("charge", Kinds::Every),
    ("usage", Kinds::Every),
];

/// The names of [`RULE_FIELDS`].
pub fn names() -> [&'static str; RULE_FIELDS.len()] {
    RULE_FIELDS.map(|(name, _)| name)
}

/// The fields that belong to `kinds`, in table order.
pub fn of(kinds: Kinds) -> impl Iterator<Item = &'static str> {
    RULE_FIELDS
        .into_iter()
        .filter(move |&(_, k)| k == kinds)
        .map(|(name, _)| name)
}

/// The fields of a rule of the other kind than `concurrency` says, in table order.
pub fn of_the_other_kind(concurrency: bool) -> impl Iterator<Item = &'static str> {
    of(if concurrency {
        Kinds::Rate
    } else {
        Kinds::Concurrency
    })
}
