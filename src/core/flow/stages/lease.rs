//! The lease pools as a stage ([`crate::core::local::lease`]): before the call, the pools pay
//! for the request (or a cached denial answers); after an answer, grants are deposited and
//! denials cached; when the service did not admit, the pools still pay if they can.

use super::{refund, Cx, Early, Stage};
use crate::core::config::Config;
use crate::core::flow::{Callout, Host, Metric};
use crate::core::local::lease::{self, Count, Local};
use crate::core::local::record;
use crate::core::wire::plan::{Outcome, Plan, Verdict};
use log::debug;

/// The lease pools.
pub(in crate::core::flow) struct Lease;

impl<H: Host> Stage<H> for Lease {
    fn before(&self, cx: &mut Cx<'_, H>, plan: &mut Plan) -> Option<Early> {
        let (local, chores) = lease::local(cx.cfg, plan, cx.host.store(), cx.now);
        run_chores(cx.cfg, chores, cx.watched, cx.host);
        let Local::Answer(outcome) = local else {
            return None;
        };
        let count = match outcome {
            Outcome::Allowed(_) => Count::Local,
            _ => Count::LocalLimited,
        };
        cx.host.count(Metric::Lease(count, 1));
        Some(Early::Outcome(outcome))
    }

    fn after(&self, cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Outcome {
        let (granted, chores) = lease::apply(cx.cfg, plan, &outcome, cx.host.store(), cx.now);
        if granted > 0 {
            cx.host.count(Metric::Lease(Count::Granted, granted));
        }
        run_chores(cx.cfg, chores, cx.watched, cx.host);
        outcome
    }

    /// A denial or failure that the pools can still pay (granted tokens stay good) becomes an
    /// admission from the pools (counted as allowed, not as `lease.local`: it did make a callout).
    fn admit(&self, cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Result<Outcome, Verdict> {
        if !matches!(outcome, Outcome::Allowed(_)) {
            if let Some(paid) = lease::rescue(cx.cfg, plan, cx.host.store(), cx.now) {
                return Ok(paid);
            }
        }
        Ok(outcome)
    }
}

/// Sends what the lease pools left to do: expired tokens back to the service, and background
/// refills (not while the breaker is open: the requests' own callouts probe it). The pools this
/// worker deposited into go to `watched`, for the adapter's timer ([`lease::sweep`]).
pub(in crate::core::flow) fn run_chores<H: Host>(
    cfg: &Config,
    chores: lease::Chores,
    watched: &mut Vec<lease::Held>,
    host: &mut H,
) {
    if chores.dropped > 0 {
        host.count(Metric::Lease(Count::Expired, chores.dropped));
    }
    watched.extend(chores.watch);
    for r in &chores.returns {
        refund(cfg, r, host);
        let n = r.buckets.iter().map(|b| b.cost()).sum();
        host.count(Metric::Lease(Count::Returned, n));
    }
    if chores.refills.is_empty() {
        return;
    }
    let open = record::read(host.store()).breaker.is_open();
    for plan in chores.refills {
        if open {
            lease::abandon(cfg, &plan, host.store());
            continue;
        }
        match host.send(cfg, Callout::Refill(&plan)) {
            Ok(_) => host.count(Metric::Lease(Count::Refills, 1)),
            Err(why) => {
                debug!("background lease refill not dispatched: {why}");
                lease::abandon(cfg, &plan, host.store());
            }
        }
    }
}
