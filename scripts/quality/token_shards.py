"""Read-only access to our token shards (the layout of core/data/shards.h, version 1) from Python,
for a reference trainer that must train exactly the documents `dflash run` trains:
  index.bin        64-byte header (magic DFLSIDX1, version, header bytes, samples, shards, record
                   bytes 32, ...), then per sample: sample_id u64, token offset u64, shard u32,
                   length u32, trainable u32, reserved u32
  shard-NNNNN.bin  64-byte header (magic DFLSHRD1, version, header bytes, samples, tokens T, ...),
                   then input_ids int32[T], then loss_mask uint8[T]
All little-endian. Magic, version and sizes are checked at open; a bad sample id is a ValueError
naming it."""
import os
import struct

import numpy as np

VERSION = 1
HEADER_BYTES = 64
RECORD = np.dtype([("sample_id", "<u8"), ("offset", "<u8"), ("shard", "<u4"), ("length", "<u4"),
                   ("trainable", "<u4"), ("reserved", "<u4")])


class TokenShards:
    def __init__(self, directory):
        self.dir = directory
        index = os.path.join(directory, "index.bin")
        with open(index, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:8] != b"DFLSIDX1":
            raise ValueError(f"{index}: not a dflash token-shard index (magic {head[:8]!r})")
        version, header_bytes, samples, shards, record_bytes = struct.unpack_from("<IIQII", head, 8)
        if version != VERSION or header_bytes != HEADER_BYTES or record_bytes != RECORD.itemsize:
            raise ValueError(f"{index}: version {version}, header {header_bytes} B, record {record_bytes} B; "
                             f"this reader knows version {VERSION} (64 B, 32 B)")
        if os.path.getsize(index) != HEADER_BYTES + samples * RECORD.itemsize:
            raise ValueError(f"{index}: {os.path.getsize(index)} bytes, expected {HEADER_BYTES + samples * RECORD.itemsize} "
                             f"for {samples} samples")
        self.records = np.fromfile(index, dtype=RECORD, count=samples, offset=HEADER_BYTES)
        self.shards = [self._open_shard(k) for k in range(shards)]

    def _open_shard(self, k):
        path = os.path.join(self.dir, f"shard-{k:05d}.bin")
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:8] != b"DFLSHRD1":
            raise ValueError(f"{path}: not a dflash token shard (magic {head[:8]!r})")
        version, header_bytes, _, tokens = struct.unpack_from("<IIQQ", head, 8)
        if version != VERSION or header_bytes != HEADER_BYTES or os.path.getsize(path) != HEADER_BYTES + 5 * tokens:
            raise ValueError(f"{path}: version {version}, {os.path.getsize(path)} bytes for {tokens} tokens")
        data = np.memmap(path, dtype=np.uint8, mode="r")
        ids = data[HEADER_BYTES:HEADER_BYTES + 4 * tokens].view("<i4")
        mask = data[HEADER_BYTES + 4 * tokens:]
        return ids, mask

    def __len__(self):
        return len(self.records)

    def sample(self, i, length=None):
        """(input_ids, loss_mask) of sample i as lists, cut to its first `length` tokens when given."""
        if not 0 <= i < len(self.records):
            raise ValueError(f"{self.dir}: sample id {i} outside 0..{len(self.records) - 1}")
        r = self.records[i]
        n = int(r["length"]) if length is None else min(int(length), int(r["length"]))
        ids, mask = self.shards[int(r["shard"])]
        o = int(r["offset"])
        return ids[o:o + n].tolist(), mask[o:o + n].tolist()
