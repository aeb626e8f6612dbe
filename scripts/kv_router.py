#!/usr/bin/env python3
"""A KV-event-routed gateway: OpenAI chat completions sent to the replica
whose prefix cache holds most of the request's prompt, as each replica
reports it in its KV events (`tessera serve --kv-events-endpoint`, vLLM's
format), the way NVIDIA Dynamo's KV router and llm-d's indexer place
requests.

For each replica a subscriber thread keeps an index of the full blocks
its cache holds, replayed from its events in order (a gap in the sequence
numbers is filled from the replica's replay socket). A block is indexed
by a hash the gateway chains from its token ids (the engine's own hashes
name blocks only for parent links and removals, as in Dynamo), with the
media that hold it: the pool (`CPU`/`GPU`) and the disk tier (`DISK`,
`--cache-dir`), whose blocks a replica reads back instead of computing
them, so a block counts as held while either holds it. A request's
prompt is tokenized as the replica tokenizes it (`POST /tokenize` with the
messages), cut into blocks of the size the events carry, and chained the
same way. Each replica's cost is the blocks it would compute (the prompt's
past its longest run of leading blocks held) plus the blocks its requests
in flight hold (prompt and reply), scaled by its pool's size against the
replicas' mean (`tessera:cache_config_info` in its /metrics), as Dynamo's
KV router weighs prefill blocks against active blocks; the cheapest wins
(the one with fewer blocks in flight on a tie). A conversation whose
history no replica holds any more thus goes where there is room for it,
which a router that guesses from the text it sent cannot see. Responses
(streamed or not) are relayed as they come.

    kv_router.py PORT REPLICA_URL=EVENTS_ENDPOINT=REPLAY_ENDPOINT ...

Used by `scripts/router.py` (the `kv_events` policy of `just bench-router`).
"""

import http.client
import json
import os
import re
import sys
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import zmq

# What a block held by a request in flight weighs against a block to
# compute (KV_ROUTER_LOAD; Dynamo's default weighs them equally).
LOAD = float(os.environ.get("KV_ROUTER_LOAD", "1"))
# KV_ROUTER_POLICY=balanced: sglang-router's cache_aware rule on the
# replicas' reported blocks instead of text: while the replicas' requests
# in flight differ by at most KV_ROUTER_BALANCE, the replica holding the
# longest run of the prompt's leading blocks (ties: more requests in
# flight, so that the load gathers within the allowed imbalance), else the
# one with fewer requests in flight. Measured against cache_aware in
# docs/performance-notes.md (the KV-event gateway with sglang-router's own
# rule on exact blocks); not the default.
POLICY = os.environ.get("KV_ROUTER_POLICY", "cost")
BALANCE = int(os.environ.get("KV_ROUTER_BALANCE", "2"))


def chain(parent, tokens):
    return hash((parent, tuple(tokens)))


class Replica:
    def __init__(self, url, events, replay):
        self.url, self.events, self.replay = url, events, replay
        self.lock = threading.Lock()
        self.blocks = {}         # chained hash of a block held -> its media
        self.names = {}          # engine hash -> chained hash
        self.block_size = 16
        self.active = 0          # blocks held by the requests in flight
        self.requests = 0        # requests in flight
        self.capacity = pool_blocks(url)
        self.next_seq = 0
        self.gaps = 0
        threading.Thread(target=self.follow, daemon=True).start()

    def apply(self, payload):
        _, events, *_ = msgspec.msgpack.decode(payload)
        with self.lock:
            for e in events:
                kind = e[0]
                if kind == "BlockStored":
                    hashes, parent, tokens, bs, medium = e[1], e[2], e[3], e[4], e[6]
                    self.block_size = bs
                    if parent is None:
                        up = 0
                    elif parent in self.names:
                        up = self.names[parent]
                    else:
                        continue  # a parent never seen: not placeable
                    for i, h in enumerate(hashes):
                        up = chain(up, tokens[i * bs:(i + 1) * bs])
                        self.names[h] = up
                        self.blocks.setdefault(up, set()).add(medium)
                elif kind == "BlockRemoved":
                    medium = e[2]
                    for h in e[1]:
                        c = self.names.get(h)
                        media = self.blocks.get(c)
                        if media is None:
                            continue
                        media.discard(medium)
                        if not media:
                            del self.blocks[c]
                            del self.names[h]
                elif kind == "AllBlocksCleared":
                    self.names.clear()
                    self.blocks.clear()

    def fill(self, ctx, upto):
        """Batches `next_seq..upto` from the replay socket."""
        self.gaps += 1
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVTIMEO, 5000)
        d.connect(self.replay)
        d.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        try:
            while True:
                _, seq, payload = d.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq == -1:
                    break
                if self.next_seq <= seq < upto:
                    self.apply(payload)
                    self.next_seq = seq + 1
        finally:
            d.close(linger=0)

    def follow(self):
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.events)
        while True:
            _, seq, payload = sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq and self.replay:
                self.fill(ctx, seq)
            if seq >= self.next_seq:
                self.apply(payload)
                self.next_seq = seq + 1

    def held(self, tokens):
        """Leading full blocks of `tokens` this replica holds."""
        bs, up, n = self.block_size, 0, 0
        with self.lock:
            for j in range(len(tokens) // bs):
                up = chain(up, tokens[j * bs:(j + 1) * bs])
                if up not in self.blocks:
                    break
                n += 1
        return n


def pool_blocks(url):
    """The replica's pool in blocks, from its /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'cache_config_info\{[^}]*num_blocks="(\d+)"', text)
    if not m:
        sys.exit(f"{url}/metrics has no cache_config_info num_blocks")
    return int(m.group(1))


def post(url, path, body):
    req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


class Gateway(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    replicas = []
    lock = threading.Lock()

    def log_message(self, *_):
        pass

    def do_GET(self):
        self.relay(self.replicas[0], None)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        target = self.replicas[0]
        if self.path.startswith("/v1/chat/completions"):
            req = json.loads(body)
            tokens = post(target.url, "/tokenize", {"messages": req["messages"]})["tokens"]
            reply = req.get("max_completion_tokens") or req.get("max_tokens") or 0
            mean = sum(r.capacity for r in self.replicas) / len(self.replicas)
            blocks = [len(tokens) // r.block_size - r.held(tokens) for r in self.replicas]
            with self.lock:
                ids = range(len(self.replicas))
                reqs = [r.requests for r in self.replicas]
                if POLICY == "balanced" and max(reqs) - min(reqs) > BALANCE:
                    best = min(ids, key=lambda i: (reqs[i], blocks[i]))
                elif POLICY == "balanced":
                    best = min(ids, key=lambda i: (blocks[i], -reqs[i]))
                else:
                    cost = [blocks[i] + LOAD * r.active * mean / r.capacity
                            for i, r in enumerate(self.replicas)]
                    best = min(ids, key=lambda i: (cost[i], self.replicas[i].active))
                target = self.replicas[best]
                # Each decision, for the log.
                print(f"route {len(tokens)} tokens: blocks to compute {blocks}, blocks in "
                      f"flight {[r.active for r in self.replicas]} -> {best}", flush=True)
                need = -(-(len(tokens) + reply) // target.block_size)
                target.active += need
                target.requests += 1
            try:
                self.relay(target, body)
            finally:
                with self.lock:
                    target.active -= need
                    target.requests -= 1
        else:
            self.relay(target, body)

    def relay(self, replica, body):
        u = urllib.parse.urlparse(replica.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "content-length", "connection")}
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        conn.close()


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that hangs up mid-response is not the gateway's error.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    port = int(sys.argv[1])
    for spec in sys.argv[2:]:
        url, events, replay = spec.split("=")
        Gateway.replicas.append(Replica(url, events, replay))
    Server(("127.0.0.1", port), Gateway).serve_forever()


if __name__ == "__main__":
    main()
