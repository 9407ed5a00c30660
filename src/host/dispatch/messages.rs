//! The stream of takes as Envoy reports it: an answer goes to the message whose id it carries, a
//! stream's end fails its messages in flight, and the tick fails each message past its deadline
//! alone (one awaited late gives back what it granted) and gives up a silent stream.

use super::*;
use crate::core::wire::stream;

impl<A: Abi> Dispatcher<A> {
    /// A gRPC message arrived (`proxy_on_grpc_receive`): an answer on a stream, to the message
    /// whose id it carries, or a unary call's answer.
    pub fn on_grpc_receive(&mut self, token: u32, size: usize) {
        // A message is read off the network, never reported from Envoy's after-call queue.
        self.abi.enter(None, true);
        match self.stream_of(token) {
            Some(plugin) => self.receive(&plugin, token, size),
            None => self.on_grpc_response(token, 0, size),
        }
        // Whatever the message was, the round it began is spent on the answers that wait.
        self.end_callback();
    }

    /// A message on stream `token` of `plugin`, `size` bytes: the answer to the message whose
    /// id it carries.
    fn receive(&mut self, plugin: &Plugin, token: u32, size: usize) {
        // An answer names its message: one that cannot be read names none, and its message (if
        // any) fails at its deadline.
        if size > MAX_ANSWER_BYTES {
            debug!("stream {token}: an answer of {size} bytes, larger than any valid one");
            return;
        }
        let body = self.abi.buffer(Buffer::GrpcReceive, 0, size);
        let Some((id, result)) = stream::read_answer(&body) else {
            debug!("stream {token}: an answer that does not decode");
            return;
        };
        let message = plugin.outbox.borrow_mut().stream.answered(token, id);
        let Some(message) = message else {
            debug!("stream {token}: answer {id} names no message of it");
            return;
        };
        self.deliver(message, &mut Ready(Some(result)));
    }

    /// Message `id` of stream `token` was cancelled with the request that carried it and no
    /// request waits for it (the native build's calls end with their request): it leaves the
    /// stream and the ledger as a message nobody waits for would, counted as nothing.
    #[cfg(any(test, feature = "dynamic-module"))]
    pub fn on_message_abandoned(&mut self, token: u32, id: CalloutId) {
        self.abi.enter(None, false);
        let Some(plugin) = self.stream_of(token) else {
            return;
        };
        if plugin.outbox.borrow_mut().stream.forget(token, id) {
            self.deliver(id, &mut Ready(Some(CalloutResult::DispatchError)));
        }
    }

    /// Message `id` of stream `token` failed alone with gRPC `status` (the native build sends
    /// each message as its own call, whose end is that message's): as an error answer carrying
    /// its id would, it fails that message only, and the stream goes on.
    #[cfg(any(test, feature = "dynamic-module"))]
    pub fn on_message_failed(
        &mut self,
        token: u32,
        id: CalloutId,
        status: u32,
        message: Option<String>,
    ) {
        self.abi.enter(None, true);
        let Some(plugin) = self.stream_of(token) else {
            return;
        };
        let found = plugin.outbox.borrow_mut().stream.answered(token, id.0);
        let Some(m) = found else {
            return;
        };
        let failed = CalloutResult::Grpc {
            status: if status == 0 { 2 } else { status },
            message,
            body: Vec::new(),
        };
        self.deliver(m, &mut Ready(Some(failed)));
    }

    /// A gRPC call or stream ended (`proxy_on_grpc_close`): a unary call's failure, or a stream's
    /// end, which fails every message in flight on it with its status.
    pub fn on_grpc_close(&mut self, token: u32, status: u32) {
        // Envoy reports a call that failed while the module ran from its after-call queue.
        self.abi.enter(None, false);
        let Some(plugin) = self.stream_of(token) else {
            self.on_grpc_response(token, status, 0);
            return;
        };
        let message = self.abi.grpc_status_message();
        // Envoy keeps a stream the service closed until the module closes its side too: cancel
        // it, which frees it (and, the stream being over, sends nothing).
        let _ = self.abi.grpc_cancel(token);
        self.ledger.close(CalloutId::from(token));
        let now = self.abi.now_ms();
        let failed =
            plugin
                .outbox
                .borrow_mut()
                .stream
                .ended(token, now, plugin.config.breaker.open_ms);
        if !failed.is_empty() {
            debug!(
                "stream {token} ended with gRPC status {status} ({}): {} message(s) in flight fail",
                message.as_deref().unwrap_or(""),
                failed.len()
            );
        }
        // A stream that ends OK with messages unanswered broke the contract: a failure, not OK.
        let status = if status == 0 { 2 } else { status };
        let mut ended = CalloutResult::Grpc {
            status,
            message,
            body: Vec::new(),
        };
        for m in failed {
            // One end, one failure for the breaker: the other messages share it.
            self.deliver(m, &mut Ready(Some(ended.clone())));
            ended = ended.shared();
        }
    }

    /// The plugin whose stream `token` is.
    pub(super) fn stream_of(&self, token: u32) -> Option<Rc<Plugin>> {
        match self.ledger.get(CalloutId::from(token)).map(|e| &e.waiter) {
            Some(Waiter::Stream { plugin }) => Some(plugin.clone()),
            _ => None,
        }
    }

    /// The tick of a streaming plugin: each message past its deadline fails alone, as a timeout,
    /// and its stream goes on; a stream that answered nothing for `service.timeout_ms` while it
    /// was waited for is lost: cancelled, and its messages in flight fail as timeouts.
    pub(super) fn expire_messages(&mut self, plugin: &Rc<Plugin>) {
        let now = self.abi.now_ms();
        let cfg = &plugin.config;
        let expired = plugin.outbox.borrow_mut().stream.expired(
            now,
            cfg.service.timeout_ms,
            cfg.breaker.open_ms,
        );
        let Some(expired) = expired else {
            return;
        };
        if let Some(token) = expired.cancel {
            debug!("stream {token} answered nothing for the timeout: given up");
            if let Err(s) = self.abi.grpc_cancel(token) {
                debug!("stream {token} not cancelled: {}", abi::status_name(s));
            }
            self.ledger.close(CalloutId::from(token));
        }
        for m in expired.forgotten {
            self.ledger
                .close_if(m, |w| matches!(w, Waiter::Late { .. }));
        }
        // Messages that fail on one tick fail together: one failure for the breaker.
        let mut timeout = CalloutResult::Expired;
        for m in expired.late {
            self.go_late(m, timeout.clone());
            timeout = timeout.shared();
        }
        for m in expired.failed {
            self.deliver(m, &mut Ready(Some(timeout.clone())));
            timeout = timeout.shared();
        }
    }

    /// Message `id` passed its deadline while its stream goes on: each of its takes fails with
    /// `timeout`, and its entry stays for a late answer, as a [`Waiter::Late`] holding the takes
    /// of the requests that still waited (what the answer grants them goes back).
    pub(super) fn go_late(&mut self, id: CalloutId, timeout: CalloutResult) {
        let (plugin, takes) = match self.ledger.get(id).map(|e| &e.waiter) {
            Some(Waiter::Batch { plugin, members }) => (
                plugin.clone(),
                members.iter().map(|m| self.take_of(*m)).collect::<Vec<_>>(),
            ),
            _ => return,
        };
        let batch = if takes.iter().any(Option::is_some) {
            self.ledger.replace(id, Waiter::Late { plugin, takes })
        } else {
            self.ledger.close(id).map(|e| e.waiter)
        };
        if let Some(batch) = batch {
            self.finish(id, batch, &mut Ready(Some(timeout)));
        }
    }

    /// What the take waiting under `member` asked for: a request's, if it still waits for it, or
    /// a refill's.
    pub(super) fn take_of(&self, member: CalloutId) -> Option<TakeRequest> {
        match self.ledger.get(member).map(|e| &e.waiter)? {
            Waiter::Member { context } => match &self.filters.get(context)?.flow.phase {
                Phase::Calling { id, plan, .. } if *id == member => Some(plan.request.clone()),
                _ => None,
            },
            Waiter::Refill { plan, .. } => Some(plan.request.clone()),
            _ => None,
        }
    }
}
