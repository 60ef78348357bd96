"""Images as data: a folder of image files (read with Pillow and turned into
``pixel_values`` by the model's image processor) or a NumPy ``.npy`` array of pixel values.

Batches are read when iterated (a collection with several passes reads the files again),
so a large folder is never held in memory at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import DataError

__all__ = ["IMAGE_SUFFIXES", "ImageBatches", "is_image_data", "read_images"]

#: File name endings read as images in a DATA folder (case-insensitive).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def is_image_data(spec: str) -> bool:
    """Whether DATA names images: a folder, or a ``.npy`` file of pixel values."""
    return os.path.isdir(spec) or spec.lower().endswith(".npy")


class ImageBatches:
    """``{"pixel_values": tensor}`` batches of images, re-iterable, read lazily.

    Build with :func:`read_images`. ``len()`` is the number of batches; ``count`` the
    number of images; ``source`` says where they come from.
    """

    def __init__(
        self,
        *,
        files: list[Path] | None = None,
        processor: Any = None,
        array: np.ndarray | None = None,
        batch_size: int,
        source: str,
    ) -> None:
        self._files = files
        self._processor = processor
        self._array = array
        self.batch_size = batch_size
        self.source = source
        if files is not None:
            self.count = len(files)
        else:
            assert array is not None
            self.count = int(array.shape[0])

    def __len__(self) -> int:
        return -(-self.count // self.batch_size)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, stop = i * self.batch_size, min((i + 1) * self.batch_size, self.count)
        import torch

        if self._array is not None:
            values = np.array(self._array[start:stop], dtype=np.float32)  # a writable copy
            if not np.isfinite(values).all():
                raise DataError(
                    f"DATA {self.source}: pixel values {start}..{stop - 1} hold NaN or Inf"
                )
            return {"pixel_values": torch.from_numpy(values)}
        assert self._files is not None
        images = [_open_image(p, self.source) for p in self._files[start:stop]]
        try:
            out = self._processor(images, return_tensors="pt")
        except Exception as exc:  # the processor is transformers' (any model's) code
            raise DataError(
                f"DATA {self.source}: the model's image processor failed on "
                f"{self._files[start].name}..{self._files[stop - 1].name} ({exc})"
            ) from None
        return {"pixel_values": out["pixel_values"]}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]


def _open_image(path: Path, source: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"DATA {source}: {path.name} is not a readable image ({exc})") from None


def read_images(
    spec: str,
    *,
    processor: Any = None,
    batch_size: int = 16,
    max_images: int | None = None,
) -> ImageBatches:
    """Batches of ``pixel_values`` from DATA ``spec``.

    Parameters
    ----------
    spec
        A folder of image files (:data:`IMAGE_SUFFIXES`, in name order; other files are
        an error), read with Pillow, converted to RGB and turned into pixel values by
        ``processor`` (the model folder's image processor); or a ``.npy`` file holding a
        float array of pixel values (images, channels, height, width) as the model takes
        them, used as it is (read without pickle, memory-mapped).
    processor
        Required for a folder: called as ``processor(images, return_tensors="pt")``.
    batch_size
        Images per batch.
    max_images
        Use the first N.

    Every problem is a :class:`DataError` naming the file: an unreadable image, a
    missing processor, an array of the wrong shape or dtype.
    """
    if batch_size < 1:
        raise DataError(f"--batch-size: must be >= 1, got {batch_size}")
    if max_images is not None and max_images < 1:
        raise DataError(f"--max-texts: must be >= 1, got {max_images}")
    path = Path(spec)
    if path.is_dir():
        entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
        others = [p.name for p in entries if p.suffix.lower() not in IMAGE_SUFFIXES]
        if others:
            raise DataError(
                f"DATA {spec}: {others[0]} is not an image file ({', '.join(IMAGE_SUFFIXES)}); "
                "a DATA folder must hold only images"
            )
        files = entries[:max_images]
        if not files:
            raise DataError(f"DATA {spec}: no images")
        if processor is None:
            raise DataError(
                f"DATA {spec}: the model folder has no image processor "
                "(preprocessor_config.json) to turn images into pixel values; save one with "
                "the model, or pass a .npy file of pixel values"
            )
        return ImageBatches(files=files, processor=processor, batch_size=batch_size, source=spec)
    if not path.is_file():
        raise DataError(f"DATA {spec}: no such file or folder")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"DATA {spec}: not a NumPy .npy array file ({exc})") from None
    if array.ndim != 4 or array.dtype.kind != "f":
        raise DataError(
            f"DATA {spec}: expected a float array of pixel values (images, channels, height, "
            f"width), got {array.dtype} of shape {array.shape}"
        )
    if array.shape[0] == 0:
        raise DataError(f"DATA {spec}: no images")
    array = array[:max_images]
    return ImageBatches(array=array, batch_size=batch_size, source=spec)
