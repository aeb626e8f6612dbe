"""`tessera serve --kv-events-endpoint` read by a subscriber as vLLM's
consumers read vLLM: pyzmq's SUB socket, every batch decoded by msgspec
(the library vLLM encodes with) into vLLM's own event types, so a field
missing, misplaced or of the wrong type fails the decode (and each event's
length is checked against its type's fields, since msgspec ignores extra
trailing ones).

Checked: sequence numbers start at 0 and never skip; every BlockStored
names a parent the index knows in some medium (or none), with block_size
tokens per hash; every BlockRemoved names blocks stored in its medium; the
pool (sized small) evicts, so both kinds come, and its evicted blocks go
to the disk tier (`--cache-dir`), whose blocks come as medium "DISK": the
index's DISK blocks are as many as the tier holds (`/metrics`); the replay
socket returns every batch from 0, the ones received among them byte for
byte, then the end marker.

    python3 scripts/kv_events_client.py BINARY MODEL
"""

import json
import re
import sys
import tempfile
import urllib.request

import msgspec
import zmq

from loopback import free_port, tessera_serve


# vLLM's types (vllm/distributed/kv_events.py, the array-like encoding
# its ZmqEventPublisher sends and KV routers decode).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def complete(base, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def main():
    binary, model = sys.argv[1], sys.argv[2]
    pub, replay = free_port(), free_port()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    args = ["--kv-events-endpoint", f"tcp://*:{pub}",
            "--kv-events-replay-endpoint", f"tcp://*:{replay}",
            "--kv-events-topic", "kv",
            # About 700 tokens of f16 K/V for this model: the prompts below
            # overflow it, so blocks are evicted.
            "--kv-memory", "16MiB"]
    received, replayed = [], []
    tier = tempfile.TemporaryDirectory(prefix="tessera-kv-events-")
    args += ["--cache-dir", tier.name]
    with tier, tessera_serve(binary, model, *args) as base:
        sub.connect(f"tcp://127.0.0.1:{pub}")
        # The subscription reaches the publisher asynchronously: a first
        # request until a batch arrives.
        sub.setsockopt(zmq.RCVTIMEO, 2000)
        prompts = [f"Story {i}: " + "the river ran past the old mill and the town " * 20
                   for i in range(6)]
        answers = []
        for p in prompts:
            answers.append(complete(base, p))
            while True:
                try:
                    received.append(sub.recv_multipart())
                except zmq.Again:
                    break
        # The same prompt again: cached, so nothing new is stored for it.
        complete(base, prompts[-1])
        while True:
            try:
                received.append(sub.recv_multipart())
            except zmq.Again:
                break
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((seq, payload))
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        m = re.search(r"^\S*disk_tier_blocks(?:\{[^}]*\})? (\d+)", metrics, re.M)
        assert m, "disk_tier_blocks in /metrics"
        tier_blocks = int(m.group(1))

    assert received, "no KV events came"
    seqs = [int.from_bytes(m[1], "big") for m in received]
    assert all(m[0] == b"kv" for m in received), "topic frame"
    # A SUB socket may miss the very first batches (the slow-joiner
    # window); from the first one it got, none is skipped.
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    # Replay from 0 gives every batch since the start, the ones received
    # among them byte for byte.
    assert [int.from_bytes(s, "big") for s, _ in replayed] == list(range(len(replayed)))
    assert [(m[1], m[2]) for m in received] == [tuple(r) for r in replayed[seqs[0]:seqs[0] + len(received)]], \
        "replay gives the batches received, byte for byte"

    index, stored, removed = {"CPU": {}, "GPU": {}, "DISK": {}}, 0, 0
    fields = {"BlockStored": 7, "BlockRemoved": 3, "AllBlocksCleared": 1}
    for _, payload in replayed:
        raw = msgspec.msgpack.decode(payload)
        assert len(raw) == 3, raw
        for e in raw[1]:
            assert len(e) == fields[e[0]], e
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0
        assert batch.ts > 1.7e9
        for e in batch.events:
            if isinstance(e, BlockStored):
                stored += 1
                assert e.medium in index and e.lora_id is None, e.medium
                assert len(e.token_ids) == e.block_size * len(e.block_hashes), e
                if e.parent_block_hash is not None:
                    assert any(e.parent_block_hash in m for m in index.values()), "parent unknown"
                for h, i in zip(e.block_hashes, range(len(e.block_hashes))):
                    assert 0 <= h < 2**63
                    assert h not in index[e.medium], "stored twice"
                    index[e.medium][h] = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
            elif isinstance(e, BlockRemoved):
                removed += 1
                for h in e.block_hashes:
                    assert h in index[e.medium], "removed unknown"
                    del index[e.medium][h]
            else:
                for m in index.values():
                    m.clear()
    assert stored > 0 and removed > 0, (stored, removed)
    pool = index["CPU"] or index["GPU"]
    # The pool ends holding blocks, and the tier the blocks it evicted.
    assert len(pool) >= 4, len(pool)
    assert len(index["DISK"]) == tier_blocks > 0, (len(index["DISK"]), tier_blocks)
    print(f"KV events: {len(replayed)} batches ({len(received)} received live, seq {seqs[0]}..{seqs[-1]}), "
          f"{stored} BlockStored, {removed} BlockRemoved, all decoded as vLLM's types; "
          f"replay returned them byte for byte; {len(pool)} pool and {len(index['DISK'])} "
          "disk-tier blocks in the index at the end")


if __name__ == "__main__":
    main()
