"""Observations as arrays: the one place that turns a kind's payload into numbers, for the edge (features,
scorers) and for training alike.

- `decode_tensors(column, contract)`: a tensor kind's binary column (raw C-order bytes) or a file kind's
  files (decoded per `file.decode`) -> (m, *shape) array in the contract's dtype. Rows must be non-null
  and valid (preprocessing checked them); a row that is not names its index.
- `column_matrix(table, contract)`: a columns kind's numeric data columns -> (m, k) float32, each
  normalised to its declared range (the `norm_<column>` features), NaN where null.
- `grid_means(x, spec, cells)`: (m, *shape) -> the `per: grid` features, (m, channels x rows x cols) float32.
- `with_derived_features(table, contract)`: the table with the `norm_<column>` and `grid_...` features a bundle
  does not carry (`Contract.derived_feature_columns`), derived from its columns: what a core reads them as.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from edgehaul.contracts import Contract, ContractError, TensorSpec


class DecodeError(ValueError):
    """A payload that does not decode to the contract's tensor (carries the row index)."""

    def __init__(self, row: int, why: str) -> None:
        super().__init__(f"row {row}: {why}")
        self.row = row


def binary_values(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, data) of a binary array as numpy views, honouring a sliced array's offset."""
    if pa.types.is_large_binary(arr.type) or not pa.types.is_binary(arr.type):
        arr = arr.cast(pa.binary())
    _, off_buf, data_buf = arr.buffers()
    if off_buf is None:  # e.g. an all-null array
        return np.zeros(len(arr) + 1, dtype=np.int32), np.empty(0, np.uint8)
    offsets = np.frombuffer(off_buf, dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    return offsets, data


def _combine(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def raw_tensors(col: pa.Array | pa.ChunkedArray, spec: TensorSpec) -> np.ndarray:
    """Raw tensor bytes, each exactly `spec.nbytes` long -> one zero-copy (m, *shape) view."""
    arr = _combine(col)
    m = len(arr)
    if arr.null_count:
        raise DecodeError(int(np.flatnonzero(np.asarray(pc.is_null(arr)))[0]), "null payload (a summary row?)")
    offsets, data = binary_values(arr)
    widths = np.diff(offsets)
    if (bad := np.flatnonzero(widths != spec.nbytes)).size:
        i = int(bad[0])
        raise DecodeError(i, f"{int(widths[i])} bytes, the tensor {list(spec.shape)} {spec.dtype} has {spec.nbytes}")
    flat = data[offsets[0] : offsets[-1]] if m else data[:0]
    return flat.view(spec.np_dtype).reshape((m, *spec.shape))


def decode_file(data: bytes, spec: TensorSpec) -> np.ndarray:
    """One image file (PNG, JPEG, TIFF: whatever Pillow reads) -> the `spec` tensor."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            # a node's bytes: the header's size is checked before any pixel is decoded (a few KB of PNG can
            # declare gigapixels)
            if im.width * im.height > 16 * int(np.prod(spec.shape)):
                raise OSError(f"declares {im.width}x{im.height} px, far more than the contract's {list(spec.shape)}")
            im.load()
            a = np.asarray(im)
    except UnidentifiedImageError as e:  # its text names the BytesIO's address: not the same twice
        raise DecodeError(-1, "not a readable image (no decoder recognises it)") from e
    except (Image.DecompressionBombError, OSError, ValueError) as e:
        raise DecodeError(-1, f"not a readable image ({e})") from e
    if a.ndim == 2 and len(spec.shape) == 3:  # grey image, one channel axis in the contract
        a = np.expand_dims(a, spec.channel_axis)
    if a.shape != spec.shape:
        raise DecodeError(-1, f"decodes to shape {list(a.shape)}, the contract wants {list(spec.shape)}")
    if a.dtype != spec.np_dtype:
        raise DecodeError(-1, f"decodes to {a.dtype}, the contract wants {spec.dtype}")
    return a


def file_tensors(col: pa.Array | pa.ChunkedArray, spec: TensorSpec) -> np.ndarray:
    """Files -> (m, *shape). One decode per file: image codecs have no batch API."""
    arr = _combine(col)
    out = np.empty((len(arr), *spec.shape), dtype=spec.np_dtype)
    for i, v in enumerate(arr):
        data = v.as_py()
        if data is None:
            raise DecodeError(i, "null payload (a summary row?)")
        try:
            out[i] = decode_file(data, spec)
        except DecodeError as e:
            raise DecodeError(i, str(e).split(": ", 1)[1]) from e
    return out


def decode_tensors(col: pa.Array | pa.ChunkedArray, contract: Contract) -> np.ndarray:
    """A tensor or file kind's payload column -> (m, *shape) in the contract's dtype (not normalised)."""
    spec = contract.tensor
    if spec is None:
        raise ContractError(f"contract {contract.id} ({contract.layout}) has no tensor to decode")
    if contract.layout == "file":
        return file_tensors(col, spec)
    return raw_tensors(col, spec)


def normalise(x: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """value * scale + offset as float32 (what features and models see)."""
    return x.astype(np.float32) * np.float32(spec.scale) + np.float32(spec.offset)


def column_matrix(table: pa.Table, contract: Contract, columns: tuple[str, ...] | None = None) -> np.ndarray:
    """A columns kind's numeric columns -> (m, k) float32 scaled to each column's declared [min, max]
    (x itself where no range is declared); NaN where null."""
    specs = {c.name: c for c in contract.columns}
    names = columns or contract.numeric_columns
    out = np.empty((table.num_rows, len(names)), dtype=np.float32)
    for j, name in enumerate(names):
        c = specs[name]
        x = np.asarray(pc.fill_null(table.column(name).cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False),
                       dtype=np.float64)
        if c.min is not None and c.max is not None and c.max > c.min:
            x = (x - c.min) / (c.max - c.min)
        out[:, j] = x
    return out


def grid_means(x: np.ndarray, spec: TensorSpec, cells: tuple[int, int]) -> np.ndarray:
    """Mean of the normalised values in each cell of a rows x cols grid over the two spatial axes, per channel:
    (m, *shape) -> (m, C * rows * cols) float32, channel-major then row-major (`contracts.grid_feature_names`).
    Cells split the axes as evenly as integers allow; a float tensor's NaNs are skipped (an all-NaN cell: NaN)."""
    xc = np.moveaxis(x, 1 + spec.channel_axis, -1)  # (m, H, W, C)
    m, h, w, c = xc.shape
    rows, cols = cells
    re = [i * h // rows for i in range(rows + 1)]
    ce = [j * w // cols for j in range(cols + 1)]
    out = np.empty((m, c, rows, cols), dtype=np.float64)
    mean = np.nanmean if np.issubdtype(xc.dtype, np.floating) else np.mean
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN cell is NaN, said in the docstring
        for i in range(rows):
            for j in range(cols):
                out[:, :, i, j] = mean(xc[:, re[i]:re[i + 1], ce[j]:ce[j + 1], :], axis=(1, 2), dtype=np.float64)
    return (out * spec.scale + spec.offset).reshape(m, c * rows * cols).astype(np.float32)


def _grid_features(table: pa.Table, contract: Contract) -> np.ndarray:
    """The grid features of every row; NaN where the payload is null (a summary row)."""
    spec, cells = contract.tensor, contract.grid_cells
    assert spec is not None and cells is not None
    col = _combine(table[contract.payload_columns[0]])
    out = np.full((len(col), len(spec.channels) * cells[0] * cells[1]), np.nan, np.float32)
    have = np.flatnonzero(col.is_valid().to_numpy(zero_copy_only=False))
    if len(have):
        x = decode_tensors(col.take(pa.array(have)), contract)
        out[have] = grid_means(x, spec, cells)
    return out


def with_derived_features(table: pa.Table, contract: Contract, names: list[str] | None = None) -> pa.Table:
    """`table` with the derived features (`names`, default all of `Contract.derived_feature_columns`) it lacks
    appended as float32, computed from the row's columns as the edge computed them (NaN in a summary row or for
    a null reading). The same numbers as the edge's, so a bundle need not carry them."""
    want = [n for n in (contract.derived_feature_columns if names is None else names)
            if n not in table.column_names]
    if not want:
        return table
    grid = contract.grid_feature_columns
    got: dict[str, np.ndarray] = {}
    if norms := [n for n in want if n not in grid]:
        mat = column_matrix(table, contract, tuple(n.removeprefix("norm_") for n in norms))
        got.update({n: mat[:, j] for j, n in enumerate(norms)})
    if any(n in grid for n in want):
        mat = _grid_features(table, contract)
        got.update({n: mat[:, grid.index(n)] for n in want if n in grid})
    for n in want:
        table = table.append_column(pa.field(n, pa.float32()), pa.array(got[n], pa.float32()))
    return table
