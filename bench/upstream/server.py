"""An upstream for the instruction counts (scripts/bench-instructions.sh, variants *-upstream):
answers every request 200 `ok` over HTTP/1.1 keep-alive, its body read and dropped, so that Envoy
forwards requests as it does in production instead of answering them itself. Not counted.
`python3 bench/upstream/server.py PORT` prints `ready` once listening.
"""
import http.server, socketserver, sys


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self):
        n = int(self.headers.get("content-length") or 0)
        if n:
            self.rfile.read(n)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST = do_PUT = answer

    def log_message(self, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


if __name__ == "__main__":
    server = Server(("127.0.0.1", int(sys.argv[1])), Handler)
    print("ready", flush=True)
    server.serve_forever()
