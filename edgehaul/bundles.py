"""Bundles: many small samples merged into one Parquet (zstd) file with a manifest.

The bundle is the unit of uplink, validation and commit. Its id is derived from its content
(contract, sample ids and their content hashes, tiering policy), so a retry or a duplicate send
maps to the same object key and never makes a second copy.

Layout in the landing zone: `<node_id>/<yyyy-mm-dd>/<bundle_id>.parquet` with the manifest at
`<same>.manifest.json`; the manifest is written last, so its presence means the bundle is complete.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import types
import typing
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import zstandard

from edgehaul.contracts import ADDED_COLUMNS, Contract, contract_by_id
from edgehaul.platform.fields import NAME

MANIFEST_VERSION = 1

# Parquet writer settings per column (readers see ordinary Parquet either way). Dictionary encoding
# only for the low-cardinality strings: on unique or opaque values (ids, digests, pixel bytes) the
# writer builds a dictionary, finds it too large and falls back, page after page, for nothing.
# Min/max statistics only on the columns a reader selects rows by (ids, node, time, sequence, label,
# value, tier): pixels, digests and the per-channel features are never filtered on, and their
# statistics cost ~7% of a bundle's write time for nothing. Hex digests are
# compressed at zstd level 1: measured on 20k digests it is both smaller and 3x faster than level 3
# (random hex has no matches for the higher levels to find); every other column, the pixels
# included, uses the bundle's level.
_DICT_COLUMNS = ("node_id", "tier")
# A node's value and inclusion_p are on grids (`tiering.on_value_grid`, `tiering.on_p_grid`): a few hundred
# distinct numbers, which a dictionary writes in about a byte a row where BYTE_STREAM_SPLIT took near four (3,000
# gait rows: 151.1 KB against 156.1, and 145.8 with both constant). Each dictionary page costs ~50 B of its own, so
# only from GRID_DICT_MIN_ROWS rows: at 13 digits rows (a 2% pass) the dictionaries cost 103 B, near a row.
_GRID_COLUMNS = ("value", "inclusion_p")
GRID_DICT_MIN_ROWS = 160  # measured crossing: 150 rows still 7-15 B smaller without, 180 rows 30 B smaller with
_STATS_COLUMNS = ("sample_id", "node_id", "capture_time", "seq", "label", "value", "tier", "is_summary",
                  "inclusion_p")
# ... and only in a bundle of STATS_MIN_BYTES of rows or more. A reader skips a file by its footer's statistics
# only when the footer is much cheaper to fetch than the file; a small bundle is read whole anyway, and there
# the statistics (each written twice, page header and footer) were ~480 B of a digits bundle's 2.15 KB fixed
# part: 4 rows' bytes at a 2% link that carries 11.
STATS_MIN_BYTES = 64 * 1024
# Float columns (readings, features, value, inclusion_p) are BYTE_STREAM_SPLIT encoded: a value's bytes go to four
# streams, and zstd finds the shared exponents there. Gait bundles 3.5-4.8% smaller (12-20k rows), digits 1.6%,
# Landsat 0.3%, and a 20k-row gait bundle writes faster (12-13 ms against 14-18).
_HEX_COLUMNS = ("content_sha256",)
_HEX_ZSTD_LEVEL = 1


class BundleError(ValueError):
    """A bundle is corrupt, truncated, or does not match its manifest."""


class BundleGone(LookupError):
    """A source no longer holds a bundle it listed, and has accounted for its samples itself (sent, thinned into
    another bundle, expired, or dropped as corrupt and ledgered). A drain must neither retry it nor queue it for a
    retry: the retry queue would expire it later and ledger the same samples a second time, as retry-expired."""


# Ids become parts of object keys (landing, quarantine, claims) and Delta txn ids: only characters that
# are safe in every one of them, and never a path step ("..", "/"). Node ids as `EdgeNode.node_id`;
# bundle ids are hex digests (see `bundle_id_for`), letters, digits, "-" and "_" also accepted.
NODE_ID_PATTERN = re.compile(NAME)
BUNDLE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
DAY_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}")
# A contract id as a manifest may name it: `<kind>.v<N>` (a kind is a file name in the contracts folder).
CONTRACT_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9_]{0,62}\.v[1-9][0-9]{0,5}")


def id_problem(node_id: object, bundle_id: object) -> str:
    """Why these ids must not be used in a key ("" when they are safe); names the offending value."""
    for what, value, pattern in (("node_id", node_id, NODE_ID_PATTERN), ("bundle_id", bundle_id, BUNDLE_ID_PATTERN)):
        if not isinstance(value, str) or not pattern.fullmatch(value):
            return f"{what} {str(value)[:80]!r} does not match {pattern.pattern}"
    return ""


@dataclass(frozen=True)
class BundleManifest:
    bundle_id: str
    node_id: str
    contract: str  # e.g. "landsat_patch.v1"
    tier: str  # "high" (urgent) or "normal"; low-tier summary rows ride in normal bundles
    row_count: int
    sample_ids: list[str]
    sha256: str  # of the Parquet bytes
    nbytes: int
    min_capture_time: str
    max_capture_time: str
    value_sum: float
    max_value: float
    policy_version: str = ""
    scorer_version: str = ""
    team: str = "default"
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    manifest_version: int = MANIFEST_VERSION

    def to_json(self) -> bytes:
        # Shallow: dataclasses.asdict deep-copies every sample id (2 s of a 3.4 s edge batch of 50k samples).
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        packed = pack_sample_ids(self.sample_ids)
        if packed is not None:
            del doc["sample_ids"]
            doc[PACKED_IDS] = packed
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> BundleManifest:
        """Parse an untrusted manifest (size bounded by the caller's ranged read): nesting and number length are
        refused before Python builds anything from them, packed sample ids unpacked within a bound. Raises
        BundleError only."""
        try:
            doc = loads_bounded(data)
            if isinstance(doc, dict) and PACKED_IDS in doc:
                if "sample_ids" in doc:
                    raise ValueError(f"both sample_ids and {PACKED_IDS}")
                doc["sample_ids"] = unpack_sample_ids(doc.pop(PACKED_IDS))
            m = cls(**doc)
        except (ValueError, TypeError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise BundleError(f"malformed bundle manifest: {str(e)[:300]}") from e
        m.check_types()
        return m

    def check_types(self) -> None:
        """Every field has its declared type (a manifest is untrusted JSON): BundleError naming the field."""
        hints = typing.get_type_hints(BundleManifest)
        for f in fields(self):
            want, value = hints[f.name], getattr(self, f.name)
            if typing.get_origin(want) is list:
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            elif want is float:
                ok = isinstance(value, int | float) and not isinstance(value, bool)
            elif want is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, want) if isinstance(want, type | types.UnionType) else True
            if not ok:
                raise BundleError(f"malformed bundle manifest: field {f.name} is {type(value).__name__}, "
                                  f"expected {getattr(want, '__name__', want)}")

    @property
    def object_key(self) -> str:
        return bundle_key(self.node_id, self.bundle_id, self.min_capture_time)

    @property
    def manifest_key(self) -> str:
        return self.object_key.removesuffix(".parquet") + ".manifest.json"


# A manifest's sample ids travel packed where that is shorter: zstd over the ids joined by newlines, base64 in the
# JSON. Every id is in the bundle too, and as JSON strings they were a third of a small-row kind's wire (hive: 58 B
# a row in the bundle, 29 in its manifest); a node's ids share a prefix and count up, ~1 B each packed.
PACKED_IDS = "sample_ids_zstd"
# Unpacked ids past this are refused, the frame's own size claim included (zstd allocates what a frame says it
# holds): the largest plain manifest any contract accepts is 16 MiB by default.
MAX_UNPACKED_IDS_BYTES = 64 * 2**20


def pack_sample_ids(ids: list[str]) -> str | None:
    """The ids packed (`PACKED_IDS`), or None where the plain JSON list is as short or an id holds a newline."""
    joined = "\n".join(ids)
    if len(ids) < 4 or joined.count("\n") != len(ids) - 1:
        return None
    packed = base64.b64encode(zstandard.ZstdCompressor(level=3).compress(joined.encode())).decode()
    return packed if len(packed) < len(joined) + 3 * len(ids) else None


def unpack_sample_ids(packed: object) -> list[str]:
    """`pack_sample_ids`'s ids from an untrusted manifest: ValueError for anything but base64 zstd of at most
    MAX_UNPACKED_IDS_BYTES of UTF-8 ids."""
    if not isinstance(packed, str):
        raise ValueError(f"{PACKED_IDS} is {type(packed).__name__}, expected str")
    try:
        frame = base64.b64decode(packed, validate=True)
        claimed = zstandard.frame_content_size(frame)
        if claimed > MAX_UNPACKED_IDS_BYTES:
            raise ValueError(f"{PACKED_IDS} claims {claimed} bytes (at most {MAX_UNPACKED_IDS_BYTES})")
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(frame)) as r:
            raw = r.read(MAX_UNPACKED_IDS_BYTES + 1)
    except (binascii.Error, zstandard.ZstdError) as e:
        raise ValueError(f"{PACKED_IDS} is not base64 zstd: {e}") from e
    if len(raw) > MAX_UNPACKED_IDS_BYTES:
        raise ValueError(f"{PACKED_IDS} unpacks past {MAX_UNPACKED_IDS_BYTES} bytes")
    return raw.decode().split("\n") if raw else []


# A manifest is one object of scalars and one list of strings: nothing deeper than this is a manifest.
MAX_JSON_DEPTH = 4
# Longest number accepted (digits, sign, point, exponent): a count or a byte size has at most 19 digits; Python's
# int() refuses past 4,300 digits with a ValueError and is quadratic below that.
MAX_JSON_NUMBER_CHARS = 40
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth(raw: bytes) -> int:
    """Deepest nesting of `[`/`{` in a JSON text, strings skipped; linear, no recursion."""
    skeleton = np.frombuffer(_JSON_STRING.sub(b"", raw), dtype=np.uint8)
    step = np.isin(skeleton, (0x5B, 0x7B)).astype(np.int64) - np.isin(skeleton, (0x5D, 0x7D)).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


def _bounded_number(kind: type) -> typing.Callable[[str], object]:
    def parse(text: str) -> object:
        if len(text) > MAX_JSON_NUMBER_CHARS:
            raise ValueError(f"a number of {len(text)} characters (at most {MAX_JSON_NUMBER_CHARS})")
        return kind(text)
    return parse


def loads_bounded(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> typing.Any:
    """`json.loads` for bytes from an edge node: ValueError for nesting deeper than `max_depth` or a number
    longer than MAX_JSON_NUMBER_CHARS, before any deep or huge value is built. NaN stays accepted as `json`
    writes it (a manifest's value_sum of NaN rows: the rows themselves are refused as non_finite)."""
    raw = data.encode() if isinstance(data, str) else data
    if (depth := json_depth(raw)) > max_depth:
        raise ValueError(f"nested {depth} deep (at most {max_depth})")
    return json.loads(raw, parse_int=_bounded_number(int), parse_float=_bounded_number(float))


def full_rows(table: pa.Table) -> np.ndarray:
    """Which rows of a bundle-schema table are full rows (not summaries; a null is_summary is a full row): the rows
    a thinning draws and a model scores."""
    return ~np.asarray(pc.fill_null(table.column("is_summary"), False).to_numpy(zero_copy_only=False), dtype=bool)


def bundle_key(node_id: str, bundle_id: str, capture_time_iso: str) -> str:
    return f"{node_id}/{capture_time_iso[:10]}/{bundle_id}.parquet"


def bundle_id_for(table: pa.Table, contract: Contract, policy_fingerprint: str = "") -> str:
    """Deterministic id: same samples (ids + content hashes) under the same contract and policy."""
    h = hashlib.sha256(f"{contract.id}|{policy_fingerprint}|".encode())
    order = pc.sort_indices(table.column("sample_id"))
    ids = pc.take(table.column("sample_id"), order).combine_chunks()
    digests = pc.take(table.column("content_sha256"), order).combine_chunks()
    for col in (ids, digests):
        # Buffers of a fresh combine_chunks are contiguous; hash offsets+data, not Python strings.
        for buf in col.buffers():
            if buf is not None:
                h.update(buf)
    return h.hexdigest()[:32]


def write_bundle(
    table: pa.Table,
    contract: Contract,
    *,
    tier: str,
    policy_version: str = "",
    policy_fingerprint: str = "",
    scorer_version: str = "",
    team: str = "default",
    zstd_level: int = 3,
    row_group_rows: int = 8192,
) -> tuple[bytes, BundleManifest]:
    """Serialise preprocessed rows (the contract's bundle schema) into Parquet bytes + manifest."""
    if table.num_rows == 0:
        raise BundleError("refusing to write an empty bundle")
    table = conform(table, contract)
    nodes = pc.unique(table.column("node_id")).to_pylist()
    if len(nodes) != 1:
        raise BundleError(f"a bundle holds one node's samples, got nodes {nodes}")
    bundle_id = bundle_id_for(table, contract, policy_fingerprint)
    # A BytesIO sink hands its buffer over as the bytes (getvalue does not copy an unshared buffer):
    # ~15% of a bundle's write time less than BufferOutputStream + to_pybytes, a copy of the whole file.
    sink = io.BytesIO()
    names = table.column_names
    dict_columns = _DICT_COLUMNS + (_GRID_COLUMNS if table.num_rows >= GRID_DICT_MIN_ROWS else ())
    # No serialised Arrow schema in the footer (store_schema=False): the contract is the schema, and the Parquet
    # types read back as the same Arrow types (check_schema compares them). It was ~1.7 KB of every bundle: a
    # one-row urgent bundle cost 25 rows' bytes, and at a 2% budget that overhead was most of what a node sent.
    with pq.ParquetWriter(
        sink, table.schema, compression="zstd", store_schema=False,
        compression_level={n: min(zstd_level, _HEX_ZSTD_LEVEL) if n in _HEX_COLUMNS else zstd_level for n in names},
        use_dictionary=[n for n in names if n in dict_columns],
        write_statistics=[n for n in names if n in _STATS_COLUMNS] if table.nbytes >= STATS_MIN_BYTES else False,
        column_encoding={f.name: "BYTE_STREAM_SPLIT" for f in table.schema
                         if pa.types.is_floating(f.type) and f.name not in dict_columns} or None,
    ) as writer:
        writer.write_table(table, row_group_size=row_group_rows)
        writer.add_key_value_metadata({k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()})
    data = sink.getvalue()
    times = table.column("capture_time")
    values = table.column("value")
    manifest = BundleManifest(
        bundle_id=bundle_id,
        node_id=nodes[0],
        contract=contract.id,
        tier=tier,
        row_count=table.num_rows,
        sample_ids=table.column("sample_id").to_pylist(),
        sha256=hashlib.sha256(data).hexdigest(),
        nbytes=len(data),
        min_capture_time=pc.min(times).as_py().isoformat(),
        max_capture_time=pc.max(times).as_py().isoformat(),
        value_sum=float(pc.sum(values).as_py() or 0.0),
        max_value=float(pc.max(values).as_py() or 0.0),
        policy_version=policy_version,
        scorer_version=scorer_version,
        team=team,
    )
    return data, manifest


def read_bundle(data: bytes, manifest: BundleManifest | None = None, *, columns: list[str] | None = None) -> pa.Table:
    """Parse and check a bundle: checksum and row count against the manifest, contract, row limit and schema
    from the footer, then the rows, never unpacking more than the contract allows (`read_bounded`, refused as
    `Unpacked`). With `columns`, only those (as stored, not conformed). Raises BundleError naming what is wrong
    (ContractError for an unknown contract)."""
    where = f"bundle {manifest.bundle_id}" if manifest else "bundle"
    if manifest is not None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != manifest.sha256:
            raise BundleError(
                f"bundle {manifest.bundle_id}: checksum mismatch (manifest {manifest.sha256[:12]}, "
                f"bytes {digest[:12]}, {len(data)} of {manifest.nbytes} bytes)"
            )
    try:
        pf = pq.ParquetFile(io.BytesIO(data))
        schema, rows = pf.schema_arrow, pf.metadata.num_rows
    except (pa.ArrowException, OSError, ValueError) as e:
        raise BundleError(f"{where}: not a readable Parquet file ({str(e)[:300]})") from e
    contract_id = (schema.metadata or {}).get(b"edgehaul.contract", b"").decode(errors="replace")
    if manifest is not None:
        if contract_id and contract_id != manifest.contract:
            raise BundleError(f"{where}: file says {contract_id[:80]!r}, manifest {manifest.contract}")
        if rows != manifest.row_count:
            raise BundleError(f"{where}: {rows} rows, manifest says {manifest.row_count}")
        contract_id = manifest.contract
    if not CONTRACT_ID_PATTERN.fullmatch(contract_id):
        raise BundleError(f"{where}: contract id {contract_id[:80]!r} does not match {CONTRACT_ID_PATTERN.pattern}")
    contract = contract_by_id(contract_id)
    if rows > contract.max_rows:
        raise Unpacked(f"{where}: {rows} rows, contract {contract.id} allows {contract.max_rows}")
    check_schema(schema, contract)
    names = contract.bundle_schema.names
    if columns is not None:
        wanted: list[str] | None = sorted(set(columns) & set(schema.names))
    else:  # an older bundle's derived features are not unpacked at all
        wanted = None if set(schema.names) <= set(names) else [n for n in schema.names if n in names]
    table = read_bounded(data, wanted, unpacked_budget(contract, rows, wanted), what=where)
    return conform(table, contract) if columns is None else table


def conform(table: pa.Table, contract: Contract) -> pa.Table:
    """Rows in the contract's bundle schema; a column added to the schema since (`contracts.ADDED_COLUMNS`)
    and absent here gets the value it has by definition in older rows (inclusion_p 1: sent with certainty); the
    derived features an older bundle carried are dropped (a core derives them)."""
    want = contract.bundle_schema
    for name, default in ADDED_COLUMNS.items():
        if name not in table.column_names:
            table = table.append_column(want.field(name), pa.array([default] * table.num_rows, want.field(name).type))
    return table.select(want.names).cast(want)


def check_schema(schema: pa.Schema, contract: Contract) -> None:
    """Schema drift is an error that names the columns: missing, extra, or a changed type. A bundle written
    before a column was added (`contracts.ADDED_COLUMNS`) may lack it; `conform` fills it in. One written
    before derived features stayed on the node may carry them (`Contract.derived_feature_columns`, float32);
    `conform` drops them."""
    want = contract.bundle_schema
    missing = [n for n in want.names if n not in schema.names and n not in ADDED_COLUMNS]
    derived = contract.edge_schema
    extra = [n for n in schema.names if n not in want.names
             and not (n in contract.derived_feature_columns and schema.field(n).type.equals(derived.field(n).type))]
    changed = [
        f"{n}: {schema.field(n).type} (contract {want.field(n).type})"
        for n in want.names
        if n in schema.names and not schema.field(n).type.equals(want.field(n).type)
    ]
    problems = []
    if missing:
        problems.append(f"missing columns {missing}")
    if extra:
        problems.append(f"unexpected columns {extra}")
    if changed:
        problems.append(f"changed types {changed}")
    if problems:
        raise BundleError(f"schema drift against {contract.id}: " + "; ".join(problems))


# ---------------------------------------------------------------- bounded reading of a node's Parquet bytes
#
# A bundle's compressed size says nothing of what it unpacks to: 66 KB of zstd can hold 1.6 GB of zeros. Before
# any page is decompressed, `unpacked_size` walks the page headers of the columns to be read (Parquet's Thrift
# compact encoding, a few bytes each) and sums the sizes the pages declare; the reader (Arrow) decompresses
# each page to exactly that size or fails, so the sum bounds the decompressed bytes. A dictionary value repeated
# per row is the one way a page expands once decompressed: when rows x the dictionary pages could pass the
# budget, rows are built in batches (rows x dictionary pages <= 64 MiB) and counted as they come; otherwise
# (every honest bundle: dictionaries only on node_id and tier) the columns are read in one go.

MAX_STRING_BYTES = 256  # an id, a digest, a tier: what a row's other string columns may hold, on average
MAX_PAGES = 100_000  # pages in one bundle (pyarrow writes 1 MB / 20k-row pages: ~300 for the largest bundle)
_BATCH_BYTES = 64 * 2**20  # at most this much of dictionary-expanded values in one batch being built
_REFUSED_ENCODINGS = frozenset({"DELTA_BYTE_ARRAY"})  # prefix sharing: a tiny page rebuilds into long values


class Unpacked(BundleError):
    """A bundle would unpack to more than its budget (refused before it is built in memory)."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise BundleError("a Parquet page header is truncated or malformed")
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, i
        shift += 7


def _thrift_skip(buf: bytes, i: int, t: int, depth: int, in_list: bool = False) -> int:
    """Skip one Thrift compact value of type `t` at `i`; the index after it."""
    if depth > 8:
        raise BundleError("a Parquet page header nests too deep")
    if t in (1, 2):  # booleans: in the field header, a byte of their own inside a list
        return i + 1 if in_list else i
    if t == 3:
        return i + 1
    if t in (4, 5, 6):
        return _varint(buf, i)[1]
    if t == 7:
        return i + 8
    if t == 8:
        n, i = _varint(buf, i)
        return i + n
    if t in (9, 10):  # list, set
        if i >= len(buf):
            raise BundleError("a Parquet page header is truncated")
        head, i = buf[i], i + 1
        n, et = head >> 4, head & 0x0F
        if n == 15:
            n, i = _varint(buf, i)
        for _ in range(n):
            i = _thrift_skip(buf, i, et, depth + 1, in_list=True)
            if i > len(buf):
                raise BundleError("a Parquet page header is truncated")
        return i
    if t == 11:  # map
        n, i = _varint(buf, i)
        if n:
            kv, i = buf[i], i + 1
            for _ in range(n):
                i = _thrift_skip(buf, i, kv >> 4, depth + 1, in_list=True)
                i = _thrift_skip(buf, i, kv & 0x0F, depth + 1, in_list=True)
        return i
    if t == 12:
        return _thrift_struct(buf, i, depth + 1)[1]
    raise BundleError(f"a Parquet page header holds an unknown Thrift type {t}")


def _thrift_struct(buf: bytes, i: int, depth: int = 0) -> tuple[dict[int, int], int]:
    """The integer fields of a Thrift compact struct at `i` (others skipped) and the index after it."""
    fields_: dict[int, int] = {}
    last = 0
    while True:
        if i >= len(buf):
            raise BundleError("a Parquet page header is truncated")
        head, i = buf[i], i + 1
        if head == 0:
            return fields_, i
        delta, t = head >> 4, head & 0x0F
        if delta:
            fid = last + delta
        else:
            raw, i = _varint(buf, i)
            fid = (raw >> 1) ^ -(raw & 1)
        last = fid
        if t in (4, 5, 6):
            raw, i = _varint(buf, i)
            fields_[fid] = (raw >> 1) ^ -(raw & 1)
        else:
            i = _thrift_skip(buf, i, t, depth)


def unpacked_size(data: bytes, pf: pq.ParquetFile, columns: list[str]) -> tuple[int, int]:
    """(bytes the pages of `columns` declare unpacked, the sum over variable-width columns of each one's largest
    dictionary page: what one row may expand to beyond its pages), from the page headers alone. BundleError
    when a header is malformed, a page runs past its column chunk, or a column uses an encoding refused from a
    node (`_REFUSED_ENCODINGS`)."""
    md = pf.metadata
    wanted = {name: i for i, name in enumerate(pf.schema_arrow.names) if name in columns}
    leaf = {pf.schema.column(j).name: j for j in range(md.num_columns)}
    total = pages = 0
    dict_max: dict[str, int] = {}
    for rg in range(md.num_row_groups):
        group = md.row_group(rg)
        for name in wanted:
            if name not in leaf:
                continue
            cc = group.column(leaf[name])
            if refused := _REFUSED_ENCODINGS.intersection(cc.encodings):
                raise BundleError(f"column {name} uses encoding {sorted(refused)}, not accepted from a node")
            start = cc.data_page_offset
            if cc.has_dictionary_page and cc.dictionary_page_offset and 0 < cc.dictionary_page_offset < start:
                start = cc.dictionary_page_offset
            end = start + cc.total_compressed_size
            if start < 4 or end > len(data):
                raise BundleError(f"column {name}: its pages lie outside the file")
            variable = pf.schema_arrow.field(name).type in (pa.binary(), pa.string(), pa.large_binary(),
                                                             pa.large_string())
            i = start
            while i < end:
                head, body = _thrift_struct(data, i)
                size, stored = head.get(2, -1), head.get(3, -1)
                pages += 1
                if size < 0 or stored < 0 or body + stored > end or pages > MAX_PAGES:
                    raise BundleError(f"column {name}: a malformed page at byte {i} (or over {MAX_PAGES} pages)")
                total += size
                if head.get(1) == 2 and variable:  # a dictionary page
                    dict_max[name] = max(dict_max.get(name, 0), size)
                i = body + stored
    return total, sum(dict_max.values())


def read_bounded(data: bytes, columns: list[str] | None, budget: int, *, what: str = "bundle") -> pa.Table:
    """A node's Parquet bytes as a table of `columns` (all when None), refusing (`Unpacked`, before anything is
    decompressed) what the page headers say unpacks to more than `budget` bytes, and stopping as soon as the
    rows built exceed it. Other unreadable bytes are BundleError naming `what`."""
    try:
        pf = pq.ParquetFile(io.BytesIO(data))
        schema = pf.schema_arrow
        names = [n for n in (columns if columns is not None else schema.names) if n in schema.names]
        declared, max_dict = unpacked_size(data, pf, names)
        if declared > budget:
            raise Unpacked(f"{what}: its pages unpack to {declared} bytes, over its budget of {budget} "
                           f"({len(data)} bytes as sent)")
        n = pf.metadata.num_rows
        if declared + n * (max_dict + 16 * len(names)) <= budget:  # pages + offsets and levels: nothing can expand
            return pf.read(columns=names)
        # a dictionary value may repeat past the budget: build in batches, count as they come
        rows = max(1, min(65_536, min(_BATCH_BYTES, budget) // max(max_dict, 1)))  # a batch overshoots by <= budget
        batches, built = [], 0
        for b in pf.iter_batches(batch_size=rows, columns=names):
            built += b.nbytes
            if built > budget:
                raise Unpacked(f"{what}: its rows unpack to over {budget} bytes (its budget), "
                               f"{len(data)} bytes as sent")
            batches.append(b)
        out = pa.schema([schema.field(n) for n in names], metadata=schema.metadata)
        return pa.Table.from_batches(batches, schema=out) if batches else out.empty_table()
    except BundleError:
        raise
    except (pa.ArrowException, OSError, ValueError, IndexError, TypeError) as e:
        raise BundleError(f"{what}: not a readable Parquet file ({str(e)[:300]})") from e


def unpacked_budget(contract: Contract, rows: int, columns: list[str] | None = None) -> int:
    """What `rows` rows of `columns` (all when None) may unpack to: each column's largest value as the contract
    declares it (a tensor's bytes, a file's max_bytes, a category's longest name, MAX_STRING_BYTES for ids, 4 KiB
    for a declared string) plus 8 bytes of offsets and levels, + 1 MiB; never over `limits.max_unpacked_bytes`."""
    declared = {c.name: c for c in contract.columns}
    per_row = 0
    for f in contract.bundle_schema:
        if columns is not None and f.name not in columns:
            continue
        if f.name == contract.payload_column:
            width = contract.file.max_bytes if contract.file is not None else contract.sample_nbytes
        elif f.name in declared and declared[f.name].type == "category":
            width = max((len(v.encode()) for v in declared[f.name].values), default=0)
        elif f.name in declared and declared[f.name].type == "string":
            width = 4096
        elif pa.types.is_binary(f.type) or pa.types.is_string(f.type):
            width = MAX_STRING_BYTES
        else:
            width = max(1, f.type.bit_width // 8)
        per_row += width + 8
    return min(contract.max_unpacked_bytes, rows * per_row + 2**20)
