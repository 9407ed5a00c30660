//! The batch queue carried out: looked at on the tick and when a take queues, sent as one batch
//! (a callout, or a message on the stream) or several when the byte bounds split it.

use super::*;

impl<A: Abi> Dispatcher<A> {
    /// The batch queue looked at (on the tick, and when a request queued a take): takes that
    /// waited their whole timeout fail there, unsent; the queue leaves beside the callouts in
    /// flight when the latest left a tick ago or more, while fewer than
    /// [`batch::MAX_IN_FLIGHT`] are ([`batch::Queue::due`]).
    pub(super) fn tend_queue(&mut self, plugin: &Rc<Plugin>) {
        if plugin.outbox.borrow().queue.waiting() == 0 {
            return;
        }
        let now = self.abi.now_ms();
        let svc = &plugin.config.service;
        let expired = plugin
            .outbox
            .borrow_mut()
            .queue
            .expired(now, svc.timeout_ms);
        for id in expired {
            self.answer_member(id, CalloutResult::Unsent);
        }
        if plugin.outbox.borrow().queue.due(now, svc.tick_ms()) {
            self.flush(plugin);
        }
    }

    /// Sends the requests queued on `plugin`: one batch callout, or several when the batch's byte
    /// bounds split them (a split is not a throttle: a queue that waits for one answer per batch
    /// would overflow under load).
    pub(super) fn flush(&mut self, plugin: &Rc<Plugin>) {
        // Each round takes at least one request; a failed dispatch sends none back to the queue.
        let rounds = plugin.outbox.borrow().queue.waiting();
        for _ in 0..rounds {
            let queued = plugin
                .outbox
                .borrow_mut()
                .queue
                .drain(plugin.config.service.batch.max(1));
            if queued.is_empty() {
                return;
            }
            self.send_batch(plugin, queued);
        }
    }

    /// One batch carrying `queued` (a callout, or a message on the stream), due when the first of
    /// them must have its answer: `service.timeout_ms` bounds a request's wait from its take,
    /// queue and batch together. One that waited that long already fails here, unsent.
    pub(super) fn send_batch(&mut self, plugin: &Rc<Plugin>, queued: Vec<Queued>) {
        let timeout = plugin.config.service.timeout_ms;
        let now = self.abi.now_ms();
        let (late, queued): (Vec<Queued>, Vec<Queued>) = queued
            .into_iter()
            .partition(|q| q.deadline_ms(timeout) <= now);
        for q in late {
            self.answer_member(q.id, CalloutResult::Unsent);
        }
        let Some(deadline) = queued.iter().map(|q| q.deadline_ms(timeout)).min() else {
            return;
        };
        let takes: Vec<&TakeRequest> = queued.iter().map(|q| &q.take).collect();
        let members: Vec<CalloutId> = queued.iter().map(|q| q.id).collect();
        let mut proxy = Proxy::new(&self.abi, plugin, &mut self.ledger, 0);
        let sent = proxy.send_batch(&plugin.config, members.clone(), &takes, now, deadline);
        if let Err(why) = sent {
            debug!("batch of {} not dispatched: {why}", members.len());
            let mut failed = CalloutResult::DispatchError;
            for m in members {
                if self.answer_member(m, failed.clone()) {
                    failed = failed.shared();
                }
            }
        }
    }
}
