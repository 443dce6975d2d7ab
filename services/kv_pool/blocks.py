"""KV blocks of an arena as bytes: what the swap tier and cross-node transfers copy.

The arena is [layers, 2, slots, kv_heads, row] (row: head_dim elements, or for an int8 arena
head_dim int8 values and their float32 scale, shared/kv_layout.py); block b is slots
[b x block_size, (b+1) x block_size) of each of the 2 x layers planes, i.e. 2 x layers contiguous
segments of block_size x kv_heads x row elements: an int8 block's scales travel inside it. A block's bytes, in the order every copy here uses,
are those segments one after the other (plane by plane); several blocks are concatenated.

The pool only copies bytes, so on the CPU backend the arena is a numpy byte array over the
shared-memory file (`of_bytes`) and the kv-pool never loads torch. A torch tensor works as well
(a GPU arena with `--device cuda`, and the tests): reads and writes then stay in torch. A GPU arena
is read and written through host memory: `read` returns host bytes, and `write` (host or device
bytes) has completed on the GPU when it returns, so the worker that is told next reads the new
bytes from its own process.
"""

from __future__ import annotations

import numpy as np

from meshserve.shared.kv_layout import dtype_bytes


class ArenaBlocks:
    def __init__(self, arena, block_size: int):
        """arena: a torch tensor of the arena's shape (any device)."""
        import torch

        layers, two, slots, heads, dim = arena.shape
        assert arena.is_contiguous() and slots % block_size == 0
        self.on_gpu = arena.device.type != "cpu"
        dtype = str(arena.dtype).removeprefix("torch.")
        rows = arena.view(layers * two, slots * heads * dim).view(torch.uint8)
        self._init(rows, dtype, [layers, two, block_size, heads, dim], slots // block_size)

    @classmethod
    def of_bytes(cls, buf: np.ndarray, dtype: str, shape: list[int], block_size: int) -> "ArenaBlocks":
        """The arena in a host byte buffer (numpy uint8, e.g. a mapped shared-memory file), elements
        of `dtype` in `shape`; numpy alone, whatever the dtype (bf16 included: only bytes move)."""
        layers, two, slots, heads, dim = shape
        assert slots % block_size == 0
        planes = layers * two
        plane_bytes = slots * heads * dim * dtype_bytes(dtype)
        self = cls.__new__(cls)
        self.on_gpu = False
        self._init(buf[:planes * plane_bytes].reshape(planes, plane_bytes), dtype,
                   [layers, two, block_size, heads, dim], slots // block_size)
        return self

    def _init(self, rows, dtype: str, block_shape: list[int], num_blocks: int) -> None:
        # [planes, bytes of one plane]: a block is one column range of every row.
        self.rows, self.dtype, self.block_shape = rows, dtype, block_shape
        self.block_size, self.num_blocks = block_shape[2], num_blocks
        self.planes = block_shape[0] * block_shape[1]
        self.seg = rows.shape[1] // num_blocks
        self.block_bytes = self.planes * self.seg
        self._numpy = isinstance(rows, np.ndarray)

    def _cols(self, b: int):
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block {b} is outside the arena (0..{self.num_blocks - 1})")
        return self.rows[:, b * self.seg:(b + 1) * self.seg]

    def byte_ranges(self, blocks: list[int]) -> list[tuple[int, int]]:
        """(offset, length) in the arena's memory of those blocks' bytes: per run of consecutive ids,
        one range in each plane."""
        plane, out = self.rows.shape[1], []
        ids = sorted(set(blocks))
        i = 0
        while i < len(ids):
            j = i
            while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
                j += 1
            out += [(p * plane + ids[i] * self.seg, (j - i + 1) * self.seg) for p in range(self.planes)]
            i = j + 1
        return out

    def read(self, b: int):
        """Block b's bytes (a contiguous copy, in host memory), as an array of the arena's kind."""
        if self._numpy:
            return np.ascontiguousarray(self._cols(b)).reshape(-1)
        data = self._cols(b).contiguous().view(-1)
        return data.cpu() if self.on_gpu else data

    def write(self, b: int, data) -> None:
        if self._numpy:
            self._cols(b)[...] = np.asarray(data).reshape(self.planes, self.seg)
            return
        self._cols(b).copy_(data.view(self.planes, self.seg))
        if self.on_gpu:
            import torch

            torch.cuda.synchronize(self.rows.device)

    def read_range(self, blocks: list[int], offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the concatenation of `blocks`."""
        bb, out = self.block_bytes, []
        end = offset + length
        for i in range(offset // bb, -(-end // bb)):
            lo, hi = max(offset, i * bb) - i * bb, min(end, (i + 1) * bb) - i * bb
            part = self.read(blocks[i])[lo:hi]
            out.append(part.tobytes() if self._numpy else part.numpy().tobytes())
        return b"".join(out)

    def write_range(self, blocks: list[int], offset: int, data: bytes | memoryview) -> None:
        """Writes `data` at `offset` of the concatenation of `blocks` (a partial block is merged)."""
        src = self._from_bytes(data)
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

    def _from_bytes(self, data: bytes | memoryview):
        if self._numpy:
            return np.frombuffer(data, dtype=np.uint8)
        import torch

        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def empty_bytes_like(block, shape: tuple[int, ...]):
    """An uninitialized uint8 array of `shape`, of the same kind as `block` (numpy or torch): the
    OS gives its pages on first touch, so unused space costs no memory."""
    if isinstance(block, np.ndarray):
        return np.empty(shape, dtype=np.uint8)
    import torch

    return torch.empty(shape, dtype=torch.uint8)
