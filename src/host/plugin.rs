//! What one configuration is to the adapter ([`Plugin`]: its immutable configuration and what was
//! derived from it once, beside its runtime state: what applying it learned ([`Applied`]), the
//! core's [`Outbox`], the memo of its places), and who waits for each callout in the VM's ledger
//! ([`Waiter`]).

use super::metrics::Metrics;
use super::request::Reads;
use crate::core::base::ledger::CalloutId;
use crate::core::base::place::Memos;
use crate::core::config::Config;
use crate::core::flow::Applied;
use crate::core::outbox::Outbox;
use crate::core::wire::plan::Plan;
use crate::core::wire::TakeRequest;
use std::cell::RefCell;
use std::rc::Rc;

/// One configured plugin (a root context's configuration), shared by its requests.
pub(super) struct Plugin {
    /// Its root context.
    pub(super) root: u32,
    /// Its configuration, as parsed.
    pub(super) config: Config,
    /// What applying it learned of this Envoy's shared data (the instance id, the fallback
    /// tables earlier configurations used), kept apart from the configuration.
    pub(super) applied: Applied,
    pub(super) metrics: Metrics,
    /// Shared-data key prefix ([`crate::core::local::table::state_prefix`]: a digest of the service
    /// cluster), so a configuration push keeps the fallback shares, lease pools and breaker.
    pub(super) prefix: String,
    /// `authorization` value of every callout.
    pub(super) bearer: Option<String>,
    /// The gRPC target ([`callout::grpc_service`]).
    pub(super) grpc_service: Vec<u8>,
    /// What its requests are read for.
    pub(super) reads: Reads,
    /// How its takes leave, and what of its traffic waits or is in flight in this worker: the
    /// batch queue (queued takes are [`Waiter::Member`]s under ids of the VM's own), the stream
    /// (its token a [`Waiter::Stream`], each message a [`Waiter::Batch`] under the id the message
    /// and its answer carry), the lease pools it deposited into, its settlements (an attempt in
    /// flight a [`Waiter::Settle`]).
    pub(super) outbox: RefCell<Outbox>,
    /// The places last found in its shared-data tables (`core::local::table`), remembered for
    /// this configuration alone: another configuration of the worker keeps its own.
    pub(super) memos: Memos,
}

/// Who waits for a callout's answer: the variant of a ledger entry.
pub(super) enum Waiter {
    /// A request's take, a callout of its own; `gates`: the callout holds the plugin's batch
    /// queue back until it ends.
    Take {
        context: u32,
        plugin: Rc<Plugin>,
        gates: bool,
    },
    /// A request's take that goes in a batch (or a message on the stream), under an id of the
    /// VM's own: queued for the next batch, then a member of the [`Waiter::Batch`] that carries
    /// it. Its answer is its share of the batch's.
    Member { context: u32 },
    /// A request's acquire of concurrency slots.
    Acquire { context: u32 },
    /// A batch callout, or a message on the plugin's stream, carrying the ids of its takes (each
    /// its own entry: a [`Waiter::Member`], or a refill's).
    Batch {
        plugin: Rc<Plugin>,
        members: Vec<CalloutId>,
    },
    /// A message of the plugin's stream that failed at its deadline while the stream went on: its
    /// answer may still come, and what it granted goes back ([`crate::core::flow::late_answer`]).
    /// The takes it carried, in order (`None`: a take whose request had gone).
    Late {
        plugin: Rc<Plugin>,
        takes: Vec<Option<TakeRequest>>,
    },
    /// The plugin's stream of takes: each of its answers goes to the message whose id it carries.
    Stream { plugin: Rc<Plugin> },
    /// A background lease refill (no request waits).
    Refill {
        plugin: Rc<Plugin>,
        plan: Plan,
        gates: bool,
    },
    /// A refund of unspent lease tokens: nothing to do with the answer.
    Refund,
    /// A release of concurrency slots: its answer is counted.
    Release { plugin: Rc<Plugin> },
    /// The acquire of a request that ended first, the id it gave the slots and the keys it asked
    /// for: unless the answer is a denial (nothing taken), the slots go back at once, by name.
    Orphan {
        plugin: Rc<Plugin>,
        slot: String,
        keys: Vec<String>,
    },
    /// An attempt to deliver settlement `id`.
    Settle { plugin: Rc<Plugin>, id: String },
    /// The take of a request that went away (it still holds the batch queue back until its
    /// answer arrives): the answer is dropped, unless the take shaped (`shaped`: what it asked),
    /// when a grant for later goes back ([`crate::core::flow::abandoned_answer`]).
    Abandoned {
        plugin: Rc<Plugin>,
        gates: bool,
        shaped: Option<Box<crate::core::wire::plan::Plan>>,
    },
}

impl Waiter {
    /// A request waits (a paused stream): what the `tollgate.callouts.pending` gauge counts.
    pub(super) fn is_request(&self) -> bool {
        matches!(
            self,
            Waiter::Take { .. } | Waiter::Member { .. } | Waiter::Acquire { .. }
        )
    }

    /// The plugin whose batch queue this callout holds back, if any.
    pub(super) fn gate(&self) -> Option<&Rc<Plugin>> {
        match self {
            Waiter::Take {
                plugin,
                gates: true,
                ..
            }
            | Waiter::Refill {
                plugin,
                gates: true,
                ..
            }
            | Waiter::Abandoned {
                plugin,
                gates: true,
                ..
            }
            | Waiter::Batch { plugin, .. } => Some(plugin),
            _ => None,
        }
    }
}
