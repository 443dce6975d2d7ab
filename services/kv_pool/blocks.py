"""KV blocks of an arena as bytes: what the swap tier and cross-node transfers copy.

The arena is [layers, 2, slots, kv_heads, head_dim]; block b is slots [b x block_size, (b+1) x
block_size) of each of the 2 x layers planes, i.e. 2 x layers contiguous segments of
block_size x kv_heads x head_dim elements. A block's bytes, in the order every copy here uses,
are those segments one after the other (plane by plane); several blocks are concatenated.

A GPU arena (`--device cuda`) is read and written through host memory: `read` returns host bytes,
and `write` (host or device bytes) has completed on the GPU when it returns, so the worker that
is told next reads the new bytes from its own process.
"""

from __future__ import annotations

import torch


class ArenaBlocks:
    def __init__(self, arena: torch.Tensor, block_size: int):
        layers, two, slots, heads, dim = arena.shape
        assert arena.is_contiguous() and slots % block_size == 0
        self.block_size, self.num_blocks = block_size, slots // block_size
        self.dtype = arena.dtype
        self.on_gpu = arena.device.type != "cpu"
        self.block_shape = [layers, two, block_size, heads, dim]
        self.planes = layers * two
        # [planes, bytes of one plane]: a block is one column range of every row.
        self.rows = arena.view(self.planes, slots * heads * dim).view(torch.uint8)
        self.seg = self.rows.shape[1] // self.num_blocks
        self.block_bytes = self.planes * self.seg

    def _cols(self, b: int) -> torch.Tensor:
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block {b} is outside the arena (0..{self.num_blocks - 1})")
        return self.rows[:, b * self.seg:(b + 1) * self.seg]

    def read(self, b: int) -> torch.Tensor:
        """Block b's bytes (a contiguous copy, in host memory)."""
        data = self._cols(b).contiguous().view(-1)
        return data.cpu() if self.on_gpu else data

    def write(self, b: int, data: torch.Tensor) -> None:
        self._cols(b).copy_(data.view(self.planes, self.seg))
        if self.on_gpu:
            torch.cuda.synchronize(self.rows.device)

    def read_range(self, blocks: list[int], offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the concatenation of `blocks`."""
        bb, out = self.block_bytes, []
        end = offset + length
        for i in range(offset // bb, -(-end // bb)):
            lo, hi = max(offset, i * bb) - i * bb, min(end, (i + 1) * bb) - i * bb
            out.append(self.read(blocks[i])[lo:hi])
        return torch.cat(out).numpy().tobytes() if out else b""

    def write_range(self, blocks: list[int], offset: int, data: bytes | memoryview) -> None:
        """Writes `data` at `offset` of the concatenation of `blocks` (a partial block is merged)."""
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        bb, end, pos = self.block_bytes, offset + len(data), 0
        for i in range(offset // bb, -(-end // bb)):
            lo, hi = max(offset, i * bb) - i * bb, min(end, (i + 1) * bb) - i * bb
            part = src[pos:pos + hi - lo]
            pos += hi - lo
            if lo == 0 and hi == bb:
                self.write(blocks[i], part)
            else:
                whole = self.read(blocks[i])
                whole[lo:hi] = part
                self.write(blocks[i], whole)
