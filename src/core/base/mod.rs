//! The ground floor: plain tools that know nothing of rules or the service.
//!
//! - `hash`: SHA-256 for bounding long key parts and for slot identities.
//! - `hostmap`: the host's header map wire format.
//! - `store`: the CAS storage trait (shared data) and its bounded retry loop.
//! - `place`: a bucket's place in a shared-data table, and the memo of the last places a store
//!   was asked for.
//! - `ledger`: the VM's one table of callouts in flight, and who waits for each.
//! - `held`: the VM's requests held until a moment (shaping), earliest first.

pub mod hash;
pub mod held;
pub mod hostmap;
pub mod ledger;
pub mod place;
pub mod store;
