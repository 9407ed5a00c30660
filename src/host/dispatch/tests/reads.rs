//! What a request reads from the host: only the match headers when no rule matches, the headers
//! its rules read and no more (each once: a match header is not read again for the request), shared data twice for a steady exact request; and the match
//! prefilter agreeing with the core's decision.

use super::*;
use crate::core::rules::Request;
use crate::host::request::match_headers;

#[test]
fn a_request_no_rule_matches_reads_only_the_match_headers() {
    let cfg = config("http", "");
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 5, "/other"), CONTINUE);
    assert_eq!(d.abi.full_reads.get(), 0, "the header map is not read");
    assert_eq!(d.abi.header_reads.get(), 1, ":path only");
    assert_eq!(d.on_request_body(5, Some(0), false), CONTINUE);
    assert!(d.abi.dispatched.borrow().is_empty());
    assert_eq!(start(&mut d, 6, "/api/v1"), PAUSE);
    assert_eq!(d.abi.full_reads.get(), 0, "the rule reads :path alone");
    assert_eq!(
        d.abi.header_reads.get(),
        2,
        "the first request's :path, then this one's: read to match, kept for the request"
    );
    assert_eq!(
        d.on_request_body(6, Some(0), false),
        HOLD_BODY,
        "body waits for the decision"
    );
}

#[test]
fn a_steady_exact_request_reads_shared_data_twice() {
    let cfg = config("http", "");
    let mut d = dispatcher(&cfg);
    // As the service answers: with the live instances it counts.
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"allowed":true,"instances":3,"buckets":[{"allowed":true,"limit":5,"remaining":4,"reset_ms":1000,"retry_after_ms":0}]}"#.to_vec(),
    );
    let mut reads = Vec::new();
    for id in [101, 102, 103] {
        let before = d.abi.shared_reads.get();
        assert_eq!(start(&mut d, id, "/api/x"), PAUSE);
        d.on_http_call_response(last_token(&d), 1, 1000);
        d.on_delete(id);
        reads.push(d.abi.shared_reads.get() - before);
    }
    // The breaker's entry at admission (which also holds the learned number of proxies), and the
    // bucket's fallback share with the answer: an answer reporting the number its admission read
    // reads nothing more. The first answer also learned the number (one read, one write).
    assert_eq!(reads, vec![3, 2, 2]);
}

#[test]
fn a_matching_request_reads_the_headers_its_rules_read_and_no_more() {
    let key = |k: &str, hops: u32| {
        format!(
            r#"{{"service":{{"cluster":"svc","transport":"http","batch":0}},"trusted_hops":{hops},
                 "rules":[{{"name":"r","key":[{k}],"capacity":5,"period_ms":60000}}]}}"#
        )
    };
    // (config, whole-map reads, by-name reads) for one request.
    for (cfg, full, by_name) in [
        (key(r#""header:x-user","method""#, 0), 0, 2),
        (key(r#""client_ip""#, 0), 0, 0),
        (key(r#""authority""#, 0), 0, 2),
        (key(r#""client_ip""#, 1), 1, 0),
    ] {
        let mut d = dispatcher(&cfg);
        *d.abi.request.borrow_mut() = vec![
            (":path".into(), b"/x".to_vec()),
            (":method".into(), b"GET".to_vec()),
            (":authority".into(), b"example.com".to_vec()),
            ("x-user".into(), b"u".to_vec()),
            ("x-forwarded-for".into(), b"10.0.0.9".to_vec()),
        ];
        d.on_context_create(7, ROOT);
        d.abi.known.borrow_mut().push(7);
        assert_eq!(d.on_request_headers(7, false), PAUSE, "{cfg}");
        assert_eq!(
            (d.abi.full_reads.get(), d.abi.header_reads.get()),
            (full, by_name),
            "{cfg}"
        );
        let sent = String::from_utf8(d.abi.dispatched.borrow()[0].1.clone()).unwrap();
        assert!(
            sent.contains("r|u|GET") || !cfg.contains("x-user"),
            "the key is built from what was read: {sent}"
        );
    }
}

#[test]
fn the_match_prefilter_agrees_with_the_core() {
    let configs = [
        r#"[{"name":"a","match":{"path_exact":"/login","methods":["POST"]},"key":["literal:x"],"capacity":1,"period_ms":1000},
            {"name":"b","match":{"headers":[{"name":"x-tenant","present":true},{"name":"x-plan","equals":"free"}]},"key":["header:x-tenant"],"capacity":1,"period_ms":1000}]"#,
        r#"[{"name":"a","match":{"path_prefix":"/api","headers":[{"name":"x-internal","present":false}]},"key":["path"],"capacity":1,"period_ms":1000}]"#,
    ];
    let requests: Vec<Vec<(&str, &[u8])>> = vec![
        vec![(":path", b"/login"), (":method", b"POST")],
        vec![(":path", b"/login?x=1"), (":method", b"GET")],
        vec![(":path", b"/x"), ("x-tenant", b"t"), ("x-plan", b"free")],
        vec![(":path", b"/x"), ("x-tenant", b"t"), ("x-plan", b"paid")],
        vec![(":path", b"/api/v1")],
        vec![(":path", b"/api/v1"), ("x-internal", b"1")],
        vec![
            (":path", b"/apix"),
            ("x-plan", b"free"),
            ("x-plan", b"paid"),
        ],
        vec![],
    ];
    for rules in configs {
        let json = format!(r#"{{"service":{{"cluster":"svc"}},"rules":{rules}}}"#);
        let cfg = Config::parse(json.as_bytes()).unwrap();
        let names = match_headers(&cfg).unwrap();
        for r in &requests {
            let full = Request {
                headers: r.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect(),
                peer: Some("10.0.0.1:1".into()),
                properties: Vec::new(),
                ..Default::default()
            };
            let fake = Fake::new("");
            *fake.request.borrow_mut() = full.headers.clone();
            let plugin = Plugin {
                root: ROOT,
                config: cfg.clone(),
                metrics: Metrics::define(&fake, &cfg).unwrap(),
                prefix: String::new(),
                bearer: None,
                grpc_service: Vec::new(),
                reads: Reads {
                    match_headers: Some(names.clone()),
                    request_headers: None,
                    properties: Vec::new(),
                },
                outbox: RefCell::new(Outbox::new("t")),
                memos: Default::default(),
                applied: Default::default(),
            };
            let core = crate::core::decide::decide(&cfg, &full).step;
            let pre = may_match(&fake, &plugin.config, &plugin.reads, &mut Vec::new());
            assert_eq!(
                pre,
                !matches!(core, crate::core::wire::plan::Step::Continue),
                "{r:?} under {rules}"
            );
        }
    }
    let every = r#"{"service":{"cluster":"svc"},"rules":[{"name":"a","key":["client_ip"],"capacity":1,"period_ms":1}]}"#;
    assert_eq!(
        match_headers(&Config::parse(every.as_bytes()).unwrap()),
        None
    );
}
