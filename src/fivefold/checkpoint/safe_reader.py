"""Reading DCP checkpoints without unpickling arbitrary objects.

Details: docs/checkpoints.md.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from fivefold.errors import CheckpointError

_METADATA_MODULES = {
    "torch.distributed.checkpoint.metadata": None,  # every name of this module (dataclasses)
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bytes"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP metadata is built from."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype | torch.layout)
        ):
            return getattr(torch, name)
        allowed = _METADATA_MODULES.get(module, set())
        if module in _METADATA_MODULES and (allowed is None or name in allowed):
            return super().find_class(module, name)
        raise CheckpointError(
            f"the checkpoint index (.metadata) refers to {module}.{name}, which is not part of "
            "a checkpoint's metadata; refusing to load it (the file was not written by DCP or "
            "was tampered with)."
        )


def load_metadata(stream: io.BufferedIOBase) -> Metadata:
    """Unpickle DCP metadata from `stream`, resolving only the allowed globals."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except CheckpointError:
        raise
    except Exception as err:  # truncated or garbled pickle streams raise many types
        raise CheckpointError(
            f"the checkpoint index (.metadata) cannot be read ({type(err).__name__}: {err}); "
            "the checkpoint is damaged."
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"the checkpoint index (.metadata) holds a {type(metadata).__name__}, not DCP metadata."
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses pickled (non-tensor) values instead of unpickling them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"the checkpoint stores {read_item.dest_index.fqn!r} as a pickled object, but "
            "fivefold checkpoints hold only tensors (everything else is in state.json); "
            "refusing to unpickle it."
        )
