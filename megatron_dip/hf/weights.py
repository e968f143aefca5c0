"""Reading Hugging Face safetensors by slices into our tensors, and writing ours back.

`SafetensorsFolder` opens a model folder (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`) through safetensors' memory-mapped `safe_open`, and hands out
row / column slices of tensors with `get_slice`, counting the bytes it asks for: a rank that
fills only its shards reads only those (`bytes_read`). `local_tensor` assembles the local shard
of one of our parameters (a `models.sharded.ParamLayout`: global rows of its segments along its
partition dim) from the pieces of its `names.TensorMap`; `hf_tensors` inverts the maps for an
export: Hugging Face tensors from our full global tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from .names import TensorMap

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsFolder:
    """The safetensors tensors of one Hugging Face model folder, read by slices."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.bytes_read = 0
        self._files: dict[str, object] = {}
        self.where = self._index()

    def _index(self) -> dict[str, str]:
        index = self.folder / INDEX
        if index.is_file():
            return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        files = [self.folder / SINGLE] if (self.folder / SINGLE).is_file() else []
        files = files or sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.folder}: no {SINGLE}, {INDEX} or *.safetensors there")
        out = {}
        for path in files:
            for name in self._open(path.name).keys():  # noqa: SIM118 (safe_open has no __iter__)
                out[name] = path.name
        return out

    def _open(self, file: str):
        from safetensors import safe_open

        if file not in self._files:
            self._files[file] = safe_open(str(self.folder / file), framework="pt")
        return self._files[file]

    def names(self) -> list[str]:
        return sorted(self.where)

    def _slice(self, name: str):
        if name not in self.where:
            raise KeyError(f"{self.folder}: no tensor {name!r} in the checkpoint")
        return self._open(self.where[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(
        self, name: str, *, rows: tuple[int, int], cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Rows [rows) (and columns [cols) of a 2-D tensor) of tensor `name`."""
        part = self._slice(name)
        if len(part.get_shape()) == 1:
            if cols is not None:
                raise ValueError(f"{name}: a 1-D tensor has no columns")
            out = part[rows[0] : rows[1]]
        elif cols is None:
            out = part[rows[0] : rows[1], :]
        else:
            out = part[rows[0] : rows[1], cols[0] : cols[1]]
        self.bytes_read += out.numel() * out.element_size()
        return out


def read_rows(
    source: SafetensorsFolder,
    tmap: TensorMap,
    *,
    dim: int,
    start: int,
    length: int,
    full_rows: int,
) -> torch.Tensor | None:
    """Our global tensor `tmap.key` restricted to [start, start + length) along `dim` (0 or 1),
    read piece by piece. Rows past the pieces (a vocabulary padded beyond the checkpoint's) are
    zeros; `full_rows` is our global size along dim 0. None when every element is padding."""
    parts, offset = [], 0
    for piece in tmap.pieces:
        rows = piece.rows if piece.rows is not None else source.shape(piece.name)[0]
        lo, hi = (max(start, offset), min(start + length, offset + rows)) if dim == 0 else (0, rows)
        if hi > lo:
            r = (piece.start + lo - offset, piece.start + hi - offset)
            cols = (start, start + length) if dim == 1 else None
            parts.append(source.read(piece.name, rows=r, cols=cols))
        offset += rows
    if not parts:
        return None
    out = torch.cat(parts, dim=0)
    if out.dim() > 2:  # a kernel we hold flattened (`TensorMap.hf_tail`)
        out = out.reshape(out.shape[0], -1)
    missing = (length if dim == 0 else full_rows) - out.shape[0]
    if missing > 0:
        if dim == 1 and offset < full_rows:
            raise ValueError(f"{tmap.key}: padded rows cannot be sliced by columns")
        out = torch.cat([out, out.new_zeros((missing, *out.shape[1:]))], dim=0)
    return out


def local_tensor(source: SafetensorsFolder, tmap: TensorMap, layout) -> torch.Tensor:
    """This rank's shard of our parameter (`layout`: its `models.sharded.ParamLayout`) from the
    checkpoint, reading only the slices that its segments cover."""
    if not layout.segments:  # a scalar
        return read_rows(source, tmap, dim=0, start=0, length=1, full_rows=1)
    parts = []
    for s in layout.segments:
        part = read_rows(
            source,
            tmap,
            dim=layout.dim,
            start=s.global_start,
            length=s.length,
            full_rows=layout.global_shape[0],
        )
        if part is None:
            shape = list(layout.local_shape)
            shape[layout.dim] = s.length
            part = torch.zeros(shape)
        parts.append(part)
    out = torch.cat(parts, dim=layout.dim)
    if tuple(out.shape) != layout.local_shape:
        raise ValueError(
            f"{tmap.key}: the checkpoint gives shape {tuple(out.shape)} for a local shape "
            f"{layout.local_shape} (does config.json match the weights?)"
        )
    return out


def hf_tensors(
    maps: Mapping[str, TensorMap], ours: Mapping[str, torch.Tensor], *, shapes: Mapping
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (`shapes`: name -> shape) assembled from our full global tensors
    `ours` through `maps` (each of our tensors once; TE aliases are skipped when absent)."""
    out = {name: None for name in shapes}
    for key, tensor in ours.items():
        tmap = maps.get(key)
        if tmap is None:
            continue
        offset = 0
        for piece in tmap.pieces:
            rows = piece.rows if piece.rows is not None else shapes[piece.name][0]
            if out[piece.name] is None:
                out[piece.name] = torch.empty(shapes[piece.name], dtype=tensor.dtype)
            part = tensor[offset : offset + rows]
            if tmap.hf_tail is not None:
                part = part.reshape(rows, *tmap.hf_tail)
            out[piece.name][piece.start : piece.start + rows] = part
            offset += rows
    missing = [name for name, t in out.items() if t is None]
    if missing:
        raise ValueError(f"no tensor of ours gives the Hugging Face tensors {missing[:5]}")
    return out


@torch.no_grad()
def fill_chunk(chunk, source: SafetensorsFolder, maps: Mapping[str, TensorMap]) -> list[str]:
    """Copy this rank's shard of every parameter of `chunk` (a `models.chunk.ModelChunk`) that
    `maps` covers from `source`, in place; returns the global names it does not cover (they
    keep their initialisation, e.g. a projector the Hugging Face model lacks)."""
    from megatron_dip.models.sharded import param_layout

    kept = []
    for name, param in chunk.named_parameters():
        layout = param_layout(chunk, name, param)
        tmap = maps.get(layout.key)
        if tmap is None:
            kept.append(layout.key)
            continue
        param.copy_(local_tensor(source, tmap, layout).to(param.dtype))
    return kept
