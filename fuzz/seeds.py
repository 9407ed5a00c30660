#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into fuzz/seeds/<target>/ (committed, small).

Seeds are real inputs (the configurations shipped in deploy/, envoy.yaml and docs/, the messages of
contract/fixtures/cases.json) and hand-made edge cases. Run it again after changing those files:
    python3 fuzz/seeds.py
`make fuzz` grows its own corpus in fuzz/corpus/ (git-ignored) from these.
"""
import json
import pathlib
import re
import struct

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fuzz" / "seeds"


def write(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    (d / name).write_bytes(data)


def hostmap(pairs):
    """The host's header map format (src/core/base/hostmap.rs)."""
    pairs = [(k.encode() if isinstance(k, str) else k, v.encode() if isinstance(v, str) else v)
             for k, v in pairs]
    out = struct.pack("<I", len(pairs))
    for k, v in pairs:
        out += struct.pack("<II", len(k), len(v))
    for k, v in pairs:
        out += k + b"\0" + v + b"\0"
    return out


def envoy_plugin_config(path):
    """The JSON in the StringValue of an Envoy bootstrap's wasm filter."""
    text = (ROOT / path).read_text()
    m = re.search(r'value: \|\n((?:\s+.*\n)+?)\s+- name:', text)
    return json.dumps(json.loads(m.group(1)), indent=1)


def yaml_plugin_config(path, *keys):
    doc = yaml.safe_load((ROOT / path).read_text().split("\n---")[0])
    for k in keys:
        doc = doc[k][0] if isinstance(doc[k], list) else doc[k]
    return json.dumps(doc, indent=1)


# ---- filter_config: shipped configurations, hand-made ones reaching every field, broken ones.
# The first six are also the fixed configurations of filter_keys and filter_interpret
# (fuzz/src/lib.rs CONFIGS): keep their names.
CONFIGS = {
    "deploy-envoy.json": envoy_plugin_config("deploy/envoy/envoy.yaml"),
    "docs-filter-config.json": json.dumps(json.loads(re.search(
        r"```json(?: filter)?\n(.*?)```", (ROOT / "docs/filter-config.md").read_text(), re.S).group(1)), indent=1),
    "deploy-istio.json": yaml_plugin_config("deploy/istio/wasmplugin.yaml", "spec", "pluginConfig"),
    "every-key-part.json": json.dumps({
        "service": {"cluster": "tollgate", "transport": "grpc", "token": "t0k3n"},
        "rules": [
            {"name": "all", "key": ["literal:a|b%c", "header:x-user", "client_ip", "path", "method",
                                    "authority", "header:x-long", "literal:" + "é" * 128],
             "capacity": 10, "period_ms": 1000,
             "cost": {"header": "x-cost", "default": 2, "max": 7}},
            {"name": "no-parts", "capacity": 1, "period_ms": 1},
        ],
        "response": {"headers": ["draft", "x-ratelimit"], "on_allowed": True},
    }),
    "shared-missing-hops.json": json.dumps({
        "service": {"cluster": "c", "authority": "svc.local", "path": "/take"},
        "trusted_hops": 2,
        "rules": [{"name": "tenant", "key": ["header:x-tenant", "client_ip"], "on_missing": "shared",
                   "match": {"path_prefix": "/api", "methods": ["GET", "post"],
                             "headers": [{"name": "x-tenant", "present": True},
                                         {"name": "x-env", "equals": "prod"}]},
                   "capacity": 1000000000, "rate": 1, "period_ms": 31536000000}],
        "failure_mode": "deny", "shadow": True,
        "breaker": {"failures": 0, "open_ms": 1, "max_open_ms": 3600000},
    }),
    "fixed-window-lease.json": json.dumps({
        "service": {"cluster": "c"},
        "rules": [{"name": "fw", "key": ["authority", "method"], "algorithm": "fixed_window",
                   "capacity": 100, "period_ms": 60000, "lease": {"size": 10, "max_age_ms": 60000}},
                  {"name": "exact", "match": {"path_exact": "/login"}, "key": ["path"],
                   "capacity": 5, "period_ms": 1000, "cost": 3}],
        "failure_mode": "allow",
        "fallback": {"instances": 10000, "max_keys": 1},
        "response": {"status": 503, "body": "", "content_type": "application/json", "headers": []},
    }),
    "root-envoy.json": envoy_plugin_config("envoy.yaml"),
    "deploy-istio-grpc.json": yaml_plugin_config("deploy/istio/wasmplugin-grpc.yaml", "spec", "pluginConfig"),
    "deploy-envoy-gateway.json": yaml_plugin_config(
        "deploy/envoy-gateway/envoyextensionpolicy.yaml", "spec", "wasm", "config"),
    # Every rule field of both kinds (src/core/config/rules.rs, RULE_FIELDS; a unit test,
    # `the_fuzz_seeds_reach_every_rule_field`, checks that the accepted seeds reach them all).
    "every-rule-field.json": json.dumps({
        "service": {"cluster": "c"},
        "model": {"body": True, "max_body_bytes": 4096},
        "rules": [
            {"name": "rate", "kind": "rate",
             "match": {"path_prefix": "/api", "not": {"client_ip": ["10.0.0.0/8"]}},
             "key": ["header:x-user", "client_ip"], "on_missing": "shared",
             "capacity": 100, "rate": 10, "period_ms": 1000,
             "cost": {"header": "x-cost", "default": 2, "min": 1, "max": 50},
             "algorithm": "sliding_window",
             "overrides": [{"key_part": "header:x-user", "value": "vip", "capacity": 1000},
                           {"key_part": "client_ip", "cidr": "192.0.2.0/24", "unlimited": True}],
             "tiers": {"header": "x-tier", "limits": {"gold": {"capacity": 500},
                                                      "free": {"unlimited": True}}},
             "shadow": True, "response": {"status": 503, "headers": ["x-ratelimit"]},
             "descriptor": [{"key": "user", "value": "header:x-user"}],
             "charge": "response",
             "usage": {"header": "x-tokens", "weights": {"prompt": 1, "completion": 3},
                       "max": 8000, "cut": "reserved"}},
            {"name": "leased", "key": ["literal:k"], "capacity": 10, "period_ms": 1000,
             "lease": {"size": 5, "max_age_ms": 500}},
            {"name": "shaped", "key": ["literal:s"], "capacity": 10, "period_ms": 1000,
             "shape": {"max_delay_ms": 1000, "max_held": 64}},
            {"name": "tenant", "key": ["header:x-tenant"], "capacity": 100, "period_ms": 60000,
             "from_request": {
                 "capacity": {"metadata": ["envoy.filters.http.ext_authz", "tenant", "limit"],
                              "min": 10, "max": 100000},
                 "rate": {"header": "x-tenant-rate", "max": 100000},
                 "cost": {"metadata": ["envoy.filters.http.jwt_authn", "jwt_payload", "w"],
                          "max": 50}}},
            {"name": "monthly", "key": ["header:x-team", "model"], "capacity": 500000,
             "algorithm": "calendar_window", "calendar": "month", "time_zone": "Europe/Berlin",
             "cost": {"reserve": "max", "max": 8000}, "charge": "response",
             "usage": {"header": "x-tokens",
                       "prices": {"gpt-4o": {"prompt": 25, "completion": 100}}}},
            {"name": "slots", "kind": "concurrency", "match": {"methods": ["POST"]},
             "key": ["header:x-tenant"], "on_missing": "skip", "max_in_flight": 4,
             "deadline_ms": 30000, "shadow": False, "response": {"body": "busy\n"}},
        ],
    }),
    "bad-empty.json": "",
    "bad-nested.json": "[" * 200 + "]" * 200,
    "bad-numbers.json": '{"service":{"cluster":"c"},"rules":[{"name":"n","capacity":1e3,'
                        '"period_ms":-1,"rate":18446744073709551616}]}',
    "bad-unknown-field.json": '{"service":{"cluster":"c","clsuter":"d"},"rules":[]}',
    "bad-control-chars.json": '{"service":{"cluster":"c\\r\\nx-injected: 1"},'
                              '"rules":[{"name":"n","capacity":1,"period_ms":1}]}',
    "bad-duplicate-rule.json": '{"service":{"cluster":"c"},"rules":[{"name":"n","capacity":1,'
                               '"period_ms":1},{"name":"n","capacity":1,"period_ms":1}]}',
    "bad-escapes.json": '{"service":{"cluster":"\\ud800\\u0000"},"rules":null}',
    # Found by filter_config: a top-level key "" is refused with an empty field name.
    "bad-empty-key.json": '{"service":{"clustep":": 1"},"":[{"s":1}]}',
}

# ---- filter_keys: byte 0 picks the configuration, byte 1 trusted_hops (0xff: the
# configuration's own), then a header map; `x-fuzz-peer` stands for the peer address.
REQUESTS = {
    "plain": [(":method", "GET"), (":path", "/api/v1/items?page=2"), (":authority", "example.com"),
              ("x-forwarded-for", "203.0.113.7"), ("x-user", "alice"), ("x-tenant", "acme"),
              ("x-fuzz-peer", "192.0.2.1:4711")],
    "hostile": [(":method", "P|ST"), (":path", b"/%7C|\xff\x00#frag"), (":authority", "h\xc3\xa9st:80"),
                ("x-forwarded-for", "::ffff:1.2.3.4, [2001:db8::1]:443, 0:0::1,garbage"),
                ("x-user", b"\x00\x01|%-#"), ("x-long", "a" * 300), ("x-cost", "99999999999999999999999"),
                ("x-fuzz-peer", "[::1]:80")],
    "missing": [(":path", "/login"), ("x-cost", "0")],
    "repeated": [(":path", "/api"), (":method", "POST"), ("x-forwarded-for", "10.0.0.1"),
                 ("x-forwarded-for", "10.0.0.2, 10.0.0.3"), ("x-tenant", ""), ("x-env", "prod"),
                 ("x-tenant", "second"), ("x-cost", " 5 ")],
}
for i, name in enumerate(["deploy-envoy", "docs", "istio", "every-key-part", "shared", "lease"]):
    for rname, pairs in REQUESTS.items():
        if rname == "plain" or name in ("every-key-part", "shared", "docs"):
            write("filter_keys", f"{name}-{rname}", bytes([i, 0xff]) + hostmap(pairs))
write("filter_keys", "inline-config",
      b"\x80\x00" + CONFIGS["every-key-part.json"].encode() + b"\0" + hostmap(REQUESTS["hostile"]))
write("filter_keys", "hops-3", bytes([4, 3]) + hostmap(REQUESTS["repeated"]))

# ---- filter_hostmap: header maps as Envoy hands them over, and broken ones.
write("filter_hostmap", "request", hostmap(REQUESTS["plain"]))
write("filter_hostmap", "binary", hostmap(REQUESTS["hostile"] + [(b"\xc3", b""), (b"", b"\xff")]))
write("filter_hostmap", "empty", b"")
write("filter_hostmap", "zero-entries", struct.pack("<I", 0))
write("filter_hostmap", "truncated", hostmap(REQUESTS["plain"])[:37])
write("filter_hostmap", "huge-count", struct.pack("<III", 0xFFFFFFFF, 1, 1) + b"a\0b\0")
write("filter_hostmap", "lying-length", struct.pack("<III", 1, 0xFFFFFFF0, 1) + b"a\0b\0")
write("filter_hostmap", "no-final-nul", hostmap([("a", "b")])[:-1])

# ---- Contract fixtures: responses for the filter, requests for the service.
cases = json.loads((ROOT / "contract/fixtures/cases.json").read_text())["cases"]
for c in cases:
    n = c["name"]
    write("filter_reply_json", n, json.dumps(c["response_json"]))
    write("filter_reply_proto", n, bytes.fromhex(c["response_pb_hex"]))
    write("server_take_json", n, json.dumps(c["request_json"]))
    write("server_take_proto", n, bytes.fromhex(c["request_pb_hex"]))
    # filter_interpret: kind, configuration, status (u16 LE), body.
    write("filter_interpret", f"http-{n}", bytes([2, 0]) + struct.pack("<H", 200)
          + json.dumps(c["response_json"]).encode())
    write("filter_interpret", f"grpc-{n}", bytes([3, 1]) + struct.pack("<H", 0)
          + b"\0" + bytes.fromhex(c["response_pb_hex"]))

write("filter_reply_json", "extremes", '{"allowed":false,"buckets":[{"allowed":false,"limit":18446744073709551615,'
      '"remaining":0,"reset_ms":18446744073709551615,"retry_after_ms":18446744073709551615,'
      '"granted":0,"extra":{"nested":[1,2]}}],"more":null}')
write("filter_reply_json", "wrong-types", '{"allowed":1,"buckets":[{"allowed":true,"limit":1.5}]}')
write("filter_reply_json", "nulls", '{"allowed":true,"buckets":[{"allowed":true,"limit":null}]}')
write("filter_reply_proto", "unknown-fields", bytes([0x08, 0x01, 0x18, 0x05, 0x21] + [0] * 8
                                                    + [0x2d, 0, 0, 0, 0, 0x32, 0x00]))
write("filter_reply_proto", "long-varint", bytes([0x08] + [0xff] * 9 + [0x01]))
write("filter_reply_proto", "wrong-wire-type", bytes([0x12, 0x02, 0x0a, 0x00]))
write("filter_interpret", "connect-failure", bytes([2, 2]) + struct.pack("<H", 503)
      + b"upstream connect error or disconnect/reset before headers")
write("filter_interpret", "grpc-timeout", bytes([3, 3]) + struct.pack("<H", 14) + b"upstream request timeout\0")
write("filter_interpret", "reset", bytes([1, 0, 0, 0]))
write("filter_interpret", "denied-extremes", bytes([2, 3]) + struct.pack("<H", 200)
      + b'{"allowed":false,"buckets":[{"allowed":false,"limit":18446744073709551615,"remaining":18446744073709551615,'
        b'"reset_ms":18446744073709551615,"retry_after_ms":18446744073709551615},{"allowed":true}]}')

write("server_take_json", "seventeen", json.dumps({"buckets": [{}] * 17}))
write("server_take_json", "nulls-and-last-wins",
      '{"buckets":[{"key":"a","capacity":1,"capacity":2,"rate":null,"period_ms":1,"algorithm":null}]}')
write("server_take_json", "numbers", '{"buckets":[{"key":"k","capacity":1.0,"period_ms":1e3,"cost":-0,'
      '"lease":18446744073709551616}]}')
write("server_take_json", "unknown-field", '{"buckets":[{"key":"k","capacity":1,"period_ms":1,"colour":"red"}]}')
write("server_take_json", "escapes", '{"buckets":[{"key":"\\u0000{}%#\\ud83d\\ude00","capacity":1,'
      '"period_ms":1,"algorithm":"fixed_window","lease":5,"cost":2}]}')
write("server_take_json", "not-an-object", '[{"key":"k"}]')
write("server_take_proto", "seventeen", bytes([0x0a, 0x00] * 17))
write("server_take_proto", "group", bytes([0x0b, 0x0c, 0x0a, 0x00]))
write("server_take_proto", "unknown-fields", bytes([0x10, 0x05, 0x0a, 0x04, 0x48, 0x01, 0x30, 0x07]))
write("server_take_proto", "bad-utf8-key", bytes([0x0a, 0x03, 0x0a, 0x01, 0xff]))

# ---- server_cli: arguments separated by NUL bytes.
ARGS = {
    "memory": ["--listen", "0.0.0.0:8081", "--max-in-flight", "64", "--worker-threads", "2"],
    "redis": ["--redis-url", "redis://user:s3cr3t-pw@redis:6379/0", "--token", "a-long-random-token-0f1e2d3c4b5a6978",
              "--key-prefix", "tg:", "--redis-timeout-ms", "50", "--log-format", "json"],
    "cluster": ["--redis-cluster", "rediss://:p4ss/w0rd@a:7000,redis://b:7001", "--redis-tls-ca", "/nonexistent/ca.pem"],
    "bad": ["--listen", "nowhere", "--key-prefix", "{x}", "--max-in-flight=-1", "--log-format", "xml"],
    "equals": ["--token=abc\u0007def", "--redis-url=redis://u:p@h?password=q#frag", "--help"],
}
for name, args in ARGS.items():
    write("server_cli", name, "\0".join(args))
write("server_cli", "non-utf8", b"--token\0\xff\xfe-token\0--redis-url\0redis://:\xff@h")


if __name__ == "__main__":
    for name, text in CONFIGS.items():
        write("filter_config", name, text)
    for d in sorted(OUT.iterdir()):
        print(f"{d.name}: {len(list(d.iterdir()))} seeds")
