//! The Lua against the reference: every algorithm's scripts (take, refund, settle, as the Redis
//! store sends them) run on a real Redis, and the contract's arithmetic (as the memory store runs
//! it, `store::algorithm::State`) on the same generated cases; every answer must be the same.
//!
//! The scripts read Redis `TIME`. The only change made to them is that their clock reports what it
//! read (`now_us` of prelude.lua is wrapped to keep the value, and the reply carries it last), and
//! the reference is driven with that time: nothing of the scripts' arithmetic is replaced.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proptest::prelude::*;
use tollgate_server::domain::{
    Algorithm, BucketResult, BucketSpec, SettleSpec, MAX_AMOUNT, MAX_DELAY_MS, MAX_PERIOD_MS,
};
use tollgate_server::store::algorithm::State;
use tollgate_server::store::redis::{
    refund_script_source, settle_script_source, take_batch_script_source, take_script_source,
};

/// A script's source with its clock reporting the time it read: the reply (a take's packed reply
/// unpacked first) gets it appended.
fn reporting(source: &str) -> redis::Script {
    let clock = "local function now_us()\n  local t = redis.call('TIME')\n  return tonumber(t[1]) * MICRO + tonumber(t[2])\nend\n";
    let at = source.find(clock).expect("prelude.lua's clock") + clock.len();
    let wrapped = format!(
        "local SEEN\nlocal reply = (function()\n{}\nlocal redis_now_us = now_us\n\
         local function now_us() SEEN = redis_now_us(); return SEEN end\n{}\nend)()\n\
         if type(reply) == 'string' then\n\
           reply = {{struct.unpack('<' .. string.rep('i8', #reply / 8), reply)}}\n\
           reply[#reply] = nil\n\
         end\n\
         reply[#reply + 1] = SEEN\nreturn reply\n",
        &source[..at],
        &source[at..]
    );
    redis::Script::new(&wrapped)
}

/// One bucket's limits.
#[derive(Debug, Clone, Copy)]
struct Limits {
    capacity: u64,
    rate: u64,
    period_ms: u64,
}

#[derive(Debug, Clone)]
enum Op {
    /// A take of `cost` (up to `cost + extra` with a lease) under the first or second limits,
    /// shaped up to `max_delay` ms (token buckets; the windows take it as 0).
    Take {
        second: bool,
        cost: u64,
        extra: u64,
        max_delay: u64,
    },
    /// A refund of the last take's grant (token buckets: the only refunds the service makes
    /// outside a Redis Cluster's undo, and the only ones the memory store gives back).
    Refund,
    /// A settle; `window`: the last take's mark, moved by -1, 0 or 1, or none; `again`: with the
    /// previous settle's id (a duplicate).
    Settle {
        second: bool,
        estimate: u64,
        used: u64,
        window: Option<i64>,
        again: bool,
    },
    /// Real time passing, in ms.
    Sleep(u64),
}

fn amount() -> impl Strategy<Value = u64> {
    prop_oneof![4 => 1..=20u64, 1 => 1..=MAX_AMOUNT]
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        amount(),
        amount(),
        prop_oneof![3 => 1..=40u64, 1 => 1..=MAX_PERIOD_MS],
    )
        .prop_map(|(capacity, rate, period_ms)| Limits {
            capacity,
            rate,
            period_ms,
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (
            any::<bool>(),
            amount(),
            prop_oneof![0..=0u64, 0..=10u64],
            prop_oneof![2 => Just(0u64), 1 => 1..=100u64, 1 => 1..=MAX_DELAY_MS],
        )
            .prop_map(|(second, cost, extra, max_delay)| Op::Take {
                second,
                cost,
                extra,
                max_delay,
            }),
        1 => Just(Op::Refund),
        2 => (
            any::<bool>(),
            0..=30u64,
            0..=30u64,
            proptest::option::of(-1..=1i64),
            any::<bool>()
        )
            .prop_map(|(second, estimate, used, window, again)| Op::Settle {
                second,
                estimate,
                used,
                window,
                again,
            }),
        2 => (0..=3u64).prop_map(Op::Sleep),
    ]
}

fn algorithm() -> impl Strategy<Value = Algorithm> {
    proptest::sample::select(Algorithm::ALL.to_vec())
}

fn spec(key: &str, a: Algorithm, l: Limits, cost: u64, lease: u64) -> BucketSpec {
    BucketSpec {
        key: key.into(),
        capacity: l.capacity,
        rate: l.rate,
        period_ms: l.period_ms,
        cost,
        algorithm: a,
        lease: lease.min(MAX_AMOUNT),
        max_delay_ms: 0,
    }
}

/// A calendar window's limits from generated ones: a span whose boundary is within 20 ms of now
/// either way (the case's sleeps cross it), windows of 1 to 5 s either side, as the service packs
/// it into `rate` and `period_ms`.
fn calendar(l: Limits) -> Limits {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let span = contract::calendar::Span {
        boundary: now + 20 - l.period_ms % 41,
        before: (1 + l.period_ms % 5) * 1000,
        after: (1 + l.rate % 5) * 1000,
    };
    let (rate, period_ms) = span.pack();
    Limits {
        capacity: l.capacity,
        rate,
        period_ms,
    }
}

fn code(a: Algorithm) -> u64 {
    tollgate_server::store::algorithm::code(a)
}

struct Scripts {
    take: redis::Script,
    refund: redis::Script,
    settle: redis::Script,
}

/// Runs `script` on `keys` with ARGV `before`, then `b`'s algorithm and limits, then `after`;
/// returns the reply without its last integer, and that: the time the script's clock read (µs).
fn eval<T: redis::ToRedisArgs>(
    con: &mut redis::Connection,
    script: &redis::Script,
    keys: &[&str],
    before: &[i64],
    b: &BucketSpec,
    after: &[T],
) -> (Vec<i64>, u64) {
    let mut call = script.prepare_invoke();
    for k in keys {
        call.key(*k);
    }
    call.arg(before)
        .arg(code(b.algorithm))
        .arg(b.capacity)
        .arg(b.rate)
        .arg(b.period_ms)
        .arg(after);
    let mut reply: Vec<i64> = call.invoke(con).unwrap();
    let now = reply.pop().and_then(|t| u64::try_from(t).ok()).unwrap();
    (reply, now)
}

/// The 7 integers a take script replies for one bucket, as the reference decided it.
fn row(d: &BucketResult, state: &State) -> [i64; 7] {
    [
        i64::from(d.allowed),
        d.remaining as i64,
        d.reset_ms as i64,
        d.retry_after_ms as i64,
        d.granted as i64,
        d.delay_ms as i64,
        state.mark() as i64,
    ]
}

/// The reference's bucket: its state as the memory store keeps it (none before the first write).
struct Reference {
    stored: Option<State>,
}

/// Runs `ops` on one bucket of algorithm `a` on both sides; the first difference fails.
fn run(
    con: &mut redis::Connection,
    s: &Scripts,
    a: Algorithm,
    (first, second): (Limits, Limits),
    ops: &[Op],
) -> Result<(), TestCaseError> {
    static CASE: AtomicU64 = AtomicU64::new(0);
    let case = CASE.fetch_add(1, Ordering::Relaxed);
    let key = format!("ref:{{{case}}}:{}", a.tag());
    let mut r = Reference { stored: None };
    let (first, second) = if a == Algorithm::CalendarWindow {
        (calendar(first), calendar(second))
    } else {
        (first, second)
    };
    let (mut granted, mut mark, mut settles) = (0u64, 0u64, 0u64);
    for op in ops {
        match *op {
            Op::Take {
                second: which,
                cost,
                extra,
                max_delay,
            } => {
                let l = if which { second } else { first };
                let b = BucketSpec {
                    max_delay_ms: if a == Algorithm::TokenBucket {
                        max_delay
                    } else {
                        0
                    },
                    ..spec(&key, a, l, cost, cost + extra)
                };
                let args = [b.cost, b.lease, b.max_delay_ms];
                let (reply, now) = eval(con, &s.take, &[&key], &[], &b, &args);
                let mut state = State::load(&b, r.stored, now);
                let (d, charged) = state.take(&b, now);
                if charged {
                    r.stored = Some(state);
                }
                let mut expect = vec![i64::from(d.allowed)];
                expect.extend(row(&d, &state));
                prop_assert_eq!(&reply[..8], &expect[..], "take {:?} at {} µs", b, now);
                if d.allowed {
                    (granted, mark) = (d.granted, state.mark());
                }
            }
            Op::Refund if a == Algorithm::TokenBucket && granted > 0 => {
                let b = spec(&key, a, first, granted, granted);
                let (reply, now) = eval(con, &s.refund, &[&key], &[], &b, &[granted, mark]);
                let mut n = 0;
                if let Some(stored) = r.stored {
                    let mut state = State::load(&b, Some(stored), now);
                    if state.refund(&b, granted, mark) {
                        r.stored = Some(state);
                        n = 1;
                    }
                }
                prop_assert_eq!(reply[0], n, "refund of {} at {} µs", granted, now);
                granted = 0;
            }
            Op::Refund => {}
            Op::Settle {
                second: which,
                estimate,
                used,
                window,
                again,
            } => {
                let l = if which { second } else { first };
                let b = spec(&key, a, l, 1, 1);
                let window = window.and_then(|d| mark.checked_add_signed(d));
                let repeat = again && settles > 0;
                if !repeat {
                    settles += 1;
                }
                let id = format!("ref:{{{case}}}:settled:{settles}");
                let window_arg = window.map_or(-1, |w| w as i64);
                let (reply, now) = eval(
                    con,
                    &s.settle,
                    &[&id, &key],
                    &[60_000],
                    &b,
                    &[estimate as i64, used as i64, window_arg],
                );
                let duplicate = reply[0] == 1;
                prop_assert_eq!(duplicate, repeat, "settle id {}", id);
                let settle = SettleSpec {
                    bucket: b.clone(),
                    estimate,
                    used,
                    window,
                };
                let mut state = State::load(&b, r.stored, now);
                if !duplicate && state.settle(&settle, r.stored.is_some()) {
                    r.stored = Some(state);
                }
                let res = state.settle_result(&b, now);
                prop_assert_eq!(
                    &reply[1..3],
                    &[res.remaining as i64, res.debt as i64][..],
                    "settle {:?} at {} µs",
                    settle,
                    now
                );
            }
            Op::Sleep(ms) => std::thread::sleep(Duration::from_millis(ms)),
        }
    }
    Ok(())
}

#[test]
fn the_scripts_answer_as_the_contracts_arithmetic() {
    let redis = common::RedisProc::start();
    // The runner's closure is `Fn`: the one connection is borrowed per case.
    let con = std::cell::RefCell::new(redis.conn());
    let scripts = Scripts {
        take: reporting(&take_script_source(None)),
        refund: reporting(&refund_script_source()),
        settle: reporting(&settle_script_source()),
    };
    let config = ProptestConfig {
        cases: 192,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(
        a in algorithm(),
        first in limits(),
        second in limits(),
        ops in proptest::collection::vec(op(), 1..32),
    )| {
        run(&mut con.borrow_mut(), &scripts, a, (first, second), &ops)?;
    });
}

/// One bucket of a take in a batch: which of the case's keys, under which of its two limits, its
/// cost and how far ahead it may be granted (token buckets).
#[derive(Debug, Clone)]
struct Named {
    key: usize,
    second: bool,
    cost: u64,
    max_delay: u64,
}

/// A take of a batch: up to 3 buckets, distinct keys.
fn batch_take() -> impl Strategy<Value = Vec<Named>> {
    proptest::collection::vec(
        (
            0..3usize,
            prop_oneof![3 => Just(false), 1 => Just(true)],
            1..=4u64,
            prop_oneof![2 => Just(0u64), 1 => 1..=2_000u64],
        )
            .prop_map(|(key, second, cost, max_delay)| Named {
                key,
                second,
                cost,
                max_delay,
            }),
        1..=3,
    )
    .prop_map(|mut v| {
        v.sort_by_key(|n| n.key);
        v.dedup_by_key(|n| n.key);
        v
    })
}

/// A batch (`take_batch.lua`, one call) answers every take as the contract's arithmetic answers
/// the same takes one after another at the call's clock, each all-or-nothing: the script keeps a
/// bucket's state across the takes of its call and writes it once, which must change nothing of
/// what each take sees (a key taken again, under other limits, by a take some bucket of which
/// refuses).
#[test]
fn a_batch_answers_as_its_takes_one_after_another() {
    let redis = common::RedisProc::start();
    let con = std::cell::RefCell::new(redis.conn());
    let script = reporting(&take_batch_script_source(None));
    let config = ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(
        algs in proptest::collection::vec(
            proptest::sample::select(vec![Algorithm::TokenBucket, Algorithm::FixedWindow]), 3),
        first in proptest::collection::vec((1..=12u64, 1..=12u64, 1..=2_000u64), 3),
        second in proptest::collection::vec((1..=12u64, 1..=12u64, 1..=2_000u64), 3),
        takes in proptest::collection::vec(batch_take(), 1..=24),
        rounds in 1..=3usize,
    )| {
        static CASE: AtomicU64 = AtomicU64::new(0);
        let case = CASE.fetch_add(1, Ordering::Relaxed);
        let keys: Vec<String> = (0..3).map(|k| format!("batch:{{{case}}}:{k}")).collect();
        let mut stored: Vec<Option<State>> = vec![None; 3];
        let spec_of = |n: &Named| {
            let (capacity, rate, period_ms) = if n.second { second[n.key] } else { first[n.key] };
            let a = algs[n.key];
            BucketSpec {
                max_delay_ms: if a == Algorithm::TokenBucket { n.max_delay } else { 0 },
                ..spec(&keys[n.key], a, Limits { capacity, rate, period_ms }, n.cost, n.cost)
            }
        };
        // The same batch again: the second call starts from what the first one wrote.
        for _ in 0..rounds {
            let mut call = script.prepare_invoke();
            let mut args: Vec<u64> = vec![takes.len() as u64];
            args.extend(takes.iter().map(|t| t.len() as u64));
            for t in &takes {
                for n in t {
                    let b = spec_of(n);
                    call.key(&b.key);
                    args.extend([code(b.algorithm), b.capacity, b.rate, b.period_ms, b.cost,
                                 b.lease, b.max_delay_ms]);
                }
            }
            call.arg(&args);
            let mut reply: Vec<i64> = call.invoke(&mut *con.borrow_mut()).unwrap();
            let now = reply.pop().and_then(|t| u64::try_from(t).ok()).unwrap();
            let mut expect: Vec<i64> = Vec::new();
            for t in &takes {
                let mut states = Vec::new();
                let mut rows = Vec::new();
                let mut all = true;
                for n in t {
                    let b = spec_of(n);
                    let mut state = State::load(&b, stored[n.key], now);
                    let (d, charged) = state.take(&b, now);
                    all &= charged;
                    rows.extend(row(&d, &state));
                    states.push((n.key, state));
                }
                if all {
                    for (k, state) in states {
                        stored[k] = Some(state);
                    }
                }
                expect.push(i64::from(all));
                expect.extend(rows);
            }
            prop_assert_eq!(&reply, &expect, "batch {:?} at {} µs", takes, now);
        }
    });
}
