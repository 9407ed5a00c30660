"""The stream probe's gRPC peer (scripts/bench-stream.sh): answers every unary `Take` and every
message of a `TakeStream` with the same small answer, and prints how many of each it answered
(every two seconds), so the run can check which path its requests took. Its CPU is not counted.
"""
import sys, threading, time
from concurrent import futures
import grpc
ANSWER = b"\x08\x01\x12\x0e\x08\x01\x10\x80\x94\xeb\xdc\x03\x18\xff\x93\xeb\xdc\x03"
counts = {"unary": 0, "stream": 0}
def take(req, ctx):
    counts["unary"] += 1
    return ANSWER
def take_stream(it, ctx):
    for _ in it:
        counts["stream"] += 1
        yield ANSWER
h = grpc.method_handlers_generic_handler("tollgate.bench.Probe", {
    "Take": grpc.unary_unary_rpc_method_handler(take),
    "TakeStream": grpc.stream_stream_rpc_method_handler(take_stream),
})
s = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
s.add_generic_rpc_handlers((h,))
port = int(sys.argv[1])
s.add_insecure_port(f"127.0.0.1:{port}")
s.start()
print("ready", flush=True)
while True:
    time.sleep(2)
    print(counts, flush=True)
