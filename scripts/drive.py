"""N GETs of /x on 127.0.0.1:PORT over C keep-alive connections at once, one after the other on
each; exits non-zero on any status but 200 (or but those of STATUSES, comma-separated). The
benchmarks' client under callgrind (bench-instructions.sh, bench-stream.sh):
`python3 scripts/drive.py PORT N [C [STATUSES]]`. With DRIVE_BODY set, POSTs with that JSON body.
"""
import http.client, os, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
clients = int(sys.argv[3]) if len(sys.argv) > 3 else 1
accepted = {int(x) for x in sys.argv[4].split(",")} if len(sys.argv) > 4 else {200}
body = os.environ.get("DRIVE_BODY")
failed = []
def client(count):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for _ in range(count):
        if body is None:
            c.request("GET", "/x")
        else:
            c.request("POST", "/x", body=body, headers={"content-type": "application/json"})
        r = c.getresponse()
        r.read()
        if r.status not in accepted:
            failed.append(r.status)
            return
threads = [threading.Thread(target=client, args=(n // clients + (i < n % clients),)) for i in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
if failed:
    sys.exit(f"statuses {failed}")
