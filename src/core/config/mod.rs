//! The plugin configuration (docs/filter-config.md is the user-facing reference).
//!
//! Parsed and validated once, in `on_configure`; the result is immutable and shared by every
//! request: [`Config`] holds the validated values with every default resolved. Unknown fields
//! are errors (a typo must not silently leave a limit unset), and every error names the offending
//! field, e.g.
//! `rules[1].capacity: must be between 1 and 1000000000`. Every refusal is reported, not just the
//! first ([`Config::parse_all`]), skipping only what depends on a refused value. The numeric
//! bounds are the contract's (contract/README.md), so the service never rejects what the filter
//! accepted.
//!
//! - `model`: the validated configuration ([`Config`], [`Rule`], ...) and its bounds.
//! - `rules`: a rule's fields, once: which exist and which kind of rule each belongs to.
//! - `fields`: the fields of every other section, once: one table per section (name, value and
//!   bounds, default, meaning).
//! - `transports`: what each transport carries, once, and the check of a configuration against it.
//! - `reader`: [`Config::parse`] and [`Config::parse_all`], the JSON walked by hand by the
//!   tables, every error naming its field, every refusal kept.

pub mod fields;
mod model;
mod reader;
pub mod rules;
#[cfg(test)]
mod tests;
pub mod transports;

pub use model::*;
