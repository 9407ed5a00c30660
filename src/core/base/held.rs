//! The VM's requests held until a moment (shaping: a take granted for when its tokens will be
//! there): request contexts by the time each may go, earliest first. Whatever configuration a
//! request runs under, one list per VM, so a push that replaces a configuration leaves its held
//! requests where any root's timer finds them.
//!
//! A plain sorted list: it holds at most the places the rules allow (`shape.max_held` per rule
//! and worker), and the timer takes from its front.

/// Request contexts held, by the time each may go.
#[derive(Debug, Default)]
pub struct Held {
    /// `(until_ms, context)`, sorted.
    waiting: Vec<(u64, u32)>,
}

impl Held {
    /// Holds request `context` until `until_ms`.
    pub fn hold(&mut self, until_ms: u64, context: u32) {
        let at = self.waiting.partition_point(|e| *e <= (until_ms, context));
        self.waiting.insert(at, (until_ms, context));
    }

    /// Request `context`, held until `until_ms`, went away (it is held no more).
    pub fn forget(&mut self, until_ms: u64, context: u32) {
        if let Ok(at) = self.waiting.binary_search(&(until_ms, context)) {
            self.waiting.remove(at);
        }
    }

    /// The requests whose time has come at `now_ms`, earliest first, taken out of the list.
    pub fn due(&mut self, now_ms: u64) -> Vec<u32> {
        let n = self.waiting.partition_point(|&(until, _)| until <= now_ms);
        self.waiting
            .drain(..n)
            .map(|(_, context)| context)
            .collect()
    }

    /// Whether no request is held.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// How many requests are held.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_go_in_the_order_of_their_time_and_only_when_it_came() {
        let mut h = Held::default();
        h.hold(30, 7);
        h.hold(10, 9);
        h.hold(20, 3);
        h.hold(10, 2);
        assert_eq!(h.due(9), Vec::<u32>::new());
        assert_eq!(h.due(10), vec![2, 9], "ties in context order");
        h.forget(30, 7);
        h.forget(30, 7);
        assert_eq!(h.len(), 1);
        assert_eq!(h.due(100), vec![3]);
        assert!(h.is_empty());
    }
}
